//! Text generation over `/v1/completions` with real ONNX Runtime on the tiny decoder fixture
//! (`models/decoder/`, Optimum's past-key-values layout, a trained BPE tokenizer): greedy
//! tokens equal the references computed independently in numpy; the same seeded request gives
//! the same tokens on the simulated accelerator and on the CPU; an allocator failure before the
//! first token, or in the middle of a generation, moves it to the CPU pool with the tokens it
//! would have had; errors come in OpenAI's shape. Chat renders its template (ChatML here) and
//! answers as the completion of that prompt would; a chat offering tools is never run twice
//! once its first token is picked.

use crate::common::TestServer;
use reqwest::StatusCode;
use serde_json::{Value, json};

const CONFIG: &str = "\
devices: [{name: gpu0, kind: simulated, capacity: 256MiB}]
models: [{name: tiny, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json,
          chat_template: 'builtin:chatml'},
         {name: encoder, path: 'builtin:encoder'}]
pools:
- {name: gpu, provider: simulated, device: gpu0, models: [tiny, encoder], fallback: cpu,
   breaker: {failures: 100, window: 60s, cooldown: 1h}}
- {name: cpu, provider: cpu, models: [tiny, encoder]}
";

fn reference() -> Value {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/models/decoder/reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn case(name: &str) -> Value {
    reference()["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap()
        .clone()
}

async fn complete(server: &TestServer, body: Value) -> (StatusCode, reqwest::header::HeaderMap, Value) {
    let response = server.post_json("/v1/completions", &body).await;
    let status = response.status();
    let headers = response.headers().clone();
    (status, headers, response.json().await.unwrap())
}

/// The tokens of a completion's text, by the fixture's own tokenizer (what a client sees).
fn greedy_request(name: &str, max_tokens: u64) -> Value {
    json!({"model": "tiny", "prompt": case(name)["prompt"], "max_tokens": max_tokens, "temperature": 0})
}

#[tokio::test]
async fn greedy_completions_match_the_independent_references() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    for name in ["short", "long", "chat"] {
        let expected = case(name);
        let (status, headers, body) = complete(&server, greedy_request(name, 16)).await;
        assert_eq!(status, StatusCode::OK, "{name}: {body}");
        assert_eq!(body["object"], "text_completion");
        assert_eq!(body["choices"][0]["text"], expected["text"], "{name}: {body}");
        assert_eq!(body["choices"][0]["finish_reason"], "length");
        let prompt_tokens = expected["prompt_ids"].as_array().unwrap().len() as u64;
        assert_eq!(body["usage"]["prompt_tokens"], prompt_tokens);
        assert_eq!(body["usage"]["completion_tokens"], 16);
        assert_eq!(headers["x-vramguard-pool"], "gpu");
    }
    // A stop string ends the text before it.
    let stop = case("stop");
    let mut request = greedy_request("stop", 16);
    request["stop"] = stop["stop"].clone();
    let (_, _, body) = complete(&server, request).await;
    assert_eq!(body["choices"][0]["text"], stop["stop_text"], "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    // 3 × 16 tokens and the 14 before the stop string; one first token per request, and a
    // gap between each of the others.
    let metrics = server.metrics().await;
    for line in [
        "vramguard_generated_tokens_total{model=\"tiny\",pool=\"gpu\"} 62",
        "vramguard_time_to_first_token_seconds_count{model=\"tiny\",pool=\"gpu\"} 4",
        "vramguard_inter_token_seconds_count{model=\"tiny\",pool=\"gpu\"} 58",
    ] {
        assert!(metrics.contains(line), "{line} missing: {metrics}");
    }
    server.stop().await;
}

#[tokio::test]
async fn a_seeded_request_gives_the_same_tokens_on_the_accelerator_and_on_the_cpu() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let request = json!({"model": "tiny", "prompt": case("long")["prompt"], "max_tokens": 12,
                         "temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 1234});
    let (status, headers, on_gpu) = complete(&server, request.clone()).await;
    assert_eq!(status, StatusCode::OK, "{on_gpu}");
    assert_eq!(headers["x-vramguard-pool"], "gpu");
    // The accelerator is reset: the same request runs on the CPU pool.
    let reset = server
        .post_json("/admin/sim/gpu0", &json!({"driver_reset": true}))
        .await;
    assert_eq!(reset.status(), StatusCode::OK);
    let (status, headers, on_cpu) = complete(&server, request.clone()).await;
    assert_eq!(status, StatusCode::OK, "{on_cpu}");
    assert_eq!(headers["x-vramguard-pool"], "cpu");
    assert_eq!(on_gpu["choices"][0]["text"], on_cpu["choices"][0]["text"]);
    // Another seed, another text (the sampler really samples).
    let mut other = request;
    other["seed"] = json!(99);
    let (_, _, different) = complete(&server, other).await;
    assert_ne!(different["choices"][0]["text"], on_cpu["choices"][0]["text"]);
    server.stop().await;
}

#[tokio::test]
async fn allocator_failures_before_or_during_generation_move_it_to_the_cpu_with_the_same_tokens() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let expected = case("short")["text"].clone();
    // The prompt's run fails: retried once on the CPU pool.
    let injected = server.post_json("/admin/sim/gpu0", &json!({"fail_next": 1})).await;
    assert_eq!(injected.status(), StatusCode::OK);
    let (status, headers, body) = complete(&server, greedy_request("short", 16)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(headers["x-vramguard-pool"], "cpu");
    assert_eq!(headers["x-vramguard-decision"], "redirect");
    assert_eq!(body["choices"][0]["text"], expected);

    // The 6th run fails: the prompt's run and four tokens' runs pass on the accelerator, then
    // that step and the rest move to the CPU pool, with the same tokens.
    let injected = server
        .post_json("/admin/sim/gpu0", &json!({"pass_first": 5, "fail_next": 1}))
        .await;
    assert_eq!(injected.status(), StatusCode::OK);
    let state: Value = injected.json().await.unwrap();
    assert_eq!(
        (state["pass_first"].as_u64(), state["fail_next"].as_u64()),
        (Some(5), Some(1))
    );
    let (status, headers, body) = complete(&server, greedy_request("short", 16)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(headers["x-vramguard-pool"], "cpu", "it ended on the fallback");
    assert_eq!(body["choices"][0]["text"], expected, "the tokens it would have had");
    let metrics = server.metrics().await;
    let failovers = crate::common::sum_samples(&metrics, |l| {
        l.starts_with("vramguard_failovers_total{from=\"gpu\",to=\"cpu\",reason=\"oom_retry\"}")
    });
    assert_eq!(
        failovers, 2.0,
        "one before the first token, one in the middle: {metrics}"
    );
    // Counted once each, as requests that succeeded.
    let ok = crate::common::requests_with(&metrics, |o| o == "ok");
    assert_eq!(ok, 2.0, "{metrics}");
    server.stop().await;
}

#[tokio::test]
async fn models_are_listed_and_errors_come_in_openais_shape() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let models: Value = reqwest::get(server.url("/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    let ids = crate::common::model_ids(&models);
    assert_eq!(ids, ["tiny"], "only models that generate text");

    for (body, status, param) in [
        (
            json!({"model": "nope", "prompt": "x"}),
            StatusCode::NOT_FOUND,
            json!("model"),
        ),
        (
            json!({"model": "encoder", "prompt": "x"}),
            StatusCode::BAD_REQUEST,
            json!("model"),
        ),
        (
            json!({"model": "tiny", "prompt": "x", "n": 0}),
            StatusCode::BAD_REQUEST,
            json!("n"),
        ),
        (
            json!({"model": "tiny", "prompt": "x", "frequency_penalty": 2.5}),
            StatusCode::BAD_REQUEST,
            json!("frequency_penalty"),
        ),
        (
            json!({"model": "tiny", "prompt": "x", "presence_penalty": -3}),
            StatusCode::BAD_REQUEST,
            json!("presence_penalty"),
        ),
        (
            json!({"model": "tiny", "prompt": "x", "repetition_penalty": 0}),
            StatusCode::BAD_REQUEST,
            json!("repetition_penalty"),
        ),
        // The fixture's vocabulary has 512 ids.
        (
            json!({"model": "tiny", "prompt": "x", "logit_bias": {"512": 1}}),
            StatusCode::BAD_REQUEST,
            json!("logit_bias"),
        ),
        (
            json!({"model": "tiny", "prompt": "x", "logit_bias": {"hello": 1}}),
            StatusCode::BAD_REQUEST,
            json!("logit_bias"),
        ),
        (
            json!({"model": "tiny", "prompt": "x", "logit_bias": {"7": 100.5}}),
            StatusCode::BAD_REQUEST,
            json!("logit_bias"),
        ),
        (
            json!({"model": "tiny", "prompt": "x", "logit_bias": {"7": 1, "07": 2}}),
            StatusCode::BAD_REQUEST,
            json!("logit_bias"),
        ),
        (
            json!({"model": "tiny", "prompt": "x", "logprobs": 6}),
            StatusCode::BAD_REQUEST,
            json!("logprobs"),
        ),
        (
            json!({"model": "tiny", "prompt": "x", "logprobs": true}),
            StatusCode::BAD_REQUEST,
            json!("logprobs"),
        ),
        (
            json!({"model": "tiny", "prompt": "x", "temperature": 3}),
            StatusCode::BAD_REQUEST,
            json!("temperature"),
        ),
        (
            json!({"model": "tiny", "prompt": 5}),
            StatusCode::BAD_REQUEST,
            json!("prompt"),
        ),
    ] {
        let (got, _, error) = complete(&server, body.clone()).await;
        assert_eq!(got, status, "{body}: {error}");
        assert!(
            error["error"]["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{error}"
        );
        assert!(error["error"]["type"].is_string(), "{error}");
        assert_eq!(error["error"]["param"], param, "{error}");
    }
    // The decoder's estimate comes from its graph's KV cache.
    let metadata: Value = server.model_metadata("tiny").await;
    let profile = &metadata["parameters"]["memory_profile"];
    assert_eq!(profile["source"], "kv_cache", "{metadata}");
    assert_eq!(
        profile["kv_bytes_per_token"],
        reference()["model"]["kv_bytes_per_token"]
    );
    // Its graph was rewritten at load: the prompt's run makes the last position's logits only.
    assert_eq!(profile["prefill_logits"], "last_position", "{metadata}");
    assert_eq!(metadata["outputs"][0]["shape"], json!([-1, 1, 512]), "{metadata}");
    server.stop().await;
}

/// A graph alone, whose folder does not say the positions it takes, is not refused before it
/// runs: running past them (the rotary table's `Gather` out of range) is still the client's
/// error, a 400, not a failure of the server.
#[tokio::test]
async fn running_past_the_models_positions_is_the_clients_error_not_a_500() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let bare = vramguard::testing::Scratch::new();
    let root = env!("CARGO_MANIFEST_DIR");
    let graph = bare.write(
        "model.onnx",
        std::fs::read(format!("{root}/models/decoder/model.onnx")).unwrap(),
    );
    let config = format!(
        "models: [{{name: tiny, path: '{}', tokenizer: '{root}/models/decoder/tokenizer.json'}}]\n\
         pools: [{{name: cpu, provider: cpu, models: [tiny]}}]\n",
        graph.display()
    );
    let server = TestServer::start(&config).await;
    // Past the fixture's 32,768 positions, as token ids (nothing to tokenize).
    let ids: Vec<u32> = (0..32_800).map(|i| 100 + i % 300).collect();
    let request = json!({"model": "tiny", "prompt": ids, "max_tokens": 4, "temperature": 0});
    let (status, _, error) = complete(&server, request).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{error}");
    assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
    assert_ne!(
        error["error"]["code"], "context_length_exceeded",
        "the graph alone says no limit: {error}"
    );
    let metrics = server.metrics().await;
    assert_eq!(
        crate::common::requests_with(&metrics, |o| o == "failed"),
        0.0,
        "{metrics}"
    );
    server.stop().await;
}

/// The `data:` payloads of a server-sent event stream, up to `[DONE]`.
pub(crate) async fn events(response: reqwest::Response) -> Vec<Value> {
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let text = response.text().await.unwrap();
    let mut out = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let data = block
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not an SSE data event: {block:?}"));
        if data == "[DONE]" {
            return out;
        }
        out.push(serde_json::from_str(data).unwrap());
    }
    panic!("the stream did not end with [DONE]: {text}");
}

#[tokio::test]
async fn a_streamed_completion_sends_the_same_text_in_pieces_and_usage_at_the_end() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let mut request = greedy_request("short", 16);
    request["stream"] = json!(true);
    let chunks = events(server.post_json("/v1/completions", &request).await).await;
    assert!(chunks.len() >= 4, "{chunks:?}");
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, case("short")["text"].as_str().unwrap());
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["completion_tokens"], 16);
    assert!(
        chunks[..chunks.len() - 1]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null())
    );

    // A stop string never leaks into the stream, not even in part.
    let stop = case("stop");
    let mut request = greedy_request("stop", 16);
    request["stream"] = json!(true);
    request["stop"] = stop["stop"].clone();
    let chunks = events(server.post_json("/v1/completions", &request).await).await;
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, stop["stop_text"].as_str().unwrap());
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");

    // Refused before the first token: an ordinary error response, not a stream.
    let mut unknown = request.clone();
    unknown["model"] = json!("nope");
    let response = server.post_json("/v1/completions", &unknown).await;
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    server.stop().await;
}

