//! Failover over real HTTP and real ONNX Runtime sessions on the simulated accelerator:
//! injected allocator failures are retried once on the CPU pool, a non-replayable request gets
//! a resumable error, repeated failures open the breaker (new work goes to the CPU pool, the
//! service reads as degraded), and a restore lets a probe close it again.

mod common;

use common::TestServer;
use reqwest::StatusCode;
use serde_json::{Value, json};

/// A simulated `gpu` pool falling back on a `cpu` pool, breaker opening after two failures.
fn config() -> String {
    format!(
        "devices: [{{name: gpu0, kind: simulated, capacity: 128MiB}}]\n\
         models: [{{name: encoder, path: 'builtin:encoder', context: {{input: input, axis: 1}}}}]\n\
         pools:\n\
         - {{name: gpu, provider: simulated, device: gpu0, models: [encoder], fallback: cpu,\n\
             breaker: {{failures: 2, window: 60s, cooldown: 1h}}}}\n\
         - {{name: cpu, provider: cpu, models: [encoder]}}\n\
         host: {{reserve: 64MiB}}\n{}",
        common::admit_all_policy()
    )
}

async fn inject(server: &TestServer, body: Value) -> Value {
    let response = server.post_json("/admin/sim/gpu0", &body).await;
    assert_eq!(response.status(), StatusCode::OK);
    response.json().await.unwrap()
}

async fn encoder_request(server: &TestServer, headers: &[(&str, &str)]) -> reqwest::Response {
    let headers = headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
    post_encoder(server.url("/v2/models/encoder/infer"), 64, headers).await
}

/// An encoder request of `seq` tokens (binary tensors) to `url`, owning everything it needs so
/// it can run in a spawned task.
async fn post_encoder(url: String, seq: usize, headers: Vec<(String, String)>) -> reqwest::Response {
    let (header, body) = common::encoder_binary_request(seq);
    let mut request = reqwest::Client::new()
        .post(url)
        .header("Inference-Header-Content-Length", header.len());
    for (name, value) in headers {
        request = request.header(name, value);
    }
    request.body(body).send().await.unwrap()
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn an_allocator_failure_is_retried_once_on_the_cpu_pool_under_the_same_id() {
    let server = TestServer::start(&config()).await;
    let state = inject(&server, json!({"fail_next": 1})).await;
    assert_eq!(state["fail_next"], 1);

    let response = encoder_request(&server, &[("x-request-id", "retry-me")]).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-request-id"], "retry-me");
    assert_eq!(response.headers()["x-vramguard-pool"], "cpu");
    assert_eq!(response.headers()["x-vramguard-decision"], "redirect");
    let degraded = response.headers()["x-vramguard-degraded"].to_str().unwrap().to_string();
    assert!(degraded.contains("from pool `gpu` to `cpu`"), "{degraded}");

    let metrics = server.metrics().await;
    assert_eq!(
        metric(&metrics, "vramguard_retries_total{pool=\"gpu\",result=\"ok\"}"),
        1.0
    );
    assert_eq!(
        metric(
            &metrics,
            "vramguard_failovers_total{from=\"gpu\",to=\"cpu\",reason=\"oom_retry\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &metrics,
            "vramguard_allocator_failures_total{pool=\"gpu\",device=\"gpu0\",kind=\"oom\"}"
        ),
        1.0
    );
    assert_eq!(metric(&metrics, "vramguard_degraded_mode "), 1.0);
    assert_eq!(
        metric(&metrics, "vramguard_degraded_info{reason=\"memory_redirect\"}"),
        1.0
    );
    // One failure is below the breaker's threshold: the next request runs on the accelerator.
    let next = encoder_request(&server, &[]).await;
    assert_eq!(next.headers()["x-vramguard-pool"], "gpu");
    assert_eq!(next.headers()["x-vramguard-decision"], "admit");
    server.stop().await;
}

#[tokio::test]
async fn a_non_replayable_request_gets_a_resumable_error_not_a_silent_replay() {
    let server = TestServer::start(&config()).await;
    inject(&server, json!({"fail_next": 1})).await;
    let response = encoder_request(
        &server,
        &[("x-request-id", "once-only"), ("x-vramguard-replayable", "false")],
    )
    .await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(response.headers().contains_key("retry-after"));
    assert_eq!(response.headers()["x-vramguard-pool"], "gpu");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["request_id"], "once-only");
    assert_eq!(body["reason"], "allocator_failure_oom");
    assert_eq!(body["retried"], false);
    assert!(
        body["not_retried"].as_str().unwrap().contains("not replayable"),
        "{body}"
    );
    let metrics = server.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "vramguard_retries_total{pool=\"gpu\",result=\"not_replayable\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(&metrics, "vramguard_failovers_total{from=\"gpu\""),
        0.0,
        "nothing moved: {metrics}"
    );
    server.stop().await;
}

