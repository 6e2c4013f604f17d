//! An embedder is a model like any other: loaded on demand, unloaded and loaded again, counted
//! per model, and, in a background service, giving way while its device is under the policy's
//! reserve. The bundled embedder (`builtin:embedder`) over `POST /v1/embeddings`, with real
//! ONNX Runtime sessions; every answer is held to the vector the same input gave at rest.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::common::{TestServer, sample};
use vramguard::testing::{ADMIT_ALL, Scratch};

const SENTENCE: &str = "The GPU is shared by chat, embeddings and speech";

/// `POST /v1/embeddings` of [`SENTENCE`] to `model`: the status and the vector.
async fn embed(url: String, model: &str) -> (StatusCode, Option<Vec<f64>>) {
    let response = reqwest::Client::new()
        .post(url)
        .json(&json!({"model": model, "input": SENTENCE}))
        .send()
        .await
        .unwrap();
    let status = response.status();
    let body: Value = response.json().await.unwrap();
    let vector = body["data"][0]["embedding"]
        .as_array()
        .map(|v| v.iter().map(|x| x.as_f64().unwrap()).collect());
    (status, vector)
}

fn same(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6)
}

fn series(name: &str, rest: &str) -> String {
    format!("vramguard_{name}{{model=\"embed\",pool=\"cpu\"{rest}}}")
}

#[tokio::test]
async fn an_on_demand_embedder_loads_on_its_first_request_and_again_after_an_unload() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(
        "models: [{name: embed, path: 'builtin:embedder', tokenizer: 'builtin:embedder', residency: on_demand}]\n\
         pools: [{name: cpu, provider: cpu, models: [embed]}]\n",
    )
    .await;
    let (resident, loads) = (
        series("model_resident", ""),
        series("model_loads_total", ",reason=\"on_demand\""),
    );
    assert_eq!(sample(&server.metrics().await, &resident), 0.0, "not loaded at start");

    let (status, first) = embed(server.url("/v1/embeddings"), "embed").await;
    assert_eq!(status, StatusCode::OK, "the first request loads it");
    let metrics = server.metrics().await;
    assert_eq!((sample(&metrics, &resident), sample(&metrics, &loads)), (1.0, 1.0));

    let unload = server.post_json("/admin/models/embed/unload", &json!({})).await;
    assert_eq!(unload.status(), StatusCode::OK);
    assert_eq!(sample(&server.metrics().await, &resident), 0.0);
    let (status, again) = embed(server.url("/v1/embeddings"), "embed").await;
    assert_eq!(status, StatusCode::OK, "a request loads it again");
    assert!(
        same(&first.unwrap(), &again.unwrap()),
        "the reloaded model gives the same vector"
    );
    let metrics = server.metrics().await;
    assert_eq!((sample(&metrics, &resident), sample(&metrics, &loads)), (1.0, 2.0));
    assert_eq!(
        sample(&metrics, &series("requests_total", ",outcome=\"ok\"")),
        2.0,
        "{metrics}"
    );
    server.stop().await;
}

#[tokio::test]
async fn an_embedder_of_a_background_service_waits_while_its_device_is_under_the_reserve() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let scratch = Scratch::new();
    let policy = scratch.write("policy.rhai", ADMIT_ALL);
    let yaml = format!(
        "devices: [{{name: gpu0, kind: simulated, capacity: 128MiB}}]\n\
         services: [{{name: ingest, class: background}}]\n\
         models: [{{name: embed, path: 'builtin:embedder', tokenizer: 'builtin:embedder', service: ingest}}]\n\
         pools: [{{name: gpu, provider: simulated, device: gpu0, models: [embed], queue: {{capacity: 8, max_wait: 20s}}}}]\n\
         policy: {{path: '{}', watch_interval: 0s, params: {{reserve_bytes: 64MiB}}}}\n",
        policy.display()
    );
    let server = TestServer::start(&yaml).await;
    let url = server.url("/v1/embeddings");
    let (status, at_rest) = embed(url.clone(), "embed").await;
    assert_eq!(status, StatusCode::OK);

    // 100 MiB held by someone else: the device's headroom drops under the 64 MiB reserve.
    let set = server
        .post_json("/admin/sim/gpu0", &json!({"pressure": "100MiB"}))
        .await;
    assert_eq!(set.status(), StatusCode::OK);
    let waiting = tokio::spawn(embed(url, "embed"));
    crate::common::until_waiting(&server, 1.0, "the background embedding").await;
    assert!(!waiting.is_finished(), "the device is still under its reserve");

    let released = server.post_json("/admin/sim/gpu0", &json!({"pressure": "0"})).await;
    assert_eq!(released.status(), StatusCode::OK);
    let (status, vector) = waiting.await.unwrap();
    assert_eq!(status, StatusCode::OK, "served once the headroom is back");
    assert!(same(&at_rest.unwrap(), &vector.unwrap()));
    server.stop().await;
}