#[tokio::test]
async fn a_failure_after_tokens_were_streamed_ends_with_an_error_event_not_a_replay() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    // Non-replayable: its runs are never moved; the 6th run fails after 5 tokens were sent.
    let injected = server
        .post_json("/admin/sim/gpu0", &json!({"pass_first": 5, "fail_next": 1}))
        .await;
    assert_eq!(injected.status(), StatusCode::OK);
    let mut request = greedy_request("short", 16);
    request["stream"] = json!(true);
    let response = reqwest::Client::new()
        .post(server.url("/v1/completions"))
        .header("x-request-id", "stream-1")
        .header("x-vramguard-replayable", "false")
        .json(&request)
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status(),
        StatusCode::OK,
        "the stream had started: {:?}",
        response.text().await
    );
    let chunks = events(response).await;
    let error = &chunks.last().unwrap()["error"];
    assert_eq!(error["request_id"], "stream-1", "{chunks:?}");
    assert_eq!(error["tokens_sent"], 5, "{chunks:?}");
    assert!(
        error["resume"].as_str().unwrap().contains("text received so far"),
        "{error}"
    );
    let text: String = chunks[..chunks.len() - 1]
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert!(case("short")["text"].as_str().unwrap().starts_with(&text), "{text:?}");
    server.stop().await;
}

