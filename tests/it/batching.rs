//! Continuous batching on the decoder fixture, through the server: concurrent generations of
//! different prompts and lengths share each step's run on their pool, joining and leaving
//! between steps, and every one of them, whole or streamed, gives the greedy text of the
//! independent references. On the CPU pool (threads) and on the simulated accelerator, whose
//! caches live in its worker process.

use crate::common::TestServer;
use crate::generation::events;
use reqwest::StatusCode;
use serde_json::{Value, json};

const CPU: &str = "\
models: [{name: tiny, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json}]
pools: [{name: cpu, provider: cpu, models: [tiny], workers: 2}]
";

const SIMULATED: &str = "\
devices: [{name: gpu0, kind: simulated, capacity: 256MiB}]
models: [{name: tiny, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json}]
pools:
- {name: gpu, provider: simulated, device: gpu0, models: [tiny], fallback: cpu}
- {name: cpu, provider: cpu, models: [tiny]}
";

fn reference() -> Value {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/models/decoder/reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The text of the first `n` greedy tokens of `case`, as the fixture's tokenizer decodes them.
fn expected_text(case: &Value, n: usize) -> String {
    let tokenizer =
        tokenizers::Tokenizer::from_file(concat!(env!("CARGO_MANIFEST_DIR"), "/models/decoder/tokenizer.json"))
            .unwrap();
    let ids: Vec<u32> = case["greedy_ids"].as_array().unwrap()[..n]
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    tokenizer.decode(&ids, true).unwrap()
}

/// One completion's text, streamed (joined from its chunks) or whole.
async fn text_of(server: &TestServer, body: Value, stream: bool) -> String {
    let mut body = body;
    body["stream"] = json!(stream);
    let response = server.post_json("/v1/completions", &body).await;
    assert_eq!(response.status(), StatusCode::OK);
    if stream {
        events(response)
            .await
            .iter()
            .map(|c| c["choices"][0]["text"].as_str().unwrap().to_string())
            .collect()
    } else {
        let body: Value = response.json().await.unwrap();
        body["choices"][0]["text"].as_str().unwrap().to_string()
    }
}

/// `concurrency` generations at once, cycling over the reference cases with different
/// lengths, half of them streamed: each gives its reference's text.
async fn concurrent_generations_match(server: &TestServer, concurrency: usize) {
    let reference = reference();
    let cases = reference["cases"].as_array().unwrap();
    let lengths = [16usize, 5, 11, 8, 16, 3, 13, 9];
    let runs = (0..concurrency).map(|i| {
        let case = &cases[i % cases.len()];
        let n = lengths[i % lengths.len()];
        let body = json!({"model": "tiny", "prompt": case["prompt"], "max_tokens": n, "temperature": 0});
        let expected = expected_text(case, n);
        async move {
            let got = text_of(server, body, i % 2 == 1).await;
            (i, case["name"].clone(), n, got, expected)
        }
    });
    for (i, name, n, got, expected) in futures_util::future::join_all(runs).await {
        assert_eq!(got, expected, "generation {i} of {concurrency} ({name}, {n} tokens)");
    }
}

#[tokio::test]
async fn concurrent_generations_on_the_cpu_give_the_reference_text_for_1_3_and_8_at_once() {
    let server = TestServer::start(CPU).await;
    for concurrency in [1, 3, 8] {
        concurrent_generations_match(&server, concurrency).await;
    }
    // Every step crossed only tokens in and one row of logits out: what the prompts and steps
    // took is far below one copy of the caches they built.
    let metrics = server.metrics().await;
    let bytes = |direction: &str| {
        crate::common::sum_samples(&metrics, |l| {
            l.starts_with(&format!(
                "vramguard_pool_transfer_bytes_total{{pool=\"cpu\",direction=\"{direction}\"}}"
            ))
        })
    };
    assert!(bytes("to_pool") > 0.0 && bytes("from_pool") > 0.0, "{metrics}");
    server.stop().await;
}

#[tokio::test]
async fn concurrent_generations_on_the_simulated_accelerator_keep_their_caches_in_its_worker() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(SIMULATED).await;
    for concurrency in [1, 3, 8] {
        concurrent_generations_match(&server, concurrency).await;
    }
    let metrics = server.metrics().await;
    let ok = crate::common::requests_with(&metrics, |o| o == "ok");
    assert_eq!(ok, 12.0, "{metrics}");
    let on_gpu = crate::common::sum_samples(&metrics, |l| {
        l.starts_with("vramguard_generated_tokens_total{model=\"tiny\",pool=\"gpu\"}")
    });
    assert!(on_gpu > 0.0, "they ran on the accelerator: {metrics}");
    server.stop().await;
}

/// Read a stream's SSE events until `[DONE]`, calling `after` once `at` events have come.
async fn read_stream(mut response: reqwest::Response, at: usize, after: impl AsyncFnOnce()) -> Vec<Value> {
    let mut after = Some(after);
    let (mut buffer, mut events) = (String::new(), Vec::new());
    while let Some(chunk) = response.chunk().await.unwrap() {
        buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = buffer.find("\n\n") {
            let block: String = buffer.drain(..end + 2).collect();
            let data = block.trim().strip_prefix("data: ").unwrap().to_string();
            if data == "[DONE]" {
                return events;
            }
            events.push(serde_json::from_str(&data).unwrap());
            if events.len() == at
                && let Some(after) = after.take()
            {
                after().await;
            }
        }
    }
    panic!("the stream ended without [DONE]: {events:?}");
}

