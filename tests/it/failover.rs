//! Failover over real HTTP and real ONNX Runtime sessions on the simulated accelerator:
//! injected allocator failures are retried once on the CPU pool, a non-replayable request gets
//! a resumable error, repeated failures open the breaker (new work goes to the CPU pool, the
//! service reads as degraded), and after a restore the server's own health check closes it.

use crate::common::TestServer;
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use vramguard::testing::ADMIT_ALL;

/// A simulated `gpu` pool falling back on a `cpu` pool, breaker opening after two failures
/// (started with [`ADMIT_ALL`]: these tests are about what happens after admission).
const CONFIG: &str = "devices: [{name: gpu0, kind: simulated, capacity: 128MiB}]
models: [{name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}}]
pools:
- {name: gpu, provider: simulated, device: gpu0, models: [encoder], fallback: cpu,
   breaker: {failures: 2, window: 60s, cooldown: 1h}}
- {name: cpu, provider: cpu, models: [encoder]}
host: {reserve: 64MiB}
";

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
    let (header, body) = crate::common::encoder_binary_request(seq);
    let mut request = reqwest::Client::new()
        .post(url)
        .header("Inference-Header-Content-Length", header.len());
    for (name, value) in headers {
        request = request.header(name, value);
    }
    request.body(body).send().await.unwrap()
}

fn requests_ok(metrics: &str) -> f64 {
    crate::common::requests_with(metrics, |o| o == "ok")
}

#[tokio::test]
async fn an_allocator_failure_is_retried_once_on_the_cpu_pool_under_the_same_id() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::with_policy(CONFIG, ADMIT_ALL).await;
    let state = inject(&server, json!({"fail_next": 1})).await;
    assert_eq!(state["fail_next"], 1);

    let response = encoder_request(&server, &[("x-request-id", "retry-me")]).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-request-id"], "retry-me");
    assert_eq!(response.headers()["x-vramguard-pool"], "cpu");
    assert_eq!(response.headers()["x-vramguard-decision"], "redirect");
    let degraded = response.headers()["x-vramguard-degraded"].to_str().unwrap().to_string();
    assert!(degraded.contains("from pool `gpu` to `cpu`"), "{degraded}");
    // The answer says why it was retried and when its run started on the CPU pool.
    let json_len: usize = match response.headers().get("inference-header-content-length") {
        Some(v) => v.to_str().unwrap().parse().unwrap(),
        None => usize::MAX,
    };
    let body = response.bytes().await.unwrap();
    let head: Value = serde_json::from_slice(&body[..json_len.min(body.len())]).unwrap();
    assert_eq!(head["parameters"]["reason"], "oom_retry", "{head}");
    let started = head["parameters"]["retry_started_ms"].as_f64().unwrap();
    assert!(started > 0.0 && started < 60_000.0, "{head}");

    let metrics = server.metrics().await;
    assert_eq!(
        crate::common::sample(&metrics, "vramguard_retries_total{pool=\"gpu\",result=\"ok\"}"),
        1.0
    );
    assert_eq!(
        crate::common::sample(
            &metrics,
            "vramguard_failovers_total{from=\"gpu\",to=\"cpu\",reason=\"oom_retry\"}"
        ),
        1.0
    );
    assert_eq!(
        crate::common::sample(
            &metrics,
            "vramguard_allocator_failures_total{pool=\"gpu\",device=\"gpu0\",kind=\"oom\"}"
        ),
        1.0
    );
    assert_eq!(crate::common::sample(&metrics, "vramguard_degraded_mode "), 1.0);
    assert_eq!(
        crate::common::sample(&metrics, "vramguard_degraded_info{reason=\"memory_redirect\"}"),
        1.0
    );
    // One failure is below the breaker's threshold: the next request runs on the accelerator,
    // as usual, so its answer says nothing of degraded mode, which the service is still in (the
    // memory redirect's window) and says so where operators look.
    let next = encoder_request(&server, &[]).await;
    assert_eq!(next.headers()["x-vramguard-pool"], "gpu");
    assert_eq!(next.headers()["x-vramguard-decision"], "admit");
    assert!(
        next.headers().get("x-vramguard-degraded").is_none(),
        "{:?}",
        next.headers()
    );
    let status: Value = reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap();
    assert_eq!(status["degraded"]["active"], true, "{status}");
    // The retried request's decision says where the policy sent it, and who answered it.
    let retried = status["recent_decisions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["request_id"] == "retry-me")
        .unwrap_or_else(|| panic!("{status}"));
    assert_eq!(
        (&retried["pool"], &retried["answered_by"], &retried["outcome"]),
        (&json!("gpu"), &json!("cpu"), &json!("ok")),
        "{retried}"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_non_replayable_request_gets_a_resumable_error_not_a_silent_replay() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::with_policy(CONFIG, ADMIT_ALL).await;
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
        crate::common::sample(
            &metrics,
            "vramguard_retries_total{pool=\"gpu\",result=\"not_replayable\"}"
        ),
        1.0
    );
    assert_eq!(
        crate::common::sample(&metrics, "vramguard_failovers_total{from=\"gpu\""),
        0.0,
        "nothing moved: {metrics}"
    );
    server.stop().await;
}

