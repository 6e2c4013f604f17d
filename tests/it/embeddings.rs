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
        &format!("is longer than the model's max_seq_length of {limit} tokens; shorten it, or send `truncate: true`"),
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
        &format!("has {} tokens, above the model's max_seq_length of {limit}", many.len()),
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
        &format!("longer than the model's max_seq_length of {limit} tokens"),
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
    // OpenAI's forms are strings or lists of token ids, not both in one list.
    refused(
        &server,
        json!({"model": "mean", "input": [[1, 2], "a"]}),
        "input",
        "`input[1]` is a string and `input[0]` a list of token ids",
    )
    .await;
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

/// `models[].auto_truncate` (TEI's `--auto-truncate`): a long input is cut when the request
/// does not say, and refused when it says `truncate: false`; on a model that reads no text the
/// key is refused at start.
#[tokio::test]
async fn auto_truncate_cuts_what_the_request_does_not_refuse() {
    let config = "models: [{name: cut, path: models/embed/bert-mean-normalize/model.onnx, auto_truncate: true}]\n\
                  pools: [{name: cpu, provider: cpu, models: [cut]}]\n";
    let server = TestServer::start(config).await;
    // Open WebUI's default chunk, 1,000 characters; the fixture's tiny vocabulary spells most
    // of its words in pieces, past the 512 tokens the model takes.
    let chunk: String = std::fs::read_to_string("docs/embeddings.md")
        .unwrap()
        .chars()
        .take(1000)
        .collect();
    let (_, answer) = embed(&server, json!({"model": "cut", "input": [chunk.as_str(), "short"]})).await;
    let tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(tokens > 64 && tokens <= 512 + 3, "{answer}");
    let long = "the server defers the request ".repeat(600);
    let (_, answer) = embed(&server, json!({"model": "cut", "input": long})).await;
    assert_eq!(answer["usage"]["prompt_tokens"], 512);
    refused(
        &server,
        json!({"model": "cut", "input": long, "truncate": false}),
        "input",
        "is longer than the model's max_seq_length of 512 tokens",
    )
    .await;
    server.stop().await;
    let config = "models: [{name: encoder, path: 'builtin:encoder', auto_truncate: true}]\n\
                  pools: [{name: cpu, provider: cpu, models: [encoder]}]\n";
    let err = TestServer::try_start(config).await.err().expect("refused");
    assert!(
        err.contains("models[0].auto_truncate: it reads no texts to embed or rerank"),
        "{err}"
    );
}

/// A string of 10 MB (issue 63: refused after 5–12 s and +0.9 GB, about 85 bytes a byte) is
/// refused, or cut, reading only what the model takes: measured here as the time to answer and
/// the growth of this process's resident memory while it is answered, with bounds generous
/// enough for a loaded machine and a debug build (the bug's cost in either is far past them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_string_of_ten_megabytes_costs_what_the_model_takes() {
    let server = TestServer::start(CONFIG).await;
    let text = "the server defers the request ".repeat(10_000_000 / 30);
    for (truncate, status) in [(false, 400), (true, 200)] {
        let body = json!({"model": "mean", "input": text, "truncate": truncate});
        let before = crate::memory::resident(std::process::id());
        let started = std::time::Instant::now();
        let request = server.post_json("/v1/embeddings", &body);
        tokio::pin!(request);
        let mut peak = before;
        let response = loop {
            tokio::select! {
                response = &mut request => break response,
                () = tokio::time::sleep(std::time::Duration::from_millis(10)) => {
                    peak = peak.max(crate::memory::resident(std::process::id()));
                }
            }
        };
        let took = started.elapsed();
        assert_eq!(response.status(), status);
        let grew = peak.saturating_sub(before) >> 20;
        eprintln!("10 MB, truncate {truncate}: {took:?}, resident memory +{grew} MiB");
        assert!(took < std::time::Duration::from_secs(20), "{took:?}");
        assert!(grew < 400, "+{grew} MiB");
    }
    server.stop().await;
}