#[tokio::test]
async fn a_reader_that_goes_away_stops_the_generation_and_it_counts_as_cancelled() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    // Greedy from this prompt, the end-of-text token comes after 188 tokens: long after the
    // reader has gone.
    let request = json!({"model": "tiny", "prompt": case("long")["prompt"], "max_tokens": 300,
                         "temperature": 0, "stream": true});
    let mut response = server.post_json("/v1/completions", &request).await;
    assert_eq!(response.status(), StatusCode::OK);
    let first = response.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    // While it runs, its KV cache is held on the pool: whole positions of the model's layout.
    let gauge =
        |m: &str, name: &str| crate::common::sum_samples(m, |l| l.starts_with(&format!("{name}{{pool=\"gpu\"}}")));
    let metrics = server.metrics().await;
    assert_eq!(gauge(&metrics, "vramguard_sequences_running"), 1.0, "{metrics}");
    let kv = gauge(&metrics, "vramguard_kv_cache_bytes");
    let per_token = reference()["model"]["kv_bytes_per_token"].as_f64().unwrap();
    assert!(kv >= 140.0 * per_token && kv % per_token == 0.0, "{kv} {metrics}");
    drop(response);
    let mut metrics = server.metrics().await;
    for _ in 0..100 {
        if metrics.contains("vramguard_requests_total{model=\"tiny\",pool=\"gpu\",outcome=\"cancelled\"} 1") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        metrics = server.metrics().await;
    }
    assert!(
        metrics.contains("vramguard_requests_total{model=\"tiny\",pool=\"gpu\",outcome=\"cancelled\"} 1"),
        "{metrics}"
    );
    // Counted cancelled once its future is dropped, which gave the cache back.
    assert_eq!(gauge(&metrics, "vramguard_sequences_running"), 0.0, "{metrics}");
    assert_eq!(gauge(&metrics, "vramguard_kv_cache_bytes"), 0.0, "{metrics}");
    assert_eq!(gauge(&metrics, "vramguard_sequences_waiting"), 0.0, "{metrics}");
    server.stop().await;
}

