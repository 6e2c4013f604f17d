//! `vramguard drill` against a running server (`--target`), as a user checks their own
//! deployment: the quick drill passes and writes its record; a server it cannot squeeze is
//! refused by name. (The drill's own server is what `make test`'s `drill` target runs.)

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
            "idempotency"
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
    // Every record says what happened to it.
    for r in records {
        for field in ["phase", "id", "expect", "latency_ms", "connection_held", "as_expected"] {
            assert!(!r[field].is_null(), "{field} missing in {r}");
        }
    }
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
