//! `POST /v1/embeddings` on the sentence-transformers folders of `models/embed/` (a tiny BERT
//! and a tiny Qwen3 from random weights, exported by Optimum's `feature-extraction`; `make.py`
//! made them): every
//! vector equals what `SentenceTransformer.encode` gave on the same folder (`reference.json`),
//! each input alone and all of them in one request (padding changes no answer), in every input
//! form, as floats and as base64, cut to `dimensions`; and what is refused is refused naming
//! the field.

use std::path::Path;

use base64::Engine;
use serde_json::{Value, json};

use crate::common::TestServer;

const CONFIG: &str = "
models:
  - {name: mean, path: models/embed/bert-mean-normalize/model.onnx}
  # Its tokenizer named, as a decoder's is; `mean`'s found beside its graph.
  - {name: cls, path: models/embed/bert-cls/model.onnx, tokenizer: models/embed/bert-cls/tokenizer.json}
  # A decoder (Qwen3's layout) taking `position_ids`, its last token pooled.
  - {name: qwen3, path: models/embed/qwen3-lasttoken/model.onnx}
  # Saved by sentence-transformers 5.7: `pooling_mode` names its pooling, and its
  # `max_seq_length` is the tokenizer's `model_max_length`.
  - {name: st57, path: models/embed/bert-mean-st57/model.onnx}
  - {name: encoder, path: 'builtin:encoder'}
pools: [{name: cpu, provider: cpu, models: [mean, cls, qwen3, st57, encoder]}]
";

/// The folders' references: model name as served → its reference (`cases` of `input`, `ids`,
/// `embedding`, `alone`).
fn reference() -> Vec<(&'static str, Value)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/embed/reference.json");
    let all: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    vec![
        ("mean", all["models"]["bert-mean-normalize"].clone()),
        ("cls", all["models"]["bert-cls"].clone()),
        ("qwen3", all["models"]["qwen3-lasttoken"].clone()),
        ("st57", all["models"]["bert-mean-st57"].clone()),
    ]
}

pub(crate) fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

pub(crate) fn cosine(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// The largest difference of two vectors' components.
pub(crate) fn max_difference(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, f64::max)
}

fn length(v: &[f32]) -> f64 {
    v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt()
}

/// The vectors of an answer, in `index` order, checked to be a list of embeddings.
pub(crate) async fn embed(server: &TestServer, body: Value) -> (Vec<Vec<f32>>, Value) {
    let response = server.post_json("/v1/embeddings", &body).await;
    let status = response.status();
    let answer: Value = response.json().await.unwrap();
    assert_eq!(status, 200, "{body} → {answer}");
    assert_eq!(answer["object"], "list");
    assert_eq!(answer["model"], body["model"]);
    let vectors = answer["data"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, item)| {
            assert_eq!((&item["object"], &item["index"]), (&json!("embedding"), &json!(i)));
            match &item["embedding"] {
                Value::String(text) => base64::engine::general_purpose::STANDARD
                    .decode(text)
                    .unwrap()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
                list => floats(list),
            }
        })
        .collect();
    (vectors, answer)
}

