//! The OpenAI surface beyond one prompt and one answer, with real ONNX Runtime on the tiny
//! decoder fixture (`models/decoder/`), served from the CPU: `GET /v1/models/{id}` (OpenAI's 404
//! for any name not served, one with `/` in it included); a completion's `prompt` in each form
//! OpenAI takes, each prompt its own choice, and `echo`, whole and streamed.

use crate::common::TestServer;
use reqwest::StatusCode;
use serde_json::{Value, json};

const CONFIG: &str = "\
models: [{name: tiny, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json,
          chat_template: 'builtin:chatml'},
         {name: encoder, path: 'builtin:encoder'}]
pools:
- {name: cpu, provider: cpu, models: [tiny, encoder]}
";

/// `GET path` on `server`: its status and JSON body.
async fn get(server: &TestServer, path: &str) -> (StatusCode, Value) {
    let response = reqwest::get(server.url(path)).await.unwrap();
    (response.status(), response.json().await.unwrap())
}

/// `client.models.retrieve(id)`: the list's own entry for a text model; OpenAI's 404
/// `model_not_found` for a name not served and for a model that does not generate text. A
/// configured name is one path segment, but an id with `/` in it (`org/model`, as OpenAI-style
/// clients write one) reaches the route too, and is answered as OpenAI answers it, not as a
/// path no route serves.
#[tokio::test]
async fn a_model_is_retrieved_by_its_id_and_any_other_is_model_not_found() {
    let server = TestServer::start(CONFIG).await;
    let (status, list) = get(&server, "/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    for entry in list["data"].as_array().unwrap() {
        let id = entry["id"].as_str().unwrap();
        let (status, model) = get(&server, &format!("/v1/models/{id}")).await;
        assert_eq!(status, StatusCode::OK, "{id}: {model}");
        assert_eq!(&model, entry, "the list's entry");
    }
    assert_eq!(crate::common::model_ids(&list), ["tiny"]);
    for id in ["nope", "encoder", "org/tiny", "tiny/extra"] {
        let (status, error) = get(&server, &format!("/v1/models/{id}")).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{id}: {error}");
        let error = &error["error"];
        assert_eq!(error["code"], "model_not_found", "{id}: {error}");
        assert_eq!(error["type"], "not_found_error", "{id}: {error}");
        assert_eq!(error["param"], "model", "{id}: {error}");
        assert!(error["message"].as_str().unwrap().contains(id), "{id}: {error}");
    }
    server.stop().await;
}

/// The fixture's reference cases, by name: prompt, its token ids and its greedy text.
fn case(name: &str) -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/models/decoder/reference.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = reference["cases"].as_array().unwrap();
    cases.iter().find(|c| c["name"] == name).unwrap().clone()
}

/// A greedy completion of 16 tokens of `prompt`, with `extra` fields.
fn greedy(prompt: Value, extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

/// `POST /v1/completions`: its status and JSON body.
async fn complete(server: &TestServer, body: &Value) -> (StatusCode, Value) {
    let response = server.post_json("/v1/completions", body).await;
    (response.status(), response.json().await.unwrap())
}

/// Each choice's text, joined from a stream's chunks by `index`, and each one's finish reason;
/// the stream's `usage` (on its last chunk).
fn joined(chunks: &[Value], choices: usize) -> (Vec<String>, Vec<String>, Value) {
    let mut texts = vec![String::new(); choices];
    let mut finishes = vec![String::new(); choices];
    for chunk in chunks {
        let choice = &chunk["choices"][0];
        let index = choice["index"].as_u64().unwrap() as usize;
        texts[index].push_str(choice["text"].as_str().unwrap());
        if let Some(finish) = choice["finish_reason"].as_str() {
            assert!(finishes[index].is_empty(), "choice {index} finished twice: {chunks:?}");
            finishes[index] = finish.to_string();
        }
    }
    let last = chunks.last().unwrap();
    assert!(last["usage"].is_object(), "usage comes last: {last}");
    (texts, finishes, last["usage"].clone())
}

/// `prompt` as a string, an array of strings, token ids and arrays of token ids: each prompt
/// is its own choice, in order, with the text it has alone; usage sums them; streamed, each
/// chunk names its choice, and the choices' texts are the same. Each prompt is a generation
/// of its own, counted as one request.
#[tokio::test]
async fn every_prompt_form_is_its_own_choice_with_the_text_it_has_alone() {
    let server = TestServer::start(CONFIG).await;
    let names = ["short", "stop", "long"];
    let cases: Vec<Value> = names.iter().map(|n| case(n)).collect();
    let mut alone = Vec::new();
    for case in &cases {
        let (status, body) = complete(&server, &greedy(case["prompt"].clone(), json!({}))).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["choices"][0]["text"], case["text"], "{body}");
        alone.push(body);
    }
    let texts: Vec<Value> = cases.iter().map(|c| c["prompt"].clone()).collect();
    let ids: Vec<Value> = cases.iter().map(|c| c["prompt_ids"].clone()).collect();
    let forms = [
        ("strings", json!(texts)),
        ("token arrays", json!(ids)),
        ("one string in an array", json!([texts[0]])),
        ("token ids", ids[0].clone()),
    ];
    for (form, prompt) in forms {
        let (status, body) = complete(&server, &greedy(prompt.clone(), json!({}))).await;
        assert_eq!(status, StatusCode::OK, "{form}: {body}");
        let choices = body["choices"].as_array().unwrap();
        let count = if prompt[0].is_string() || prompt[0].is_array() {
            prompt.as_array().unwrap().len()
        } else {
            1
        };
        assert_eq!(choices.len(), count, "{form}: {body}");
        let mut usage = (0, 0);
        for (i, choice) in choices.iter().enumerate() {
            assert_eq!(choice["index"], i, "{form}: {body}");
            assert_eq!(choice["text"], alone[i]["choices"][0]["text"], "{form}: choice {i}");
            assert_eq!(choice["finish_reason"], alone[i]["choices"][0]["finish_reason"]);
            usage.0 += alone[i]["usage"]["prompt_tokens"].as_u64().unwrap();
            usage.1 += alone[i]["usage"]["completion_tokens"].as_u64().unwrap();
        }
        assert_eq!(
            body["usage"],
            json!({"prompt_tokens": usage.0, "completion_tokens": usage.1, "total_tokens": usage.0 + usage.1}),
            "{form}"
        );
        // Streamed: the same choices, each chunk naming its own.
        let response = server
            .post_json("/v1/completions", &greedy(prompt, json!({"stream": true})))
            .await;
        let chunks = crate::generation::events(response).await;
        let (streamed, finishes, streamed_usage) = joined(&chunks, count);
        for i in 0..count {
            assert_eq!(
                streamed[i],
                alone[i]["choices"][0]["text"].as_str().unwrap(),
                "{form}: {i}"
            );
            assert_eq!(finishes[i], alone[i]["choices"][0]["finish_reason"].as_str().unwrap());
        }
        assert_eq!(streamed_usage, body["usage"], "{form}");
    }
    // 4 alone, then 3 + 3 + 1 + 1 prompts, twice each: one request per prompt.
    let metrics = server.metrics().await;
    let ok = crate::common::requests_with(&metrics, |o| o == "ok");
    assert_eq!(ok, (3 + 2 * (3 + 3 + 1 + 1)) as f64, "{metrics}");
    server.stop().await;
}

