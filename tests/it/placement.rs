//! `server.cpus` and `pools[].cpus` on a real `vramguard serve`: every thread is where the
//! configuration put it, as the kernel reports it (`/proc/<pid>/task/*/status`), including the
//! threads ONNX Runtime starts for a session's intra-op work and a worker process's own; and a
//! CPU vramguard may not run on is refused naming the key.

use std::collections::BTreeMap;

use serde_json::Value;
use vramguard::core::cpus::CpuSet;
use vramguard::testing::Scratch;

/// Each thread of process `pid` by name (`comm`), with the CPUs it may run on.
fn threads(pid: u32) -> Vec<(String, CpuSet)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        let (Ok(comm), Ok(status)) = (
            std::fs::read_to_string(task.join("comm")),
            std::fs::read_to_string(task.join("status")),
        ) else {
            continue; // a thread that ended meanwhile
        };
        let allowed = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap_or_else(|| panic!("no Cpus_allowed_list in {}", task.display()));
        out.push((comm.trim().to_string(), CpuSet::parse(allowed.trim()).unwrap()));
    }
    out
}

/// The CPUs of every thread whose name starts with `prefix` (there must be one).
fn where_runs(threads: &[(String, CpuSet)], prefix: &str) -> Vec<CpuSet> {
    let found: Vec<CpuSet> = threads
        .iter()
        .filter(|(name, _)| name.starts_with(prefix))
        .map(|(_, cpus)| cpus.clone())
        .collect();
    assert!(!found.is_empty(), "no thread named {prefix}*: {threads:?}");
    found
}

#[tokio::test]
async fn the_server_and_each_pool_run_on_the_cpus_they_are_given() {
    let all = CpuSet::current().unwrap();
    // Two CPUs of this machine, or its only one twice: the server's and the pools'.
    let first = all.iter().next().unwrap();
    let last = all.iter().last().unwrap();
    let (server_cpus, pool_cpus) = (CpuSet::new([first]).unwrap(), CpuSet::new([last]).unwrap());
    let scratch = Scratch::new();
    let config = scratch.write(
        "serve.yaml",
        format!(
            "server: {{listen: '127.0.0.1:0', admin_socket: 'off', cpus: '{server_cpus}'}}
devices: [{{name: sim0, kind: simulated, capacity: 256MiB}}]
models: [{{name: encoder, path: 'builtin:encoder'}}]
pools:
- {{name: gpu, provider: simulated, device: sim0, models: [encoder], cpus: '{pool_cpus}'}}
- {{name: cpu, provider: cpu, models: [encoder], intra_threads: 2, cpus: [{pool_cpus}]}}
- {{name: plain, provider: cpu, models: [encoder]}}
"
        ),
    );
    let server = crate::common::spawn_serving(
        &["serve", "--config", config.to_str().unwrap()],
        &[],
        "vramguard serving",
    );
    let status: Value = reqwest::get(format!("http://{}/status", server.addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let pools: BTreeMap<&str, &Value> = status["pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["name"].as_str().unwrap(), p))
        .collect();
    assert_eq!(pools["gpu"]["cpus"], pool_cpus.to_string(), "{status}");
    assert_eq!(pools["cpu"]["cpus"], pool_cpus.to_string(), "{status}");
    // A pool without `cpus` runs where vramguard was started, and says so.
    assert_eq!(pools["plain"]["cpus"], all.to_string(), "{status}");

    let pid = server.child.id();
    let mine = threads(pid);
    for cpus in where_runs(&mine, "tokio-rt-worker") {
        assert_eq!(cpus, server_cpus, "{mine:?}");
    }
    // A thread-isolated pool's worker threads run its sessions: the pool's CPUs, and the
    // intra-op thread ONNX Runtime started for its session (named by nothing of ours) too.
    for cpus in where_runs(&mine, "cpu-worker") {
        assert_eq!(cpus, pool_cpus, "{mine:?}");
    }
    for cpus in where_runs(&mine, "plain-worker") {
        assert_eq!(cpus, all, "{mine:?}");
    }
    // The process pool's threads here only pass frames: they stay with the server's.
    for cpus in where_runs(&mine, "gpu-worker") {
        assert_eq!(cpus, server_cpus, "{mine:?}");
    }
    // ONNX Runtime's threads take the name of the thread that started them: the main thread,
    // which built the sessions and is on the server's CPUs.
    if first != last {
        assert!(
            mine.iter()
                .any(|(name, cpus)| name == "vramguard" && *cpus == pool_cpus),
            "no intra-op thread on the pool's CPUs: {mine:?}"
        );
    }
    // Every thread of the worker process, ONNX Runtime's included.
    let worker = pools["gpu"]["worker_pid"].as_u64().expect("a worker pid") as u32;
    let theirs = threads(worker);
    assert!(theirs.len() >= 2, "{theirs:?}");
    for (name, cpus) in &theirs {
        assert_eq!(*cpus, pool_cpus, "worker thread {name}: {theirs:?}");
    }
}

#[test]
fn a_cpu_vramguard_may_not_run_on_is_refused_naming_the_key() {
    let scratch = Scratch::new();
    let config = scratch.write(
        "serve.yaml",
        "server: {listen: '127.0.0.1:0', admin_socket: 'off'}
models: [{name: encoder, path: 'builtin:encoder'}]
pools: [{name: cpu, provider: cpu, models: [encoder], cpus: '0,1023'}]
",
    );
    let out = std::process::Command::new(crate::common::BIN)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["serve", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains("pools[0].cpus: CPUs 1023 are not among those vramguard may run on"),
        "{stderr}"
    );
}
