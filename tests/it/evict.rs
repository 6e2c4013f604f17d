//! Several models on one simulated accelerator that cannot hold them all: `make_room` unloads a
//! lower-priority idle model so a higher-priority request runs on the accelerator instead of
//! the CPU, never a pinned model, never one loaded within its `min_residency`, and what is
//! unloaded and loaded shows in `/metrics` and `/status`. Real ONNX Runtime sessions on
//! generated models (`runtime::onnx::dense`) whose weights (16 MiB each) decide what fits: the
//! device holds two.

use std::path::PathBuf;

use reqwest::StatusCode;
use serde_json::{Value, json};
use vramguard::runtime::onnx::dense::Dense as DenseModel;
use vramguard::testing::Scratch;

use crate::common::{TestServer, sample};

/// The generated models `a`, `b` and `c`, in a scratch folder removed on drop.
struct Dense {
    dir: Scratch,
}

impl Dense {
    /// Write them with the drill's dense-model writer (`evict_models.py`'s model, which
    /// `tests/it/drill.rs` checks it against): 16 MiB weights, fixed seeds.
    fn generate() -> Dense {
        let dir = Scratch::new();
        for (seed, name) in (41..).zip(["a", "b", "c"]) {
            dir.write(&format!("{name}.onnx"), DenseModel::of_mib(seed, 16).to_onnx());
        }
        Dense { dir }
    }

    fn path(&self, model: &str) -> PathBuf {
        self.dir.path().join(format!("{model}.onnx"))
    }

    /// A 40 MiB device: `a` and `b` (16 MiB each) and the pinned classifier fit, `c` does not
    /// beside them. `b` has the lowest priority; `c` loads on demand. `extra` goes on every
    /// model of the three.
    fn config(&self, extra: &str) -> String {
        let model = |name: &str, rest: &str| {
            format!(
                "  - {{name: {name}, path: '{}', {rest}{extra}}}\n",
                self.path(name).display()
            )
        };
        format!(
            "devices: [{{name: sim0, kind: simulated, capacity: 40MiB}}]
models:
{}{}{}  - {{name: pin, path: 'builtin:classifier', residency: pinned}}
pools:
  - {{name: gpu, provider: simulated, device: sim0, models: [a, b, c, pin], workers: 1, fallback: cpu}}
  - {{name: cpu, provider: cpu, models: [a, b, c, pin], workers: 1}}
policy: {{params: {{reserve_bytes: 2MiB}}}}
",
            model("a", "priority: 5"),
            model("b", "priority: 1"),
            model("c", "priority: 5, residency: on_demand"),
        )
    }
}

async fn infer(server: &TestServer, model: &str) -> (StatusCode, String, String) {
    let body = json!({"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": vec![0.5f32; 64]}]});
    let response = server.post_json(&format!("/v2/models/{model}/infer"), &body).await;
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    let (pool, decision) = (header("x-vramguard-pool"), header("x-vramguard-decision"));
    (response.status(), pool, decision)
}

fn series(name: &str, model: &str, rest: &str) -> String {
    format!("vramguard_{name}{{model=\"{model}\",pool=\"gpu\"{rest}}}")
}

async fn status(server: &TestServer) -> Value {
    reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap()
}

/// `/status` says whether `model` is resident on `pool`.
fn resident_in(status: &Value, model: &str, pool: &str) -> bool {
    status["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == model)
        .and_then(|m| m["pools"].as_array().unwrap().iter().find(|p| p["pool"] == pool))
        .map(|p| p["resident"].as_bool().unwrap())
        .unwrap()
}

#[tokio::test]
async fn a_lower_priority_idle_model_is_evicted_so_a_higher_priority_request_runs_on_the_accelerator() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let models = Dense::generate();
    let server = TestServer::start(&models.config(", min_residency: 0s")).await;
    let before = status(&server).await;
    assert!(resident_in(&before, "a", "gpu") && resident_in(&before, "b", "gpu"));
    assert!(!resident_in(&before, "c", "gpu"), "on demand");

    // `c` does not fit beside `a` and `b`: `b`, of lower priority and idle, makes room.
    assert_eq!(
        infer(&server, "c").await,
        (StatusCode::OK, "gpu".into(), "make_room".into())
    );
    let metrics = server.metrics().await;
    assert_eq!(
        sample(&metrics, &series("model_unloads_total", "b", ",reason=\"evicted\"")),
        1.0
    );
    assert_eq!(
        sample(&metrics, &series("model_unloads_total", "a", ",reason=\"evicted\"")),
        0.0
    );
    assert_eq!(sample(&metrics, &series("model_resident", "b", "")), 0.0);
    assert_eq!(sample(&metrics, &series("model_resident", "c", "")), 1.0);
    assert_eq!(
        sample(&metrics, &series("model_loads_total", "c", ",reason=\"on_demand\"")),
        1.0
    );
    assert_eq!(
        sample(
            &metrics,
            "vramguard_policy_decisions_total{action=\"make_room\",pool=\"gpu\"}"
        ),
        1.0
    );
    let after = status(&server).await;
    let eviction = &after["evictions"][0];
    assert_eq!(
        (&eviction["model"], &eviction["pool"], &eviction["for_model"]),
        (&json!("b"), &json!("gpu"), &json!("c")),
        "{after}"
    );
    assert!(eviction["freed_bytes"].as_u64().unwrap() >= 16 << 20);
    assert_eq!(after["evictions"].as_array().unwrap().len(), 1);
    assert!(resident_in(&after, "pin", "gpu"), "the pinned model stays");
    let device = &after["devices"]["sim0"];
    assert!(
        device["used_bytes"].as_u64() <= device["total_bytes"].as_u64(),
        "never over the capacity: {device}"
    );

    // `b` may not evict models of higher priority for itself: it is served on the CPU, whole.
    assert_eq!(
        infer(&server, "b").await,
        (StatusCode::OK, "cpu".into(), "redirect".into())
    );
    // The resident ones keep running on the accelerator.
    assert_eq!(
        infer(&server, "a").await,
        (StatusCode::OK, "gpu".into(), "admit".into())
    );
    assert_eq!(
        infer(&server, "c").await,
        (StatusCode::OK, "gpu".into(), "admit".into())
    );
    let metrics = server.metrics().await;
    let evicted: f64 = ["a", "b", "c", "pin"]
        .iter()
        .map(|m| sample(&metrics, &series("model_unloads_total", m, ",reason=\"evicted\"")))
        .sum();
    assert_eq!(evicted, 1.0, "nothing else was evicted:\n{metrics}");
    assert_eq!(sample(&metrics, &series("model_resident", "pin", "")), 1.0);
    let end = status(&server).await;
    for model in ["a", "b", "c", "pin"] {
        assert_eq!(
            resident_in(&end, model, "gpu"),
            sample(&metrics, &series("model_resident", model, "")) == 1.0,
            "/status and /metrics agree on {model}"
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn a_model_loaded_within_its_min_residency_is_never_a_victim() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let models = Dense::generate();
    // The default min_residency (30 s) protects `a` and `b`, loaded at start.
    let server = TestServer::start(&models.config("")).await;
    assert_eq!(
        infer(&server, "c").await,
        (StatusCode::OK, "cpu".into(), "redirect".into())
    );
    let metrics = server.metrics().await;
    assert_eq!(
        sample(&metrics, &series("model_unloads_total", "b", ",reason=\"evicted\"")),
        0.0
    );
    assert_eq!(sample(&metrics, &series("model_resident", "b", "")), 1.0);
    assert_eq!(status(&server).await["evictions"], json!([]));
    server.stop().await;
}
