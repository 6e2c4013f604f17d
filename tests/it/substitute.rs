//! A smaller fallback model answering instead (`models[].fallback_model`), over real HTTP and
//! real ONNX Runtime sessions: only with the client's leave (the header, the request's
//! `parameters`, or the model's `allow_substitute` for a client that does not say, an explicit
//! `false` winning), the answer naming the model that answered, counted once under it and in
//! `vramguard_substitutions_total`, for each reason (the policy's refusal, a request that can
//! never fit, an open breaker); a fallback that cannot take the inputs leaves the first
//! refusal, saying so; a completion and a streamed chat are made again for the fallback.

use crate::common::TestServer;
use reqwest::StatusCode;
use serde_json::{Value, json};

/// Two names for the encoder, the policy refusing the one asked for: `big` falls back on
/// `small`, `eager` too and allows it by default, `picky` on the classifier, whose inputs are
/// not the encoder's.
const CONFIG: &str = "\
models:
- {name: big, path: 'builtin:encoder', fallback_model: small}
- {name: small, path: 'builtin:encoder'}
- {name: eager, path: 'builtin:encoder', fallback_model: small, allow_substitute: true}
- {name: picky, path: 'builtin:encoder', fallback_model: cls}
- {name: cls, path: 'builtin:classifier'}
pools: [{name: cpu, provider: cpu, models: [big, small, eager, picky, cls]}]
";

/// Admits only the fallbacks.
const POLICY: &str = r#"fn decide(req, state) {
    if req.model == "small" || req.model == "cls" { admit() } else { reject("the policy keeps this model off") }
}
"#;

/// An encoder request to `model` (binary tensors), with `parameters` and `headers`.
async fn encode(server: &TestServer, model: &str, parameters: Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let (header, body) = crate::common::encoder_binary_request_with(8, Some(parameters));
    let mut request = reqwest::Client::new()
        .post(server.url(&format!("/v2/models/{model}/infer")))
        .header("Inference-Header-Content-Length", header.len());
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.body(body).send().await.unwrap()
}

/// The JSON part of an inference response (all of it: the outputs are asked for as JSON).
async fn head(response: reqwest::Response) -> Value {
    assert!(response.headers().get("inference-header-content-length").is_none());
    response.json().await.unwrap()
}

fn substitutions(metrics: &str, model: &str, fallback: &str, reason: &str) -> f64 {
    let series =
        format!("vramguard_substitutions_total{{model=\"{model}\",fallback_model=\"{fallback}\",reason=\"{reason}\"}}");
    assert!(metrics.contains(&series), "no {series} in:\n{metrics}");
    crate::common::sample(metrics, &series)
}

fn all_requests(metrics: &str) -> f64 {
    crate::common::requests_with(metrics, |_| true)
}

#[tokio::test]
async fn without_leave_the_model_is_never_swapped() {
    let server = TestServer::with_policy(CONFIG, POLICY).await;
    let metrics = server.metrics().await;
    // Every model with a fallback has its series from the first scrape.
    for reason in ["breaker_open", "no_fit", "unavailable"] {
        assert_eq!(substitutions(&metrics, "big", "small", reason), 0.0);
        assert_eq!(substitutions(&metrics, "picky", "cls", reason), 0.0);
    }
    assert!(
        !metrics.contains("vramguard_substitutions_total{model=\"small\""),
        "{metrics}"
    );

    let response = encode(&server, "big", json!({}), &[]).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(response.headers().get("x-vramguard-model").is_none());
    let body: Value = response.json().await.unwrap();
    let error = body["error"].as_str().unwrap();
    assert!(error.contains("the policy keeps this model off"), "{error}");
    assert!(!error.contains("substitute"), "{error}");
    // The same with the client's explicit no, on a model whose config allows it by default.
    let response = encode(
        &server,
        "eager",
        json!({}),
        &[("x-vramguard-allow-substitute", "false")],
    )
    .await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let response = encode(
        &server,
        "eager",
        json!({"allow_substitute": true}),
        &[("x-vramguard-allow-substitute", "false")],
    )
    .await;
    assert_eq!(
        response.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "the header wins over parameters"
    );

    let metrics = server.metrics().await;
    assert_eq!(substitutions(&metrics, "big", "small", "no_fit"), 0.0);
    assert_eq!(substitutions(&metrics, "eager", "small", "no_fit"), 0.0);
    let big = "vramguard_requests_total{model=\"big\",pool=\"\",outcome=\"rejected\"}";
    assert_eq!(crate::common::sample(&metrics, big), 1.0, "{metrics}");
    assert_eq!(all_requests(&metrics), 3.0);
    server.stop().await;
}

