//! The `vramguard` binary: config commands, `policy check`, `doctor`, refusal of bad configs before binding,
//! and graceful shutdown on SIGTERM.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use vramguard::testing::Scratch;

/// `vramguard config check` on `yaml` written to `name`: exit code, stderr and the file's path.
fn config_check(name: &str, yaml: &str) -> (Option<i32>, String, PathBuf) {
    let scratch = Scratch::new();
    let path = scratch.write(name, yaml);
    let out = crate::common::binary()
        .args(["config", "check"])
        .arg(&path)
        .output()
        .unwrap();
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
    let out = crate::common::binary()
        .args(["config", "check", example])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok (2 models, 4 pools)"));

    let out = crate::common::binary().args(["config", "default"]).output().unwrap();
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
    let out = crate::common::binary()
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["policy", "check"])
        .args(args)
        .output()
        .unwrap();
    crate::common::outcome(out)
}

#[test]
fn policy_check_runs_the_script_and_names_where_it_fails() {
    let scratch = Scratch::new();
    // Compiles, but fails on every request: check must say so, not `ok`.
    let typo = scratch.write(
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
    let scratch = Scratch::new();
    let path = scratch.write("typo.yaml", "server: {listne: 1}\nmodels: []\npools: []\n");
    let out = crate::common::binary()
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("server: unknown field `listne`"), "{stderr}");
}

