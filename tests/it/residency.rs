//! Models loaded on demand and unloaded on request, on a CPU pool with real ONNX Runtime
//! sessions: what `/metrics`, `/v2/models/{model}` and the admin API show at each step.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::common::{TestServer, reference_cases, request_from_case, sample};

const CONFIG: &str = "
models:
  - {name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}, residency: on_demand}
  - {name: classifier, path: 'builtin:classifier', residency: pinned}
pools:
  - {name: cpu, provider: cpu, models: [encoder, classifier], workers: 2}
";

fn series(name: &str, model: &str, rest: &str) -> String {
    format!("vramguard_{name}{{model=\"{model}\",pool=\"cpu\"{rest}}}")
}

async fn admin(server: &TestServer, model: &str, what: &str) -> (StatusCode, Value) {
    let response = server
        .post_json(&format!("/admin/models/{model}/{what}"), &json!({}))
        .await;
    (response.status(), response.json().await.unwrap())
}

async fn classify(server: &TestServer) -> StatusCode {
    let case = &reference_cases("classifier")[0];
    server
        .post_json("/v2/models/classifier/infer", &request_from_case(case))
        .await
        .status()
}

#[tokio::test]
async fn an_on_demand_model_loads_on_its_first_request_and_unloads_on_request() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let resident = series("model_resident", "encoder", "");
    let on_demand = series("model_loads_total", "encoder", ",reason=\"on_demand\"");
    let metrics = server.metrics().await;
    assert_eq!(sample(&metrics, &resident), 0.0, "not loaded at start:\n{metrics}");
    assert_eq!(sample(&metrics, &series("model_resident", "classifier", "")), 1.0);
    assert_eq!(
        sample(
            &metrics,
            &series("model_loads_total", "classifier", ",reason=\"start\"")
        ),
        1.0
    );
    assert_eq!(
        server.model_metadata("encoder").await["parameters"]["pools"][0]["resident"],
        false
    );

    assert_eq!(
        server.encoder(16).await.status(),
        StatusCode::OK,
        "the first request loads it"
    );
    let metrics = server.metrics().await;
    assert_eq!(sample(&metrics, &resident), 1.0);
    assert_eq!(sample(&metrics, &on_demand), 1.0);
    assert_eq!(
        sample(&metrics, &series("cold_start_seconds_count", "encoder", "")),
        1.0
    );
    assert_eq!(
        server.model_metadata("encoder").await["parameters"]["pools"][0]["resident"],
        true
    );

    let (status, body) = admin(&server, "encoder", "unload").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["pools"][0]["result"], "unloaded", "{body}");
    let metrics = server.metrics().await;
    assert_eq!(sample(&metrics, &resident), 0.0);
    assert_eq!(
        sample(
            &metrics,
            &series("model_unloads_total", "encoder", ",reason=\"requested\"")
        ),
        1.0
    );
    assert_eq!(classify(&server).await, StatusCode::OK, "the other model keeps serving");
    assert_eq!(
        admin(&server, "encoder", "unload").await.1["pools"][0]["result"],
        "already"
    );

    assert_eq!(
        server.encoder(16).await.status(),
        StatusCode::OK,
        "a request loads it again"
    );
    let metrics = server.metrics().await;
    assert_eq!(sample(&metrics, &on_demand), 2.0);
    assert_eq!(sample(&metrics, &resident), 1.0);
    assert_eq!(
        admin(&server, "encoder", "load").await.1["pools"][0]["result"],
        "already"
    );

    let (status, body) = admin(&server, "classifier", "unload").await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(body["error"].as_str().unwrap().contains("pinned"), "{body}");
    assert_eq!(admin(&server, "nope", "unload").await.0, StatusCode::NOT_FOUND);
    assert_eq!(classify(&server).await, StatusCode::OK);
    server.stop().await;
}