/// The ChatML prompt of `system` and `user`, written out by hand (what the template must make).
fn chatml(system: &str, user: &str) -> String {
    format!("<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

async fn chat(server: &TestServer, body: &Value) -> (StatusCode, reqwest::header::HeaderMap, Value) {
    let response = server.post_json("/v1/chat/completions", body).await;
    let status = response.status();
    let headers = response.headers().clone();
    (status, headers, response.json().await.unwrap())
}

const TOOLS: &str = r#"[{"type": "function", "function": {"name": "free_vram", "description": "Free memory of a GPU",
    "parameters": {"type": "object", "properties": {"gpu": {"type": "integer"}}}}}]"#;

#[tokio::test]
async fn a_chat_answers_as_the_completion_of_its_rendered_template_streamed_or_not() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let (system, user) = ("You watch GPUs.", case("short")["prompt"].as_str().unwrap().to_string());
    let request = json!({"model": "tiny", "temperature": 0, "max_tokens": 12,
                         "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]});
    let (status, headers, body) = chat(&server, &request).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(headers["x-vramguard-pool"], "gpu");
    assert!(headers.get("x-vramguard-pool-limits").is_none(), "only while degraded");
    assert_eq!(body["object"], "chat.completion");
    let message = &body["choices"][0]["message"];
    assert_eq!(message["role"], "assistant");
    assert!(message.get("tool_calls").is_none(), "{body}");
    let (_, _, plain) = complete(
        &server,
        json!({"model": "tiny", "prompt": chatml(system, &user), "max_tokens": 12, "temperature": 0,
               "stop": ["<|im_end|>"]}),
    )
    .await;
    assert_eq!(message["content"], plain["choices"][0]["text"], "{body} vs {plain}");
    assert_eq!(
        body["choices"][0]["finish_reason"],
        plain["choices"][0]["finish_reason"]
    );
    assert_eq!(body["usage"], plain["usage"]);

    // Streamed: the role first (with the serving pool), then the same text in pieces.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let chunks = events(server.post_json("/v1/chat/completions", &streamed).await).await;
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["vramguard"]["pool"], "gpu", "{:?}", chunks[0]);
    assert!(chunks[0]["vramguard"].get("degraded").is_none());
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(json!(text), message["content"]);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], body["choices"][0]["finish_reason"]);
    assert_eq!(last["usage"], body["usage"]);

    // A model without a template, and messages that are not a conversation, are refused by name.
    let mut encoder = request.clone();
    encoder["model"] = json!("encoder");
    let (status, _, error) = chat(&server, &encoder).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{error}");
    for (messages, param, needle) in [
        (
            json!([{"role": "robot", "content": "x"}]),
            "messages[0].role",
            "`messages[0].role` is `robot`",
        ),
        (json!([]), "messages", "at least one message"),
        (
            json!([{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[1].content[0].type",
            "image_url",
        ),
    ] {
        let mut bad = request.clone();
        bad["messages"] = messages;
        let (status, _, error) = chat(&server, &bad).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{error}");
        assert_eq!(error["error"]["param"], param, "{error}");
        assert!(error["error"]["message"].as_str().unwrap().contains(needle), "{error}");
    }
    // A call forced of a function not offered.
    let mut forced = request.clone();
    forced["tools"] = serde_json::from_str(TOOLS).unwrap();
    forced["tool_choice"] = json!({"type": "function", "function": {"name": "absent"}});
    let (status, _, error) = chat(&server, &forced).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{error}");
    assert_eq!(error["error"]["param"], "tool_choice", "{error}");
    server.stop().await;
}

#[tokio::test]
async fn a_chat_offering_tools_is_replayed_before_its_first_token_and_never_after() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let request = json!({"model": "tiny", "temperature": 0, "max_tokens": 10,
                         "tools": serde_json::from_str::<Value>(TOOLS).unwrap(),
                         "messages": [{"role": "user", "content": case("short")["prompt"]}]});
    let (status, _, undisturbed) = chat(&server, &request).await;
    assert_eq!(status, StatusCode::OK, "{undisturbed}");

    // Before the first token nothing can have acted: the prompt's run is retried on the CPU.
    server.post_json("/admin/sim/gpu0", &json!({"fail_next": 1})).await;
    let (status, headers, replayed) = chat(&server, &request).await;
    assert_eq!(status, StatusCode::OK, "{replayed}");
    assert_eq!(headers["x-vramguard-pool"], "cpu");
    assert_eq!(replayed["choices"], undisturbed["choices"], "the same answer");

    // After it: the failure is the answer, and nothing runs on the CPU pool.
    let before = server.metrics().await;
    let cpu_runs = |m: &str| {
        crate::common::sum_samples(m, |l| {
            l.starts_with("vramguard_requests_total{model=\"tiny\",pool=\"cpu\"")
        })
    };
    server
        .post_json("/admin/sim/gpu0", &json!({"pass_first": 3, "fail_next": 1}))
        .await;
    let (status, _, error) = chat(&server, &request).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{error}");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("offers tools"), "{message}");
    let after = server.metrics().await;
    assert_eq!(cpu_runs(&after), cpu_runs(&before), "{after}");
    let moved = |m: &str| crate::common::sum_samples(m, |l| l.starts_with("vramguard_failovers_total{"));
    assert_eq!(moved(&after), moved(&before), "no step moved: {after}");

    // Streamed, the same failure ends the stream with an error event after the tokens sent.
    server
        .post_json("/admin/sim/gpu0", &json!({"pass_first": 3, "fail_next": 1}))
        .await;
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let chunks = events(server.post_json("/v1/chat/completions", &streamed).await).await;
    let error = &chunks.last().unwrap()["error"];
    assert_eq!(error["tokens_sent"], 3, "{chunks:?}");
    assert!(error["message"].as_str().unwrap().contains("offers tools"), "{error}");
    assert_eq!(cpu_runs(&server.metrics().await), cpu_runs(&before));
    server.stop().await;
}

#[tokio::test]
async fn while_degraded_a_generation_says_where_it_runs_its_limits_and_delay() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let reset = server
        .post_json("/admin/sim/gpu0", &json!({"driver_reset": true}))
        .await;
    assert_eq!(reset.status(), StatusCode::OK);
    let request = json!({"model": "tiny", "temperature": 0, "max_tokens": 4,
                         "messages": [{"role": "user", "content": "hello"}]});
    let (status, headers, body) = chat(&server, &request).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(headers["x-vramguard-pool"], "cpu");
    assert!(headers.get("x-vramguard-degraded").is_some(), "{headers:?}");
    let limits = headers["x-vramguard-pool-limits"].to_str().unwrap();
    assert!(
        limits.starts_with("max_context=none; concurrency=1; queue_capacity="),
        "{limits}"
    );
    assert!(
        headers["x-vramguard-estimated-delay-ms"]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .is_ok()
    );

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let response = server.post_json("/v1/chat/completions", &streamed).await;
    assert!(response.headers().get("x-vramguard-degraded").is_some());
    let chunks = events(response).await;
    let facts = &chunks[0]["vramguard"];
    assert_eq!(facts["pool"], "cpu", "{facts}");
    assert!(facts["degraded"].as_str().is_some_and(|r| !r.is_empty()), "{facts}");
    assert_eq!(facts["limits"]["concurrency"], 1, "{facts}");
    assert!(facts["estimated_delay_ms"].is_u64(), "{facts}");
    server.stop().await;
}