#[tokio::test]
async fn a_generation_whose_worker_dies_mid_stream_is_prefilled_again_on_the_cpu_with_the_same_text() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(SIMULATED).await;
    let case = &reference()["cases"][1];
    let body = json!({"model": "tiny", "prompt": case["prompt"], "max_tokens": 120, "temperature": 0,
                      "stream": true});
    let undisturbed = events(server.post_json("/v1/completions", &body).await).await;
    let text =
        |events: &[Value]| -> String { events.iter().filter_map(|e| e["choices"][0]["text"].as_str()).collect() };
    let expected = text(&undisturbed);
    let tokens = undisturbed.last().unwrap()["usage"]["completion_tokens"]
        .as_u64()
        .unwrap();
    assert!(tokens > 40, "long enough to be killed in the middle: {tokens}");
    // The same request, its worker killed once ten chunks have come.
    let response = server.post_json("/v1/completions", &body).await;
    assert_eq!(response.headers()["x-vramguard-pool"], "gpu");
    let kill = async || {
        let killed = server.post_json("/admin/sim/gpu0", &json!({"kill_worker": true})).await;
        assert_eq!(killed.status(), StatusCode::OK);
    };
    let disturbed = read_stream(response, 10, kill).await;
    assert_eq!(text(&disturbed), expected, "the tokens it would have had, none twice");
    let last = disturbed.last().unwrap();
    assert_eq!(last["usage"]["completion_tokens"].as_u64(), Some(tokens));
    assert!(
        disturbed.iter().any(|e| e["vramguard"]["pool"] == "cpu"),
        "a chunk names the pool it moved to: {disturbed:?}"
    );
    let metrics = server.metrics().await;
    let moved = crate::common::sum_samples(&metrics, |l| {
        l.starts_with("vramguard_failovers_total{from=\"gpu\",to=\"cpu\",reason=\"worker_lost\"}")
    });
    assert_eq!(moved, 1.0, "{metrics}");
    server.stop().await;
}

/// A generation that would join a batch is estimated with the padding it brings there: a short
/// prompt joining a long one's batch is left-padded up to the batch's length, and the policy
/// sees that cache in `req.estimate.context_bytes` (here in its reject reason). Once the long
/// generation is gone, the short one costs its own positions again.
#[tokio::test]
async fn a_generation_joining_a_longer_batch_is_estimated_with_the_padding_it_gets() {
    const POLICY: &str = r#"fn decide(req, state) {
        if req.max_new_tokens == 7 { reject(`context_bytes=${req.estimate.context_bytes}.`) } else { admit() }
    }"#;
    let server = TestServer::with_policy(CPU, POLICY).await;
    let short = json!({"model": "tiny", "prompt": "The GPU", "max_tokens": 7, "temperature": 0});
    let estimated = async || -> u64 {
        let response = server.post_json("/v1/completions", &short).await;
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body: Value = response.json().await.unwrap();
        let message = body["error"]["message"].as_str().unwrap().to_string();
        let at = message.find("context_bytes=").expect("the policy's reason") + "context_bytes=".len();
        let digits: String = message[at..].chars().take_while(char::is_ascii_digit).collect();
        digits.parse().unwrap()
    };
    let prompt_tokens = async |prompt: &str| -> u64 {
        let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0});
        let response = server.post_json("/v1/completions", &body).await;
        assert_eq!(response.status(), StatusCode::OK);
        let body: Value = response.json().await.unwrap();
        body["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let long_prompt = reference()["cases"][1]["prompt"].as_str().unwrap().to_string();
    let (long, own) = (prompt_tokens(&long_prompt).await, prompt_tokens("The GPU").await);
    assert!(long > own + 100, "{long} and {own} tokens");
    let alone = estimated().await;

    // The long one streams; its reader stops after three chunks, so it stays in the batch.
    let body = json!({"model": "tiny", "prompt": long_prompt, "max_tokens": 100, "temperature": 0, "stream": true});
    let mut response = server.post_json("/v1/completions", &body).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut received = String::new();
    while received.matches("\n\n").count() < 3 {
        received.push_str(std::str::from_utf8(&response.chunk().await.unwrap().unwrap()).unwrap());
    }
    // The batch's shape is reported by the step after the long one joined: wait for it.
    let kv_bytes_per_token = 512;
    let (mut joining, started) = (alone, std::time::Instant::now());
    while joining == alone && started.elapsed() < std::time::Duration::from_secs(5) {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        joining = estimated().await;
    }
    let padding = joining - alone;
    assert_eq!(padding % kv_bytes_per_token, 0, "{joining} against {alone}");
    let positions = padding / kv_bytes_per_token;
    assert!(
        (long - own..=long + 100 - own).contains(&positions),
        "padded by {positions} positions up to the batch of a {long}-token prompt, from {own}"
    );

    // The long one's client goes away: it leaves the batch, and the short one costs its own.
    drop(response);
    let (mut after, started) = (joining, std::time::Instant::now());
    while after != alone && started.elapsed() < std::time::Duration::from_secs(5) {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        after = estimated().await;
    }
    assert_eq!(after, alone, "the batch it would join is gone");
    server.stop().await;
}
