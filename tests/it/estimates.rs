//! Memory estimates against what ONNX Runtime really takes, on models generated here
//! (`estimate_models.py`, into a scratch folder; nothing generated is committed): a
//! convolutional image model whose working memory grows with batch·height·width, and a model
//! whose `[batch, n, m]` scores grow with two axes at once. The server measures each model's
//! profile at start-up; these tests measure fresh runs at sizes it never measured and check the
//! estimate, and that an estimate over the device's memory is sent to the CPU pool before it runs.
//!
//! The measured and estimated figures are printed; `ran_in_own_process` keeps a child's output,
//! so to read them run the tests in this process:
//! `VRAMGUARD_IT_OWN_PROCESS=1 cargo test --test it estimates -- --nocapture --test-threads=1`.

use std::path::{Path, PathBuf};

use crate::common::{TestServer, sample, sum_samples};
use reqwest::StatusCode;
use serde_json::{Value, json};
use vramguard::core::tensor::{Tensor, TensorData};
use vramguard::runtime::estimate::{MemoryProfile, ProfileSource};
use vramguard::runtime::onnx::{SessionOptions, arena, build_session, run, runtime};
use vramguard::testing::Scratch;

/// How far an estimate of a run's working memory may be from the measured peak, either way.
const FACTOR: f64 = 1.5;

/// The generated models, in a scratch folder removed on drop.
struct Models {
    dir: Scratch,
}

impl Models {
    /// Run the generator into a new scratch folder. Fails (never skips) without its packages.
    fn generate() -> Models {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let deps = root.join(".deps/modelgen");
        assert!(
            deps.join(".installed").exists(),
            "the model generator's packages (onnx, numpy) are missing from {}: run `make .deps/modelgen/.installed`",
            deps.display()
        );
        let dir = Scratch::new();
        let out = std::process::Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
            .arg(root.join("tests/it/estimate_models.py"))
            .arg(dir.path())
            .env("PYTHONPATH", &deps)
            .output()
            .expect("python3 runs");
        let (code, stdout, stderr) = crate::common::outcome(out);
        assert_eq!(code, Some(0), "estimate_models.py failed:\n{stdout}\n{stderr}");
        Models { dir }
    }

    fn path(&self, model: &str) -> PathBuf {
        self.dir.path().join(format!("{model}.onnx"))
    }

    /// The `models:` entries of a config for the models named.
    fn config(&self, names: &[&str]) -> String {
        let entries: Vec<String> = names
            .iter()
            .map(|n| format!("  - {{name: {n}, path: '{}'}}\n", self.path(n).display()))
            .collect();
        format!("models:\n{}", entries.concat())
    }
}

/// The profile `server` measured for `model`.
async fn profile(server: &TestServer, model: &str) -> MemoryProfile {
    let metadata: Value = server.model_metadata(model).await;
    let profile = &metadata["parameters"]["memory_profile"];
    assert_eq!(profile["source"], "measured", "{model}: {metadata}");
    serde_json::from_value(profile.clone()).unwrap_or_else(|e| panic!("{model}'s profile: {e}: {profile}"))
}

/// An FP32 tensor of `shape` with small values that are not all zero.
fn tensor(name: &str, shape: &[i64]) -> Tensor {
    let len = shape.iter().product::<i64>() as usize;
    let data = (0..len).map(|i| (i % 13) as f32 * 0.05 - 0.3).collect();
    Tensor {
        name: name.into(),
        shape: shape.to_vec(),
        data: TensorData::Fp32(data),
    }
}

/// The peak working memory of one run of `model` on `inputs` in a fresh CPU session with its own
/// arena, measured as the server measures it: the arena's peak after the run less what it held
/// once the session was built.
fn measured_working_bytes(model: &Path, inputs: Vec<Tensor>) -> u64 {
    let rt = runtime(None).expect("ONNX Runtime loads");
    let options = SessionOptions::quiet_cpu();
    let bytes = std::fs::read(model).unwrap();
    let mut session = build_session(rt, &bytes[..], &options).expect("session builds");
    let info = ort::memory::MemoryInfo::new(
        ort::memory::AllocationDevice::CPU,
        0,
        ort::memory::AllocatorType::Arena,
        ort::memory::MemoryType::Default,
    )
    .unwrap();
    let allocator = ort::memory::Allocator::new(&session, info).unwrap();
    let built = arena::allocator_stats(&allocator).unwrap();
    run(&mut session, inputs, &[], None).expect("the run succeeds");
    let ran = arena::allocator_stats(&allocator).unwrap();
    assert!(
        ran.peak_active_bytes > built.peak_active_bytes,
        "the run raised the arena's peak above the session's build: {built:?} {ran:?}"
    );
    ran.peak_active_bytes - built.active_bytes
}

