//! The simulated accelerator: its arena is capped, so a request that does not fit what is left fails with a
//! genuine ONNX Runtime allocator failure, answered 503, and the next request that fits succeeds.
//! (One ONNX Runtime process holds one simulated arena, so these tests share one capacity.)

use crate::common::TestServer;
use reqwest::StatusCode;
use serde_json::{Value, json};

const CONFIG: &str = crate::common::SIMULATED_CONFIG;

#[tokio::test]
async fn a_request_that_never_fits_is_the_clients_error_and_one_that_does_not_fit_now_an_allocator_failure() {
    if crate::common::ran_in_own_process() {
        return;
    }
    // Admit everything: this is about what ONNX Runtime does when a request does not fit.
    let server = TestServer::with_policy(CONFIG, vramguard::testing::ADMIT_ALL).await;

    let before: Value = reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap();
    let reserved_before = before["pools"][0]["arena"]["reserved_bytes"].as_u64().unwrap();
    let small = server.encoder(64).await;
    assert_eq!(small.status(), StatusCode::OK);
    let body: Value = small.json().await.unwrap();
    assert_eq!(body["parameters"]["simulated"], true);
    assert_eq!(body["parameters"]["provider"], "simulated");
    let after: Value = reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap();
    let arena = &after["pools"][0]["arena"];
    assert!(
        arena["reserved_bytes"].as_u64().unwrap() > reserved_before,
        "a run reserves arena memory: {arena}"
    );
    assert!(arena["peak_active_bytes"].as_u64().unwrap() > arena["active_bytes"].as_u64().unwrap());

    // 4 heads × 4096² FP32 attention scores alone are 256 MiB: twice the simulated capacity, and
    // no other pool serves the encoder. Waiting cannot help, so it is the client's error, said
    // at once, with what would fit; nothing runs and no allocator failure is counted.
    let big = server.encoder(4096).await;
    assert_eq!(big.status(), StatusCode::BAD_REQUEST);
    assert!(!big.headers().contains_key("retry-after"));
    let error: Value = big.json().await.unwrap();
    let message = error["error"].as_str().unwrap();
    assert!(
        message.starts_with("`encoder` can never fit here: it needs an estimated "),
        "{message}"
    );
    assert!(message.contains("for 4096 tokens"), "{message}");
    assert!(message.contains("pool `gpu`: device `gpu0` of 128 MiB"), "{message}");
    assert!(message.contains("(input `input` axis 1)"), "{message}");
    assert_eq!(error["reason"], "never_fits");
    assert!(error["needed_bytes"].as_u64().unwrap() >= 256 << 20, "{error}");
    assert!(error["max_bytes"].as_u64().unwrap() <= 128 << 20, "{error}");
    let max_tokens = error["max_tokens"].as_u64().unwrap();
    assert!((1024..4096).contains(&max_tokens), "{error}");

    // The arena statistics come from ONNX Runtime and show the cap.
    let status: Value = reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap();
    let pool = &status["pools"][0];
    assert_eq!(pool["simulated"], true);
    assert_eq!(pool["arena"]["limit_bytes"], 128 << 20);
    assert!(pool["arena"]["reserved_bytes"].as_u64().unwrap() > 0);
    assert!(pool["arena"]["reserved_bytes"].as_u64().unwrap() <= 128 << 20);
    // External pressure is a real hold in the arena: used/free move, and a request that would
    // fit the device but needs more than what is left fails inside ONNX Runtime (503: not now)
    // until the pressure is released. (Only small runs came before, so the arena has cached
    // little memory of its own.)
    let set = server
        .post_json("/admin/sim/gpu0", &json!({"pressure": "100MiB"}))
        .await;
    assert_eq!(set.status(), StatusCode::OK);
    let set: Value = set.json().await.unwrap();
    assert_eq!(set["pressure_bytes"], 100 << 20);
    let metrics = server.metrics().await;
    let value = |name: &str| -> u64 {
        let prefix = format!("{name}{{device=\"gpu0\",kind=\"simulated\"}} ");
        let line = metrics
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("{prefix} in {metrics}"));
        line[prefix.len()..].parse().unwrap()
    };
    assert!(value("vramguard_device_memory_used_bytes") >= 100 << 20);
    assert!(value("vramguard_device_memory_free_bytes") <= 28 << 20);
    assert_eq!(value("vramguard_device_memory_total_bytes"), 128 << 20);
    assert!(
        metrics.contains("process=\"simulated-pressure\",service=\"simulated\"} 104857600\n"),
        "{metrics}"
    );
    // 4 × 1536² FP32 scores are 36 MiB in one block: more than the 28 MiB the pressure leaves.
    let squeezed = server.encoder(1536).await;
    assert_eq!(squeezed.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(squeezed.headers().contains_key("retry-after"));
    assert_eq!(squeezed.headers()["x-vramguard-pool"], "gpu");
    let error: Value = squeezed.json().await.unwrap();
    let message = error["error"].as_str().unwrap();
    assert!(
        message.starts_with("allocator failure (oom) on pool `gpu`, device `gpu0` (simulated)"),
        "{message}"
    );
    assert!(message.contains("Available memory of"), "{message}");
    // The server stays healthy.
    assert_eq!(
        reqwest::get(server.url("/v2/health/ready")).await.unwrap().status(),
        StatusCode::OK
    );
    // Sent the way `curl -d` sends it (form content type): JSON is read all the same.
    let release = reqwest::Client::new()
        .post(server.url("/admin/sim/gpu0"))
        .bearer_auth(crate::common::ADMIN_TOKEN)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(r#"{"pressure": 0}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(release.status(), StatusCode::OK);
    // The next request that fits is served.
    assert_eq!(server.encoder(1536).await.status(), StatusCode::OK);
    let metrics = server.metrics().await;
    assert!(
        !metrics.contains("simulated-pressure"),
        "a released hold leaves no series: {metrics}"
    );
    assert!(
        metrics.contains("vramguard_allocator_failures_total{pool=\"gpu\",device=\"gpu0\",kind=\"oom\"} 1\n"),
        "{metrics}"
    );
    assert!(metrics.contains("vramguard_requests_total{model=\"encoder\",pool=\"gpu\",outcome=\"rejected\"} 1\n"));
    assert!(metrics.contains("vramguard_requests_total{model=\"encoder\",pool=\"gpu\",outcome=\"ok\"} 2\n"));
    assert!(
        metrics.contains("vramguard_requests_total{model=\"encoder\",pool=\"\",outcome=\"client_error\"} 1\n"),
        "{metrics}"
    );

    // Bad admin input is refused with a reason.
    let bad = server.post_json("/admin/sim/gpu0", &json!({"pressure": "lots"})).await;
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    let too_much = server.post_json("/admin/sim/gpu0", &json!({"pressure": "1GiB"})).await;
    assert_eq!(too_much.status(), StatusCode::CONFLICT);
    let unknown = server.post_json("/admin/sim/gpu9", &json!({"pressure": 1})).await;
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    server.stop().await;
}

/// `promtool check metrics` must report nothing for a live exposition with traffic on it, and
/// Prometheus (which asks for OpenMetrics) gets OpenMetrics.
#[tokio::test]
async fn the_live_exposition_passes_promtool_and_negotiates_openmetrics() {
    if crate::common::ran_in_own_process() {
        return;
    }
    // A budget the 68 KB encoder never reaches: the service budget family the alerts use exists.
    let server = TestServer::start(&format!(
        "{CONFIG}services: [{{name: encoder, device_memory: 64MiB}}]\n"
    ))
    .await;
    assert_eq!(server.encoder(32).await.status(), StatusCode::OK);
    // A driver reset opens the breaker: degraded mode, so every series the alerts use exists.
    let reset = server
        .post_json("/admin/sim/gpu0", &json!({"driver_reset": true}))
        .await;
    assert_eq!(reset.status(), StatusCode::OK);
    assert_eq!(server.encoder(32).await.status(), StatusCode::SERVICE_UNAVAILABLE);
    let text = reqwest::get(server.url("/metrics")).await.unwrap();
    assert_eq!(
        text.headers()["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let text = text.text().await.unwrap();
    for name in [
        "vramguard_build_info",
        "vramguard_device_memory_total_bytes",
        "vramguard_allocator_reserved_bytes",
        "vramguard_queue_oldest_age_seconds",
        "vramguard_queue_wait_seconds_bucket",
        "vramguard_host_memory_available_bytes",
        "vramguard_exporter_sample_duration_seconds_count",
        "vramguard_breaker_state{pool=\"gpu\"} 2",
        "vramguard_degraded_mode 1",
        // The reason may be `driver_fault` or, while the reset pool rebuilds its backend,
        // `pool_unavailable`: either way the family the alerts use exists.
        "vramguard_degraded_info{reason=\"",
    ] {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
    // Every metric the shipped alert rules use must be exported (a renamed metric would silently
    // disable an alert otherwise).
    let metric_name = regex::Regex::new(r"vramguard_[a-z_]+").unwrap();
    for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/alerts")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let rules = std::fs::read_to_string(&path).unwrap();
            for name in metric_name.find_iter(&rules) {
                assert!(
                    text.contains(&format!("\n{}", name.as_str())),
                    "{} uses {}, which is not exported",
                    path.display(),
                    name.as_str()
                );
            }
        }
    }
    let findings = crate::common::promtool_findings(&text);
    assert!(findings.is_empty(), "promtool: {findings}");

    let open = reqwest::Client::new()
        .get(server.url("/metrics"))
        .header(
            "accept",
            "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
        )
        .send()
        .await
        .unwrap();
    assert!(
        open.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text")
    );
    assert!(open.text().await.unwrap().ends_with("# EOF\n"));
    server.stop().await;
}

/// `GET /` is a page for people: HTML from the binary that polls `/status` and labels the
/// simulated accelerator as such.
#[tokio::test]
async fn the_status_page_is_served_and_reads_status() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let page = reqwest::get(server.url("/")).await.unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    assert_eq!(page.headers()["content-type"], "text/html; charset=utf-8");
    let html = page.text().await.unwrap();
    for needle in [
        "<title>vramguard</title>",
        "fetch(\"/status\"",
        "SIMULATED",
        "Degraded since",
    ] {
        assert!(html.contains(needle), "{needle} missing");
    }
    // Every field the page reads is in /status.
    let status: Value = reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap();
    for key in [
        "version",
        "onnxruntime",
        "config",
        "degraded",
        "pools",
        "devices",
        "host",
        "policy",
        "processes",
        "recent_decisions",
    ] {
        assert!(!status[key].is_null(), "/status lacks {key}");
    }
    for key in [
        "breaker",
        "queue_capacity",
        "estimated_delay_ms",
        "simulated",
        "fallback",
        "arena",
    ] {
        assert!(status["pools"][0].get(key).is_some(), "/status pools lack {key}");
    }
    server.stop().await;
}