#[tokio::test]
async fn repeated_failures_open_the_breaker_and_a_restore_closes_it_through_a_probe() {
    let server = TestServer::start(&config()).await;
    inject(&server, json!({"fail_next": 2})).await;
    for _ in 0..2 {
        let retried = encoder_request(&server, &[]).await;
        assert_eq!(retried.status(), StatusCode::OK);
        assert_eq!(retried.headers()["x-vramguard-pool"], "cpu");
    }
    // Two failures within the window: open. New work goes straight to the CPU pool.
    let status: Value = reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap();
    let gpu = &status["pools"][0];
    assert_eq!(gpu["breaker"], "open", "{gpu}");
    assert_eq!(status["degraded"]["active"], true);
    assert_eq!(status["degraded"]["cause"], "breaker_open");
    let routed = encoder_request(&server, &[]).await;
    assert_eq!(routed.status(), StatusCode::OK);
    assert_eq!(routed.headers()["x-vramguard-pool"], "cpu");
    assert!(
        routed.headers()["x-vramguard-degraded"]
            .to_str()
            .unwrap()
            .contains("circuit breaker is open")
    );
    let metrics = server.metrics().await;
    assert_eq!(metric(&metrics, "vramguard_breaker_state{pool=\"gpu\"}"), 2.0);
    assert_eq!(
        metric(
            &metrics,
            "vramguard_failovers_total{from=\"gpu\",to=\"cpu\",reason=\"breaker_open\"}"
        ),
        1.0
    );

    // The operator restores the pool: its backends are rebuilt and the next request probes.
    let restored = server.post_json("/admin/pools/gpu/restore", &json!({})).await;
    assert_eq!(restored.status(), StatusCode::OK);
    let restored: Value = restored.json().await.unwrap();
    assert_eq!(restored["breaker"], "half_open", "{restored}");
    assert_eq!(restored["rebuilt_backends"], 1);
    let probe = encoder_request(&server, &[]).await;
    assert_eq!(probe.status(), StatusCode::OK);
    assert_eq!(probe.headers()["x-vramguard-pool"], "gpu");
    let metrics = server.metrics().await;
    assert_eq!(metric(&metrics, "vramguard_breaker_state{pool=\"gpu\"}"), 0.0);
    assert_eq!(
        metric(&metrics, "vramguard_breaker_recovery_seconds_count{pool=\"gpu\"}"),
        1.0
    );
    server.stop().await;
}

