//! The default policy on the simulated accelerator. (Its own test binary: the simulated arena is
//! per process, and the other simulated tests need it nearly empty.)

mod common;

use common::TestServer;
use reqwest::StatusCode;

const CONFIG: &str = common::SIMULATED_CONFIG;

/// The default policy sees the same request coming and shrinks its context to what fits, so
/// no allocation fails at all.
#[tokio::test]
async fn the_default_policy_shrinks_a_request_that_would_not_fit() {
    let server = TestServer::start(CONFIG).await;
    let response = server.encoder(4096).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-vramguard-decision"], "shrink_context");
    let context = response.headers()["x-vramguard-context"].to_str().unwrap().to_string();
    let to: u64 = context.strip_prefix("4096->").unwrap().parse().unwrap();
    // 16·n² bytes of scores must fit in 128 MiB minus the 32 MiB reserve: n < 2508.
    assert!((16..2508).contains(&to), "{context}");
    let metrics = server.metrics().await;
    assert!(metrics.contains("vramguard_allocator_failures_total{pool=\"gpu\",device=\"gpu0\",kind=\"oom\"} 0\n"));
    assert!(
        metrics.contains("vramguard_policy_decisions_total{action=\"shrink_context\",pool=\"gpu\"} 1\n"),
        "{metrics}"
    );
    server.stop().await;
}