#[tokio::test]
async fn a_shrink_keeps_the_system_prompt_and_latest_turns_only_when_the_client_allows_it() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let dir = vramguard::testing::Scratch::new();
    let policy = dir.path().join("shrink.rhai");
    std::fs::write(
        &policy,
        "fn decide(req, state) { if req.context_tokens > 80 { shrink_context(80) } else { admit() } }",
    )
    .unwrap();
    let config = format!(
        "{CONFIG}policy: {{path: '{}', fallback: {{action: admit}}}}\n",
        policy.display()
    );
    let server = TestServer::start(&config).await;
    let turn = |role: &str, text: &str| json!({"role": role, "content": text});
    let request = json!({"model": "tiny", "temperature": 0, "max_tokens": 6, "messages": [
        turn("system", "Be brief."),
        turn("user", "The GPU ran out of memory while the queue was long and the model was large."),
        turn("assistant", "Then the work moved to the CPU pool."),
        turn("user", "Why?"),
    ]});
    let send = |allow: bool| {
        let client = reqwest::Client::new()
            .post(server.url("/v1/chat/completions"))
            .header("x-vramguard-allow-shrink", if allow { "true" } else { "false" })
            .json(&request);
        async move { client.send().await.unwrap() }
    };

    // Allowed: the first turn goes, the system prompt and the latest turn stay.
    let response = send(true).await;
    assert_eq!(response.status(), StatusCode::OK, "{:?}", response.text().await);
    let context = response.headers()["x-vramguard-context"].to_str().unwrap().to_string();
    let cut = response.headers()["x-vramguard-context-cut"]
        .to_str()
        .unwrap()
        .to_string();
    let body: Value = response.json().await.unwrap();
    let (from, to) = context.split_once("->").unwrap();
    let (from, to): (u64, u64) = (from.parse().unwrap(), to.parse().unwrap());
    assert!(from > 80 && to <= 80, "{context}");
    assert_eq!(cut, "2 of 4 messages: the oldest turns after the system prompt");
    assert_eq!(body["usage"]["prompt_tokens"], to, "{body}");
    let (_, _, plain) = complete(
        &server,
        json!({"model": "tiny", "prompt": chatml("Be brief.", "Why?"), "max_tokens": 6, "temperature": 0,
               "stop": ["<|im_end|>"]}),
    )
    .await;
    assert_eq!(plain["usage"]["prompt_tokens"], to, "{plain}");
    assert_eq!(body["choices"][0]["message"]["content"], plain["choices"][0]["text"]);

    // Not allowed: the policy's shrink is not carried out (its fallback admits it whole).
    let response = send(false).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers().get("x-vramguard-context").is_none());
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["usage"]["prompt_tokens"], from, "{body}");

    // A completion is cut from its start, and a stream's first chunk says so.
    let long = json!({"model": "tiny", "prompt": case("long")["prompt"], "max_tokens": 4, "temperature": 0,
                      "stream": true});
    let response = reqwest::Client::new()
        .post(server.url("/v1/completions"))
        .header("x-vramguard-allow-shrink", "true")
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["x-vramguard-context"], "140->80");
    let chunks = events(response).await;
    let context = &chunks[0]["vramguard"]["context"];
    assert_eq!(context["cut"], "the first 60 of the prompt's 140 tokens", "{context}");
    assert_eq!(chunks.last().unwrap()["usage"]["prompt_tokens"], 80);
    server.stop().await;
}
