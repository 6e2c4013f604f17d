//! The simulated accelerator: its arena is capped, so a request that does not fit fails with a
//! genuine ONNX Runtime allocator failure, answered 503, and the next request that fits succeeds.
//! (One ONNX Runtime process holds one simulated arena, so these tests share one capacity.)

mod common;

use common::TestServer;
use reqwest::StatusCode;
use serde_json::{Value, json};

const CONFIG: &str = "
devices: [{name: gpu0, kind: simulated, capacity: 128MiB}]
models: [{name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}}]
pools: [{name: gpu, provider: simulated, device: gpu0, models: [encoder]}]
";

/// An encoder request of `seq` tokens, sent as binary tensor data.
async fn encoder(server: &TestServer, seq: usize) -> reqwest::Response {
    let header = json!({
        "inputs": [{"name": "input", "shape": [1, seq, 64], "datatype": "FP32",
                    "parameters": {"binary_data_size": seq * 64 * 4}}],
        "outputs": [{"name": "pooled"}]
    })
    .to_string();
    let mut body = header.clone().into_bytes();
    for i in 0..seq * 64 {
        body.extend_from_slice(&((i % 7) as f32 * 0.01).to_le_bytes());
    }
    reqwest::Client::new()
        .post(server.url("/v2/models/encoder/infer"))
        .header("Inference-Header-Content-Length", header.len())
        .body(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_request_that_does_not_fit_gets_an_allocator_failure_and_the_next_one_is_served() {
    let server = TestServer::start(CONFIG).await;

    let small = encoder(&server, 64).await;
    assert_eq!(small.status(), StatusCode::OK);
    let body: Value = small.json().await.unwrap();
    assert_eq!(body["parameters"]["simulated"], true);
    assert_eq!(body["parameters"]["provider"], "simulated");

    // 4 heads × 4096² FP32 attention scores alone are 256 MiB: twice the simulated capacity.
    let big = encoder(&server, 4096).await;
    assert_eq!(big.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(big.headers().contains_key("retry-after"));
    assert_eq!(big.headers()["x-vramguard-pool"], "gpu");
    let error: Value = big.json().await.unwrap();
    let message = error["error"].as_str().unwrap();
    assert!(
        message.starts_with("allocator failure (oom) on pool `gpu`, device `gpu0` (simulated)"),
        "{message}"
    );
    assert!(message.contains("Available memory of"), "{message}");

    // The server stays healthy and serves the next request that fits.
    assert_eq!(
        reqwest::get(server.url("/v2/health/ready")).await.unwrap().status(),
        StatusCode::OK
    );
    let again = encoder(&server, 256).await;
    assert_eq!(again.status(), StatusCode::OK);

    let metrics = server.metrics().await;
    assert!(
        metrics.contains("vramguard_allocator_failures_total{pool=\"gpu\",device=\"gpu0\",kind=\"oom\"} 1\n"),
        "{metrics}"
    );
    assert!(metrics.contains("vramguard_requests_total{model=\"encoder\",pool=\"gpu\",outcome=\"rejected\"} 1\n"));
    assert!(metrics.contains("vramguard_requests_total{model=\"encoder\",pool=\"gpu\",outcome=\"ok\"} 2\n"));

    // The arena statistics come from ONNX Runtime and show the cap.
    let status: Value = reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap();
    let pool = &status["pools"][0];
    assert_eq!(pool["simulated"], true);
    assert_eq!(pool["arena"]["limit_bytes"], 128 << 20);
    assert!(pool["arena"]["reserved_bytes"].as_u64().unwrap() > 0);
    assert!(pool["arena"]["reserved_bytes"].as_u64().unwrap() <= 128 << 20);
    server.stop().await;
}
