//! The default policy on the simulated accelerator. (Its own test binary: the simulated arena is
//! per process, and the other simulated tests need it nearly empty.)

use crate::common::TestServer;
use reqwest::StatusCode;

/// The simulated accelerator of 128 MiB and a CPU pool beside it. The host reserve is small so
/// that the CPU pool can take the long request on any test machine.
const CONFIG: &str = "
devices: [{name: gpu0, kind: simulated, capacity: 128MiB}]
models: [{name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}}]
pools:
  - {name: gpu, provider: simulated, device: gpu0, models: [encoder]}
  - {name: cpu, provider: cpu, models: [encoder]}
host: {reserve: 64MiB}
";

/// The default policy sees a request coming that would not fit. Cutting its context would
/// change the answer, so without the client's leave it runs whole on the CPU pool; with
/// `x-vramguard-allow-shrink: true` its context is cut to what fits on the accelerator. Either
/// way no allocation fails.
#[tokio::test]
async fn the_default_policy_redirects_a_long_request_and_shrinks_it_only_when_allowed() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;

    let whole = server.encoder(4096).await;
    assert_eq!(whole.status(), StatusCode::OK);
    assert_eq!(whole.headers()["x-vramguard-decision"], "redirect");
    assert_eq!(whole.headers()["x-vramguard-pool"], "cpu");
    assert!(!whole.headers().contains_key("x-vramguard-context"));

    let shrunk = server
        .encoder_with_headers(4096, &[("x-vramguard-allow-shrink", "true")])
        .await;
    assert_eq!(shrunk.status(), StatusCode::OK);
    assert_eq!(shrunk.headers()["x-vramguard-decision"], "shrink_context");
    assert_eq!(shrunk.headers()["x-vramguard-pool"], "gpu");
    let context = shrunk.headers()["x-vramguard-context"].to_str().unwrap().to_string();
    let to: u64 = context.strip_prefix("4096->").unwrap().parse().unwrap();
    // 16·n² bytes of scores must fit in 128 MiB minus the 32 MiB reserve: n < 2508.
    assert!((16..2508).contains(&to), "{context}");

    let metrics = server.metrics().await;
    assert!(metrics.contains("vramguard_allocator_failures_total{pool=\"gpu\",device=\"gpu0\",kind=\"oom\"} 0\n"));
    for decision in [
        "vramguard_policy_decisions_total{action=\"redirect\",pool=\"cpu\"} 1\n",
        "vramguard_policy_decisions_total{action=\"shrink_context\",pool=\"gpu\"} 1\n",
    ] {
        assert!(metrics.contains(decision), "{decision}{metrics}");
    }
    assert!(
        !metrics.contains("vramguard_policy_errors_total{kind=\"bad_return\"} 1"),
        "{metrics}"
    );
    server.stop().await;
}