/// `make run`: the embedded default answers at once (chat, tensors, embeddings), and its first
/// requests, which correct memory estimates, log no warning: the log is JSON lines throughout,
/// its worker processes' included, and an estimate a run outgrew is information with both
/// numbers.
#[tokio::test]
async fn serve_without_a_config_chats_with_tiny_at_once_and_warns_of_nothing() {
    // The admin socket in a folder of this test's own, so no other server's is in the way.
    let scratch = Scratch::new();
    let runtime_dir = scratch.path().to_str().unwrap();
    let mut server = crate::common::spawn_serving(
        &["serve", "--listen", "127.0.0.1:0"],
        &[("RUNTIME_DIRECTORY", runtime_dir)],
        "vramguard serving",
    );
    let url = |p: &str| format!("http://{}{p}", server.addr);
    let models: Value = reqwest::get(url("/v1/models")).await.unwrap().json().await.unwrap();
    let ids = crate::common::model_ids(&models);
    assert_eq!(ids, ["tiny", "tiny-embed", "tiny-whisper"], "{models}");
    let response = reqwest::Client::new()
        .post(url("/v1/chat/completions"))
        .json(&serde_json::json!({"model": "tiny", "max_tokens": 8, "temperature": 0,
                                  "messages": [{"role": "user", "content": "Is the GPU full?"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), reqwest::StatusCode::OK);
    assert_eq!(response.headers()["x-vramguard-pool"], "cpu");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["choices"][0]["message"]["role"], "assistant", "{body}");
    assert!(body["choices"][0]["message"]["content"].is_string(), "{body}");
    let produced = body["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=8).contains(&produced), "{body}");
    // The first request to the encoder, which the embedded default runs on the simulated
    // accelerator's worker process.
    let inputs = serde_json::json!({"inputs": [{"name": "input", "shape": [1, 16, 64], "datatype": "FP32",
                                                "data": vec![0.1; 16 * 64]}]});
    let response = reqwest::Client::new()
        .post(url("/v2/models/encoder/infer"))
        .json(&inputs)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), reqwest::StatusCode::OK);
    // The bundled embedder, on the simulated accelerator too: one vector per input, of length 1.
    let response = reqwest::Client::new()
        .post(url("/v1/embeddings"))
        .json(&serde_json::json!({"model": "tiny-embed", "input": ["The GPU is shared", "by two models"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), reqwest::StatusCode::OK);
    assert_eq!(response.headers()["x-vramguard-pool"], "gpu");
    let body: Value = response.json().await.unwrap();
    for item in body["data"].as_array().unwrap() {
        let norm: f64 = item["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap().powi(2))
            .sum();
        assert!((norm - 1.0).abs() < 1e-5, "{body}");
    }
    assert_eq!(body["data"].as_array().unwrap().len(), 2, "{body}");

    sigterm(&server.child);
    assert_eq!(server.child.wait().unwrap().code(), Some(0));
    let log = server.log_after_exit();
    for line in &log {
        let entry: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(!["WARN", "ERROR"].contains(&entry["level"].as_str().unwrap()), "{line}");
        if entry["message"].as_str().unwrap().contains("estimate") {
            assert!(
                entry["estimate_bytes"].is_u64() && entry["measured_bytes"].is_u64(),
                "{line}"
            );
        }
    }
}

/// A report holds only its own lines, and a log written to a file or a pipe is plain text:
/// `doctor` writes no log line beside its report (`2>&1` included), and `config check`, which
/// logs as it loads the models, writes no colour codes into a pipe.
#[test]
fn doctor_writes_no_log_lines_and_a_piped_log_has_no_colour() {
    let out = crate::common::binary()
        .args(["doctor", "--url", &nobody_listening()])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(report.contains("ok    config "), "{report}");
    for log_line in [" INFO ", " WARN ", " ERROR ", "\x1b["] {
        assert!(!report.contains(log_line), "{log_line:?} in:\n{report}");
    }
    let out = crate::common::binary()
        .args(["config", "check", "config/default.yaml"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains(" INFO ") && !log.contains("\x1b["), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_running_work_answers_queued_work_and_exits_0() {
    let scratch = Scratch::new();
    let config = scratch.write(
        "serve.yaml",
        "server: {listen: '127.0.0.1:0', shutdown_grace: 30s, admin_socket: 'off'}\n\
         models: [{name: encoder, path: 'builtin:encoder'}]\n\
         pools: [{name: cpu, provider: cpu, models: [encoder], workers: 1}]\n",
    );
    let mut server = crate::common::spawn_serving(
        &["serve", "--config", config.to_str().unwrap()],
        &[],
        "vramguard serving",
    );
    let addr = server.addr.clone();
    let url = |p: &str| format!("http://{addr}{p}");
    let client = reqwest::Client::new();
    let send = |seq: usize| {
        let (header, body) = crate::common::encoder_binary_request(seq);
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
    sigterm(&server.child);

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
    let exit = tokio::task::spawn_blocking(move || server.child.wait().unwrap())
        .await
        .unwrap();
    assert_eq!(exit.code(), Some(0));
}

#[test]
fn the_exporter_serves_host_metrics_without_a_gpu_or_onnx_runtime() {
    // Monitoring mode must not need ONNX Runtime at all.
    let mut exporter = crate::common::spawn_serving(
        &["exporter", "--listen", "127.0.0.1:0"],
        &[("ORT_DYLIB_PATH", "/nonexistent/libonnxruntime.so")],
        "vramguard exporter serving",
    );
    let body = std::process::Command::new("curl")
        .args(["-s", &format!("http://{}/metrics", exporter.addr)])
        .output()
        .unwrap();
    let text = String::from_utf8(body.stdout).unwrap();
    assert!(text.contains("vramguard_host_memory_total_bytes "), "{text}");
    assert!(text.contains("vramguard_host_memory_available_bytes "), "{text}");
    assert!(text.contains("vramguard_process_resident_memory_bytes "), "{text}");
    assert!(
        text.contains(&format!(
            "vramguard_build_info{{version=\"{}\",onnxruntime=\"none\"}} 1",
            env!("CARGO_PKG_VERSION")
        )),
        "{text}"
    );
    if !vramguard::device::nvidia_gpu_present() {
        // No device to report: the family is there for dashboards, with no series in it.
        assert!(
            text.contains("# TYPE vramguard_device_memory_total_bytes gauge\n"),
            "{text}"
        );
        assert!(!text.contains("vramguard_device_memory_total_bytes{"), "{text}");
    }
    sigterm(&exporter.child);
    assert_eq!(exporter.child.wait().unwrap().code(), Some(0));
}

/// Send SIGTERM to `child` (a graceful stop, as systemd and Kubernetes ask).
fn sigterm(child: &std::process::Child) {
    let sent = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success(), "kill -TERM {}", child.id());
}

/// `vramguard doctor ARGS...` with extra environment: exit code and stdout.
fn doctor(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let out = crate::common::binary()
        .arg("doctor")
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A URL where nothing listens, so no server another test (or person) runs is asked.
fn nobody_listening() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("http://127.0.0.1:{port}")
}

#[test]
fn doctor_passes_on_the_embedded_default_and_says_what_is_simulated() {
    let (code, out) = doctor(&["--url", &nobody_listening()], &[]);
    assert!(
        out.contains("ok    config       <embedded default>: valid (5 models, 2 pools, 1 device)"),
        "{out}"
    );
    assert!(out.contains("ok    onnxruntime  1.31.1 from /"), "{out}");
    assert!(
        out.contains("ok    policy       builtin:default: compiles, passes its"),
        "{out}"
    );
    assert!(
        out.contains("warn  server       nothing answers at http://127.0.0.1:"),
        "{out}"
    );
    // The default reserves 2 GiB of host memory; a machine with less available fails, and says so.
    let host_ok = out.contains("ok    host_memory  ");
    assert!(host_ok || out.contains("below host.reserve of 2 GiB"), "{out}");
    if !vramguard::device::nvidia_gpu_present() {
        assert_eq!(code, Some(if host_ok { 0 } else { 1 }), "{out}");
        assert!(
            out.contains("info  nvml         no NVIDIA device: NVML unavailable"),
            "{out}"
        );
        assert!(
            out.contains("gpu0: SIMULATED accelerator of 512 MiB (from the config; no driver involved)"),
            "{out}"
        );
        assert!(
            out.contains("info  cuda         this ONNX Runtime is a CPU-only build"),
            "{out}"
        );
    }
}

#[test]
fn doctor_fails_on_a_broken_config_and_names_the_key() {
    let scratch = Scratch::new();
    let path = scratch.write(
        "doctor-bad.yaml",
        "models: [{name: m, path: 'builtin:classifier'}]\npools: [{name: cpu, provider: cpu, models: [m], workers: 0}]\n",
    );
    let (code, out) = doctor(&["--config", path.to_str().unwrap(), "--url", &nobody_listening()], &[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(&format!(
            "fail  config       {}: pools[0].workers: expected 1 to 256, got 0\n",
            path.display()
        )),
        "{out}"
    );
    assert!(out.contains("fix: correct that key"), "{out}");
    // The rest is still checked, so one run shows everything that is wrong.
    assert!(out.contains("ok    onnxruntime  "), "{out}");
    assert!(
        out.contains("warn  policy       not checked: the config is invalid"),
        "{out}"
    );
    assert!(out.contains("1 failed\n"), "{out}");
}

#[test]
fn doctor_json_has_every_check_with_its_facts() {
    let (code, out) = doctor(&["--json", "--url", &nobody_listening()], &[]);
    let report: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let names: Vec<&str> = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "config",
            "onnxruntime",
            "cuda",
            "nvml",
            "attribution",
            "policy",
            "server",
            "host_memory"
        ]
    );
    for check in report["checks"].as_array().unwrap() {
        assert!(
            ["ok", "info", "warn", "fail"].contains(&check["status"].as_str().unwrap()),
            "{check}"
        );
        assert!(!check["summary"].as_str().unwrap().is_empty(), "{check}");
    }
    assert_eq!(report["vramguard"], env!("CARGO_PKG_VERSION"));
    assert_eq!(report["checks"][1]["data"]["version"], "1.31.1");
    assert!(report["checks"][7]["data"]["available_bytes"].as_u64().unwrap() > 0);
    let failed = report["counts"]["fail"].as_u64().unwrap();
    assert_eq!(code, Some(if failed == 0 { 0 } else { 1 }));
}

#[test]
fn doctor_asks_a_running_server_with_the_admin_token_and_attributes_its_simulated_device() {
    let scratch = Scratch::new();
    let config = scratch.write(
        "doctor-serve.yaml",
        "server: {listen: '127.0.0.1:0', admin_token_env: VG_DOCTOR_TOKEN, admin_socket: 'off'}\n\
         devices: [{name: gpu0, kind: simulated, capacity: 128MiB}]\n\
         models: [{name: encoder, path: 'builtin:encoder'}]\n\
         pools: [{name: gpu, provider: simulated, device: gpu0, models: [encoder]}]\n",
    );
    let config = config.to_str().unwrap();
    let token = [("VG_DOCTOR_TOKEN", "s3cret")];
    let mut server = crate::common::spawn_serving(&["serve", "--config", config], &token, "vramguard serving");
    let url = format!("http://{}", server.addr);
    let pressure = Command::new("curl")
        .args([
            "-sf",
            "-XPOST",
            &format!("{url}/admin/sim/gpu0"),
            "-H",
            "authorization: Bearer s3cret",
        ])
        .args(["-d", r#"{"pressure": "32MiB"}"#])
        .output()
        .unwrap();
    assert!(pressure.status.success(), "{pressure:?}");

    let (_, out) = doctor(&["--config", config, "--url", &url], &token);
    assert!(
        out.contains(&format!(
            "ok    server       vramguard at {url} is ready, admin reachable"
        )),
        "{out}"
    );
    assert!(
        out.contains("admin endpoints accept this client (with the bearer token from $VG_DOCTOR_TOKEN)"),
        "{out}"
    );
    assert!(out.contains("gpu0 (SIMULATED, from the running server): "), "{out}");
    assert!(out.contains("(simulated 32 MiB, vramguard "), "{out}");
    assert!(!out.contains("fail  server") && !out.contains("fail  policy"), "{out}");

    let (code, out) = doctor(&["--config", config, "--url", &url], &[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("fail  server       "), "{out}");
    assert!(
        out.contains("admin needs a bearer token, and $VG_DOCTOR_TOKEN is not set here"),
        "{out}"
    );
    assert!(
        out.contains("fix: export VG_DOCTOR_TOKEN=<the server's token>"),
        "{out}"
    );

    sigterm(&server.child);
    assert_eq!(server.child.wait().unwrap().code(), Some(0));
}

/// Admin by default: on an owner-only Unix socket, with TCP refusing admin without a token and
/// pointing at the socket; doctor goes through the socket; the socket goes with the server.
#[test]
fn admin_lives_on_an_owner_only_socket_and_tcp_admin_needs_a_token() {
    use std::os::unix::fs::PermissionsExt;
    let scratch = Scratch::new();
    let socket = scratch.path().join("run/admin.sock");
    let config = scratch.write(
        "admin-socket.yaml",
        format!(
            "server: {{listen: '127.0.0.1:0', admin_socket: '{}'}}\n\
             devices: [{{name: gpu0, kind: simulated, capacity: 128MiB}}]\n\
             models: [{{name: encoder, path: 'builtin:encoder'}}]\n\
             pools: [{{name: gpu, provider: simulated, device: gpu0, models: [encoder]}}]\n",
            socket.display()
        ),
    );
    let config = config.to_str().unwrap();
    // Killed if an assertion fails, so no server outlives the test.
    let mut server = crate::common::spawn_serving(&["serve", "--config", config], &[], "vramguard serving");
    let addr = server.addr.clone();
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "owner-only socket");

    // Over TCP, even from loopback: refused before the body is read, with the way in.
    let tcp = Command::new("curl")
        .args([
            "-s",
            "-w",
            "\n%{http_code}",
            "-XPOST",
            &format!("http://{addr}/admin/sim/gpu0"),
        ])
        .args(["-d", r#"{"pressure": "32MiB"}"#])
        .output()
        .unwrap();
    let tcp = String::from_utf8_lossy(&tcp.stdout).to_string();
    assert!(tcp.ends_with("\n403"), "{tcp}");
    assert!(tcp.contains("--unix-socket"), "{tcp}");

    // On the socket: allowed.
    let sim = Command::new("curl")
        .args(["-sf", "--unix-socket"])
        .arg(&socket)
        .args([
            "-XPOST",
            "http://localhost/admin/sim/gpu0",
            "-d",
            r#"{"pressure": "32MiB"}"#,
        ])
        .output()
        .unwrap();
    assert!(sim.status.success(), "{sim:?}");
    let state: serde_json::Value = serde_json::from_slice(&sim.stdout).unwrap();
    assert_eq!(state["pressure_bytes"], 32 << 20);

    let (_, out) = doctor(&["--config", config, "--url", &format!("http://{addr}")], &[]);
    assert!(
        out.contains("admin endpoints accept this client (through the admin socket)"),
        "{out}"
    );

    sigterm(&server.child);
    assert_eq!(server.child.wait().unwrap().code(), Some(0));
    assert!(!socket.exists(), "the socket is removed on exit");
}