/// `echo` puts the prompt's text before each choice's (the first chunk of each streamed
/// choice); token ids are echoed as their text. A prompt OpenAI would not take, a token id the
/// model does not have, and `echo` with `logprobs` (the prompt's run has no logits for the
/// prompt's own tokens) are 400s naming the field.
#[tokio::test]
async fn echo_puts_the_prompt_first_and_bad_prompts_are_refused_by_name() {
    let server = TestServer::start(CONFIG).await;
    let short = case("short");
    let stop = case("stop");
    let prompts = json!([short["prompt_ids"], stop["prompt_ids"]]);
    let (status, body) = complete(&server, &greedy(prompts.clone(), json!({"echo": true}))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    for (i, case) in [&short, &stop].into_iter().enumerate() {
        let want = format!("{}{}", case["prompt"].as_str().unwrap(), case["text"].as_str().unwrap());
        assert_eq!(body["choices"][i]["text"], want, "{body}");
    }
    let response = server
        .post_json(
            "/v1/completions",
            &greedy(prompts, json!({"echo": true, "stream": true})),
        )
        .await;
    let chunks = crate::generation::events(response).await;
    for (i, case) in [&short, &stop].into_iter().enumerate() {
        let first = chunks.iter().find(|c| c["choices"][0]["index"] == i).unwrap();
        assert_eq!(first["choices"][0]["text"], case["prompt"], "{chunks:?}");
    }
    let (texts, _, _) = joined(&chunks, 2);
    assert_eq!(texts[0], body["choices"][0]["text"].as_str().unwrap());
    assert_eq!(texts[1], body["choices"][1]["text"].as_str().unwrap());
    let (_, body) = complete(&server, &greedy(stop["prompt"].clone(), json!({"echo": true}))).await;
    assert_eq!(body["choices"][0]["text"], texts[1], "a text prompt echoes as sent");

    let vocabulary = 512;
    for (prompt, extra, param) in [
        (json!([1, vocabulary]), json!({}), "prompt"),
        (json!([[1, 2], [3, -1]]), json!({}), "prompt"),
        (json!([]), json!({}), "prompt"),
        (json!([[]]), json!({}), "prompt"),
        (json!(["x", 5]), json!({}), "prompt"),
        (json!({"text": "x"}), json!({}), "prompt"),
        (json!("x"), json!({"echo": true, "logprobs": 2}), "echo"),
        (json!("x"), json!({"best_of": 2}), "best_of"),
    ] {
        let (status, error) = complete(&server, &greedy(prompt.clone(), extra)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{prompt}: {error}");
        assert_eq!(error["error"]["param"], param, "{prompt}: {error}");
    }
    let (_, error) = complete(&server, &greedy(json!([1, vocabulary]), json!({}))).await;
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains(&format!("token id {vocabulary}")), "{message}");
    let (_, error) = complete(&server, &greedy(json!("x"), json!({"echo": true, "logprobs": 2}))).await;
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("last position"), "says why: {message}");
    server.stop().await;
}