#[tokio::test]
async fn repeated_failures_open_the_breaker_and_after_a_restore_its_health_check_closes_it() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::with_policy(CONFIG, ADMIT_ALL).await;
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
    assert_eq!(
        crate::common::sample(&metrics, "vramguard_breaker_state{pool=\"gpu\"}"),
        2.0
    );
    assert_eq!(
        crate::common::sample(
            &metrics,
            "vramguard_failovers_total{from=\"gpu\",to=\"cpu\",reason=\"breaker_open\"}"
        ),
        1.0
    );

    // The operator restores the pool: its backends are rebuilt, and the server's own health
    // check (no client's request) is the probe that closes the breaker.
    let restored = server.post_json("/admin/pools/gpu/restore", &json!({})).await;
    assert_eq!(restored.status(), StatusCode::OK);
    let restored: Value = restored.json().await.unwrap();
    assert_eq!(restored["rebuilt_backends"], 1);
    let (closed, metrics) = crate::common::breaker_closes(&server, "gpu", Duration::from_secs(5)).await;
    assert!(closed, "{metrics}");
    let served = encoder_request(&server, &[]).await;
    assert_eq!(served.status(), StatusCode::OK);
    assert_eq!(served.headers()["x-vramguard-pool"], "gpu");
    assert_eq!(
        crate::common::sample(&metrics, "vramguard_breaker_recovery_seconds_count{pool=\"gpu\"}"),
        1.0
    );
    server.stop().await;
}

