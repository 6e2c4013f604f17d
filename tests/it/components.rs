//! A model as its components, and identical weights loaded once, as operators see them:
//! `/status` lists a Whisper's encoder and decoder with their weights (which add up to the
//! model's, as `vramguard_model_component_weights_bytes` does on `/metrics`); one decoder file
//! served under two names (other services, other priorities) is loaded once per pool, shown
//! once in `/status` and `/metrics`, held once on the simulated device, and each name keeps its
//! own request counters; the session stays while either name is loaded.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::common::{TestServer, sample};

async fn status(server: &TestServer) -> Value {
    reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap()
}

/// `/status`'s entry of `model`.
fn model<'a>(status: &'a Value, name: &str) -> &'a Value {
    status["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == name)
        .unwrap_or_else(|| panic!("no model `{name}` in {status}"))
}

/// `model`'s entry on `pool` in `/status`.
fn on_pool<'a>(status: &'a Value, name: &str, pool: &str) -> &'a Value {
    model(status, name)["pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pool"] == pool)
        .unwrap()
}

#[tokio::test]
async fn status_lists_a_whisper_as_its_encoder_and_decoder_with_their_weights() {
    let server = TestServer::start(
        "models: [{name: tiny-whisper, path: models/speech/whisper/encoder_model.onnx}]\n\
         pools: [{name: cpu, provider: cpu, models: [tiny-whisper], workers: 2}]\n",
    )
    .await;
    let status = status(&server).await;
    let whisper = model(&status, "tiny-whisper");
    let folder = concat!(env!("CARGO_MANIFEST_DIR"), "/models/speech/whisper/");
    let decoder = std::fs::metadata(format!("{folder}decoder_model_merged.onnx"))
        .unwrap()
        .len();
    let components = whisper["components"].as_array().unwrap();
    let names: Vec<&str> = components.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["encoder", "decoder"], "{whisper}");
    let encoder_file = components[0]["files"][0].as_str().unwrap();
    assert!(
        encoder_file.ends_with("models/speech/whisper/encoder_model.onnx"),
        "{whisper}"
    );
    assert_eq!(components[1]["files"], json!(["decoder_model_merged.onnx"]));
    assert_eq!(components[1]["weights_bytes"], decoder, "{whisper}");
    let encoder = components[0]["weights_bytes"].as_u64().unwrap();
    assert!(encoder > 0, "{whisper}");
    for component in components {
        assert_eq!(component["resident"], json!(["cpu"]), "{component}");
    }
    // The pool holds both, in each of its two workers' sessions.
    let weights = on_pool(&status, "tiny-whisper", "cpu")["weights_bytes"]
        .as_u64()
        .unwrap();
    assert_eq!(weights, 2 * (encoder + decoder), "{whisper}");
    let metrics = server.metrics().await;
    let series = |component: &str| {
        format!(
            "vramguard_model_component_weights_bytes{{model=\"tiny-whisper\",pool=\"cpu\",component=\"{component}\"}}"
        )
    };
    assert_eq!(sample(&metrics, &series("encoder")), (2 * encoder) as f64);
    assert_eq!(sample(&metrics, &series("decoder")), (2 * decoder) as f64);
    assert_eq!(
        sample(
            &metrics,
            "vramguard_model_memory_bytes{model=\"tiny-whisper\",pool=\"cpu\",kind=\"weights\"}"
        ),
        weights as f64,
        "the model's weights series is unchanged: its components' sum"
    );
}

/// One decoder file under two names, other services and priorities, on a CPU pool and on a
/// pool of the simulated accelerator in this process.
const SHARED: &str = "
devices: [{name: gpu0, kind: simulated, capacity: 256MiB}]
services: [{name: chat}, {name: batch}]
models:
- {name: chat, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json, service: chat, priority: 5}
- {name: batch, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json, service: batch, priority: 1}
pools:
- {name: gpu, provider: simulated, device: gpu0, isolation: thread, models: [chat, batch], workers: 1}
- {name: cpu, provider: cpu, models: [chat, batch], workers: 1}
";

async fn complete(server: &TestServer, model: &str) -> StatusCode {
    let body = json!({"model": model, "prompt": "the cat", "max_tokens": 3, "temperature": 0});
    server.post_json("/v1/completions", &body).await.status()
}

async fn device_used(server: &TestServer) -> f64 {
    let metrics = server.metrics().await;
    sample(
        &metrics,
        "vramguard_device_memory_used_bytes{device=\"gpu0\",kind=\"simulated\"}",
    )
}

async fn admin(server: &TestServer, model: &str, what: &str) {
    let response = server
        .post_json(&format!("/admin/models/{model}/{what}"), &json!({}))
        .await;
    assert_eq!(response.status(), StatusCode::OK, "{what} {model}");
}

