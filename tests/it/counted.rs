//! Every answer counted, and every series the configuration fixes there from the start: a fresh
//! server exposes each request, duration, decision, failover, retry and degraded series at 0,
//! and every metric the shipped dashboards and alerts use (the embedded default describes each
//! of their families in its first scrape, series or not); after a mix of served and refused
//! requests over both protocols, `vramguard_requests_total` says, outcome by outcome, what the
//! clients saw.

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::TestServer;
use reqwest::StatusCode;
use serde_json::{Value, json};

/// The encoder and the tiny decoder on a simulated accelerator and on its CPU fallback.
const CONFIG: &str = "\
devices: [{name: gpu0, kind: simulated, capacity: 128MiB}]
models: [{name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}},
         {name: tiny, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json,
          chat_template: 'builtin:chatml'}]
pools:
- {name: gpu, provider: simulated, device: gpu0, models: [encoder, tiny], fallback: cpu}
- {name: cpu, provider: cpu, models: [encoder, tiny]}
# A budget the encoder never reaches: the service budget family the dashboard reads exists.
services: [{name: encoder, device_memory: 64MiB}]
";

const OUTCOMES: [&str; 6] = [
    "ok",
    "client_error",
    "rejected",
    "deferred_timeout",
    "failed",
    "cancelled",
];

/// Every `vramguard_*` name the expressions of the shipped dashboards and alert rules use.
fn names_used() -> Vec<(String, String)> {
    fn exprs(value: &Value, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                for (key, v) in map {
                    match (key.as_str(), v) {
                        ("expr" | "query", Value::String(expr)) => out.push(expr.clone()),
                        _ => exprs(v, out),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|v| exprs(v, out)),
            _ => {}
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let name = regex::Regex::new(r"vramguard_[a-z0-9_]+").unwrap();
    let mut used = Vec::new();
    for folder in ["dashboards", "alerts"] {
        for entry in std::fs::read_dir(root.join(folder)).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let value: Value = match path.extension().and_then(|e| e.to_str()) {
                Some("json") => serde_json::from_str(&text).unwrap(),
                Some("yaml") if folder == "alerts" && text.contains("groups:") => {
                    vramguard::config::parse_yaml(&text, "rules").unwrap()
                }
                _ => continue,
            };
            let mut found = Vec::new();
            exprs(&value, &mut found);
            for expr in found {
                for m in name.find_iter(&expr) {
                    used.push((path.display().to_string(), m.as_str().to_string()));
                }
            }
        }
    }
    assert!(used.len() > 20, "too few metric names found: {used:?}");
    used
}

#[tokio::test]
async fn a_fresh_server_exposes_every_known_series_at_zero() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let metrics = server.metrics().await;
    let mut zero = Vec::new();
    for (model, pools) in [("encoder", ["gpu", "cpu"]), ("tiny", ["gpu", "cpu"])] {
        for pool in pools {
            for outcome in OUTCOMES {
                zero.push(format!(
                    "vramguard_requests_total{{model=\"{model}\",pool=\"{pool}\",outcome=\"{outcome}\"}}"
                ));
            }
            zero.push(format!(
                "vramguard_request_duration_seconds_count{{model=\"{model}\",pool=\"{pool}\"}}"
            ));
        }
        // Refused before a pool was chosen.
        zero.push(format!(
            "vramguard_requests_total{{model=\"{model}\",pool=\"\",outcome=\"client_error\"}}"
        ));
    }
    // Requests naming no configured model share one label value.
    zero.push("vramguard_requests_total{model=\"\",pool=\"\",outcome=\"client_error\"}".into());
    for action in ["admit", "defer", "shrink_context", "redirect", "reject"] {
        for pool in ["gpu", "cpu"] {
            zero.push(format!(
                "vramguard_policy_decisions_total{{action=\"{action}\",pool=\"{pool}\"}}"
            ));
        }
    }
    for reason in [
        "oom_retry",
        "driver_retry",
        "breaker_open",
        "policy_redirect",
        "remote_retry",
        "worker_lost",
    ] {
        zero.push(format!(
            "vramguard_failovers_total{{from=\"gpu\",to=\"cpu\",reason=\"{reason}\"}}"
        ));
    }
    for result in ["ok", "failed", "not_replayable", "no_fallback"] {
        zero.push(format!("vramguard_retries_total{{pool=\"gpu\",result=\"{result}\"}}"));
    }
    for reason in [
        "pool_unavailable",
        "driver_fault",
        "breaker_open",
        "memory_redirect",
        "worker_lost",
    ] {
        zero.push(format!("vramguard_degraded_info{{reason=\"{reason}\"}}"));
    }
    for series in &zero {
        assert!(
            metrics.lines().any(|l| l == format!("{series} 0")),
            "{series} is not exposed at 0 on a fresh server:\n{metrics}"
        );
    }
    // A pool without a fallback moves nothing anywhere.
    assert!(!metrics.contains("vramguard_retries_total{pool=\"cpu\""), "{metrics}");

    for (origin, name) in names_used() {
        assert!(
            metrics.lines().any(|l| l
                .strip_prefix(name.as_str())
                .is_some_and(|rest| rest.starts_with(['{', ' ']))),
            "{origin} uses {name}, which a fresh server does not expose:\n{metrics}"
        );
    }
    server.stop().await;
}

