//! The defects found by probing the server as an attacker on loopback would (issue 10), one
//! test each, over real HTTP and real ONNX Runtime: user input never gets a 5xx, every refusal
//! names the tensor or header and the reason, and nothing a client sends chooses the size of
//! the answer.

use crate::common::{SIMULATED_CONFIG, TestServer};
use reqwest::StatusCode;
use serde_json::{Value, json};

async fn error_of(response: reqwest::Response) -> (StatusCode, String) {
    let status = response.status();
    let body: Value = response.json().await.unwrap();
    (status, body["error"].as_str().unwrap_or_default().to_string())
}

fn outcome(metrics: &str, outcome: &str) -> f64 {
    crate::common::requests_with(metrics, |o| o == outcome)
}

#[tokio::test]
async fn a_zero_element_tensor_claiming_a_huge_axis_is_a_400_naming_the_tensor() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(SIMULATED_CONFIG).await;
    for shape in [json!([0, 1u64 << 62, 64]), json!([1u64 << 62, 0, 64])] {
        let body = json!({"inputs": [{"name": "input", "shape": shape, "datatype": "FP32", "data": []}]});
        let (status, error) = error_of(server.post_json("/v2/models/encoder/infer", &body).await).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{shape}: {error}");
        assert!(error.starts_with("input `input`: dimension"), "{error}");
        assert!(error.contains("4611686018427387904"), "{error}");
    }
    let metrics = server.metrics().await;
    assert_eq!(outcome(&metrics, "failed"), 0.0, "{metrics}");
    assert_eq!(outcome(&metrics, "client_error"), 2.0, "{metrics}");
    // A zero-element tensor of a sane shape is served (an empty batch is not an error).
    let empty = json!({"inputs": [{"name": "input", "shape": [0, 16, 64], "datatype": "FP32", "data": []}]});
    assert_eq!(
        server.post_json("/v2/models/encoder/infer", &empty).await.status(),
        StatusCode::OK
    );
    server.stop().await;
}

#[tokio::test]
async fn numbers_outside_the_type_and_non_finite_outputs_are_400s_not_silent_changes() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(SIMULATED_CONFIG).await;
    // 1e39 does not fit FP32: refused, not turned into infinity.
    let mut data = vec![json!(0.5); 64];
    data[3] = json!(1e39);
    let body = json!({"inputs": [{"name": "input", "shape": [1, 1, 64], "datatype": "FP32", "data": data}]});
    let (status, error) = error_of(server.post_json("/v2/models/encoder/infer", &body).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        error,
        "input `input`: value 1e39 is not a valid FP32 element (element 3)"
    );

    // A NaN input (binary data can carry one) gives NaN outputs: JSON cannot carry them, so the
    // client is told which output and how to get it; asked as binary, it gets the exact bits.
    let send = |binary_output: bool| {
        let header = json!({
            "inputs": [{"name": "input", "shape": [1, 1, 64], "datatype": "FP32",
                        "parameters": {"binary_data_size": 256}}],
            "parameters": {"binary_data_output": binary_output}
        })
        .to_string();
        let mut body = header.clone().into_bytes();
        for _ in 0..64 {
            body.extend_from_slice(&f32::NAN.to_le_bytes());
        }
        reqwest::Client::new()
            .post(server.url("/v2/models/encoder/infer"))
            .header("Inference-Header-Content-Length", header.len())
            .body(body)
            .send()
    };
    let response = send(false).await.unwrap();
    let (status, error) = error_of(response).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error.starts_with("output `hidden` has a non-finite value (NaN at element 0)"),
        "{error}"
    );
    assert!(error.contains("binary_data"), "{error}");
    let binary = send(true).await.unwrap();
    assert_eq!(binary.status(), StatusCode::OK);
    server.stop().await;
}

#[tokio::test]
async fn a_repeated_header_length_is_refused_rather_than_the_first_used() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(SIMULATED_CONFIG).await;
    let (header, body) = crate::common::encoder_binary_request(16);
    let response = reqwest::Client::new()
        .post(server.url("/v2/models/encoder/infer"))
        .header("Inference-Header-Content-Length", header.len())
        .header("Inference-Header-Content-Length", header.len() + 1)
        .body(body)
        .send()
        .await
        .unwrap();
    let (status, error) = error_of(response).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        error,
        "inference-header-content-length is given more than once; send it once"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_wrong_method_gets_a_json_405() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(SIMULATED_CONFIG).await;
    let response = reqwest::Client::new()
        .delete(server.url("/v2/models/encoder/infer"))
        .send()
        .await
        .unwrap();
    let (status, error) = error_of(response).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(error, "method DELETE is not allowed on this endpoint");
    server.stop().await;
}

