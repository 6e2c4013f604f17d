//! Health checks of a local pool, over real HTTP and real ONNX Runtime sessions on the simulated
//! accelerator: once the breaker's cooldown passes or a restore rebuilds the pool, vramguard's
//! own probe inference decides whether it closes; an idle pool is checked too, so a reset
//! driver opens the breaker before any client meets it. No client request is ever the probe,
//! and probes are not counted as requests.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use vramguard::testing::ADMIT_ALL;

use crate::common::{TestServer, breaker_closes, requests_with, sample};

/// A simulated `gpu` pool with a short cooldown, falling back on a `cpu` pool; idle checks far
/// apart, so only the half-open breaker's probes run here.
const CONFIG: &str = "devices: [{name: gpu0, kind: simulated, capacity: 128MiB}]
models: [{name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}}]
pools:
- {name: gpu, provider: simulated, device: gpu0, models: [encoder], fallback: cpu,
   breaker: {failures: 2, window: 60s, cooldown: 1s}, health: {interval: 1h, timeout: 5s}}
- {name: cpu, provider: cpu, models: [encoder]}
host: {reserve: 64MiB}
";

const GPU_STATE: &str = "vramguard_breaker_state{pool=\"gpu\"}";
const GPU_OK: &str = "vramguard_health_checks_total{pool=\"gpu\",result=\"ok\"}";
const GPU_FAILED: &str = "vramguard_health_checks_total{pool=\"gpu\",result=\"failed\"}";

async fn inject(server: &TestServer, body: Value) {
    let response = server.post_json("/admin/sim/gpu0", &body).await;
    assert_eq!(response.status(), StatusCode::OK);
}

fn requests(metrics: &str) -> f64 {
    requests_with(metrics, |_| true)
}

/// Poll `/metrics` until `series` reaches `at_least`, for at most `within`.
async fn reaches(server: &TestServer, series: &str, at_least: f64, within: Duration) -> String {
    let until = Instant::now() + within;
    loop {
        let metrics = server.metrics().await;
        if sample(&metrics, series) >= at_least {
            return metrics;
        }
        assert!(
            Instant::now() < until,
            "{series} < {at_least} after {within:?}:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn after_the_cooldown_and_a_restore_the_breaker_closes_by_its_own_probe_without_user_traffic() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::with_policy(CONFIG, ADMIT_ALL).await;
    let fresh = server.metrics().await;
    assert_eq!(sample(&fresh, GPU_OK), 0.0);
    assert!(
        fresh.contains(GPU_FAILED),
        "both results exist from the first scrape:\n{fresh}"
    );

    // A driver reset: the one request is retried on the CPU pool and the breaker opens.
    inject(&server, json!({"driver_reset": true})).await;
    let first = server.encoder(16).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(first.headers()["x-vramguard-pool"], "cpu");
    let metrics = server.metrics().await;
    assert_eq!(sample(&metrics, GPU_STATE), 2.0);
    let answered = requests(&metrics);
    assert_eq!(answered, 1.0, "{metrics}");

    // The cooldown passes with the driver still reset: the health check's probe fails and the
    // breaker opens again, with no client's request spent on it.
    let metrics = reaches(&server, GPU_FAILED, 1.0, Duration::from_secs(10)).await;
    assert_ne!(
        sample(&metrics, GPU_STATE),
        0.0,
        "a failed probe keeps it open:\n{metrics}"
    );
    assert_eq!(sample(&metrics, GPU_OK), 0.0);

    // The operator restores the pool; nothing is sent to it, and its own probe closes it.
    let restored = server.post_json("/admin/pools/gpu/restore", &json!({})).await;
    assert_eq!(restored.status(), StatusCode::OK);
    let (closed, metrics) = breaker_closes(&server, "gpu", Duration::from_secs(4)).await;
    assert!(closed, "the breaker did not close by its probe:\n{metrics}");
    assert!(sample(&metrics, GPU_OK) >= 1.0, "{metrics}");
    assert_eq!(
        sample(&metrics, "vramguard_breaker_recovery_seconds_count{pool=\"gpu\"}"),
        1.0,
        "{metrics}"
    );
    assert_eq!(requests(&metrics), answered, "probes are not requests:\n{metrics}");
    assert_eq!(
        sample(&metrics, "vramguard_queue_wait_seconds_count{pool=\"gpu\"}"),
        1.0,
        "probes are not in the queue's wait times (only the first request's run):\n{metrics}"
    );

    // And the next request runs on the accelerator again.
    let back = server.encoder(16).await;
    assert_eq!(back.status(), StatusCode::OK);
    assert_eq!(back.headers()["x-vramguard-pool"], "gpu");
    server.stop().await;
}

#[tokio::test]
async fn an_idle_pool_is_checked_so_a_reset_driver_opens_the_breaker_before_any_request_meets_it() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let config = CONFIG
        .replace("interval: 1h", "interval: 200ms")
        .replace("cooldown: 1s", "cooldown: 1h");
    let server = TestServer::with_policy(&config, ADMIT_ALL).await;
    // Healthy and idle: checks pass and change nothing.
    let metrics = reaches(&server, GPU_OK, 1.0, Duration::from_secs(5)).await;
    assert_eq!(sample(&metrics, GPU_STATE), 0.0);

    inject(&server, json!({"driver_reset": true})).await;
    let metrics = reaches(&server, GPU_FAILED, 1.0, Duration::from_secs(5)).await;
    assert_eq!(sample(&metrics, GPU_STATE), 2.0, "{metrics}");
    assert!(
        sample(
            &metrics,
            "vramguard_allocator_failures_total{pool=\"gpu\",device=\"gpu0\",kind=\"driver\"}"
        ) >= 1.0,
        "{metrics}"
    );
    assert_eq!(requests(&metrics), 0.0, "no request was sent or counted:\n{metrics}");

    // The first client goes to the CPU pool without meeting the reset device.
    let first = server.encoder(16).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(first.headers()["x-vramguard-pool"], "cpu");
    let metrics = server.metrics().await;
    assert_eq!(
        sample(&metrics, "vramguard_retries_total{pool=\"gpu\",result=\"ok\"}"),
        0.0,
        "it was routed there, not retried:\n{metrics}"
    );
    server.stop().await;
}

/// A probe shows that the pool runs a model: with none loaded (the model is `on_demand`), the
/// breaker's probe loads the pool's first model and runs it, rather than closing the breaker on
/// no run at all.
#[tokio::test]
async fn a_probe_with_no_model_loaded_loads_one_and_runs_it_before_the_breaker_closes() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let config = CONFIG.replace(
        "context: {input: input, axis: 1}}",
        "context: {input: input, axis: 1}, residency: on_demand}",
    );
    let server = TestServer::with_policy(&config, ADMIT_ALL).await;
    let resident = "vramguard_model_resident{model=\"encoder\",pool=\"gpu\"}";
    let metrics = server.metrics().await;
    assert_eq!(sample(&metrics, resident), 0.0, "on_demand: not loaded at start");
    let restored = server.post_json("/admin/pools/gpu/restore", &json!({})).await;
    assert_eq!(restored.status(), StatusCode::OK);
    let (closed, metrics) = breaker_closes(&server, "gpu", Duration::from_secs(20)).await;
    assert!(closed, "{metrics}");
    assert_eq!(sample(&metrics, resident), 1.0, "the probe ran it:\n{metrics}");
    assert_eq!(sample(&metrics, GPU_OK), 1.0, "{metrics}");
    assert_eq!(requests(&metrics), 0.0, "no request was sent or counted:\n{metrics}");
    server.stop().await;
}
