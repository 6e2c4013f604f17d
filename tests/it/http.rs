//! The HTTP API over real sockets against real ONNX Runtime sessions (CPU pools).

use crate::common::{TestServer, assert_close, floats, reference_cases, request_from_case};
use reqwest::StatusCode;
use serde_json::{Value, json};

const CONFIG: &str = "
server:
  body_limit: 64KiB
models:
  - {name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}}
  - {name: classifier, path: 'builtin:classifier'}
  - {name: dtypes, path: tests/fixtures/dtypes.onnx}
pools:
  - {name: cpu, provider: cpu, models: [encoder, classifier, dtypes], workers: 2}
";

async fn error_of(response: reqwest::Response) -> (StatusCode, String) {
    let status = response.status();
    let body: Value = response.json().await.unwrap();
    (status, body["error"].as_str().expect("error body").to_string())
}

#[tokio::test]
async fn bundled_models_match_the_committed_reference_outputs() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    for model in ["encoder", "classifier"] {
        for case in reference_cases(model) {
            let response = server
                .post_json(&format!("/v2/models/{model}/infer"), &request_from_case(&case))
                .await;
            assert_eq!(response.status(), StatusCode::OK, "{model} {}", case["name"]);
            let body: Value = response.json().await.unwrap();
            for out in body["outputs"].as_array().unwrap() {
                let name = out["name"].as_str().unwrap();
                let want = &case["outputs"][name];
                assert_eq!(out["shape"], want["shape"], "{model} {name} shape");
                assert_eq!(out["datatype"], "FP32");
                assert_close(
                    &floats(&out["data"]),
                    &floats(&want["data"]),
                    1e-4,
                    &format!("{model}/{name}"),
                );
            }
        }
    }
    server.stop().await;
}