#[tokio::test]
async fn an_admin_load_builds_the_sessions_before_it_answers() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let (status, body) = admin(&server, "encoder", "load").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["pools"][0]["result"], "loaded", "{body}");
    let metrics = server.metrics().await;
    assert_eq!(sample(&metrics, &series("model_resident", "encoder", "")), 1.0);
    assert_eq!(
        sample(
            &metrics,
            &series("model_loads_total", "encoder", ",reason=\"requested\"")
        ),
        1.0
    );
    // One session per worker.
    assert_eq!(
        sample(&metrics, &series("model_load_duration_seconds_count", "encoder", "")),
        2.0
    );
    assert_eq!(server.encoder(16).await.status(), StatusCode::OK);
    let metrics = server.metrics().await;
    assert_eq!(
        sample(&metrics, &series("cold_start_seconds_count", "encoder", "")),
        0.0,
        "no cold start"
    );
    server.stop().await;
}

#[tokio::test]
async fn an_unload_waits_for_the_models_running_request() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(&CONFIG.replace("residency: on_demand", "residency: resident")).await;
    let running = crate::common::spawn_binary_encoder(&server, 4096);
    let until = Instant::now() + Duration::from_secs(10);
    while sample(&server.metrics().await, "vramguard_inflight_requests{pool=\"cpu\"}") < 1.0 {
        assert!(Instant::now() < until, "the request never started");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let (status, answer) = admin(&server, "encoder", "unload").await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["pools"][0]["result"], "unloaded", "{answer}");
    assert_eq!(
        sample(&server.metrics().await, "vramguard_inflight_requests{pool=\"cpu\"}"),
        0.0,
        "the unload answered only once the run was over"
    );
    assert_eq!(
        running.await.unwrap(),
        StatusCode::OK,
        "the running request was not interrupted"
    );
    assert_eq!(classify(&server).await, StatusCode::OK);
    server.stop().await;
}

#[tokio::test]
async fn a_model_without_requests_for_its_idle_unload_is_unloaded_and_loads_again_on_demand() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let config = CONFIG
        .replace("residency: on_demand", "idle_unload: 1s")
        .replace("residency: pinned", "idle_unload: 1s");
    let server = TestServer::start(&config).await;
    let idle = |model| series("model_unloads_total", model, ",reason=\"idle\"");
    let metrics = server.metrics().await;
    assert_eq!(
        sample(&metrics, &idle("encoder")),
        0.0,
        "at 0 from the first scrape:\n{metrics}"
    );
    assert!(metrics.contains(&format!("{} 0", idle("classifier"))), "{metrics}");
    let served = Instant::now();
    assert_eq!(server.encoder(16).await.status(), StatusCode::OK);

    // The classifier keeps getting requests; the encoder gets none (scrapes and the pool's
    // health checks are no requests).
    let until = served + Duration::from_secs(10);
    let metrics = loop {
        assert_eq!(classify(&server).await, StatusCode::OK);
        let metrics = server.metrics().await;
        if sample(&metrics, &idle("encoder")) >= 1.0 {
            break metrics;
        }
        assert!(Instant::now() < until, "the encoder was never unloaded:\n{metrics}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        served.elapsed() >= Duration::from_secs(1),
        "unloaded before its idle time"
    );
    assert_eq!(sample(&metrics, &idle("encoder")), 1.0);
    assert_eq!(sample(&metrics, &series("model_resident", "encoder", "")), 0.0);
    assert_eq!(
        sample(&metrics, &idle("classifier")),
        0.0,
        "requests keep it:\n{metrics}"
    );
    assert_eq!(sample(&metrics, &series("model_resident", "classifier", "")), 1.0);

    assert_eq!(
        server.encoder(16).await.status(),
        StatusCode::OK,
        "its next request loads it"
    );
    let metrics = server.metrics().await;
    assert_eq!(
        sample(
            &metrics,
            &series("model_loads_total", "encoder", ",reason=\"on_demand\"")
        ),
        1.0
    );
    assert_eq!(sample(&metrics, &series("model_resident", "encoder", "")), 1.0);
    server.stop().await;
}