/// Check `profile`'s estimate for `inputs` against a measured run of `model` at that size,
/// which must be none of the sizes the profile was measured at.
/// `Err` says how far off it is.
fn check_estimate(name: &str, model: &Path, profile: &MemoryProfile, inputs: Vec<Tensor>) -> Result<(), String> {
    let dims = profile.dims_of(&inputs);
    let described = profile.describe(&dims);
    let ProfileSource::Measured { points, .. } = &profile.source else {
        panic!("{name}: not measured: {profile:?}");
    };
    assert!(
        points.iter().all(|(at, _)| at.as_slice() != dims.as_slice()),
        "{name} at {described} was measured at start-up: {points:?}"
    );
    let estimate = profile.estimate(&dims);
    let estimated = (estimate.context_bytes + estimate.workspace_bytes) as f64;
    let measured = measured_working_bytes(model, inputs) as f64;
    let ratio = estimated / measured;
    eprintln!(
        "{name} {described}: estimated {estimated:.0} B, measured {measured:.0} B, estimate/measured {ratio:.3} \
         ({}; {} points)",
        profile.formula(),
        points.len()
    );
    if (1.0 / FACTOR..=FACTOR).contains(&ratio) {
        return Ok(());
    }
    Err(format!(
        "{name} at {described}: the estimate of {estimated:.0} B working memory is {ratio:.3}× the \
         {measured:.0} B measured (within {FACTOR}× wanted); profile {}, measured at {points:?}",
        profile.formula()
    ))
}

#[tokio::test]
async fn estimates_hold_at_sizes_the_start_up_measuring_never_ran() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let models = Models::generate();
    let config = format!(
        "{}pools: [{{name: cpu, provider: cpu, models: [conv, scores]}}]\n",
        models.config(&["conv", "scores"])
    );
    let server = TestServer::start(&config).await;
    let conv = profile(&server, "conv").await;
    let scores = profile(&server, "scores").await;
    server.stop().await;

    let names: Vec<&str> = conv.axes.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, ["batch", "height", "width"], "{conv:?}");
    // Every size is checked before any failure is reported, so one run shows them all.
    let mut off = Vec::new();
    for shape in [[1, 3, 512, 384], [2, 3, 300, 200], [3, 3, 96, 640]] {
        off.extend(check_estimate("conv", &models.path("conv"), &conv, vec![tensor("image", &shape)]).err());
    }
    let names: Vec<&str> = scores.axes.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, ["batch", "n", "m"], "{scores:?}");
    for (batch, n, m) in [(1, 700, 300), (2, 250, 900), (4, 1000, 40), (1, 2000, 1500)] {
        let inputs = vec![tensor("x", &[batch, n, 32]), tensor("y", &[batch, m, 32])];
        off.extend(check_estimate("scores", &models.path("scores"), &scores, inputs).err());
    }
    assert!(off.is_empty(), "{}", off.join("\n"));
}

/// The simulated accelerator's capacity.
const DEVICE_BYTES: u64 = 64 << 20;

