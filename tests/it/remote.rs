//! Remote pools between two real `vramguard serve` processes on loopback: the first one's
//! simulated accelerator is squeezed, so the policy moves work to its remote pool (the second
//! server's CPU pool), which answers exactly as a local run would, with the request's identity
//! and idempotency key kept; then the second one goes away, and the first one's breaker for it
//! opens, shows in /status and metrics, and requests get a local retry or a clear error.

use std::time::{Duration, Instant};

use serde_json::Value;
use vramguard::testing::Scratch;
use vramguard::testing::process::Serving;

/// The admin token of the first server (admin over TCP, for the simulated pressure).
const TOKEN: &str = "remote-test-token";

/// A server and its base URL; dropping it stops the server.
struct Server {
    _process: Serving,
    url: String,
}

fn serve(dir: &Scratch, name: &str, yaml: &str, env: &[(&str, &str)]) -> Server {
    let path = dir.write(&format!("{name}.yaml"), yaml);
    let process =
        crate::common::spawn_serving(&["serve", "--config", path.to_str().unwrap()], env, "vramguard serving");
    Server {
        url: format!("http://{}", process.addr),
        _process: process,
    }
}

const SERVER: &str = "server: {listen: '127.0.0.1:0', admin_socket: 'off'}\n";

/// The second server: a plain CPU pool serving the encoder.
fn remote_config() -> String {
    format!(
        "{SERVER}models: [{{name: encoder, path: 'builtin:encoder', context: {{input: input, axis: 1}}}}]
pools: [{{name: cpu, provider: cpu, models: [encoder]}}]
"
    )
}

