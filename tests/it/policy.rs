//! Every policy decision enacted over real HTTP, the fallback on a failing script, and hot
//! reload through the admin endpoint and the file watcher.

use std::time::{Duration, Instant};

use crate::common::TestServer;
use reqwest::StatusCode;
use serde_json::{Value, json};
use vramguard::testing::Scratch;

/// A script whose decision the test picks with `x-vramguard-priority`.
const SCRIPT: &str = r#"
fn decide(req, state) {
    if req.priority == 1 { return redirect("slow"); }
    if req.priority == 2 { return shrink_context(8); }
    if req.priority == 3 { return defer(40); }
    if req.priority == 4 { return reject("the test said so"); }
    if req.priority == 5 { return redirect("nowhere"); }
    if req.priority == 6 { let x = 0; loop { x += 1; } }
    if req.priority == 7 { return 42; }
    admit()
}
"#;

/// A folder with the policy `p.rhai` and its (empty) `tests/`.
fn policy_dir(script: &str) -> Scratch {
    let dir = Scratch::new();
    std::fs::create_dir_all(dir.path().join("tests")).unwrap();
    dir.write("p.rhai", script);
    dir
}

fn config(dir: &std::path::Path, watch: &str) -> String {
    format!(
        "
models: [{{name: encoder, path: 'builtin:encoder', context: {{input: input, axis: 1, keep: end}}}}]
pools:
  - {{name: fast, provider: cpu, models: [encoder], queue: {{max_wait: 100ms}}}}
  - {{name: slow, provider: cpu, models: [encoder]}}
policy:
  path: {}/p.rhai
  fallback: {{action: admit}}
  watch_interval: {watch}
",
        dir.display()
    )
}

fn tokens(seq: usize) -> Vec<f32> {
    (0..seq * 64)
        .map(|i| ((i / 64) as f32) * 0.1 + (i % 64) as f32 * 0.001)
        .collect()
}

async fn infer(server: &TestServer, seq: usize, priority: i64) -> reqwest::Response {
    infer_with(server, seq, priority, &[]).await
}