#[tokio::test]
async fn with_leave_the_fallback_answers_and_says_so_counted_once() {
    let server = TestServer::with_policy(CONFIG, POLICY).await;
    // A model that answers itself is named too.
    let response = encode(&server, "small", json!({}), &[]).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-vramguard-model"], "small");
    let own = head(response).await;

    let response = encode(&server, "big", json!({}), &[("x-vramguard-allow-substitute", "true")]).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-vramguard-model"], "small");
    assert_eq!(response.headers()["x-vramguard-pool"], "cpu");
    let answer = head(response).await;
    assert_eq!(answer["model_name"], "small", "{answer}");
    assert_eq!(answer["parameters"]["model"], "small", "{answer}");
    assert_eq!(answer["parameters"]["requested_model"], "big", "{answer}");
    assert_eq!(answer["parameters"]["substituted"], "no_fit", "{answer}");
    assert_eq!(
        answer["outputs"], own["outputs"],
        "the fallback's answer, as it gives it"
    );

    // `parameters.allow_substitute` in the body, and the model's default, allow it too.
    let response = encode(&server, "big", json!({"allow_substitute": true}), &[]).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-vramguard-model"], "small");
    let response = encode(&server, "eager", json!({}), &[]).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-vramguard-model"], "small");

    let metrics = server.metrics().await;
    assert_eq!(substitutions(&metrics, "big", "small", "no_fit"), 2.0);
    assert_eq!(substitutions(&metrics, "eager", "small", "no_fit"), 1.0);
    // Each request counted once, as the model that answered it.
    let small = "vramguard_requests_total{model=\"small\",pool=\"cpu\",outcome=\"ok\"}";
    assert_eq!(crate::common::sample(&metrics, small), 4.0, "{metrics}");
    assert_eq!(all_requests(&metrics), 4.0, "{metrics}");
    server.stop().await;
}

#[tokio::test]
async fn a_fallback_that_cannot_take_the_inputs_leaves_the_first_refusal() {
    let server = TestServer::with_policy(CONFIG, POLICY).await;
    let response = encode(&server, "picky", json!({}), &[("x-vramguard-allow-substitute", "true")]).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(response.headers().get("retry-after").is_some());
    let body: Value = response.json().await.unwrap();
    let error = body["error"].as_str().unwrap();
    assert!(error.contains("the policy keeps this model off"), "{error}");
    assert!(error.contains("unknown input `input`"), "{error}");
    assert!(
        error.contains("its substitute `cls` could not take the request"),
        "{error}"
    );
    let metrics = server.metrics().await;
    assert_eq!(substitutions(&metrics, "picky", "cls", "no_fit"), 0.0);
    let picky = "vramguard_requests_total{model=\"picky\",pool=\"\",outcome=\"rejected\"}";
    assert_eq!(crate::common::sample(&metrics, picky), 1.0, "{metrics}");
    assert_eq!(all_requests(&metrics), 1.0);
    server.stop().await;
}