#[tokio::test]
async fn a_driver_reset_opens_the_breaker_at_once_while_the_cpu_pool_keeps_serving() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::with_policy(CONFIG, ADMIT_ALL).await;
    let state = inject(&server, json!({"driver_reset": true})).await;
    assert_eq!(state["driver_reset"], true);
    let first = encoder_request(&server, &[]).await;
    assert_eq!(first.status(), StatusCode::OK, "retried on the CPU pool");
    assert_eq!(first.headers()["x-vramguard-pool"], "cpu");
    let metrics = server.metrics().await;
    assert_eq!(
        crate::common::sample(
            &metrics,
            "vramguard_failovers_total{from=\"gpu\",to=\"cpu\",reason=\"driver_retry\"}"
        ),
        1.0
    );
    assert_eq!(
        crate::common::sample(&metrics, "vramguard_breaker_state{pool=\"gpu\"}"),
        2.0
    );
    assert_eq!(
        crate::common::sample(
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
    // `/status` says where the work goes meanwhile and what it meets there.
    let status: Value = reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap();
    assert_eq!(status["degraded"]["active"], true, "{status}");
    let fallback = &status["degraded"]["fallbacks"][0];
    assert_eq!(fallback["from"], "gpu", "{status}");
    assert_eq!(fallback["pool"], "cpu", "{status}");
    assert!(fallback["concurrency"].as_u64().unwrap() >= 1, "{status}");
    assert!(fallback["queue_position"].as_u64().unwrap() >= 1, "{status}");
    assert!(fallback["estimated_delay_ms"].is_u64(), "{status}");
    let restored = server.post_json("/admin/pools/gpu/restore", &json!({})).await;
    assert_eq!(restored.status(), StatusCode::OK);
    for request in in_flight {
        let response = request.await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    let state = inject(&server, json!({"fail_next": 0})).await;
    assert_eq!(state["driver_reset"], false, "a restore clears the simulated reset");
    let (closed, metrics) = crate::common::breaker_closes(&server, "gpu", Duration::from_secs(5)).await;
    assert!(
        closed,
        "the health check closes the breaker after the restore: {metrics}"
    );
    let back = encoder_request(&server, &[]).await;
    assert_eq!(back.status(), StatusCode::OK);
    assert_eq!(back.headers()["x-vramguard-pool"], "gpu");
    server.stop().await;
}

#[tokio::test]
async fn an_idempotency_key_executes_at_most_once() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::with_policy(CONFIG, ADMIT_ALL).await;
    let first = encoder_request(&server, &[("idempotency-key", "k1"), ("x-request-id", "a")]).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert!(!first.headers().contains_key("idempotent-replayed"));
    let first_body = first.bytes().await.unwrap();
    let again = encoder_request(&server, &[("idempotency-key", "k1"), ("x-request-id", "b")]).await;
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(
        again.headers()["x-request-id"],
        "b",
        "each response names its own request"
    );
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(
        again.bytes().await.unwrap(),
        first_body,
        "the stored response, not a new run"
    );
    assert_eq!(requests_ok(&server.metrics().await), 1.0, "executed once");

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
    assert_eq!(requests_ok(&server.metrics().await), 2.0);
    let metrics = server.metrics().await;
    assert!(
        crate::common::sample(&metrics, "vramguard_idempotency_hits_total") >= 6.0,
        "{metrics}"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_key_whose_request_did_not_run_may_run_on_retry() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::with_policy(CONFIG, ADMIT_ALL).await;
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

/// Available host memory as the kernel reports it (`MemAvailable`), in bytes.
fn host_available() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// What a client saw of its request.
#[derive(Debug)]
enum Seen {
    /// An answer; `replayed` when it was the stored answer of an earlier request with its key.
    Ok { replayed: bool },
    Error {
        status: StatusCode,
        body: Value,
        replayed: bool,
    },
    /// The client hung up before the answer came.
    Gone,
}

/// 200 concurrent requests of mixed sizes while pressure steps up, allocator failures are
/// injected and the driver is reset and restored; some requests are non-replayable, some share
/// idempotency keys, some clients hang up early. Every request ends in success or a documented
/// error, no key runs twice, host memory stays above the reserve, and what clients saw
/// reconciles exactly with `vramguard_requests_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_pressure_faults_and_a_reset_nothing_accepted_is_lost_or_run_twice() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::with_policy(CONFIG, ADMIT_ALL).await;
    let url = server.url("/v2/models/encoder/infer");
    let sampling = Arc::new(AtomicBool::new(true));
    let lowest = tokio::spawn({
        let sampling = sampling.clone();
        async move {
            let mut lowest = u64::MAX;
            while sampling.load(Ordering::Relaxed) {
                lowest = lowest.min(host_available());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            lowest
        }
    });
    let mut tasks = Vec::new();
    for i in 0..200usize {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            // 30 keyed requests over 10 keys (same body per key); 50 non-replayable; 20 whose
            // client hangs up after a few milliseconds; the rest plain, of three sizes.
            let keyed = (i % 20 == 0 || i % 20 == 7 || i % 20 == 13).then(|| format!("key-{}", i % 10));
            let hangs_up = keyed.is_none() && i % 10 == 3;
            let seq = if keyed.is_some() { 64 } else { [32, 128, 512][i % 3] };
            let mut headers = vec![("x-request-id".to_string(), format!("r{i}"))];
            if let Some(key) = &keyed {
                headers.push(("idempotency-key".into(), key.clone()));
            } else if i % 4 == 1 {
                headers.push(("x-vramguard-replayable".into(), "false".into()));
            }
            let seen = async {
                let response = post_encoder(url, seq, headers).await;
                let replayed = response.headers().contains_key("idempotent-replayed");
                match response.status() {
                    StatusCode::OK => Seen::Ok { replayed },
                    status => Seen::Error {
                        status,
                        body: response.json().await.unwrap(),
                        replayed,
                    },
                }
            };
            let seen = if hangs_up {
                // From before its request is read to while it waits in a queue or runs.
                let patience = Duration::from_millis(5 + 10 * (i % 19) as u64);
                tokio::time::timeout(patience, seen).await.unwrap_or(Seen::Gone)
            } else {
                seen.await
            };
            (i, keyed.is_some(), seen)
        }));
        if i == 40 {
            inject(&server, json!({"pressure": "40MiB", "fail_next": 3})).await;
        }
        if i == 90 {
            inject(&server, json!({"driver_reset": true})).await;
        }
        if i == 140 {
            // Injected failures not yet consumed (the reset took precedence) are cleared first,
            // or the restore's health-check probe would meet one.
            inject(&server, json!({"pressure": 0, "fail_next": 0})).await;
            let restored = server.post_json("/admin/pools/gpu/restore", &json!({})).await;
            assert_eq!(restored.status(), StatusCode::OK);
        }
    }
    // What clients saw of the runs (answers replayed from the idempotency cache are not runs).
    let (mut ok, mut errors, mut replayed, mut gone) = (0.0, 0.0, 0.0, 0.0);
    let mut keyed_ok = 0.0;
    for task in tasks {
        let (i, keyed, seen) = task.await.unwrap();
        match seen {
            Seen::Ok { replayed: true } | Seen::Error { replayed: true, .. } => replayed += 1.0,
            Seen::Ok { .. } => {
                ok += 1.0;
                if keyed {
                    keyed_ok += 1.0;
                }
            }
            Seen::Error {
                status: StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT,
                body,
                ..
            } => {
                assert!(body["error"].is_string(), "r{i}: {body}");
                assert_eq!(body["request_id"], format!("r{i}"), "{body}");
                errors += 1.0;
            }
            Seen::Error { status, body, .. } => panic!("r{i}: undocumented status {status}: {body}"),
            Seen::Gone => gone += 1.0,
        }
    }
    sampling.store(false, Ordering::Relaxed);
    let lowest = lowest.await.unwrap();
    assert!(
        lowest > 64 << 20,
        "host memory fell to {lowest} bytes, under the 64 MiB reserve"
    );
    assert!(keyed_ok <= 10.0, "a key ran twice: {keyed_ok} successful keyed runs");

    // A server notices a hang-up when it next touches the connection: wait until the counts
    // settle.
    let mut metrics = server.metrics().await;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = server.metrics().await;
        let settled = crate::common::requests_with(&now, |_| true) == crate::common::requests_with(&metrics, |_| true);
        metrics = now;
        if settled {
            break;
        }
    }
    assert_eq!(
        crate::common::sample(&metrics, "vramguard_idempotency_hits_total"),
        replayed
    );
    // Clients that stayed saw exactly what the server counted. Each one that hung up was counted
    // `cancelled`, or as what it would have got a moment later, or not at all when it left
    // before its request had been read (never accepted).
    let counted_ok = crate::common::requests_with(&metrics, |o| o == "ok");
    let cancelled = crate::common::requests_with(&metrics, |o| o == "cancelled");
    let counted_errors = crate::common::requests_with(&metrics, |o| o != "ok" && o != "cancelled");
    let late = (counted_ok - ok) + (counted_errors - errors);
    assert!(counted_ok >= ok && counted_errors >= errors, "{metrics}");
    // Nothing was counted twice, and nothing that left was counted as anything but the above.
    let never_read = gone - late - cancelled;
    assert!(
        never_read >= 0.0,
        "hang-ups: {gone}, late: {late}, cancelled: {cancelled}"
    );
    // The accelerator is back and serves.
    let back = encoder_request(&server, &[]).await;
    assert_eq!(back.status(), StatusCode::OK);
    assert_eq!(back.headers()["x-vramguard-pool"], "gpu");
    server.stop().await;
}

#[tokio::test]
async fn cpu_work_that_would_eat_into_the_host_reserve_is_refused_and_not_retried_there() {
    if crate::common::ran_in_own_process() {
        return;
    }
    // A reserve no machine has: every host-pool run would breach it.
    let config = CONFIG.replace("host: {reserve: 64MiB}", "host: {reserve: 1000TiB}");
    let server = TestServer::with_policy(&config, ADMIT_ALL).await;
    inject(&server, json!({"fail_next": 1})).await;
    let response = encoder_request(&server, &[("x-request-id", "no-room")]).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(response.headers().contains_key("retry-after"));
    let body: Value = response.json().await.unwrap();
    let why = body["not_retried"].as_str().unwrap();
    assert!(why.contains("memory reserve"), "{body}");
    let metrics = server.metrics().await;
    assert_eq!(
        crate::common::sample(&metrics, "vramguard_retries_total{pool=\"gpu\",result=\"no_fallback\"}"),
        1.0
    );
    server.stop().await;
}