async fn infer_with(server: &TestServer, seq: usize, priority: i64, headers: &[(&str, &str)]) -> reqwest::Response {
    let data = tokens(seq);
    let mut request = reqwest::Client::new()
        .post(server.url("/v2/models/encoder/infer"))
        .header("x-vramguard-priority", priority);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request
        .json(
            &json!({"inputs": [{"name": "input", "shape": [1, seq, 64], "datatype": "FP32", "data": data}],
                      "outputs": [{"name": "hidden"}]}),
        )
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn every_decision_is_enacted_on_the_request_path() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let dir = policy_dir(SCRIPT);
    let server = TestServer::start(&config(dir.path(), "0")).await;

    // admit(): the router's pool.
    let admitted = infer(&server, 16, 0).await;
    assert_eq!(admitted.status(), StatusCode::OK);
    assert_eq!(admitted.headers()["x-vramguard-pool"], "fast");
    assert_eq!(admitted.headers()["x-vramguard-decision"], "admit");

    // redirect("slow"): the other pool runs it and says so.
    let redirected = infer(&server, 16, 1).await;
    assert_eq!(redirected.status(), StatusCode::OK);
    assert_eq!(redirected.headers()["x-vramguard-pool"], "slow");
    assert_eq!(redirected.headers()["x-vramguard-decision"], "redirect");
    let body: Value = redirected.json().await.unwrap();
    assert_eq!(body["parameters"]["pool"], "slow");

    // shrink_context(8) from a client that did not allow it: not carried out; the fallback
    // (admit) runs the whole context and it counts as a bad return.
    let whole = infer(&server, 32, 2).await;
    assert_eq!(whole.status(), StatusCode::OK);
    assert_eq!(whole.headers()["x-vramguard-decision"], "admit");
    assert!(!whole.headers().contains_key("x-vramguard-context"));
    let whole: Value = whole.json().await.unwrap();
    assert_eq!(whole["outputs"][0]["shape"], json!([1, 32, 64]));

    // shrink_context(8) from a client that allows it: the last 8 of 32 tokens run (keep: end),
    // and the output is what those 8 tokens give on their own.
    let shrunk = infer_with(&server, 32, 2, &[("x-vramguard-allow-shrink", "true")]).await;
    assert_eq!(shrunk.status(), StatusCode::OK);
    assert_eq!(shrunk.headers()["x-vramguard-context"], "32->8");
    assert_eq!(shrunk.headers()["x-vramguard-decision"], "shrink_context");
    let shrunk: Value = shrunk.json().await.unwrap();
    assert_eq!(shrunk["outputs"][0]["shape"], json!([1, 8, 64]));
    assert_eq!(shrunk["parameters"]["context"], "32->8");
    let last8: Vec<f32> = tokens(32)[24 * 64..].to_vec();
    let direct: Value = server
        .post_json(
            "/v2/models/encoder/infer",
            &json!({"inputs": [{"name": "input", "shape": [1, 8, 64], "datatype": "FP32", "data": last8}],
                      "outputs": [{"name": "hidden"}]}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(shrunk["outputs"][0]["data"], direct["outputs"][0]["data"]);

    // defer(40) forever: two waits fit in `fast`'s 100 ms max wait, the third would not → 429.
    let started = Instant::now();
    let deferred = infer(&server, 16, 3).await;
    assert_eq!(deferred.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(
        started.elapsed() >= Duration::from_millis(80),
        "it waited both deferrals"
    );
    assert_eq!(deferred.headers()["retry-after"], "1");
    let error: Value = deferred.json().await.unwrap();
    assert!(
        error["error"].as_str().unwrap().contains("max wait of 100ms"),
        "{error}"
    );

    // reject(reason): 503 + Retry-After with the reason.
    let rejected = infer(&server, 16, 4).await;
    assert_eq!(rejected.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(rejected.headers().contains_key("retry-after"));
    let error: Value = rejected.json().await.unwrap();
    assert_eq!(error["error"], "rejected by policy: the test said so");

    // A decision that cannot be carried out, a script stuck in a loop, a non-decision: each
    // gets the fallback (admit) and is counted by kind.
    for priority in [5, 6, 7] {
        let fallback = infer(&server, 16, priority).await;
        assert_eq!(fallback.status(), StatusCode::OK, "priority {priority}");
        assert_eq!(fallback.headers()["x-vramguard-pool"], "fast");
    }

    let metrics = server.metrics().await;
    for (series, want) in [
        ("vramguard_policy_decisions_total{action=\"admit\",pool=\"fast\"}", 6.0),
        (
            "vramguard_policy_decisions_total{action=\"redirect\",pool=\"slow\"}",
            1.0,
        ),
        (
            "vramguard_policy_decisions_total{action=\"shrink_context\",pool=\"fast\"}",
            1.0,
        ),
        ("vramguard_policy_decisions_total{action=\"defer\",pool=\"fast\"}", 3.0),
        ("vramguard_policy_decisions_total{action=\"reject\",pool=\"fast\"}", 1.0),
        ("vramguard_policy_errors_total{kind=\"bad_return\"}", 3.0),
        ("vramguard_policy_errors_total{kind=\"limit\"}", 1.0),
        (
            "vramguard_requests_total{model=\"encoder\",pool=\"\",outcome=\"deferred_timeout\"}",
            1.0,
        ),
        (
            "vramguard_requests_total{model=\"encoder\",pool=\"\",outcome=\"rejected\"}",
            1.0,
        ),
    ] {
        assert_eq!(crate::common::sample(&metrics, series), want, "{series} in\n{metrics}");
    }
    assert_eq!(
        crate::common::sample(&metrics, "vramguard_policy_eval_duration_seconds_count"),
        12.0
    );
    server.stop().await;
}

const CASES: &str = "
policy: p.rhai
cases:
  - name: small requests are admitted
    request: {pool: fast, context_tokens: 16}
    state: {pools: {fast: {provider: cpu}, slow: {provider: cpu}}}
    expect: {action: admit}
";

async fn reload(server: &TestServer) -> (StatusCode, Value) {
    let response = reqwest::Client::new()
        .post(server.url("/admin/policy/reload"))
        .bearer_auth(crate::common::ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    (response.status(), response.json().await.unwrap())
}

async fn policy_status(server: &TestServer) -> Value {
    let status: Value = reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap();
    status["policy"].clone()
}

#[tokio::test]
async fn a_reload_swaps_only_a_script_that_compiles_and_passes_its_cases() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let dir = policy_dir("fn decide(req, state) { admit() }");
    std::fs::write(dir.path().join("tests/p.yaml"), CASES).unwrap();
    let server = TestServer::start(&config(dir.path(), "0")).await;
    let first = policy_status(&server).await;
    assert_eq!(first["cases"], 1);

    // Bad syntax: refused with file:line:col, the old script keeps serving.
    std::fs::write(dir.path().join("p.rhai"), "fn decide(req, state) {\n  admit(\n}\n").unwrap();
    let (status, body) = reload(&server).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let message = body["error"].as_str().unwrap();
    assert!(message.contains("p.rhai:3:"), "{message}");
    let now = policy_status(&server).await;
    assert_eq!(now["sha256"], first["sha256"]);
    assert!(now["last_error"].as_str().unwrap().contains("p.rhai:3:"));
    assert_eq!(infer(&server, 16, 0).await.status(), StatusCode::OK);

    // Compiles, but fails its own test case: refused too.
    std::fs::write(dir.path().join("p.rhai"), "fn decide(req, state) { reject(\"no\") }").unwrap();
    let (status, body) = reload(&server).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        body["error"].as_str().unwrap().contains("1 of 1 test cases failed"),
        "{body}"
    );
    assert_eq!(infer(&server, 16, 0).await.status(), StatusCode::OK);

    // A good script: swapped in, visible in /status and vramguard_policy_info.
    std::fs::write(
        dir.path().join("p.rhai"),
        "fn decide(req, state) { if req.context_tokens > 100 { return redirect(\"slow\"); } admit() }",
    )
    .unwrap();
    let (status, body) = reload(&server).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let now = policy_status(&server).await;
    assert_ne!(now["sha256"], first["sha256"]);
    assert_eq!(now["last_error"], Value::Null);
    let long = infer(&server, 128, 0).await;
    assert_eq!(long.headers()["x-vramguard-pool"], "slow");
    let metrics = server.metrics().await;
    assert_eq!(
        crate::common::sample(&metrics, "vramguard_policy_reloads_total{result=\"ok\"}"),
        1.0
    );
    assert_eq!(
        crate::common::sample(&metrics, "vramguard_policy_reloads_total{result=\"error\"}"),
        2.0
    );
    let info = format!("sha256=\"{}\"}} 1", now["sha256"].as_str().unwrap());
    assert!(metrics.contains(&info), "{metrics}");
    assert_eq!(
        metrics.matches("vramguard_policy_info{").count(),
        1,
        "only the serving script: {metrics}"
    );
    server.stop().await;
}

#[tokio::test]
async fn an_edited_policy_file_is_picked_up_by_the_watcher() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let dir = policy_dir("fn decide(req, state) { admit() }");
    let server = TestServer::start(&config(dir.path(), "50ms")).await;
    let before = policy_status(&server).await["sha256"].clone();
    // Make sure the modification time moves even on coarse-grained file systems.
    tokio::time::sleep(Duration::from_millis(20)).await;
    std::fs::write(
        dir.path().join("p.rhai"),
        "fn decide(req, state) { redirect(\"slow\") }",
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while policy_status(&server).await["sha256"] == before {
        assert!(Instant::now() < deadline, "the watcher never reloaded the policy");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(infer(&server, 16, 0).await.headers()["x-vramguard-pool"], "slow");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builtin_policies_load_from_the_binary_and_show_as_builtin() {
    if crate::common::ran_in_own_process() {
        return;
    }
    // Servers in one process start on builtin policies at the same time: they share no files.
    let yaml = |name: &str| {
        format!(
            "models: [{{name: encoder, path: 'builtin:encoder', context: {{input: input, axis: 1, keep: end}}}}]\n\
             pools: [{{name: cpu, provider: cpu, models: [encoder]}}]\n\
             policy: {{path: 'builtin:{name}'}}\n"
        )
    };
    let (default, latency_first) = (yaml("default"), yaml("latency-first"));
    let (a, b, c) = tokio::join!(
        TestServer::start(&default),
        TestServer::start(&default),
        TestServer::start(&latency_first),
    );
    for (server, name) in [(a, "default"), (b, "default"), (c, "latency-first")] {
        let origin = format!("builtin:{name}");
        let status = policy_status(&server).await;
        assert_eq!(status["path"], origin.as_str(), "{status}");
        assert!(status["cases"].as_u64().unwrap() >= 8, "{status}");
        let info = format!("vramguard_policy_info{{path=\"{origin}\",");
        assert!(server.metrics().await.contains(&info), "{info}");
        // Reloading a builtin checks the same text again.
        let (code, body) = reload(&server).await;
        assert_eq!(code, StatusCode::OK, "{body}");
        assert_eq!(policy_status(&server).await["sha256"], status["sha256"]);
        server.stop().await;
    }
}