#[tokio::test]
async fn a_substituted_answer_is_the_answer_to_its_idempotency_key() {
    let server = TestServer::with_policy(CONFIG, POLICY).await;
    let headers = [("x-vramguard-allow-substitute", "true"), ("idempotency-key", "swap-1")];
    let first = encode(&server, "big", json!({}), &headers).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(first.headers()["x-vramguard-model"], "small");
    let first = head(first).await;
    let again = encode(&server, "big", json!({}), &headers).await;
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.headers()["x-vramguard-model"], "small");
    assert_eq!(head(again).await, first);
    // Leave to substitute changes what the request means: the same key without it is another
    // request.
    let other = encode(&server, "big", json!({}), &[("idempotency-key", "swap-1")]).await;
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);

    let metrics = server.metrics().await;
    assert_eq!(substitutions(&metrics, "big", "small", "no_fit"), 1.0);
    let small = "vramguard_requests_total{model=\"small\",pool=\"cpu\",outcome=\"ok\"}";
    assert_eq!(crate::common::sample(&metrics, small), 1.0, "{metrics}");
    server.stop().await;
}

/// The tiny decoder under two names: `tiny` falls back on `small`, the policy refusing `tiny`.
const DECODERS: &str = "\
models:
- {name: tiny, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json,
   chat_template: 'builtin:chatml', fallback_model: small}
- {name: small, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json,
   chat_template: 'builtin:chatml'}
pools: [{name: cpu, provider: cpu, models: [tiny, small]}]
";

const KEEP_TINY_OFF: &str = r#"fn decide(req, state) {
    if req.model == "small" { admit() } else { reject("the policy keeps this model off") }
}
"#;

/// POST `body` to `path` with `headers`.
async fn post(server: &TestServer, path: &str, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut request = reqwest::Client::new().post(server.url(path)).json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

#[tokio::test]
async fn a_completion_is_answered_by_the_fallback_named_in_its_model_field() {
    let server = TestServer::with_policy(DECODERS, KEEP_TINY_OFF).await;
    let completion = |model: &str| json!({"model": model, "prompt": "The GPU", "max_tokens": 6, "temperature": 0});
    let allow = [("x-vramguard-allow-substitute", "true")];

    let refused = post(&server, "/v1/completions", &completion("tiny"), &[]).await;
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    let own = post(&server, "/v1/completions", &completion("small"), &[]).await;
    assert_eq!(own.status(), StatusCode::OK);
    assert_eq!(own.headers()["x-vramguard-model"], "small");
    let own: Value = own.json().await.unwrap();

    let response = post(&server, "/v1/completions", &completion("tiny"), &allow).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-vramguard-model"], "small");
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["model"], "small", "{answer}");
    assert_eq!(answer["choices"][0]["text"], own["choices"][0]["text"], "{answer}");
    assert_eq!(answer["usage"], own["usage"], "{answer}");

    // A streamed chat: every chunk names the fallback, the first says what it stands in for.
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
                      "max_tokens": 4, "temperature": 0, "stream": true});
    let response = post(&server, "/v1/chat/completions", &chat, &allow).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-vramguard-model"], "small");
    let chunks = crate::generation::events(response).await;
    assert!(chunks.iter().all(|c| c["model"] == "small"), "{chunks:?}");
    let facts = &chunks[0]["vramguard"];
    assert_eq!(facts["model"], "small", "{facts}");
    assert_eq!(facts["requested_model"], "tiny", "{facts}");
    assert_eq!(facts["substituted"], "no_fit", "{facts}");

    let metrics = server.metrics().await;
    assert_eq!(substitutions(&metrics, "tiny", "small", "no_fit"), 2.0);
    let small = "vramguard_requests_total{model=\"small\",pool=\"cpu\",outcome=\"ok\"}";
    assert_eq!(crate::common::sample(&metrics, small), 3.0, "{metrics}");
    let tiny = "vramguard_requests_total{model=\"tiny\",pool=\"\",outcome=\"rejected\"}";
    assert_eq!(crate::common::sample(&metrics, tiny), 1.0, "{metrics}");
    assert_eq!(all_requests(&metrics), 4.0, "{metrics}");
    server.stop().await;
}