/// A 400 in OpenAI's shape naming `param`, its message containing `says`.
pub(crate) async fn refused(server: &TestServer, body: Value, param: &str, says: &str) {
    let response = server.post_json("/v1/embeddings", &body).await;
    let status = response.status();
    let answer: Value = response.json().await.unwrap();
    assert_eq!(status, 400, "{body} → {answer}");
    assert_eq!(answer["error"]["param"], param, "{body} → {answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains(says), "{body} → {message}");
}

#[tokio::test]
async fn every_input_form_gives_sentence_transformers_vectors_alone_and_together() {
    let server = TestServer::start(CONFIG).await;
    for (model, reference) in reference() {
        let cases = reference["cases"].as_array().unwrap();
        let normalizes = reference["normalize"] == true;
        let close = |got: &[f32], want: &Value, what: &str| {
            let want = floats(want);
            let c = cosine(got, &want);
            assert!(c >= 0.9999, "{model} {what}: cosine {c}");
            // Not only the direction: every component, since random weights leave the vectors
            // of different sentences close in direction (bert-cls's within a cosine of 1e-4).
            let far = max_difference(got, &want);
            assert!(far <= 1e-4 * length(&want), "{model} {what}: a component {far} away");
        };
        for (i, case) in cases.iter().enumerate() {
            let (got, answer) = embed(&server, json!({"model": model, "input": case["input"]})).await;
            close(&got[0], &case["alone"], &format!("case {i} as a string"));
            let tokens = case["ids"].as_array().unwrap().len();
            assert_eq!(
                answer["usage"],
                json!({"prompt_tokens": tokens, "total_tokens": tokens})
            );
            let (got, _) = embed(&server, json!({"model": model, "input": case["ids"]})).await;
            close(&got[0], &case["alone"], &format!("case {i} as token ids"));
        }
        // All at once, padded to the longest: every vector as it was alone.
        let texts: Vec<&Value> = cases.iter().map(|c| &c["input"]).collect();
        let ids: Vec<&Value> = cases.iter().map(|c| &c["ids"]).collect();
        let total: usize = cases.iter().map(|c| c["ids"].as_array().unwrap().len()).sum();
        for (form, input) in [("strings", json!(texts)), ("lists of token ids", json!(ids))] {
            let (got, answer) = embed(&server, json!({"model": model, "input": input})).await;
            assert_eq!(got.len(), cases.len());
            assert_eq!(answer["usage"]["prompt_tokens"], total);
            for (i, (got, case)) in got.iter().zip(cases).enumerate() {
                close(got, &case["embedding"], &format!("case {i} of {form} in one request"));
                close(got, &case["alone"], &format!("case {i} of {form} against alone"));
                // Against the server's own answer alone: padding changes nothing beyond the
                // runtime's rounding.
                let (alone, _) = embed(&server, json!({"model": model, "input": [case["input"]]})).await;
                let far = max_difference(got, &alone[0]);
                assert!(
                    far <= 1e-5 * length(got),
                    "{model} case {i} of {form}: {far} from alone"
                );
            }
        }
        // Base64 carries the same floats, bit for bit.
        let (floats_of, _) = embed(&server, json!({"model": model, "input": texts, "user": "u-1"})).await;
        let (decoded, _) = embed(
            &server,
            json!({"model": model, "input": texts, "encoding_format": "base64"}),
        )
        .await;
        assert_eq!(decoded, floats_of, "{model}: base64");
        // Matryoshka: the first 8, normalized again when the folder normalizes.
        let (cut, _) = embed(&server, json!({"model": model, "input": texts, "dimensions": 8})).await;
        for (got, whole) in cut.iter().zip(&floats_of) {
            let mut want = whole[..8].to_vec();
            if normalizes {
                vramguard::runtime::embedder::normalize(&mut want);
            }
            assert_eq!(got.len(), 8);
            assert!(cosine(got, &want) >= 0.99999, "{model}: dimensions 8");
            assert!(
                (length(got) - length(&want)).abs() < 1e-5,
                "{model}: dimensions 8's length"
            );
        }
        if normalizes {
            assert!((length(&cut[0]) - 1.0).abs() < 1e-5);
        }
    }
    server.stop().await;
}

#[tokio::test]
async fn a_long_input_is_refused_naming_the_limit_unless_truncate_cuts_it() {
    let server = TestServer::start(CONFIG).await;
    let (model, reference) = reference().remove(0);
    let limit = reference["max_seq_length"].as_u64().unwrap() as usize;
    let long = "the server defers the request ".repeat(limit);
    refused(
        &server,
        json!({"model": model, "input": long}),
        "input",
        &format!("above the model's max_seq_length of {limit}; shorten it, or send `truncate: true`"),
    )
    .await;
    let (cut, answer) = embed(&server, json!({"model": model, "input": long, "truncate": true})).await;
    assert_eq!(answer["usage"]["prompt_tokens"], limit);
    // Cut as sentence-transformers cuts: the text's first tokens between [CLS] and [SEP].
    let tokenizer = tokenizers::Tokenizer::from_file("models/embed/bert-mean-normalize/tokenizer.json").unwrap();
    let own = tokenizer.encode(long.as_str(), false).unwrap();
    let (cls, sep) = (
        tokenizer.token_to_id("[CLS]").unwrap(),
        tokenizer.token_to_id("[SEP]").unwrap(),
    );
    let mut ids = vec![cls];
    ids.extend(&own.get_ids()[..limit - 2]);
    ids.push(sep);
    let (same, _) = embed(&server, json!({"model": model, "input": ids})).await;
    assert_eq!(cut, same);
    // Token ids are cut as sent.
    let many: Vec<u32> = own.get_ids().to_vec();
    refused(
        &server,
        json!({"model": model, "input": many}),
        "input",
        "above the model's",
    )
    .await;
    let (_, answer) = embed(&server, json!({"model": model, "input": [many], "truncate": true})).await;
    assert_eq!(answer["usage"]["prompt_tokens"], limit);
    server.stop().await;
}

#[tokio::test]
async fn a_folder_saved_by_sentence_transformers_5_7_is_cut_at_the_length_it_keeps() {
    let server = TestServer::start(CONFIG).await;
    let (model, reference) = reference().pop().unwrap();
    assert_eq!((model, &reference["sentence_transformers"]), ("st57", &json!("5.7.0")));
    let long = &reference["long"];
    let limit = long["ids"].as_array().unwrap().len();
    assert_eq!(reference["max_seq_length"], limit);
    refused(
        &server,
        json!({"model": model, "input": long["input"]}),
        "input",
        &format!("above the model's max_seq_length of {limit}"),
    )
    .await;
    let (cut, answer) = embed(
        &server,
        json!({"model": model, "input": long["input"], "truncate": true}),
    )
    .await;
    assert_eq!(answer["usage"]["prompt_tokens"], limit);
    let want = floats(&long["embedding"]);
    let far = max_difference(&cut[0], &want);
    assert!(far <= 1e-4 * length(&want), "a component {far} from what 5.7 embeds");
    server.stop().await;
}

#[tokio::test]
async fn what_is_not_an_embeddings_request_is_refused_naming_the_field() {
    let server = TestServer::start(CONFIG).await;
    let input = "An embedding model indexes notes";
    refused(&server, json!({"model": "mean", "input": []}), "input", "empty list").await;
    refused(&server, json!({"model": "mean", "input": ""}), "input", "empty string").await;
    refused(
        &server,
        json!({"model": "mean", "input": ["a", ""]}),
        "input",
        "`input[1]` is an empty string",
    )
    .await;
    refused(
        &server,
        json!({"model": "mean", "input": [[]]}),
        "input",
        "empty list of tokens",
    )
    .await;
    refused(
        &server,
        json!({"model": "mean", "input": [1, 100000]}),
        "input",
        "not a token id",
    )
    .await;
    refused(
        &server,
        json!({"model": "mean", "input": [{"a": 1}]}),
        "input",
        "`input[0]`",
    )
    .await;
    refused(&server, json!({"model": "mean"}), "input", "missing").await;
    refused(
        &server,
        json!({"model": "mean", "input": input, "encoding_format": "int8"}),
        "encoding_format",
        "`float` or `base64`",
    )
    .await;
    refused(
        &server,
        json!({"model": "mean", "input": input, "dimensions": 33}),
        "dimensions",
        "`dimensions` is 33, above the model's 32",
    )
    .await;
    refused(
        &server,
        json!({"model": "mean", "input": input, "dimensions": 0}),
        "dimensions",
        "above 0",
    )
    .await;
    refused(
        &server,
        json!({"model": "mean", "input": input, "truncate": "yes"}),
        "truncate",
        "true or false",
    )
    .await;
    refused(
        &server,
        json!({"model": "encoder", "input": input}),
        "model",
        "does not embed",
    )
    .await;
    let response = server
        .post_json("/v1/embeddings", &json!({"model": "nope", "input": input}))
        .await;
    assert_eq!(response.status(), 404);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(
        (&answer["error"]["code"], &answer["error"]["param"]),
        (&json!("model_not_found"), &json!("model"))
    );
    // Listed among the models clients pick from; a tensor model is not.
    let models: Value = reqwest::get(server.url("/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(crate::common::model_ids(&models), vec!["mean", "cls", "qwen3", "st57"]);
    // The graph pools: its one output is the vectors, not every token's state.
    for model in ["mean", "cls", "qwen3", "st57"] {
        let metadata = server.model_metadata(model).await;
        assert_eq!(
            metadata["outputs"],
            json!([{"name": "sentence_embedding", "datatype": "FP32", "shape": [-1, 32]}]),
            "{model}"
        );
    }
    let metrics = server.metrics().await;
    let refused = crate::common::sum_samples(&metrics, |l| {
        l.starts_with("vramguard_requests_total{")
            && l.contains("model=\"mean\"")
            && l.contains("outcome=\"client_error\"")
    });
    assert!(refused >= 10.0, "refusals are counted under their model: {refused}");
    server.stop().await;
}

#[tokio::test]
async fn a_folder_whose_pooling_is_not_served_is_refused_at_start_naming_the_key() {
    let scratch = vramguard::testing::Scratch::new();
    let folder = scratch.path().join("max");
    std::fs::create_dir_all(folder.join("1_Pooling")).unwrap();
    let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/embed/bert-cls");
    for file in ["model.onnx", "tokenizer.json", "modules.json", "config.json"] {
        std::fs::copy(from.join(file), folder.join(file)).unwrap();
    }
    std::fs::write(
        folder.join("1_Pooling/config.json"),
        r#"{"pooling_mode_cls_token": false, "pooling_mode_max_tokens": true}"#,
    )
    .unwrap();
    let config = format!(
        "models: [{{name: m, path: '{}'}}]\npools: [{{name: cpu, provider: cpu, models: [m]}}]\n",
        folder.join("model.onnx").display()
    );
    let err = TestServer::try_start(&config).await.err().expect("refused");
    assert!(err.contains("`pooling_mode_max_tokens` is not served"), "{err}");
}
