//! The `vramguard` binary: config commands, `policy check`, refusal of bad configs before binding,
//! and graceful shutdown on SIGTERM.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_vramguard");

fn temp_file(name: &str, contents: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vramguard-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

/// `vramguard config check` on `yaml` written to `name`: exit code, stderr and the file's path.
fn config_check(name: &str, yaml: &str) -> (Option<i32>, String, PathBuf) {
    let path = temp_file(name, yaml);
    let out = Command::new(BIN).args(["config", "check"]).arg(&path).output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        path,
    )
}

#[test]
fn config_check_names_the_file_and_key_and_exits_64() {
    let (code, stderr, path) = config_check(
        "bad.yaml",
        "models: [{name: m, path: 'builtin:classifier'}]\npools: [{name: cpu, provider: cpu, models: [m], workers: 0}]\n",
    );
    assert_eq!(code, Some(64));
    assert!(
        stderr.contains(&format!(
            "error: {}: pools[0].workers: expected 1 to 256, got 0",
            path.display()
        )),
        "{stderr}"
    );

    let (code, stderr, _) = config_check(
        "ctx.yaml",
        "models: [{name: m, path: 'builtin:encoder', context: {input: tokens, axis: 1}}]\npools: [{name: cpu, provider: cpu, models: [m]}]\n",
    );
    assert_eq!(code, Some(64));
    assert!(
        stderr.contains("models[0].context.input: model `m` has no input `tokens`; its inputs are: input"),
        "{stderr}"
    );
}

#[test]
fn the_example_config_checks_and_the_default_round_trips() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/config/example.yaml");
    let out = Command::new(BIN).args(["config", "check", example]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok (2 models, 3 pools)"));

    let out = Command::new(BIN).args(["config", "default"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    if !vramguard::device::nvidia_gpu_present() {
        assert!(
            text.starts_with("# vramguard embedded default (no NVIDIA GPU: the `gpu` pool is a SIMULATED accelerator)")
        );
    }
    let (code, stderr, _) = config_check("default.yaml", &text);
    assert_eq!(code, Some(0), "{stderr}");
}

/// `vramguard policy check ARGS...` run from the repository root: exit code, stdout, stderr.
fn policy_check(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(BIN)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["policy", "check"])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn policy_check_runs_the_script_and_names_where_it_fails() {
    // Compiles, but fails on every request: check must say so, not `ok`.
    let typo = temp_file(
        "typo.rhai",
        "fn decide(req, state) {\n    if req.priorty > 0 { return admit(); }\n    admit()\n}\n",
    );
    let (code, stdout, stderr) = policy_check(&[typo.to_str().unwrap()]);
    assert_eq!(code, Some(64), "{stdout}");
    assert!(
        stderr.starts_with(&format!("{}:2:12: Property not found: priorty", typo.display())),
        "{stderr}"
    );
}

#[test]
fn policy_check_passes_the_shipped_policies_on_the_default_and_example_configs() {
    let shipped = [
        "policies/default.rhai",
        "policies/latency-first.rhai",
        "policies/availability-first.rhai",
    ];
    let with_example: Vec<&str> = ["--config", "config/example.yaml"].into_iter().chain(shipped).collect();
    for args in [&shipped[..], &with_example[..]] {
        let (code, stdout, stderr) = policy_check(args);
        assert_eq!(code, Some(0), "{args:?}: {stderr}");
        for policy in shipped {
            assert!(stdout.contains(&format!("{policy}: ok\n")), "{args:?}: {stdout}");
        }
    }
}

#[test]
fn serve_refuses_a_bad_config_before_binding() {
    let path = temp_file("typo.yaml", "server: {listne: 1}\nmodels: []\npools: []\n");
    let out = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("server: unknown field `listne`"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_running_work_answers_queued_work_and_exits_0() {
    let config = temp_file(
        "serve.yaml",
        "server: {listen: '127.0.0.1:0', shutdown_grace: 30s}\n\
         models: [{name: encoder, path: 'builtin:encoder'}]\n\
         pools: [{name: cpu, provider: cpu, models: [encoder], workers: 1}]\n",
    );
    let (mut child, addr) = common::spawn_serving(
        &["serve", "--config", config.to_str().unwrap()],
        &[],
        "vramguard serving",
    );
    let url = |p: &str| format!("http://{addr}{p}");
    let client = reqwest::Client::new();
    let send = |seq: usize| {
        let (header, body) = common::encoder_binary_request(seq);
        client
            .post(url("/v2/models/encoder/infer"))
            .header("Inference-Header-Content-Length", header.len())
            .body(body)
            .send()
    };
    let status = || async {
        reqwest::get(url("/status"))
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap()
    };

    let running = tokio::spawn(send(3072));
    let deadline = Instant::now() + Duration::from_secs(20);
    while status().await["pools"][0]["inflight"] != 1 {
        assert!(Instant::now() < deadline, "the long request never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let queued = tokio::spawn(send(8));
    while status().await["pools"][0]["queue_depth"] != 1 {
        assert!(Instant::now() < deadline, "the second request never queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap()
            .success()
    );

    let queued = queued.await.unwrap().unwrap();
    assert_eq!(queued.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
    let error: Value = queued.json().await.unwrap();
    assert_eq!(error["error"], "pool `cpu` is shutting down");
    let running = running.await.unwrap().unwrap();
    assert_eq!(
        running.status(),
        reqwest::StatusCode::OK,
        "the running request finishes"
    );
    let exit = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert_eq!(exit.code(), Some(0));
}

#[test]
fn the_exporter_serves_host_metrics_without_a_gpu_or_onnx_runtime() {
    // Monitoring mode must not need ONNX Runtime at all.
    let (mut child, addr) = common::spawn_serving(
        &["exporter", "--listen", "127.0.0.1:0"],
        &[("ORT_DYLIB_PATH", "/nonexistent/libonnxruntime.so")],
        "vramguard exporter serving",
    );
    let body = std::process::Command::new("curl")
        .args(["-s", &format!("http://{addr}/metrics")])
        .output()
        .unwrap();
    let text = String::from_utf8(body.stdout).unwrap();
    assert!(text.contains("vramguard_host_memory_total_bytes "), "{text}");
    assert!(text.contains("vramguard_host_memory_available_bytes "), "{text}");
    assert!(text.contains("vramguard_process_resident_memory_bytes "), "{text}");
    assert!(
        text.contains("vramguard_build_info{version=\"0.1.0\",onnxruntime=\"none\"} 1"),
        "{text}"
    );
    if !vramguard::device::nvidia_gpu_present() {
        assert!(!text.contains("vramguard_device_memory_total_bytes"), "{text}");
    }
    assert!(
        Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    assert_eq!(child.wait().unwrap().code(), Some(0));
}