#[tokio::test]
async fn a_driver_reset_opens_the_breaker_at_once_while_the_cpu_pool_keeps_serving() {
    let server = TestServer::start(&config()).await;
    let state = inject(&server, json!({"driver_reset": true})).await;
    assert_eq!(state["driver_reset"], true);
    let first = encoder_request(&server, &[]).await;
    assert_eq!(first.status(), StatusCode::OK, "retried on the CPU pool");
    assert_eq!(first.headers()["x-vramguard-pool"], "cpu");
    let metrics = server.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "vramguard_failovers_total{from=\"gpu\",to=\"cpu\",reason=\"driver_retry\"}"
        ),
        1.0
    );
    assert_eq!(metric(&metrics, "vramguard_breaker_state{pool=\"gpu\"}"), 2.0);
    assert_eq!(
        metric(
            &metrics,
            "vramguard_allocator_failures_total{pool=\"gpu\",device=\"gpu0\",kind=\"driver\"}"
        ),
        1.0
    );

    // While the accelerator is down, requests keep being served by the CPU pool; restoring the
    // accelerator does not interrupt them.
    let in_flight: Vec<_> = (0..4)
        .map(|_| tokio::spawn(post_encoder(server.url("/v2/models/encoder/infer"), 64, Vec::new())))
        .collect();
    let restored = server.post_json("/admin/pools/gpu/restore", &json!({})).await;
    assert_eq!(restored.status(), StatusCode::OK);
    for request in in_flight {
        let response = request.await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    let state = inject(&server, json!({"fail_next": 0})).await;
    assert_eq!(state["driver_reset"], false, "a restore clears the simulated reset");
    let back = encoder_request(&server, &[]).await;
    assert_eq!(back.status(), StatusCode::OK);
    assert_eq!(back.headers()["x-vramguard-pool"], "gpu");
    server.stop().await;
}

