//! Every answer under `/v1/` has OpenAI's error body, `{"error": {"message", "type", "param",
//! "code"}}`, whoever writes it: the router for a path or a method it does not serve, the
//! connection layer for a body over `server.body_limit` (declared or chunked), the handlers for
//! a body that is not JSON. Other paths keep `{"error": "..."}`.

use crate::common::TestServer;
use axum::body::Bytes;
use reqwest::StatusCode;
use serde_json::{Value, json};

const CONFIG: &str = "\
server: {body_limit: 64KiB, admin_socket: 'off'}
models: [{name: encoder, path: 'builtin:encoder'}]
pools: [{name: cpu, provider: cpu, models: [encoder], workers: 1}]
";

/// OpenAI's error body for `message` of `kind`, with no `param` and no `code`.
fn openai(message: &str, kind: &str) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": null}})
}

/// The status and JSON body of `response`, which says it is JSON.
async fn answer(response: reqwest::Response) -> (StatusCode, Value) {
    let status = response.status();
    let kind = response.headers()[reqwest::header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(kind, "application/json", "{status}");
    (status, response.json().await.unwrap())
}

#[tokio::test]
async fn every_v1_error_has_openais_body_and_other_paths_keep_theirs() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let client = reqwest::Client::new();

    // A path no route serves: what `client.audio.speech.create` asks of a server without it.
    let speech = client
        .post(server.url("/v1/audio/speech"))
        .json(&json!({"model": "encoder", "input": "x", "voice": "alloy"}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        answer(speech).await,
        (
            StatusCode::NOT_FOUND,
            openai("Invalid URL (POST /v1/audio/speech)", "not_found_error")
        )
    );

    // A method the route does not take, with the methods it does.
    let get = client.get(server.url("/v1/chat/completions")).send().await.unwrap();
    assert_eq!(get.headers()[reqwest::header::ALLOW], "POST");
    assert_eq!(
        answer(get).await,
        (
            StatusCode::METHOD_NOT_ALLOWED,
            openai(
                "Invalid method for URL (GET /v1/chat/completions)",
                "invalid_request_error"
            )
        )
    );

    // A body that is not JSON.
    let malformed = client
        .post(server.url("/v1/completions"))
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body("{\"model\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(
        answer(malformed).await,
        (
            StatusCode::BAD_REQUEST,
            openai(
                "the body is not JSON: EOF while parsing a value at line 1 column 10",
                "invalid_request_error"
            )
        )
    );

    // A body over `server.body_limit`, refused by the connection layer: by its declared length
    // before any route sees it, and chunked while the route reads it.
    let too_large = openai(
        "request body exceeds the 65536 byte limit (server.body_limit)",
        "invalid_request_error",
    );
    let over = vec![b' '; 64 * 1024 + 1];
    let declared = client
        .post(server.url("/v1/chat/completions"))
        .body(over.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(
        answer(declared).await,
        (StatusCode::PAYLOAD_TOO_LARGE, too_large.clone())
    );
    let chunks = futures_util::stream::iter([Ok::<_, std::io::Error>(Bytes::from(over))]);
    let chunked = client
        .post(server.url("/v1/chat/completions"))
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .unwrap();
    assert_eq!(answer(chunked).await, (StatusCode::PAYLOAD_TOO_LARGE, too_large));

    // The Open Inference Protocol's paths keep its own body.
    let unknown = client.post(server.url("/v2/nope")).send().await.unwrap();
    assert_eq!(
        answer(unknown).await,
        (StatusCode::NOT_FOUND, json!({"error": "no such endpoint"}))
    );
    server.stop().await;
}

/// A field of the wrong type or out of its range, in any `/v1/` JSON body, is a 400 whose
/// `param` is the field's path in the body and whose message names it: top-level fields,
/// nested ones (`messages[2].content`, `tools[0].function.parameters`), numbers JSON can write
/// and a double cannot hold, `max_completion_tokens` by its own name, and a `$ref` cycle in a
/// structured output's schema named as such. Each body is sent as raw text, as a client writes
/// it.
#[tokio::test]
async fn a_field_of_the_wrong_type_is_named_by_its_path_on_every_endpoint() {
    let server = TestServer::start(
        "\
server: {admin_socket: 'off'}
models: [{name: tiny, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json,
          chat_template: 'builtin:chatml'},
         {name: mean, path: models/embed/bert-mean-normalize/model.onnx},
         {name: rerank, path: models/embed/bert-cross-encoder/model.onnx}]
pools: [{name: cpu, provider: cpu, models: [tiny, mean, rerank]}]
",
    )
    .await;
    let chat = r#"{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]"#;
    let completion = r#"{"model": "tiny", "prompt": "hi""#;
    let embedding = r#"{"model": "mean", "input": "hi""#;
    let rerank = r#"{"model": "rerank", "query": "q", "documents": ["a"]"#;
    let cycle = r##""response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema":
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}}}"##;
    let cases = [
        (
            "/v1/chat/completions",
            chat,
            r#""max_tokens": -1"#,
            "max_tokens",
            "got -1",
        ),
        (
            "/v1/chat/completions",
            chat,
            r#""top_logprobs": -1"#,
            "top_logprobs",
            "got -1",
        ),
        (
            "/v1/chat/completions",
            chat,
            r#""logprobs": "yes""#,
            "logprobs",
            "expected a boolean",
        ),
        (
            "/v1/chat/completions",
            chat,
            r#""temperature": "hot""#,
            "temperature",
            "expected a number",
        ),
        (
            "/v1/chat/completions",
            chat,
            r#""seed": -1"#,
            "seed",
            "non-negative integer",
        ),
        (
            "/v1/chat/completions",
            chat,
            r#""seed": 1180591620717411303424"#,
            "seed",
            "non-negative integer",
        ),
        ("/v1/chat/completions", chat, r#""top_k": -5"#, "top_k", "got -5"),
        (
            "/v1/chat/completions",
            chat,
            r#""logit_bias": [1, 2]"#,
            "logit_bias",
            "expected an object",
        ),
        (
            "/v1/chat/completions",
            chat,
            r#""presence_penalty": 1e400"#,
            "presence_penalty",
            "out of range",
        ),
        (
            "/v1/chat/completions",
            chat,
            r#""max_completion_tokens": 0"#,
            "max_completion_tokens",
            "got 0",
        ),
        (
            "/v1/chat/completions",
            chat,
            r#""stop": 5"#,
            "stop",
            "a string or an array of strings",
        ),
        ("/v1/chat/completions", chat, cycle, "response_format", "`$ref` cycles"),
        (
            "/v1/chat/completions",
            r#"{"model": "tiny", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": 5}]"#,
            r#""n": 1"#,
            "messages[2].content",
            "must be a string",
        ),
        (
            "/v1/chat/completions",
            chat,
            r#""tools": [{"type": "function", "function": {"name": "f", "parameters": "none"}}]"#,
            "tools[0].function.parameters",
            "JSON Schema object",
        ),
        (
            "/v1/completions",
            completion,
            r#""max_tokens": -1"#,
            "max_tokens",
            "got -1",
        ),
        (
            "/v1/completions",
            completion,
            r#""temperature": "hot""#,
            "temperature",
            "expected a number",
        ),
        ("/v1/completions", completion, r#""n": 1e400"#, "n", "out of range"),
        ("/v1/completions", completion, cycle, "response_format", "`$ref` cycles"),
        (
            "/v1/embeddings",
            embedding,
            r#""dimensions": 1e400"#,
            "dimensions",
            "out of range",
        ),
        ("/v1/rerank", rerank, r#""top_n": 1e400"#, "top_n", "out of range"),
    ];
    let client = reqwest::Client::new();
    for (path, body, field, param, says) in cases {
        let body = format!("{body}, {field}}}");
        let response = client
            .post(server.url(path))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        let (status, answer) = answer(response).await;
        let error = &answer["error"];
        assert_eq!(
            (status, &error["param"], &error["type"]),
            (StatusCode::BAD_REQUEST, &json!(param), &json!("invalid_request_error")),
            "{path} {body}: {answer}"
        );
        let message = error["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("`{param}`")) && message.contains(says),
            "{path} {body}: {message:?} should name `{param}` and say {says:?}"
        );
    }
    server.stop().await;
}