/// A binary-extension request of one image, its output asked for as binary data too (a large
/// image's output as JSON text would be many times its size).
async fn infer_image(server: &TestServer, shape: [i64; 4]) -> reqwest::Response {
    let image = tensor("image", &shape);
    let TensorData::Fp32(data) = &image.data else {
        unreachable!()
    };
    let header = json!({
        "inputs": [{"name": "image", "shape": shape, "datatype": "FP32",
                    "parameters": {"binary_data_size": data.len() * 4}}],
        "outputs": [{"name": "output", "parameters": {"binary_data": true}}]
    })
    .to_string();
    let mut body = header.clone().into_bytes();
    body.extend(data.iter().flat_map(|v| v.to_le_bytes()));
    reqwest::Client::new()
        .post(server.url("/v2/models/conv/infer"))
        .header("Inference-Header-Content-Length", header.len())
        .body(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn an_image_estimated_over_the_devices_memory_is_sent_to_the_cpu_before_it_runs() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let models = Models::generate();
    let config = format!(
        "server: {{body_limit: 64MiB}}
devices: [{{name: gpu0, kind: simulated, capacity: 64MiB}}]
{}pools:
  - {{name: gpu, provider: simulated, device: gpu0, models: [conv], fallback: cpu}}
  - {{name: cpu, provider: cpu, models: [conv]}}
host: {{reserve: 64MiB}}
policy:
  path: builtin:default
  fallback: {{action: admit}}
  params: {{cpu_pool: cpu, reserve_bytes: 32MiB, min_context_tokens: 16, defer_ms: 25, defer_max_queue: 4}}
",
        models.config(&["conv"])
    );
    let server = TestServer::start(&config).await;
    let profile = profile(&server, "conv").await;
    let working = |side: i64| {
        let e = profile.estimate(&profile.dims_of(&[tensor("image", &[1, 3, side, side])]));
        e.context_bytes + e.workspace_bytes
    };
    // The smallest square image estimated at more than twice the device, and well within the host.
    let side = [256, 384, 512, 768, 1024, 1536, 2048]
        .into_iter()
        .find(|&s| working(s) > 2 * DEVICE_BYTES)
        .unwrap_or_else(|| panic!("no image up to 2048² is estimated over the device: {profile:?}"));
    let needed = working(side);
    assert!(needed < 1 << 30, "{side}²: {needed} B");
    eprintln!("conv 1×3×{side}×{side}: estimated {needed} B of working memory");

    let big = infer_image(&server, [1, 3, side, side]).await;
    assert_eq!(big.status(), StatusCode::OK, "{side}²");
    let headers = big.headers().clone();
    assert_eq!(headers["x-vramguard-pool"], "cpu", "{headers:?}");
    assert_eq!(headers["x-vramguard-decision"], "redirect", "{headers:?}");
    // The policy's redirect, before any run: a retry after a failed run on the device says
    // `oom_retry` in its answer (and counts an allocator failure, checked below).
    let json_len: usize = headers["inference-header-content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let body = big.bytes().await.unwrap();
    let head: Value = serde_json::from_slice(&body[..json_len]).unwrap();
    assert_ne!(head["parameters"]["reason"], "oom_retry", "{head}");
    assert!(head["parameters"].get("retry_started_ms").is_none(), "{head}");

    let small = infer_image(&server, [1, 3, 32, 32]).await;
    assert_eq!(small.status(), StatusCode::OK);
    assert_eq!(small.headers()["x-vramguard-pool"], "gpu", "{:?}", small.headers());
    assert_eq!(small.headers()["x-vramguard-decision"], "admit");
    let _ = small.bytes().await.unwrap();

    let metrics = server.metrics().await;
    let failures = sum_samples(&metrics, |l| {
        l.starts_with("vramguard_allocator_failures_total{pool=\"gpu\"")
    });
    assert_eq!(failures, 0.0, "{metrics}");
    assert_eq!(
        sample(
            &metrics,
            "vramguard_policy_decisions_total{action=\"redirect\",pool=\"cpu\"}"
        ),
        1.0,
        "{metrics}"
    );
    server.stop().await;
}

/// The bundled encoder's attention, measured by ONNX Runtime at start-up, is recovered exactly:
/// `1024·batch·seq + 16·batch·seq²` bytes (four heads of `seq × seq` FP32 scores, per item),
/// with the batch as its own axis, not folded into the context.
#[tokio::test]
async fn the_bundled_encoders_attention_is_measured_exactly_over_batch_and_sequence() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let config = "models: [{name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1, keep: end}}]\n\
                  pools: [{name: cpu, provider: cpu, models: [encoder]}]\n";
    let server = TestServer::start(config).await;
    let encoder = profile(&server, "encoder").await;
    server.stop().await;
    let axes: Vec<(&str, String)> = encoder
        .axes
        .iter()
        .map(|a| (a.name.as_str(), format!("{:?}", a.role)))
        .collect();
    assert_eq!(
        axes,
        [("batch", "Batch".to_string()), ("seq", "Context".to_string())],
        "{encoder:?}"
    );
    let term = |powers: &[u8]| {
        encoder
            .terms
            .iter()
            .find(|t| t.powers == powers)
            .map(|t| t.bytes)
            .unwrap_or_else(|| panic!("no {powers:?} term: {}", encoder.formula()))
    };
    assert!((term(&[1, 2]) - 16.0).abs() < 0.01, "{}", encoder.formula());
    assert!((term(&[1, 1]) - 1024.0).abs() < 1.0, "{}", encoder.formula());
    assert_eq!(encoder.terms.len(), 2, "{}", encoder.formula());
}