fn ok_count(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("vramguard_requests_total{") && l.contains("outcome=\"ok\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn an_idempotency_key_executes_at_most_once() {
    let server = TestServer::start(&config()).await;
    let first = encoder_request(&server, &[("idempotency-key", "k1"), ("x-request-id", "a")]).await;
    assert_eq!(first.status(), StatusCode::OK);
    let first_body = first.bytes().await.unwrap();
    let again = encoder_request(&server, &[("idempotency-key", "k1"), ("x-request-id", "b")]).await;
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(
        again.headers()["x-request-id"],
        "b",
        "each response names its own request"
    );
    assert_eq!(
        again.bytes().await.unwrap(),
        first_body,
        "the stored response, not a new run"
    );
    assert_eq!(ok_count(&server.metrics().await), 1.0, "executed once");

    // The same key with another request is refused.
    let key = vec![("idempotency-key".to_string(), "k1".to_string())];
    let other = post_encoder(server.url("/v2/models/encoder/infer"), 32, key).await;
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let error: Value = other.json().await.unwrap();
    assert!(error["error"].as_str().unwrap().contains("`k1`"), "{error}");

    // Concurrent duplicates wait for the first and get its response: one more execution.
    let duplicates: Vec<_> = (0..6)
        .map(|_| {
            let url = server.url("/v2/models/encoder/infer");
            tokio::spawn(async move {
                let key = vec![("idempotency-key".to_string(), "k2".to_string())];
                let response = post_encoder(url, 64, key).await;
                (response.status(), response.bytes().await.unwrap())
            })
        })
        .collect();
    let mut bodies = Vec::new();
    for d in duplicates {
        let (status, body) = d.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        bodies.push(body);
    }
    assert!(bodies.windows(2).all(|w| w[0] == w[1]));
    assert_eq!(ok_count(&server.metrics().await), 2.0);
    let metrics = server.metrics().await;
    assert!(metric(&metrics, "vramguard_idempotency_hits_total") >= 6.0, "{metrics}");
    server.stop().await;
}

#[tokio::test]
async fn a_key_whose_request_did_not_run_may_run_on_retry() {
    let server = TestServer::start(&config()).await;
    inject(&server, json!({"fail_next": 1})).await;
    let refused = encoder_request(
        &server,
        &[("idempotency-key", "k3"), ("x-vramguard-replayable", "false")],
    )
    .await;
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    let retried = encoder_request(
        &server,
        &[("idempotency-key", "k3"), ("x-vramguard-replayable", "false")],
    )
    .await;
    assert_eq!(retried.status(), StatusCode::OK, "an allocator failure stored nothing");
    server.stop().await;
}

/// 200 concurrent requests of mixed sizes while pressure steps up, allocator failures are
/// injected and the driver is reset and restored; some requests are non-replayable, some share
/// idempotency keys. Every request ends in success or a documented error, no key runs twice,
/// and what clients saw reconciles exactly with `vramguard_requests_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_pressure_faults_and_a_reset_nothing_accepted_is_lost_or_run_twice() {
    let server = TestServer::start(&config()).await;
    let url = server.url("/v2/models/encoder/infer");
    let mut tasks = Vec::new();
    for i in 0..200usize {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            // 30 keyed requests over 10 keys (same body per key); 50 non-replayable; the rest
            // plain, of three sizes.
            let keyed = (i % 20 == 0 || i % 20 == 7 || i % 20 == 13).then(|| format!("key-{}", i % 10));
            let seq = if keyed.is_some() { 64 } else { [32, 128, 512][i % 3] };
            let mut headers = vec![("x-request-id".to_string(), format!("r{i}"))];
            if let Some(key) = &keyed {
                headers.push(("idempotency-key".into(), key.clone()));
            } else if i % 4 == 1 {
                headers.push(("x-vramguard-replayable".into(), "false".into()));
            }
            let response = post_encoder(url, seq, headers).await;
            let status = response.status();
            let body: Value = if status == StatusCode::OK {
                Value::Null
            } else {
                response.json().await.unwrap()
            };
            (i, keyed.is_some(), status, body)
        }));
        if i == 40 {
            inject(&server, json!({"pressure": "40MiB", "fail_next": 3})).await;
        }
        if i == 90 {
            inject(&server, json!({"driver_reset": true})).await;
        }
        if i == 140 {
            // Injected failures not yet consumed (the reset took precedence) are cleared first,
            // or the restore's probe would meet one.
            inject(&server, json!({"pressure": 0, "fail_next": 0})).await;
            let restored = server.post_json("/admin/pools/gpu/restore", &json!({})).await;
            assert_eq!(restored.status(), StatusCode::OK);
        }
    }
    let mut ok_unkeyed = 0.0;
    for task in tasks {
        let (i, keyed, status, body) = task.await.unwrap();
        match status {
            StatusCode::OK => {
                if !keyed {
                    ok_unkeyed += 1.0;
                }
            }
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT => {
                assert!(body["error"].is_string(), "r{i}: {body}");
                if !keyed {
                    assert_eq!(body["request_id"], format!("r{i}"), "{body}");
                }
            }
            other => panic!("r{i}: undocumented status {other}: {body}"),
        }
    }
    let metrics = server.metrics().await;
    let total: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("vramguard_requests_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    let hits = metric(&metrics, "vramguard_idempotency_hits_total");
    // Every request reached the lifecycle exactly once, except duplicates answered from the
    // idempotency cache.
    assert_eq!(total, 200.0 - hits, "{metrics}");
    // Keyed requests that ran to success: at most one per key.
    let keyed_ok = ok_count(&metrics) - ok_unkeyed;
    assert!(keyed_ok <= 10.0, "a key ran twice: {keyed_ok} successful keyed runs");
    // The accelerator is back and serves.
    let back = encoder_request(&server, &[]).await;
    assert_eq!(back.status(), StatusCode::OK);
    assert_eq!(back.headers()["x-vramguard-pool"], "gpu");
    server.stop().await;
}

#[tokio::test]
async fn cpu_work_that_would_eat_into_the_host_reserve_is_refused_and_not_retried_there() {
    // A reserve no machine has: every host-pool run would breach it.
    let config = config().replace("host: {reserve: 64MiB}", "host: {reserve: 1000TiB}");
    let server = TestServer::start(&config).await;
    inject(&server, json!({"fail_next": 1})).await;
    let response = encoder_request(&server, &[("x-request-id", "no-room")]).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(response.headers().contains_key("retry-after"));
    let body: Value = response.json().await.unwrap();
    let why = body["not_retried"].as_str().unwrap();
    assert!(why.contains("memory reserve"), "{body}");
    let metrics = server.metrics().await;
    assert_eq!(
        metric(&metrics, "vramguard_retries_total{pool=\"gpu\",result=\"no_fallback\"}"),
        1.0
    );
    server.stop().await;
}
