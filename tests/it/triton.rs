//! Triton's extensions over real sockets (CPU pools, real ONNX Runtime sessions): the model
//! repository's index and its load and unload (the admin API's, under its authorization),
//! model configuration and statistics.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::common::{ADMIN_TOKEN, TestServer, reference_cases, request_from_case};

const CONFIG: &str = "
models:
  - {name: classifier, path: 'builtin:classifier', residency: pinned}
  - {name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}, residency: on_demand}
pools:
  - {name: cpu, provider: cpu, models: [classifier, encoder], workers: 2}
";

/// POST `body` to `path` with `token` as the bearer token (none: no `Authorization`).
async fn post(server: &TestServer, path: &str, token: Option<&str>, body: &Value) -> (StatusCode, Value) {
    let mut request = reqwest::Client::new().post(server.url(path)).json(body);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.unwrap();
    (response.status(), response.json().await.unwrap())
}

async fn get(server: &TestServer, path: &str) -> (StatusCode, Value) {
    let response = reqwest::get(server.url(path)).await.unwrap();
    (response.status(), response.json().await.unwrap())
}

/// The index's entries as `(name, state)`.
fn states(index: &Value) -> Vec<(&str, &str)> {
    index
        .as_array()
        .expect("the index is an array")
        .iter()
        .map(|m| (m["name"].as_str().unwrap(), m["state"].as_str().unwrap()))
        .collect()
}

#[tokio::test]
async fn repository_load_and_unload_over_tcp_need_the_admin_token() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let load = "/v2/repository/models/encoder/load";
    let (status, body) = post(&server, load, None, &json!({})).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    let (status, body) = post(&server, load, Some("not-the-token"), &json!({})).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    assert_eq!(body["error"], "admin endpoints need `Authorization: Bearer <token>`");
    let (status, index) = post(&server, "/v2/repository/index", None, &json!({})).await;
    assert_eq!(status, StatusCode::OK, "the index is no admin endpoint: {index}");
    assert_eq!(
        states(&index),
        [("classifier", "READY"), ("encoder", "READY")],
        "an on-demand model not loaded yet is served: {index}"
    );
    assert!(
        index[1]["reason"]
            .as_str()
            .unwrap()
            .contains("its next request loads it"),
        "{index}"
    );

    let (status, body) = post(&server, load, Some(ADMIN_TOKEN), &json!({})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["pools"][0]["result"], "loaded", "{body}");
    let (_, index) = post(&server, "/v2/repository/index", None, &json!({})).await;
    assert_eq!(index[1]["reason"], "", "loaded now: {index}");

    // Triton's client sends `unload_dependents` on every unload; vramguard has no ensembles.
    let unload = json!({"parameters": {"unload_dependents": false}});
    let (status, body) = post(
        &server,
        "/v2/repository/models/encoder/unload",
        Some(ADMIN_TOKEN),
        &unload,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["pools"][0]["result"], "unloaded", "{body}");
    let (status, body) = post(
        &server,
        "/v2/repository/models/classifier/unload",
        Some(ADMIN_TOKEN),
        &unload,
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "a pinned model stays: {body}");
    let (status, body) = post(
        &server,
        "/v2/repository/models/nope/load",
        Some(ADMIN_TOKEN),
        &json!({}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");

    // An override Triton would apply is refused by name rather than ignored.
    let config = json!({"parameters": {"config": "{\"max_batch_size\": 8}"}});
    let (status, body) = post(&server, load, Some(ADMIN_TOKEN), &config).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .starts_with("unsupported parameters `config`"),
        "{body}"
    );
    server.stop().await;
}

#[tokio::test]
async fn without_a_token_repository_load_over_tcp_is_refused_as_admin_is() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let config = format!("server: {{admin_socket: 'off'}}\n{CONFIG}");
    let server = TestServer::without_admin_token(&config).await;
    let (status, triton) = post(&server, "/v2/repository/models/encoder/load", None, &json!({})).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{triton}");
    let (status, admin) = post(&server, "/admin/models/encoder/load", None, &json!({})).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{admin}");
    assert_eq!(triton, admin);
    assert!(
        triton["error"]
            .as_str()
            .unwrap()
            .starts_with("admin over TCP needs a token"),
        "{triton}"
    );
    let (status, _) = post(
        &server,
        "/v2/repository/models/encoder/unload",
        Some(ADMIN_TOKEN),
        &json!({}),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "no token is configured: none is right");
    server.stop().await;
}