/// `vramguard serve` with no config (the embedded default: no service has a budget, and here
/// no NVIDIA device) describes every family the dashboards and alerts read in its very first
/// scrape, before any request: a panel or rule sees a known family with nothing in it, not an
/// unknown name. promtool accepts the families without series.
#[tokio::test]
async fn the_embedded_defaults_first_scrape_describes_every_family_the_dashboards_and_alerts_use() {
    // The admin socket in a folder of this test's own, so no other server's is in the way.
    let scratch = vramguard::testing::Scratch::new();
    let runtime_dir = scratch.path().to_str().unwrap();
    let server = crate::common::spawn_serving(
        &["serve", "--listen", "127.0.0.1:0"],
        &[("RUNTIME_DIRECTORY", runtime_dir)],
        "vramguard serving",
    );
    let metrics = reqwest::get(format!("http://{}/metrics", server.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let described: Vec<&str> = metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    for (origin, name) in names_used() {
        // A histogram's samples are named after its family with a suffix.
        let family = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .filter(|family| described.contains(family))
            .unwrap_or(&name);
        assert!(
            described.contains(&family),
            "{origin} uses {name}, whose family the embedded default's first scrape does not describe:\n{metrics}"
        );
    }
    let findings = crate::common::promtool_findings(&metrics);
    assert!(findings.is_empty(), "promtool: {findings}");
}

/// What a client saw, by outcome.
#[derive(Default)]
struct Seen(BTreeMap<&'static str, u32>);

impl Seen {
    /// A response with `status`, which must be `want`, counted as `outcome`; its body, read whole.
    async fn saw(&mut self, response: reqwest::Response, want: StatusCode, outcome: &'static str) -> String {
        let status = response.status();
        let body = response.text().await.unwrap();
        assert_eq!(status, want, "{body}");
        *self.0.entry(outcome).or_default() += 1;
        body
    }
}

#[tokio::test]
async fn requests_total_says_outcome_by_outcome_what_the_clients_saw() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let client = reqwest::Client::new();
    let mut seen = Seen::default();
    let infer = |model: &str| client.post(server.url(&format!("/v2/models/{model}/infer")));
    let (header, body) = crate::common::encoder_binary_request(8);
    let binary = |request: reqwest::RequestBuilder, body: Vec<u8>| {
        request
            .header("inference-header-content-length", header.len())
            .body(body)
    };

    // The Open Inference Protocol: served, a bad tensor, an unknown model and version, a bad
    // header.
    for _ in 0..2 {
        seen.saw(server.encoder(8).await, StatusCode::OK, "ok").await;
    }
    let bad =
        json!({"inputs": [{"name": "input", "shape": [1, 2, 3], "datatype": "FP32", "data": [1, 2, 3, 4, 5, 6]}]});
    let response = infer("encoder").json(&bad).send().await.unwrap();
    seen.saw(response, StatusCode::BAD_REQUEST, "client_error").await;
    let response = binary(infer("nope"), body.clone()).send().await.unwrap();
    seen.saw(response, StatusCode::NOT_FOUND, "client_error").await;
    let versioned = client.post(server.url("/v2/models/encoder/versions/7/infer"));
    let response = binary(versioned, body.clone()).send().await.unwrap();
    seen.saw(response, StatusCode::NOT_FOUND, "client_error").await;
    let response = binary(infer("encoder").header("x-vramguard-deadline-ms", "soon"), body.clone())
        .send()
        .await
        .unwrap();
    seen.saw(response, StatusCode::BAD_REQUEST, "client_error").await;

    // Idempotency keys: the first run, its answer sent again, the key with another body, a key
    // that is not one.
    let keyed = |key: &str, body: Vec<u8>| binary(infer("encoder").header("idempotency-key", key), body);
    let response = keyed("k1", body.clone()).send().await.unwrap();
    seen.saw(response, StatusCode::OK, "ok").await;
    // The answer sent again is the same request's, counted once, when it was first answered;
    // the resend is counted in `vramguard_idempotency_hits_total`.
    let again = keyed("k1", body.clone()).send().await.unwrap();
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let (_, other) = crate::common::encoder_binary_request(9);
    let response = keyed("k1", other).send().await.unwrap();
    seen.saw(response, StatusCode::UNPROCESSABLE_ENTITY, "client_error")
        .await;
    let response = keyed(&"k".repeat(300), body.clone()).send().await.unwrap();
    seen.saw(response, StatusCode::BAD_REQUEST, "client_error").await;

    // OpenAI: a completion whole and streamed, a chat, and refusals while the request is read.
    let completion = json!({"model": "tiny", "prompt": "The GPU", "max_tokens": 3, "temperature": 0});
    let response = server.post_json("/v1/completions", &completion).await;
    seen.saw(response, StatusCode::OK, "ok").await;
    let mut streamed = completion.clone();
    streamed["stream"] = json!(true);
    let response = server.post_json("/v1/completions", &streamed).await;
    let events = seen.saw(response, StatusCode::OK, "ok").await;
    assert!(events.ends_with("data: [DONE]\n\n"), "{events}");
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let response = server.post_json("/v1/chat/completions", &chat).await;
    seen.saw(response, StatusCode::OK, "ok").await;
    let unknown = json!({"model": "nope", "prompt": "x"});
    let response = server.post_json("/v1/completions", &unknown).await;
    seen.saw(response, StatusCode::NOT_FOUND, "client_error").await;
    let mut unsupported = completion.clone();
    unsupported["suffix"] = json!("x");
    let response = server.post_json("/v1/completions", &unsupported).await;
    seen.saw(response, StatusCode::BAD_REQUEST, "client_error").await;
    let response = client
        .post(server.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    seen.saw(response, StatusCode::BAD_REQUEST, "client_error").await;
    let response = client
        .post(server.url("/v1/completions"))
        .header("x-vramguard-replayable", "perhaps")
        .json(&completion)
        .send()
        .await
        .unwrap();
    seen.saw(response, StatusCode::BAD_REQUEST, "client_error").await;

    let metrics = server.metrics().await;
    for outcome in OUTCOMES {
        let counted = crate::common::requests_with(&metrics, |o| o == outcome);
        let saw = seen.0.get(outcome).copied().unwrap_or(0);
        assert_eq!(counted, f64::from(saw), "outcome {outcome}:\n{metrics}");
    }
    // The unknown model (both protocols) and the body that named none, under one label value.
    assert_eq!(
        crate::common::sample(
            &metrics,
            "vramguard_requests_total{model=\"\",pool=\"\",outcome=\"client_error\"}"
        ),
        3.0,
        "{metrics}"
    );
    assert_eq!(crate::common::sample(&metrics, "vramguard_idempotency_hits_total"), 1.0);
    assert_eq!(
        crate::common::sample(
            &metrics,
            "vramguard_requests_total{model=\"encoder\",pool=\"gpu\",outcome=\"ok\"}"
        ),
        3.0,
        "{metrics}"
    );
    server.stop().await;
}
