//! Models whose weights lie in external data files, as the ONNX Runtime GenAI builder and
//! Optimum write them (`tests/fixtures/external/`, made by its `make.py` from the bundled
//! encoder): the real binary, started in a folder of its own with its config in another, serves
//! them on a CPU pool and on a process-isolated simulated pool, at start and when a request
//! loads them, with the inline model's outputs,
//! counts their data in the weights' estimate, and refuses a model whose data file is missing,
//! naming it.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use vramguard::testing::Scratch;

use crate::common::{BIN, floats};

/// The committed fixture folder `name`.
fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/external")
        .join(name)
}

/// A copy of fixture folder `name` at `to`.
fn copy_fixture(name: &str, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for file in std::fs::read_dir(fixture(name)).unwrap() {
        let file = file.unwrap();
        std::fs::copy(file.path(), to.join(file.file_name())).unwrap();
    }
}

/// What the model in fixture folder `name` takes stored: its graph and its data files.
fn stored_bytes(name: &str) -> u64 {
    std::fs::read_dir(fixture(name))
        .unwrap()
        .map(|f| f.unwrap().metadata().unwrap().len())
        .sum()
}

/// One encoder request's outputs from `model`, and the pool that ran it.
async fn infer(addr: &str, model: &str) -> (Vec<(String, Vec<f64>)>, String) {
    let data: Vec<f64> = (0..5 * 64).map(|i| f64::from((i * 37) % 101) / 50.0 - 1.0).collect();
    let body = json!({"inputs": [{"name": "input", "shape": [1, 5, 64], "datatype": "FP32", "data": data}]});
    let response = reqwest::Client::new()
        .post(format!("http://{addr}/v2/models/{model}/infer"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success(), "{model}: {}", response.status());
    let answer: Value = response.json().await.unwrap();
    let mut outputs: Vec<(String, Vec<f64>)> = answer["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| (o["name"].as_str().unwrap().to_string(), floats(&o["data"])))
        .collect();
    outputs.sort_by(|a, b| a.0.cmp(&b.0));
    (
        outputs,
        answer["parameters"]["pool"].as_str().unwrap_or_default().to_string(),
    )
}

/// The largest difference between two models' outputs.
fn largest_difference(a: &[(String, Vec<f64>)], b: &[(String, Vec<f64>)]) -> f64 {
    assert_eq!(
        a.iter().map(|o| &o.0).collect::<Vec<_>>(),
        b.iter().map(|o| &o.0).collect::<Vec<_>>()
    );
    a.iter()
        .zip(b)
        .flat_map(|((_, x), (_, y))| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(x, y)| (x - y).abs())
        })
        .fold(0.0, f64::max)
}

#[tokio::test(flavor = "multi_thread")]
async fn external_data_models_load_from_their_folder_wherever_vramguard_runs() {
    let home = Scratch::new();
    let elsewhere = Scratch::new();
    copy_fixture("one", &home.path().join("models/one"));
    let several = fixture("several").join("model.onnx");
    let (fp16, int4) = (fixture("fp16").join("model.onnx"), fixture("int4").join("model.onnx"));
    // `one` by a path relative to the config's folder, the others by absolute paths; the server
    // runs in a third folder, where no data file lies. `several` is loaded by its first request
    // (in the worker process on `iso`), the others at start.
    let config = home.write(
        "conf/vramguard.yaml",
        format!(
            "server: {{listen: '127.0.0.1:0', admin_socket: 'off'}}\n\
             devices: [{{name: gpu0, kind: simulated, capacity: 128MiB}}]\n\
             models:\n\
             - {{name: inline, path: 'builtin:encoder'}}\n\
             - {{name: one, path: ../models/one/model.onnx}}\n\
             - {{name: several, path: '{several}', residency: on_demand}}\n\
             - {{name: fp16, path: '{fp16}'}}\n\
             - {{name: int4, path: '{int4}'}}\n\
             - {{name: inline_iso, path: 'builtin:encoder'}}\n\
             - {{name: one_iso, path: ../models/one/model.onnx}}\n\
             - {{name: several_iso, path: '{several}', residency: on_demand}}\n\
             pools:\n\
             - {{name: cpu, provider: cpu, models: [inline, one, several, fp16, int4]}}\n\
             - {{name: iso, provider: simulated, device: gpu0, isolation: process, models: [inline_iso, one_iso, several_iso]}}\n",
            several = several.display(),
            fp16 = fp16.display(),
            int4 = int4.display(),
        ),
    );
    let server = vramguard::testing::process::spawn_serving_in(
        elsewhere.path(),
        BIN,
        &["serve", "--config", config.to_str().unwrap()],
        &[],
        "vramguard serving",
    );

    let (inline, pool) = infer(&server.addr, "inline").await;
    assert_eq!(pool, "cpu");
    for model in ["one", "several"] {
        let (outputs, pool) = infer(&server.addr, model).await;
        assert_eq!(pool, "cpu");
        assert_eq!(largest_difference(&outputs, &inline), 0.0, "{model}");
    }
    // The same encoder, its weights rounded to FP16 or to 4 bits in blocks of 32.
    let (outputs, _) = infer(&server.addr, "fp16").await;
    let fp16_off = largest_difference(&outputs, &inline);
    assert!(fp16_off < 5e-3, "fp16 is {fp16_off} off");
    let (outputs, _) = infer(&server.addr, "int4").await;
    let int4_off = largest_difference(&outputs, &inline);
    assert!(int4_off < 0.5, "int4 is {int4_off} off");

    let (inline_iso, pool) = infer(&server.addr, "inline_iso").await;
    assert_eq!(pool, "iso");
    for model in ["one_iso", "several_iso"] {
        let (outputs, pool) = infer(&server.addr, model).await;
        assert_eq!(pool, "iso");
        assert_eq!(largest_difference(&outputs, &inline_iso), 0.0, "{model}");
    }

    // Each one's weights count its data files, not the few kilobytes of its graph alone.
    let status: Value = reqwest::get(format!("http://{}/status", server.addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let weights = |model: &str| {
        status["models"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == model)
            .unwrap()["pools"][0]["weights_bytes"]
            .as_u64()
            .unwrap()
    };
    for (model, folder) in [
        ("one", "one"),
        ("several", "several"),
        ("fp16", "fp16"),
        ("int4", "int4"),
        ("one_iso", "one"),
    ] {
        let stored = stored_bytes(folder);
        assert!(
            weights(model) >= stored,
            "{model}: weights {} < {stored} stored",
            weights(model)
        );
    }
}

#[test]
fn a_missing_data_file_is_refused_at_start_naming_it() {
    let home = Scratch::new();
    copy_fixture("one", &home.path().join("model"));
    std::fs::remove_file(home.path().join("model/model.onnx.data")).unwrap();
    let config = home.write(
        "vramguard.yaml",
        "models: [{name: one, path: model/model.onnx}]\n\
         pools: [{name: cpu, provider: cpu, models: [one]}]\n",
    );
    let elsewhere = Scratch::new();
    let out = crate::common::binary()
        .current_dir(elsewhere.path())
        .args(["config", "check"])
        .arg(&config)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{said}");
    assert!(said.contains("models[0].path"), "{said}");
    assert!(
        said.contains(&format!(
            "cannot read external data file {}",
            home.path().join("model/model.onnx.data").display()
        )),
        "{said}"
    );
}
