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
                "the body is not a completion request: EOF while parsing a value at line 1 column 10",
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