#[tokio::test]
async fn binary_tensor_extension_round_trips_like_tritons_client() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let case = &reference_cases("classifier")[1];
    let data: Vec<f32> = floats(&case["inputs"]["features"]["data"])
        .iter()
        .map(|v| *v as f32)
        .collect();
    let header = json!({
        "inputs": [{"name": "features", "shape": case["inputs"]["features"]["shape"], "datatype": "FP32",
                    "parameters": {"binary_data_size": data.len() * 4}}],
        "outputs": [{"name": "probabilities", "parameters": {"binary_data": true}}, {"name": "logits"}]
    })
    .to_string();
    let mut body = header.clone().into_bytes();
    data.iter().for_each(|v| body.extend_from_slice(&v.to_le_bytes()));
    let response = reqwest::Client::new()
        .post(server.url("/v2/models/classifier/infer"))
        .header("Inference-Header-Content-Length", header.len())
        .header("content-type", "application/octet-stream")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let json_len: usize = response.headers()["inference-header-content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let bytes = response.bytes().await.unwrap();
    let head: Value = serde_json::from_slice(&bytes[..json_len]).unwrap();
    // Outputs come back in the order asked for; only the binary one carries binary_data_size.
    assert_eq!(head["outputs"][0]["name"], "probabilities");
    assert_eq!(head["outputs"][0]["parameters"]["binary_data_size"], 12 * 4);
    assert_eq!(head["outputs"][1]["name"], "logits");
    assert_close(
        &floats(&head["outputs"][1]["data"]),
        &floats(&case["outputs"]["logits"]["data"]),
        1e-4,
        "logits",
    );
    let probabilities: Vec<f64> = bytes[json_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
        .collect();
    assert_close(
        &probabilities,
        &floats(&case["outputs"]["probabilities"]["data"]),
        1e-5,
        "probabilities",
    );
    server.stop().await;
}

#[tokio::test]
async fn every_supported_datatype_round_trips_in_json_and_binary() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let values = json!({
        "FP32": [1.5, -2.25], "FP64": [1e300, -0.5], "FP16": [0.5, -3.0], "INT8": [-128, 127],
        "INT16": [-32768, 300], "INT32": [2147483647, -7], "INT64": [9007199254740993i64, -1],
        "UINT8": [0, 255], "BOOL": [true, false]
    });
    let inputs: Vec<Value> = values
        .as_object()
        .unwrap()
        .iter()
        .map(|(dt, data)| json!({"name": format!("in_{}", dt.to_lowercase()), "shape": [2], "datatype": dt, "data": data}))
        .collect();
    let response = server
        .post_json("/v2/models/dtypes/infer", &json!({ "inputs": inputs }))
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let body: Value = response.json().await.unwrap();
    for out in body["outputs"].as_array().unwrap() {
        let dt = out["datatype"].as_str().unwrap();
        assert_eq!(out["name"], format!("out_{}", dt.to_lowercase()));
        assert_eq!(out["data"], values[dt], "{dt}");
    }

    // The same through binary: every output requested as bytes.
    let response = server
        .post_json(
            "/v2/models/dtypes/infer",
            &json!({ "inputs": inputs, "parameters": {"binary_data_output": true} }),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let json_len: usize = response.headers()["inference-header-content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let bytes = response.bytes().await.unwrap();
    let head: Value = serde_json::from_slice(&bytes[..json_len]).unwrap();
    let mut offset = json_len;
    for out in head["outputs"].as_array().unwrap() {
        let size = out["parameters"]["binary_data_size"].as_u64().unwrap() as usize;
        let chunk = &bytes[offset..offset + size];
        offset += size;
        if out["datatype"] == "INT64" {
            assert_eq!(i64::from_le_bytes(chunk[..8].try_into().unwrap()), 9007199254740993);
        }
        if out["datatype"] == "BOOL" {
            assert_eq!(chunk, [1, 0]);
        }
    }
    assert_eq!(offset, bytes.len());
    server.stop().await;
}

#[tokio::test]
async fn bad_requests_get_the_documented_status_and_message() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let features = |shape: Value, datatype: &str, data: Value| json!({"inputs": [{"name": "features", "shape": shape, "datatype": datatype, "data": data}]});
    let sixteen: Vec<f32> = vec![0.5; 16];
    let cases: Vec<(Value, StatusCode, &str)> = vec![
        (
            features(json!([1, 16]), "INT32", json!(sixteen)),
            StatusCode::BAD_REQUEST,
            "input `features`: datatype is INT32 but the model expects FP32",
        ),
        (
            features(json!([1, 8]), "FP32", json!(vec![0.5; 8])),
            StatusCode::BAD_REQUEST,
            "input `features`: dimension 1 is 8 but the model requires 16",
        ),
        (
            features(json!([16]), "FP32", json!(sixteen)),
            StatusCode::BAD_REQUEST,
            "input `features`: shape [16] has rank 1 but the model expects rank 2",
        ),
        (
            features(json!([1, 16]), "FP32", json!(vec![0.5; 15])),
            StatusCode::BAD_REQUEST,
            "input `features`: shape [1, 16] needs 16 elements but 15 were given",
        ),
        (
            features(json!([1, 16]), "FP32", json!("abc")),
            StatusCode::BAD_REQUEST,
            "input `features`: invalid type: string",
        ),
        (
            json!({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}),
            StatusCode::BAD_REQUEST,
            "unknown input `x`; the model's inputs are: features",
        ),
        (
            json!({"inputs": []}),
            StatusCode::BAD_REQUEST,
            "missing input(s): features",
        ),
        (
            json!({"outputs": []}),
            StatusCode::BAD_REQUEST,
            "malformed request JSON: missing field `inputs`",
        ),
    ];
    for (body, status, message) in cases {
        let (got_status, got) = error_of(server.post_json("/v2/models/classifier/infer", &body).await).await;
        assert_eq!(got_status, status, "{body}");
        assert!(got.starts_with(message), "got `{got}`, want `{message}`");
    }
    let mut with_outputs = features(json!([1, 16]), "FP32", json!(sixteen));
    with_outputs["outputs"] = json!([{"name": "nope"}]);
    let (status, message) = error_of(server.post_json("/v2/models/classifier/infer", &with_outputs).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(message.starts_with("unknown output `nope`"), "{message}");

    let raw = reqwest::Client::new()
        .post(server.url("/v2/models/classifier/infer"))
        .body("{not json")
        .send()
        .await
        .unwrap();
    let (status, message) = error_of(raw).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(message.starts_with("malformed request JSON"), "{message}");

    let (status, message) = error_of(server.post_json("/v2/models/gpt/infer", &json!({})).await).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(message, "unknown model `gpt`; models: encoder, classifier, dtypes");
    let (status, _) = error_of(
        server
            .post_json("/v2/models/classifier/versions/7/infer", &json!({}))
            .await,
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // 64 KiB limit: an encoder request of 1×256×64 floats is far larger as JSON.
    let big = json!({"inputs": [{"name": "input", "shape": [1, 256, 64], "datatype": "FP32", "data": vec![0.123456; 256 * 64]}]});
    let (status, message) = error_of(server.post_json("/v2/models/encoder/infer", &big).await).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(message.contains("65536 byte limit"), "{message}");

    let (status, message) = error_of(
        reqwest::Client::new()
            .post(server.url("/v2/models/classifier/infer"))
            .header("x-vramguard-deadline-ms", "soon")
            .json(&features(json!([1, 16]), "FP32", json!(sixteen)))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(message.contains("x-vramguard-deadline-ms"), "{message}");

    let metrics = server.metrics().await;
    assert!(
        metrics.contains("vramguard_requests_total{model=\"classifier\",pool=\"\",outcome=\"client_error\"}"),
        "{metrics}"
    );
    server.stop().await;
}

#[tokio::test]
async fn request_identity_and_metadata_follow_the_protocol() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(CONFIG).await;
    let case = &reference_cases("classifier")[0];
    let mut body = request_from_case(case);
    body["id"] = json!("client-42");
    body["outputs"] = json!([{"name": "probabilities"}]);
    let response = reqwest::Client::new()
        .post(server.url("/v2/models/classifier/infer"))
        .header("x-request-id", "trace-abc")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-request-id"], "trace-abc");
    assert_eq!(response.headers()["x-vramguard-pool"], "cpu");
    assert_eq!(response.headers()["x-vramguard-decision"], "admit");
    let out: Value = response.json().await.unwrap();
    assert_eq!(out["id"], "client-42");
    assert_eq!(out["model_name"], "classifier");
    assert_eq!(out["parameters"]["pool"], "cpu");
    assert_eq!(out["parameters"]["request_id"], "trace-abc");
    assert_eq!(out["outputs"].as_array().unwrap().len(), 1);
    assert_eq!(out["outputs"][0]["name"], "probabilities");

    // Without x-request-id one is generated and returned.
    let response = server
        .post_json("/v2/models/classifier/infer", &request_from_case(case))
        .await;
    assert_eq!(response.headers()["x-request-id"].len(), 36);

    let meta: Value = server.model_metadata("encoder").await;
    assert_eq!(
        meta["inputs"],
        json!([{"name": "input", "datatype": "FP32", "shape": [-1, -1, 64]}])
    );
    assert_eq!(
        meta["outputs"][1],
        json!({"name": "pooled", "datatype": "FP32", "shape": [-1, 64]})
    );
    assert_eq!(
        meta["parameters"]["context"],
        json!({"input": "input", "axis": 1, "keep": "end"})
    );
    let versioned: Value = reqwest::get(server.url("/v2/models/encoder/versions/1"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(versioned, meta);

    let v2: Value = reqwest::get(server.url("/v2")).await.unwrap().json().await.unwrap();
    assert_eq!(v2["onnxruntime"], "1.31.1");
    assert_eq!(
        v2["extensions"],
        json!([
            "binary_tensor_data",
            "model_repository",
            "model_configuration",
            "statistics"
        ])
    );
    for path in ["/v2/health/live", "/v2/health/ready", "/v2/models/classifier/ready"] {
        assert_eq!(
            reqwest::get(server.url(path)).await.unwrap().status(),
            StatusCode::OK,
            "{path}"
        );
    }
    assert_eq!(
        reqwest::get(server.url("/v2/models/nope/ready"))
            .await
            .unwrap()
            .status(),
        StatusCode::NOT_FOUND
    );

    let metrics = server.metrics().await;
    assert!(
        metrics.contains(&format!(
            "vramguard_build_info{{version=\"{}\",onnxruntime=\"1.31.1\"}} 1",
            env!("CARGO_PKG_VERSION")
        )),
        "{metrics}"
    );
    assert!(
        metrics.contains("vramguard_requests_total{model=\"classifier\",pool=\"cpu\",outcome=\"ok\"} 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("vramguard_request_duration_seconds_count{model=\"classifier\",pool=\"cpu\"} 2"),
        "{metrics}"
    );
    server.stop().await;
}

#[tokio::test]
async fn an_unavailable_cuda_pool_is_reported_and_never_runs_on_the_cpu() {
    if crate::common::ran_in_own_process() {
        return;
    }
    // No NVIDIA driver here (and CI has none): the cuda pool must be unavailable with a reason.
    if vramguard::device::nvidia_gpu_present() {
        return;
    }
    let server = TestServer::start(
        "
devices: [{name: gpu0, kind: nvidia, index: 0}]
models: [{name: classifier, path: 'builtin:classifier'}]
pools: [{name: gpu, provider: cuda, device: gpu0, models: [classifier]}]
",
    )
    .await;
    let status: Value = reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap();
    assert_eq!(status["pools"][0]["state"], "unavailable");
    assert!(
        status["pools"][0]["reason"].as_str().unwrap().contains("NVML"),
        "{status}"
    );
    assert_eq!(
        reqwest::get(server.url("/v2/health/ready")).await.unwrap().status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    let response = server
        .post_json(
            "/v2/models/classifier/infer",
            &request_from_case(&reference_cases("classifier")[0]),
        )
        .await;
    assert_eq!(response.headers()["retry-after"], "5");
    let (status, message) = error_of(response).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        message.starts_with("no pool can take `classifier` (gpu: NVML unavailable"),
        "{message}"
    );
    server.stop().await;
}

#[tokio::test]
async fn arena_shrinkage_returns_memory_after_each_run_and_shows_in_metrics() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(
        "
models: [{name: encoder, path: 'builtin:encoder'}]
pools:
  - {name: lean, provider: cpu, models: [encoder], memory: {arena_shrinkage: true}}
",
    )
    .await;
    let seq = 512;
    let request = json!({"inputs": [{"name": "input", "shape": [1, seq, 64], "datatype": "FP32", "data": vec![0.01; seq * 64]}],
                         "outputs": [{"name": "pooled"}]});
    let response = server.post_json("/v2/models/encoder/infer", &request).await;
    assert_eq!(response.headers()["x-vramguard-pool"], "lean");
    let status: Value = reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap();
    let lean = &status["pools"][0]["arena"];
    assert!(lean["shrinkages"].as_u64().unwrap() >= 1, "{lean}");
    // After shrinking, the arena keeps far less than the run's peak (4×512² FP32 scores = 4 MiB).
    assert!(
        lean["reserved_bytes"].as_u64().unwrap() < lean["peak_active_bytes"].as_u64().unwrap() / 2,
        "{lean}"
    );
    let metrics = server.metrics().await;
    assert!(
        metrics.contains("vramguard_allocator_arena_shrinkages_total{pool=\"lean\",device=\"host\"}"),
        "{metrics}"
    );
    server.stop().await;
}

#[tokio::test]
async fn allow_shrink_comes_from_the_header_then_the_parameter_then_the_model() {
    if crate::common::ran_in_own_process() {
        return;
    }
    // The policy answers with what it was given, so the 503's reason shows req.allow_shrink.
    let server = TestServer::with_policy(
        "
models:
  - {name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}, allow_shrink: true}
  - {name: classifier, path: 'builtin:classifier'}
pools:
  - {name: cpu, provider: cpu, models: [encoder, classifier]}
",
        "fn decide(req, state) { reject(`allow_shrink=${req.allow_shrink}`) }\n",
    )
    .await;
    let send = |model: &str, parameter: Option<Value>, header: Option<&str>| {
        let mut body = match model {
            "classifier" => {
                json!({"inputs": [{"name": "features", "shape": [1, 16], "datatype": "FP32", "data": vec![0.5; 16]}]})
            }
            _ => {
                json!({"inputs": [{"name": "input", "shape": [1, 2, 64], "datatype": "FP32", "data": vec![0.5; 128]}]})
            }
        };
        if let Some(allow) = parameter {
            body["parameters"] = json!({"allow_shrink": allow});
        }
        let mut request = reqwest::Client::new()
            .post(server.url(&format!("/v2/models/{model}/infer")))
            .json(&body);
        if let Some(value) = header {
            request = request.header("x-vramguard-allow-shrink", value);
        }
        async move { error_of(request.send().await.unwrap()).await }
    };
    // (model, parameters.allow_shrink, header, what the policy sees); only `encoder` allows it
    // by default.
    let cases = [
        ("classifier", None, None, false),
        ("classifier", Some(true), None, true),
        ("classifier", Some(true), Some("false"), false),
        ("classifier", None, Some("true"), true),
        ("encoder", None, None, true),
        ("encoder", Some(false), None, false),
        ("encoder", Some(false), Some("true"), true),
    ];
    for (model, parameter, header, want) in cases {
        let what = format!("{model}, parameter {parameter:?}, header {header:?}");
        let (status, message) = send(model, parameter.map(Value::Bool), header).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{what}: {message}");
        assert_eq!(message, format!("rejected by policy: allow_shrink={want}"), "{what}");
    }

    let (status, message) = send("classifier", None, Some("maybe")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(message, "x-vramguard-allow-shrink must be `true` or `false`");
    let (status, message) = send("classifier", Some(json!("yes")), None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(message, "parameter `allow_shrink` must be true or false, got \"yes\"");
    server.stop().await;
}

/// A 60 MiB encoder input on a CPU-only server: its 16·n² attention scores would be close to a
/// terabyte, more than the host could ever give it. It is refused at once as the client's
/// error, naming the host's ceiling and the longest input that fits, without `Retry-After`, and
/// nothing runs; a request of a size that fits is then served.
#[tokio::test]
async fn a_request_over_what_the_host_could_ever_hold_is_a_400_with_what_fits() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let config = CONFIG.replace("body_limit: 64KiB", "body_limit: 128MiB");
    let server = TestServer::start(&config).await;
    let seq = 60 << 20 >> 8; // 245,760 rows of 64 FP32 values: 60 MiB
    let (header, body) = crate::common::encoder_binary_request(seq);
    let response = reqwest::Client::new()
        .post(server.url("/v2/models/encoder/infer"))
        .header("inference-header-content-length", header.len())
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert!(!response.headers().contains_key("retry-after"));
    let error: Value = response.json().await.unwrap();
    let message = error["error"].as_str().unwrap();
    assert!(message.contains(&format!("for {seq} tokens")), "{message}");
    assert!(message.contains("pool `cpu`: host memory of"), "{message}");
    assert_eq!(error["reason"], "never_fits");
    // The size asked along each axis of the input, as the estimate read it.
    assert_eq!(error["dims"], json!({"batch": 1, "seq": seq}), "{error}");
    let max_tokens = error["max_tokens"].as_u64().unwrap();
    assert!((1..seq as u64).contains(&max_tokens), "{error}");
    let metrics = server.metrics().await;
    assert!(
        metrics.contains("vramguard_requests_total{model=\"encoder\",pool=\"\",outcome=\"client_error\"} 1\n"),
        "{metrics}"
    );
    // Refused before any pool: the one run on `cpu` is the request that fits.
    assert_eq!(server.encoder(32).await.status(), StatusCode::OK);
    let metrics = server.metrics().await;
    assert!(
        metrics.contains("vramguard_requests_total{model=\"encoder\",pool=\"cpu\",outcome=\"ok\"} 1\n"),
        "{metrics}"
    );
    server.stop().await;
}
