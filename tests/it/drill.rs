//! `vramguard drill` as a user runs it: on its own server, the quick drill passes without an
//! error line; against a running server (`--target`), as a user checks their own deployment, it
//! passes and writes its record; a server it cannot squeeze is refused by name.

use std::process::Command;

use serde_json::Value;

/// `vramguard drill ARGS…` with the admin token: exit code, stdout, stderr.
fn drill(args: &[&str], token: &str) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vramguard"))
        .arg("drill")
        .args(args)
        .env("VRAMGUARD_ADMIN_TOKEN", token)
        .output()
        .unwrap();
    crate::common::outcome(out)
}

/// On its own server, a passing drill prints its report and nothing that reads like a failure:
/// no error logged for the faults it injects itself (each said in one line), and a table whose
/// columns say what they count.
#[test]
fn the_quick_drill_on_its_own_server_passes_without_an_error_line() {
    let out = Command::new(env!("CARGO_BIN_EXE_vramguard"))
        .args(["drill", "--quick"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let (code, out, err) = crate::common::outcome(out);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("PASS: every criterion met"), "{out}");
    assert!(!out.contains("ERROR") && !err.contains("ERROR"), "{out}\n{err}");
    let header = out.lines().find(|l| l.starts_with("phase ")).unwrap_or_default();
    for column in ["requests", "answered 200", "as expected"] {
        assert!(header.contains(column), "{header}");
    }
    assert!(
        out.contains("\n  worker_lost      the accelerator's worker process is killed (SIGKILL)"),
        "{out}"
    );
}

#[test]
fn the_quick_drill_passes_against_a_server_started_with_its_config() {
    let dir = vramguard::testing::Scratch::new();
    let (code, printed, _) = drill(&["--print-config"], "");
    assert_eq!(code, Some(0));
    let root = env!("CARGO_MANIFEST_DIR");
    let config = printed
        .replace("listen: 127.0.0.1:8090", "listen: '127.0.0.1:0'")
        .replace("'models/decoder/", &format!("'{root}/models/decoder/"));
    let path = dir.path().join("drill.yaml");
    std::fs::write(&path, config).unwrap();
    // The dense models, where the printed config names them: beside it.
    let models = dir.path().join("drill-models");
    let (code, written, err) = drill(&["--write-models", models.to_str().unwrap()], "");
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(written.lines().count(), 3, "{written}");
    let token = "drill-token";
    let server = crate::common::spawn_serving(
        &["serve", "--config", path.to_str().unwrap()],
        &[("VRAMGUARD_ADMIN_TOKEN", token)],
        "vramguard serving",
    );
    let record = dir.path().join("drill.json");
    let (code, out, err) = drill(
        &[
            "--quick",
            "--target",
            &format!("http://{}", server.addr),
            "--json",
            record.to_str().unwrap(),
        ],
        token,
    );
    drop(server);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("PASS: every criterion met"), "{out}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&record).unwrap()).unwrap();
    let phases: Vec<&str> = report["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect();
    assert_eq!(
        phases,
        [
            "baseline",
            "redirect",
            "pressure",
            "alloc_failure",
            "driver_reset",
            "cancel_in_queue",
            "streams",
            "non_replayable",
            "idempotency",
            "embeddings",
            "residency",
            "background",
            "speech",
            "worker_lost"
        ]
    );
    assert!(
        report["phases"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["requests"].as_u64() > Some(0))
    );
    assert!(
        report["criteria"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["passed"] == true),
        "{report}"
    );
    let records = report["records"].as_array().unwrap();
    assert!(records.len() >= 60, "{}", records.len());
    residency_as_judged(&report);
    background_as_judged(&report);
    worker_lost_as_judged(&report);
    // Every record says what happened to it.
    for r in records {
        for field in ["phase", "id", "expect", "latency_ms", "connection_held", "as_expected"] {
            assert!(!r[field].is_null(), "{field} missing in {r}");
        }
    }
}

/// The background phase, read back from the record: interactive requests were seen waiting,
/// the target counted a background request's wait, and answered every background request (one
/// more goes only when one was answered without a wait counted, at most 8).
fn background_as_judged(report: &Value) {
    let facts = &report["facts"]["background"];
    assert!(facts["interactive_waiting"].as_f64() >= Some(1.0), "{facts}");
    assert!(facts["waits_counted"].as_f64() >= Some(1.0), "{facts}");
    let records = report["records"].as_array().unwrap();
    let background: Vec<&Value> = records
        .iter()
        .filter(|r| r["id"].as_str().is_some_and(|id| id.starts_with("background-")))
        .collect();
    assert!((1..=8).contains(&background.len()), "{facts}");
    assert_eq!(facts["background_sent"], background.len(), "{facts}");
    assert!(background.iter().all(|r| r["status"] == 200), "{background:?}");
    assert!(
        records
            .iter()
            .filter(|r| r["phase"] == "background")
            .all(|r| r["status"] == 200)
    );
}

/// The worker_lost phase, read back from the record: the worker killed was the pool's, a new one
/// came back with a closed breaker within 30 s, every kind of request was sent, the
/// non-replayable ones none retried on the CPU pool, and the CPU work all served there.
fn worker_lost_as_judged(report: &Value) {
    let facts = &report["facts"]["worker_lost"];
    assert_eq!(facts["killed_worker_pid"], facts["worker_pid_before"], "{facts}");
    assert!(facts["worker_pid_after"].as_u64().is_some(), "{facts}");
    assert_ne!(facts["worker_pid_after"], facts["worker_pid_before"], "{facts}");
    assert!(
        facts["recovery_ms"].as_f64().is_some_and(|ms| ms <= 30_000.0),
        "{facts}"
    );
    assert!(facts["restarts_counted"].as_f64() >= Some(1.0), "{facts}");
    let records: Vec<&Value> = report["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["phase"] == "worker_lost")
        .collect();
    let of = |prefix: &str| -> Vec<&&Value> {
        records
            .iter()
            .filter(|r| r["id"].as_str().unwrap().starts_with(prefix))
            .collect()
    };
    for prefix in ["worker-replayable-", "worker-streams-"] {
        let sent = of(prefix);
        assert!(!sent.is_empty() && sent.iter().all(|r| r["status"] == 200), "{sent:?}");
    }
    let held = of("worker-non-replayable-");
    assert!(!held.is_empty());
    for r in held {
        match r["status"].as_u64() {
            Some(200) => assert!(r["pool"] == "gpu" || r["retry"].is_null(), "{r}"),
            Some(503) => {
                assert_ne!(r["pool"], "cpu", "{r}");
                assert_eq!(r["error"]["reason"], "worker_lost", "{r}");
                assert_eq!(r["error"]["retried"], false, "{r}");
                assert_eq!(r["error"]["request_id"], r["id"], "{r}");
            }
            _ => panic!("{r}"),
        }
    }
    let cpu = of("worker-cpu-work-");
    assert!(
        !cpu.is_empty() && cpu.iter().all(|r| r["status"] == 200 && r["pool"] == "cpu"),
        "{cpu:?}"
    );
}

/// The residency phase, read back from the record: `dense_c` made room on the accelerator by
/// evicting `dense_b` (never the pinned `keeper`), `dense_b` then ran on the CPU by redirect,
/// and the evictions `/metrics` counted are the ones `/status` showed.
fn residency_as_judged(report: &Value) {
    let facts = &report["facts"]["residency"];
    let evictions = facts["evictions"].as_array().unwrap();
    assert!(!evictions.is_empty(), "{facts}");
    assert_eq!(
        facts["evicted_counted"].as_f64(),
        Some(evictions.len() as f64),
        "{facts}"
    );
    assert!(
        evictions
            .iter()
            .all(|e| e["model"] == "dense_b" && e["for_model"] == "dense_c"),
        "{facts}"
    );
    assert_eq!(facts["pinned_missing"], serde_json::json!([]), "{facts}");
    assert!(
        facts["loads"].as_f64() >= Some(1.0),
        "dense_c loaded on demand: {facts}"
    );
    let records: Vec<&Value> = report["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["phase"] == "residency")
        .collect();
    assert!(
        records.len() >= 9 && records.iter().all(|r| r["status"] == 200),
        "{records:?}"
    );
    let answered = |model: &str, pool: &str, decision: &str| {
        records
            .iter()
            .any(|r| r["kind"].as_str().unwrap().starts_with(model) && r["pool"] == pool && r["decision"] == decision)
    };
    assert!(answered("dense_c", "gpu", "make_room"), "{records:?}");
    assert!(answered("dense_b", "cpu", "redirect"), "{records:?}");
    assert!(answered("dense_a", "gpu", "admit"), "{records:?}");
}

/// The dense models `--write-models` writes are the model `evict_models.py` writes with the
/// `onnx` package: the same graph, inputs, outputs, opset and IR version, a weight of the same
/// name, type and shape, and `onnx.checker` (with shape inference) accepts them. Fails, never
/// skips, without the generator's packages.
#[test]
fn the_models_the_drill_writes_are_evict_models_py_models_and_pass_the_onnx_checker() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let deps = root.join(".deps/modelgen");
    assert!(
        deps.join(".installed").exists(),
        "the model generator's packages (onnx, numpy) are missing from {}: run `make .deps/modelgen/.installed`",
        deps.display()
    );
    let dir = vramguard::testing::Scratch::new();
    let (code, written, err) = drill(&["--write-models", dir.path().join("models").to_str().unwrap()], "");
    assert_eq!(code, Some(0), "{err}");
    let written: Vec<&str> = written.lines().collect();
    assert_eq!(written.len(), 3);
    let check = r#"
import sys, onnx
sys.path.insert(0, sys.argv[1])
import evict_models
reference_path, ours = sys.argv[2], sys.argv[3:]
evict_models.dense(reference_path, 41, 1)
ref = onnx.load(reference_path)
for path in ours:
    m = onnx.load(path)
    onnx.checker.check_model(m, full_check=True)
    assert (m.ir_version, list(m.opset_import)) == (ref.ir_version, list(ref.opset_import)), path
    for part in ["node", "input", "output"]:
        assert list(getattr(m.graph, part)) == list(getattr(ref.graph, part)), (path, part)
    (w,), (r,) = m.graph.initializer, ref.graph.initializer
    assert (w.name, w.data_type, list(w.dims)) == (r.name, r.data_type, list(r.dims)), (path, w.dims)
    assert len(w.raw_data) == len(r.raw_data), path
    print("ok", path)
"#;
    let out = Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
        .arg("-c")
        .arg(check)
        .arg(root.join("tests/it"))
        .arg(dir.path().join("reference.onnx"))
        .args(&written)
        .env("PYTHONPATH", &deps)
        .output()
        .expect("python3 runs");
    let (code, stdout, stderr) = crate::common::outcome(out);
    assert_eq!(
        code,
        Some(0),
        "{stdout}
{stderr}"
    );
    assert_eq!(stdout.lines().filter(|l| l.starts_with("ok ")).count(), 3, "{stdout}");
}

#[test]
fn a_target_without_a_simulated_device_is_refused_by_name() {
    let dir = vramguard::testing::Scratch::new();
    let path = dir.path().join("cpu.yaml");
    std::fs::write(
        &path,
        "server: {listen: '127.0.0.1:0', admin_token_env: VRAMGUARD_ADMIN_TOKEN, admin_socket: 'off'}\n\
         models: [{name: encoder, path: 'builtin:encoder'}]\n\
         pools: [{name: cpu, provider: cpu, models: [encoder]}]\n",
    )
    .unwrap();
    let server = crate::common::spawn_serving(
        &["serve", "--config", path.to_str().unwrap()],
        &[("VRAMGUARD_ADMIN_TOKEN", "t")],
        "vramguard serving",
    );
    let (code, out, err) = drill(&["--quick", "--target", &format!("http://{}", server.addr)], "t");
    drop(server);
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(err.contains("no simulated device `sim0` to squeeze"), "{err}");
    assert!(err.contains("vramguard drill --print-config"), "{err}");
}