#[tokio::test]
async fn openmetrics_refused_with_q_0_gets_the_text_format() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(SIMULATED_CONFIG).await;
    let response = reqwest::Client::new()
        .get(server.url("/metrics"))
        .header("accept", "application/openmetrics-text;q=0, text/plain;version=0.0.4")
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.headers()["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_deadline_of_zero_does_not_blame_a_deferral_that_never_happened() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(SIMULATED_CONFIG).await;
    let response = server
        .encoder_with_headers(16, &[("x-vramguard-deadline-ms", "0")])
        .await;
    let (status, error) = error_of(response).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(
        error,
        "the deadline (x-vramguard-deadline-ms) had passed before the request could be admitted"
    );
    server.stop().await;
}

#[tokio::test]
async fn an_unknown_model_name_is_echoed_clipped() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(SIMULATED_CONFIG).await;
    let name = "m".repeat(5000);
    let response = server
        .post_json(&format!("/v2/models/{name}/infer"), &json!({"inputs": []}))
        .await;
    let (status, error) = error_of(response).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(error.len() < 300, "{} bytes: {error}", error.len());
    assert!(error.contains("… (5000 bytes)"), "{error}");
    server.stop().await;
}

#[tokio::test]
async fn admin_checks_the_token_before_reading_the_body_and_reads_the_scheme_in_any_case() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(SIMULATED_CONFIG).await;
    let client = reqwest::Client::new();
    let lower = client
        .get(server.url("/admin"))
        .header("authorization", format!("bearer {}", crate::common::ADMIN_TOKEN))
        .send()
        .await
        .unwrap();
    assert_eq!(lower.status(), StatusCode::OK);
    let body: Value = lower.json().await.unwrap();
    assert_eq!(body["auth"], "bearer");
    let wrong = client
        .get(server.url("/admin"))
        .header("authorization", "Bearer not-the-token")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(wrong.headers()["www-authenticate"], "Bearer");

    // A client announcing 60 MiB and sending none of it is answered at once.
    let addr = server.addr;
    let head = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        stream
            .write_all(
                b"POST /admin/sim/gpu0 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n\
                  Content-Length: 62914560\r\n\r\n",
            )
            .unwrap();
        let mut answer = vec![0u8; 1024];
        let n = stream.read(&mut answer).expect("answered without waiting for the body");
        String::from_utf8_lossy(&answer[..n]).into_owned()
    })
    .await
    .unwrap();
    assert!(head.starts_with("HTTP/1.1 401"), "{head}");
    server.stop().await;
}

#[tokio::test]
async fn an_answer_over_max_response_bytes_is_refused_with_the_way_out() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let config = format!("server: {{max_response_bytes: 64KiB}}\n{SIMULATED_CONFIG}");
    let server = TestServer::start(&config).await;
    // 1×256×64 FP32 `hidden` is 64 KiB binary, ~200 KB as JSON.
    let body = json!({"inputs": [{"name": "input", "shape": [1, 256, 64], "datatype": "FP32",
                                  "data": vec![0.25; 256 * 64]}]});
    let (status, error) = error_of(server.post_json("/v2/models/encoder/infer", &body).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error.contains("more than server.max_response_bytes (64 KiB)"),
        "{error}"
    );
    // Asking only for the small output fits.
    let pooled = json!({"inputs": body["inputs"], "outputs": [{"name": "pooled"}]});
    assert_eq!(
        server.post_json("/v2/models/encoder/infer", &pooled).await.status(),
        StatusCode::OK
    );
    // The answer that could not be made is counted with the error its client got, on the pool
    // that ran it; the other as served.
    let metrics = server.metrics().await;
    let counted = |outcome: &str| -> Vec<&str> {
        let outcome = format!("outcome=\"{outcome}\"}}");
        metrics
            .lines()
            .filter(|l| l.starts_with("vramguard_requests_total{model=\"encoder\",") && l.contains(&outcome))
            .filter(|l| !l.ends_with(" 0"))
            .collect()
    };
    let refused = counted("client_error");
    assert!(
        refused.len() == 1 && refused[0].ends_with(" 1") && !refused[0].contains("pool=\"\""),
        "{refused:?}"
    );
    let served = counted("ok");
    assert!(served.len() == 1 && served[0].ends_with(" 1"), "{served:?}");
    server.stop().await;
}