#[tokio::test]
async fn a_model_whose_breaker_is_open_is_answered_by_its_fallback_on_another_pool() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let config = "\
devices: [{name: gpu0, kind: simulated, capacity: 128MiB}]
models:
- {name: big, path: 'builtin:encoder', fallback_model: small}
- {name: small, path: 'builtin:encoder'}
pools:
- {name: gpu, provider: simulated, device: gpu0, models: [big], breaker: {failures: 1, window: 60s, cooldown: 1h}}
- {name: cpu, provider: cpu, models: [small]}
";
    let server = TestServer::with_policy(config, vramguard::testing::ADMIT_ALL).await;
    let reset = server
        .post_json("/admin/sim/gpu0", &json!({"driver_reset": true}))
        .await;
    assert_eq!(reset.status(), StatusCode::OK);
    // The driver failure opens the breaker; it ran, so it is not a reason to substitute.
    let failed = encode(&server, "big", json!({}), &[("x-vramguard-allow-substitute", "true")]).await;
    assert_eq!(failed.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = failed.json().await.unwrap();
    assert_eq!(body["reason"], "allocator_failure_driver", "{body}");

    let refused = encode(&server, "big", json!({}), &[]).await;
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = refused.json().await.unwrap();
    assert!(
        body["error"].as_str().unwrap().contains("circuit breaker is open"),
        "{body}"
    );

    let response = encode(&server, "big", json!({}), &[("x-vramguard-allow-substitute", "true")]).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-vramguard-model"], "small");
    assert_eq!(response.headers()["x-vramguard-pool"], "cpu");
    let answer = head(response).await;
    assert_eq!(answer["parameters"]["substituted"], "breaker_open", "{answer}");

    let metrics = server.metrics().await;
    assert_eq!(substitutions(&metrics, "big", "small", "breaker_open"), 1.0);
    assert_eq!(substitutions(&metrics, "big", "small", "no_fit"), 0.0);
    let small = "vramguard_requests_total{model=\"small\",pool=\"cpu\",outcome=\"ok\"}";
    assert_eq!(crate::common::sample(&metrics, small), 1.0, "{metrics}");
    assert_eq!(all_requests(&metrics), 3.0, "{metrics}");
    server.stop().await;
}

#[tokio::test]
async fn a_request_that_can_never_fit_is_answered_by_a_fallback_that_fits() {
    let config = "\
models:
- {name: huge, path: 'builtin:encoder', fallback_model: small, memory_profile: {workspace: 64TiB}}
- {name: small, path: 'builtin:encoder'}
pools: [{name: cpu, provider: cpu, models: [huge, small]}]
";
    let server = TestServer::with_policy(config, vramguard::testing::ADMIT_ALL).await;
    let refused = encode(&server, "huge", json!({}), &[]).await;
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["reason"], "never_fits", "{body}");

    let response = encode(&server, "huge", json!({}), &[("x-vramguard-allow-substitute", "true")]).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-vramguard-model"], "small");
    let answer = head(response).await;
    assert_eq!(answer["parameters"]["substituted"], "no_fit", "{answer}");

    let metrics = server.metrics().await;
    assert_eq!(substitutions(&metrics, "huge", "small", "no_fit"), 1.0);
    let huge = "vramguard_requests_total{model=\"huge\",pool=\"\",outcome=\"client_error\"}";
    assert_eq!(crate::common::sample(&metrics, huge), 1.0, "{metrics}");
    let small = "vramguard_requests_total{model=\"small\",pool=\"cpu\",outcome=\"ok\"}";
    assert_eq!(crate::common::sample(&metrics, small), 1.0, "{metrics}");
    assert_eq!(all_requests(&metrics), 2.0, "{metrics}");
    server.stop().await;
}
