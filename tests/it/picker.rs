//! What the Kubernetes inference gateway's endpoint picker reads from a vramguard replica:
//! - every metric named in `deploy/kubernetes/inference-gateway/endpoint-picker-config.yaml`
//!   for the `vramguard` engine is a gauge in a live exposition;
//! - `vramguard_accelerator_memory_usage_ratio` follows the simulated device's memory, reads 1
//!   after a driver reset (the breaker open, work on the CPU path, degraded for `driver_fault`),
//!   and is the device's again as soon as a restore's health check closes the breaker.

use crate::common::{FAILOVER_CONFIG, TestServer};
use reqwest::StatusCode;
use serde_json::{Value, json};

const PICKER_CONFIG: &str = "deploy/kubernetes/inference-gateway/endpoint-picker-config.yaml";
const RATIO: &str = "vramguard_accelerator_memory_usage_ratio";

/// The metric family names the picker config gives the `vramguard` engine (a spec is a PromQL
/// selector, `family{label=value}`; an empty spec turns that metric off).
fn picker_metrics() -> Vec<(String, String)> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(PICKER_CONFIG);
    let config: Value = vramguard::config::parse_yaml(&std::fs::read_to_string(path).unwrap(), PICKER_CONFIG).unwrap();
    let engines: Vec<&Value> = config["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["type"] == "core-metrics-extractor")
        .flat_map(|p| p["parameters"]["engineConfigs"].as_array().unwrap())
        .filter(|e| e["name"] == "vramguard")
        .collect();
    assert_eq!(engines.len(), 1, "one `vramguard` engine in {PICKER_CONFIG}");
    let specs: Vec<(String, String)> = engines[0]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(key, _)| key.ends_with("Spec"))
        .filter_map(|(key, spec)| {
            let family = spec.as_str().unwrap().split('{').next().unwrap().trim();
            (!family.is_empty()).then(|| (key.clone(), family.to_string()))
        })
        .collect();
    for wanted in ["queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"] {
        assert!(
            specs.iter().any(|(key, _)| key == wanted),
            "{PICKER_CONFIG}: {wanted} is missing"
        );
    }
    specs
}

#[tokio::test]
async fn every_metric_the_picker_config_names_is_a_gauge_vramguard_exports() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(FAILOVER_CONFIG).await;
    let served = server.encoder(16).await;
    assert_eq!(served.status(), StatusCode::OK);
    let metrics = server.metrics().await;
    for (spec, family) in picker_metrics() {
        assert!(
            metrics.contains(&format!("# TYPE {family} gauge\n")),
            "{spec}: `{family}` is not a gauge in:\n{metrics}"
        );
        let value = crate::common::gauge(&metrics, &family);
        assert!(value >= 0.0, "{spec}: {family} = {value}");
    }
    // Nothing is queued or running once the answer is in; the ratio is a fraction.
    assert_eq!(crate::common::gauge(&metrics, "vramguard_requests_waiting"), 0.0);
    assert_eq!(crate::common::gauge(&metrics, "vramguard_requests_running"), 0.0);
    let ratio = crate::common::gauge(&metrics, RATIO);
    assert!((0.0..1.0).contains(&ratio), "{ratio}");
    server.stop().await;
}

#[tokio::test]
async fn the_usage_ratio_follows_device_memory_reads_full_while_the_accelerator_is_down_and_recovers_with_it() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(FAILOVER_CONFIG).await;
    let sim = |body: Value| {
        let server = &server;
        async move {
            let response = server.post_json("/admin/sim/gpu0", &body).await;
            assert_eq!(response.status(), StatusCode::OK);
        }
    };
    let before = crate::common::gauge(&server.metrics().await, RATIO);
    assert!(before < 0.5, "{before}");

    // Another workload takes 96 of the device's 128 MiB: at least 3/4 of it is in use.
    sim(json!({"pressure": "96MiB"})).await;
    let metrics = server.metrics().await;
    let pressed = crate::common::gauge(&metrics, RATIO);
    let used = crate::common::sum_samples(&metrics, |l| l.starts_with("vramguard_device_memory_used_bytes{"));
    assert!((0.75..1.0).contains(&pressed), "{pressed}");
    assert_eq!(pressed, used / f64::from(128 << 20));
    sim(json!({"pressure": 0})).await;

    // A driver reset: the request is retried on the CPU pool, the breaker opens, and the ratio
    // says full although the device's memory is not, so the picker sends new work elsewhere.
    // The cause is the driver fault, not memory: nothing was moved for lack of room.
    sim(json!({"driver_reset": true})).await;
    let retried = server.encoder(16).await;
    assert_eq!(retried.status(), StatusCode::OK);
    assert_eq!(retried.headers()["x-vramguard-pool"], "cpu");
    let metrics = server.metrics().await;
    assert_eq!(crate::common::gauge(&metrics, RATIO), 1.0, "{metrics}");
    assert_eq!(crate::common::gauge(&metrics, "vramguard_degraded_mode"), 1.0);
    assert!(
        metrics.contains("vramguard_degraded_info{reason=\"driver_fault\"} 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("vramguard_degraded_info{reason=\"memory_redirect\"} 0\n"),
        "{metrics}"
    );

    // Restored, and the health check's probe closed the breaker: with no traffic at all, the
    // service is no longer degraded and the ratio is the device's again within a few seconds
    // (not after degraded::MEMORY_REDIRECT_WINDOW).
    let restored = server.post_json("/admin/pools/gpu/restore", &json!({})).await;
    assert_eq!(restored.status(), StatusCode::OK);
    let (closed, metrics) = crate::common::breaker_closes(&server, "gpu", std::time::Duration::from_secs(5)).await;
    assert!(closed, "{metrics}");
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let metrics = loop {
        let metrics = server.metrics().await;
        if crate::common::gauge(&metrics, RATIO) < 1.0 || std::time::Instant::now() >= until {
            break metrics;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(
        crate::common::gauge(&metrics, "vramguard_degraded_mode"),
        0.0,
        "{metrics}"
    );
    for reason in ["driver_fault", "breaker_open", "memory_redirect", "pool_unavailable"] {
        assert!(
            metrics.contains(&format!("vramguard_degraded_info{{reason=\"{reason}\"}} 0\n")),
            "{reason}: {metrics}"
        );
    }
    let used = crate::common::sum_samples(&metrics, |l| l.starts_with("vramguard_device_memory_used_bytes{"));
    assert_eq!(
        crate::common::gauge(&metrics, RATIO),
        used / f64::from(128 << 20),
        "{metrics}"
    );
    let served = server.encoder(16).await;
    assert_eq!(served.headers()["x-vramguard-pool"], "gpu");
    assert!(
        served.headers().get("x-vramguard-degraded").is_none(),
        "{:?}",
        served.headers()
    );
    server.stop().await;
}