#[tokio::test]
async fn repository_load_and_unload_are_served_on_the_owner_only_admin_socket() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let config = vramguard::testing::config::validated(CONFIG);
    let service = tokio::task::spawn_blocking(move || vramguard::serve::service::Service::start(config))
        .await
        .unwrap()
        .expect("service starts");
    let service = std::sync::Arc::new(service);
    // No token: TCP admin is refused, the socket is the way in.
    let state = vramguard::http::AppState::with_admin_token(std::sync::Arc::clone(&service), None);
    let scratch = vramguard::testing::Scratch::new();
    let path = scratch.path().join("run/admin.sock");
    let listener = vramguard::http::admin::bind(&path).unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let serving = tokio::spawn(vramguard::http::admin::serve_socket(
        state,
        listener,
        path.clone(),
        stop.clone(),
    ));
    let ask = |what: &'static str| {
        let path = path.clone();
        async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut stream = tokio::net::UnixStream::connect(&path).await.unwrap();
            let request = format!(
                "POST /v2/repository/models/encoder/{what} HTTP/1.1\r\nHost: localhost\r\n\
                 Content-Length: 0\r\nConnection: close\r\n\r\n"
            );
            stream.write_all(request.as_bytes()).await.unwrap();
            let mut answer = String::new();
            stream.read_to_string(&mut answer).await.unwrap();
            answer
        }
    };
    let loaded = ask("load").await;
    assert!(loaded.starts_with("HTTP/1.1 200"), "{loaded}");
    assert!(loaded.contains(r#""result":"loaded""#), "{loaded}");
    let unloaded = ask("unload").await;
    assert!(unloaded.starts_with("HTTP/1.1 200"), "{unloaded}");
    assert!(unloaded.contains(r#""result":"unloaded""#), "{unloaded}");
    stop.cancel();
    serving.await.unwrap().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    tokio::task::spawn_blocking(move || service.shutdown(deadline))
        .await
        .unwrap();
}

#[tokio::test]
async fn the_index_names_a_model_no_ready_pool_serves_and_ready_leaves_it_out() {
    if crate::common::ran_in_own_process() {
        return;
    }
    // No NVIDIA driver here (and CI has none): the cuda pool is unavailable.
    if vramguard::device::nvidia_gpu_present() {
        return;
    }
    let server = TestServer::start(
        "
devices: [{name: gpu0, kind: nvidia, index: 0}]
models:
  - {name: classifier, path: 'builtin:classifier'}
  - {name: big, path: 'builtin:classifier'}
pools:
  - {name: cpu, provider: cpu, models: [classifier]}
  - {name: gpu, provider: cuda, device: gpu0, models: [big]}
",
    )
    .await;
    let index = |body: Value| {
        let server = &server;
        async move { post(server, "/v2/repository/index", None, &body).await }
    };
    let (status, all) = index(json!({})).await;
    assert_eq!(status, StatusCode::OK, "{all}");
    assert_eq!(states(&all), [("classifier", "READY"), ("big", "UNAVAILABLE")]);
    assert_eq!(all[1]["reason"], "no ready pool serves `big`");
    assert_eq!(all[1]["version"], "1");
    let (_, ready) = index(json!({"ready": true})).await;
    assert_eq!(states(&ready), [("classifier", "READY")]);
    let (_, not_only_ready) = index(json!({"ready": false})).await;
    assert_eq!(not_only_ready, all);
    let (status, body) = index(json!({"ready": "yes"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    server.stop().await;
}

#[tokio::test]
async fn config_and_statistics_show_the_signature_and_the_answers() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let (status, config) = get(&server, "/v2/models/classifier/versions/1/config").await;
    assert_eq!(status, StatusCode::OK, "{config}");
    assert_eq!(config["platform"], "onnxruntime_onnx");
    assert_eq!(config["max_batch_size"], 0);
    assert_eq!(config["input"][0]["name"], "features");
    assert_eq!(config["input"][0]["data_type"], "TYPE_FP32");
    assert_eq!(config["input"][0]["dims"], json!([-1, 16]));
    assert_eq!(
        config["instance_group"],
        json!([{"name": "cpu", "kind": "KIND_CPU", "count": 2}])
    );
    assert_eq!(config["parameters"]["pool.cpu.simulated"]["string_value"], "false");

    let case = request_from_case(&reference_cases("classifier")[0]);
    for _ in 0..3 {
        let (status, body) = post(&server, "/v2/models/classifier/infer", None, &case).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let bad = json!({"inputs": [{"name": "features", "shape": [1, 8], "datatype": "FP32", "data": vec![0.0; 8]}]});
    let (status, _) = post(&server, "/v2/models/classifier/infer", None, &bad).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let (status, stats) = get(&server, "/v2/models/classifier/stats").await;
    assert_eq!(status, StatusCode::OK, "{stats}");
    let classifier = &stats["model_stats"][0];
    assert_eq!(classifier["name"], "classifier");
    assert_eq!(classifier["inference_count"], 3);
    assert_eq!(classifier["execution_count"], 3);
    assert_eq!(classifier["inference_stats"]["success"]["count"], 3);
    assert!(classifier["inference_stats"]["success"]["ns"].as_u64().unwrap() > 0);
    assert_eq!(classifier["inference_stats"]["fail"]["count"], 1);
    assert_eq!(
        classifier["inference_stats"]["queue"]["count"], 0,
        "not measured per model"
    );
    assert!(classifier["last_inference"].as_u64().unwrap() > 1_700_000_000_000);
    let (_, all) = get(&server, "/v2/models/stats").await;
    assert_eq!(all["model_stats"][1]["name"], "encoder");
    assert_eq!(all["model_stats"][1]["inference_count"], 0);
    assert_eq!(all["model_stats"][1]["last_inference"], 0);
    for path in [
        "/v2/models/nope/stats",
        "/v2/models/nope/config",
        "/v2/models/classifier/versions/2/stats",
        "/v2/models/classifier/versions/2/config",
        "/v2/models/classifier/versions/2/ready",
        "/v2/models/classifier/versions/2",
    ] {
        assert_eq!(get(&server, path).await.0, StatusCode::NOT_FOUND, "{path}");
    }
    // Version 1, the only one, is the model itself on every model route.
    for (path, plain) in [
        ("/v2/models/classifier/versions/1/stats", "/v2/models/classifier/stats"),
        (
            "/v2/models/classifier/versions/1/config",
            "/v2/models/classifier/config",
        ),
    ] {
        let ((status, versioned), (_, unversioned)) = (get(&server, path).await, get(&server, plain).await);
        assert_eq!(status, StatusCode::OK, "{path}");
        assert_eq!(versioned, unversioned, "{path}");
    }
    let (_, metadata) = get(&server, "/v2").await;
    for extension in ["model_repository", "model_configuration", "statistics"] {
        assert!(
            metadata["extensions"].as_array().unwrap().contains(&json!(extension)),
            "{metadata}"
        );
    }
    server.stop().await;
}