#[tokio::test]
async fn one_decoder_under_two_names_is_loaded_once_per_pool_and_counted_per_name() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(SHARED).await;
    let metrics = server.metrics().await;
    let status = status(&server).await;
    let weights = std::fs::metadata("models/decoder/model.onnx").unwrap().len() as f64;
    for pool in ["gpu", "cpu"] {
        let of = |name: &str, labels: &str| format!("{name}{{model=\"{{}}\",pool=\"{pool}\"{labels}}}");
        let at = |template: String, model: &str| sample(&metrics, &template.replace("{}", model));
        let start = of("vramguard_model_loads_total", ",reason=\"start\"");
        assert_eq!((at(start.clone(), "chat"), at(start, "batch")), (1.0, 0.0), "{pool}");
        let resident = of("vramguard_model_resident", "");
        assert_eq!(
            (at(resident.clone(), "chat"), at(resident, "batch")),
            (1.0, 1.0),
            "{pool}"
        );
        let held = of("vramguard_model_memory_bytes", ",kind=\"weights\"");
        assert!(at(held.clone(), "chat") >= weights, "{pool}: {metrics}");
        assert_eq!(at(held, "batch"), 0.0, "{pool}: shown once, under `chat`");
        let (chat, batch) = (on_pool(&status, "chat", pool), on_pool(&status, "batch", pool));
        assert!(chat["weights_bytes"].as_u64().unwrap() as f64 >= weights, "{chat}");
        assert!(chat["shares_weights_of"].is_null(), "{chat}");
        assert_eq!(
            (&batch["weights_bytes"], &batch["shares_weights_of"], &batch["resident"]),
            (&json!(0), &json!("chat"), &json!(true)),
            "{batch}"
        );
    }
    // The services' budgets count the weights once: to `chat`'s service, the first name.
    let held = (memory_of(&status, "chat"), memory_of(&status, "batch"));
    assert_eq!(
        held,
        (Some(weights_of(&status, "chat")), Some(0.0)),
        "{}",
        status["services"]
    );

    // Each name answers, and is counted, as itself.
    for name in ["chat", "batch", "batch"] {
        assert_eq!(complete(&server, name).await, StatusCode::OK, "{name}");
    }
    let metrics = server.metrics().await;
    let answered = |model: &str| {
        crate::common::sum_samples(&metrics, |l| {
            l.starts_with(&format!("vramguard_requests_total{{model=\"{model}\",")) && l.contains("outcome=\"ok\"")
        })
    };
    assert_eq!((answered("chat"), answered("batch")), (1.0, 2.0), "{metrics}");

    // The device holds one copy: the session stays while either name is loaded, goes with the
    // last, and comes back once for both.
    let both = device_used(&server).await;
    admin(&server, "chat", "unload").await;
    let batch_alone = device_used(&server).await;
    assert!((both - batch_alone).abs() < weights / 2.0, "{both} then {batch_alone}");
    assert_eq!(
        complete(&server, "batch").await,
        StatusCode::OK,
        "`batch` runs on it alone"
    );
    admin(&server, "batch", "unload").await;
    let none = device_used(&server).await;
    assert!(batch_alone - none >= weights / 2.0, "{batch_alone} then {none}");
    admin(&server, "batch", "load").await;
    let one = device_used(&server).await;
    // `batch` alone holds them: its service is charged.
    let status = self::status(&server).await;
    let held = (memory_of(&status, "chat"), memory_of(&status, "batch"));
    assert_eq!(
        held,
        (Some(0.0), Some(weights_of(&status, "chat"))),
        "{}",
        status["services"]
    );
    admin(&server, "chat", "load").await;
    let two = device_used(&server).await;
    assert!(one - none >= weights / 2.0, "{none} then {one}");
    assert!((two - one).abs() < weights / 2.0, "one copy for both: {one} then {two}");
    let metrics = server.metrics().await;
    let requested = |model: &str| {
        sample(
            &metrics,
            &format!("vramguard_model_loads_total{{model=\"{model}\",pool=\"gpu\",reason=\"requested\"}}"),
        )
    };
    assert_eq!((requested("batch"), requested("chat")), (1.0, 0.0), "{metrics}");
    assert_eq!(complete(&server, "chat").await, StatusCode::OK);
}

/// The weights `/status` shows for `model` on the gpu pool.
fn weights_of(status: &Value, name: &str) -> f64 {
    on_pool(status, name, "gpu")["weights_bytes"].as_f64().unwrap()
}

/// What `/status` says `service` holds on the simulated device.
fn memory_of(status: &Value, service: &str) -> Option<f64> {
    status["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == service)?["memory"]["gpu0"]
        .as_f64()
}
