//! What runs teach the estimate, end to end: a model whose configured profile is far too low
//! takes more than estimated, the underrun is counted and learned, and the next request of that
//! size reaches the policy with an estimate raised from observed runs, while a smaller one still
//! gets the configured estimate.

use crate::common::{TestServer, sample};
use reqwest::StatusCode;
use serde_json::Value;

/// The encoder on a CPU pool with a hand-written profile a thousand times too small.
const CONFIG: &str = "
models:
- name: encoder
  path: 'builtin:encoder'
  context: {input: input, axis: 1, keep: end}
  memory_profile: {weights: 1KiB, workspace: 0, per_token_bytes: 1, per_token_squared_bytes: 0}
pools: [{name: cpu, provider: cpu, models: [encoder]}]
";

/// Refuses what observed runs say is large, with the numbers, and admits everything else.
const POLICY: &str = r#"
fn decide(req, state) {
    if req.estimate.source == "observed" {
        return reject(`observed: ${req.estimate.total_bytes} bytes`);
    }
    admit()
}
"#;

#[tokio::test]
async fn an_underrun_raises_the_next_estimate_of_that_size_to_what_was_observed() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::with_policy(CONFIG, POLICY).await;

    let first = server.encoder(256).await;
    assert_eq!(first.status(), StatusCode::OK, "{}", first.text().await.unwrap());
    let metrics = server.metrics().await;
    assert_eq!(
        sample(
            &metrics,
            "vramguard_estimate_underruns_total{model=\"encoder\",pool=\"cpu\"}"
        ),
        1.0,
        "{metrics}"
    );
    let metadata: Value = server.model_metadata("encoder").await;
    let parameters = &metadata["parameters"];
    assert_eq!(parameters["memory_learned"]["observations"], 1, "{metadata}");
    let pool = parameters["pools"]
        .as_array()
        .and_then(|pools| pools.iter().find(|p| p["name"] == "cpu"))
        .unwrap_or_else(|| panic!("no cpu pool in {metadata}"));
    assert!(
        pool["memory"]["workspace_peak_bytes"].as_u64().is_some_and(|b| b > 0),
        "{metadata}"
    );

    // The configured profile says 1 KiB + 256 bytes; the run took far more.
    let configured = 1024 + 256;
    let again = server.encoder(256).await;
    assert_eq!(again.status(), StatusCode::SERVICE_UNAVAILABLE);
    let error: Value = again.json().await.unwrap();
    let reason = error["error"].as_str().unwrap_or_default().to_string();
    let total: u64 = reason
        .strip_prefix("rejected by policy: observed: ")
        .and_then(|r| r.strip_suffix(" bytes"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the reason names the observed total: {error}"));
    assert!(
        total > 100 * configured,
        "{total} bytes is not far above the configured {configured}"
    );

    // A smaller request was never observed to take more: the configured estimate stands.
    let smaller = server.encoder(64).await;
    assert_eq!(smaller.status(), StatusCode::OK, "{}", smaller.text().await.unwrap());
    server.stop().await;
}