/// The first server: a simulated accelerator, the remote pool `far` (where the default policy
/// redirects what does not fit, retried once on the local `cpu` pool when `far` fails), and
/// health checks every 100 ms so the outage is noticed without waiting on a request.
fn local_config(remote_url: &str) -> String {
    format!(
        "server: {{listen: '127.0.0.1:0', admin_socket: 'off', admin_token_env: VRAMGUARD_REMOTE_TEST_TOKEN}}
devices: [{{name: gpu0, kind: simulated, capacity: 128MiB}}]
models: [{{name: encoder, path: 'builtin:encoder', context: {{input: input, axis: 1}}}}]
pools:
- {{name: gpu, provider: simulated, device: gpu0, models: [encoder]}}
- {{name: far, provider: remote, url: '{remote_url}', models: [encoder], fallback: cpu,
   breaker: {{failures: 3, window: 60s, cooldown: 1h}},
   remote: {{timeout: 10s, connect_timeout: 500ms, health_interval: 100ms, health_timeout: 500ms}}}}
- {{name: cpu, provider: cpu, models: [encoder]}}
policy:
  path: builtin:default
  params: {{cpu_pool: far, reserve_bytes: 32MiB, min_context_tokens: 16, defer_ms: 25, defer_max_queue: 4}}
"
    )
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// An encoder request of 128 tokens as binary tensors, with extra headers: (status, pool,
/// headers, JSON body).
async fn infer(url: &str, headers: &[(&str, &str)]) -> (u16, String, reqwest::header::HeaderMap, Value) {
    let (header, body) = crate::common::encoder_binary_request(128);
    let mut request = client()
        .post(format!("{url}/v2/models/encoder/infer"))
        .header("Inference-Header-Content-Length", header.len());
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.body(body).send().await.unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let pool = headers
        .get("x-vramguard-pool")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let json: Value = response.json().await.unwrap();
    (status, pool, headers, json)
}

fn pooled(answer: &Value) -> Vec<f64> {
    crate::common::floats(&answer["outputs"][0]["data"])
}

async fn get_json(url: &str) -> Value {
    client().get(url).send().await.unwrap().json().await.unwrap()
}

async fn metrics(url: &str) -> String {
    client()
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

fn far_status(status: &Value) -> Value {
    status["pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "far")
        .unwrap()
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_squeezed_accelerator_moves_work_to_the_remote_server_and_its_outage_opens_the_breaker() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let dir = Scratch::new();
    let remote = serve(&dir, "remote", &remote_config(), &[]);
    let local = serve(
        &dir,
        "local",
        &local_config(&remote.url),
        &[("VRAMGUARD_REMOTE_TEST_TOKEN", TOKEN)],
    );

    // Before the squeeze the accelerator takes it.
    let (status, pool, _, on_gpu) = infer(&local.url, &[]).await;
    assert_eq!((status, pool.as_str()), (200, "gpu"), "{on_gpu}");
    let far = far_status(&get_json(&format!("{}/status", local.url)).await);
    assert_eq!(
        (
            far["provider"].as_str(),
            far["device_kind"].as_str(),
            far["breaker"].as_str()
        ),
        (Some("remote"), Some("remote"), Some("closed")),
        "{far}"
    );

    // Squeezed: the policy redirects to the remote pool; the answer is the local one, and the
    // request's id and idempotency key reach the remote server.
    let squeezed = client()
        .post(format!("{}/admin/sim/gpu0", local.url))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({"pressure": "100MiB"}))
        .send()
        .await
        .unwrap();
    assert_eq!(squeezed.status(), 200, "{}", squeezed.text().await.unwrap());
    let (status, pool, headers, via_remote) = infer(
        &local.url,
        &[("x-request-id", "hop-1"), ("idempotency-key", "hop-key-1")],
    )
    .await;
    assert_eq!((status, pool.as_str()), (200, "far"), "{via_remote}");
    assert_eq!(headers["x-vramguard-decision"], "redirect");
    assert_eq!(headers["x-request-id"], "hop-1");
    crate::common::assert_close(&pooled(&via_remote), &pooled(&on_gpu), 1e-6, "remote vs local");
    let (_, _, _, direct) = infer(&remote.url, &[]).await;
    assert_eq!(
        pooled(&via_remote),
        pooled(&direct),
        "the remote's own answer, unchanged"
    );
    let decisions = get_json(&format!("{}/status", remote.url)).await["recent_decisions"].clone();
    assert!(
        decisions
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d.to_string().contains("hop-1")),
        "the request id reached the remote server: {decisions}"
    );
    // The remote server holds the key: the same key with another request is refused there.
    let (status, _, _, conflict) = infer(&remote.url, &[("idempotency-key", "hop-key-1")]).await;
    assert_eq!(status, 422, "{conflict}");
    let text = metrics(&local.url).await;
    assert_eq!(
        crate::common::sum_samples(&text, |l| l
            .starts_with("vramguard_remote_request_duration_seconds_count{pool=\"far\"}")),
        1.0,
        "{text}"
    );
    assert!(
        text.contains("vramguard_requests_total{model=\"encoder\",pool=\"far\",outcome=\"ok\"} 1\n"),
        "{text}"
    );

    // The remote server goes away. The first request sent there meanwhile is retried once on
    // the local CPU pool, under its id; the health checks open the breaker.
    drop(remote);
    let (status, pool, headers, retried) = infer(&local.url, &[("x-request-id", "hop-2")]).await;
    // (Three failures open the breaker: this request's and two health checks', 200 ms apart,
    // so it is still closed when this request is sent right after the remote stops.)
    assert_eq!((status, pool.as_str()), (200, "cpu"), "{retried}");
    assert_eq!(retried["parameters"]["reason"], "remote_retry", "{retried}");
    assert_eq!(headers["x-request-id"], "hop-2");
    crate::common::assert_close(&pooled(&retried), &pooled(&on_gpu), 1e-6, "retry vs local");
    let deadline = Instant::now() + Duration::from_secs(10);
    let far = loop {
        let far = far_status(&get_json(&format!("{}/status", local.url)).await);
        if far["breaker"] == "open" || Instant::now() > deadline {
            break far;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(far["breaker"], "open", "{far}");
    let reason = far["breaker_reason"].as_str().unwrap();
    assert!(reason.contains("failures of the remote server"), "{reason}");

    // Open: the policy no longer sends work there and says so; the server stays ready.
    let (status, _, headers, refused) = infer(&local.url, &[]).await;
    assert_eq!(status, 503, "{refused}");
    assert!(headers.contains_key("retry-after"));
    let message = refused["error"].as_str().unwrap();
    assert!(message.contains("the CPU pool cannot take it"), "{message}");
    let status = get_json(&format!("{}/status", local.url)).await;
    assert_eq!(status["degraded"]["active"], true, "{status}");
    let ready = client()
        .get(format!("{}/v2/health/ready", local.url))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    let text = metrics(&local.url).await;
    assert!(text.contains("vramguard_breaker_state{pool=\"far\"} 2\n"), "{text}");
    assert!(
        text.contains("vramguard_failovers_total{from=\"far\",to=\"cpu\",reason=\"remote_retry\"} 1\n"),
        "{text}"
    );
    let failures = |kind: &str| {
        crate::common::sum_samples(&text, |l| {
            l.starts_with(&format!(
                "vramguard_remote_errors_total{{pool=\"far\",kind=\"{kind}\"}}"
            ))
        })
    };
    // The request's failure (no connection, or the old one found closed) and the checks'.
    assert!(failures("connect") + failures("server_error") >= 1.0, "{text}");
    assert!(failures("health") >= 2.0, "{text}");
}
