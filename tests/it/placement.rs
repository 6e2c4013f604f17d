//! `server.cpus` and `pools[].cpus` on a real `vramguard serve`: every thread is where the
//! configuration put it, as the kernel reports it (`/proc/<pid>/task/*/status`), including the
//! threads ONNX Runtime starts for a session's intra-op work and a worker process's own; and a
//! CPU vramguard may not run on is refused naming the key. `server.cpu_wake_latency`: the limit
//! the kernel applies (read back from `/dev/cpu_dma_latency`) while requests are in flight.

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
    let out = crate::common::binary()
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

/// The CPU wake-up latency limit the kernel applies now, in µs (every holder's lowest).
fn kernel_wake_limit() -> i32 {
    let bytes = std::fs::read(vramguard::core::wakeup::DEVICE).unwrap();
    i32::from_ne_bytes(bytes[..4].try_into().unwrap())
}

/// Polls until `limit` is the kernel's wake-up limit, up to `within`; what it read last.
async fn until_limit(limit: i32, within: std::time::Duration) -> i32 {
    let deadline = std::time::Instant::now() + within;
    loop {
        let now = kernel_wake_limit();
        if now == limit || std::time::Instant::now() > deadline {
            return now;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Sends seq-16 encoder requests one after another until `stop`; how many were answered.
fn keep_busy(addr: String, stop: tokio_util::sync::CancellationToken) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let client = reqwest::Client::new();
        let (header, body) = crate::common::encoder_binary_request(16);
        let mut answered = 0;
        while !stop.is_cancelled() {
            let sent = client
                .post(format!("http://{addr}/v2/models/encoder/infer"))
                .header("inference-header-content-length", header.len())
                .body(body.clone())
                .send()
                .await;
            let response = match sent {
                Ok(response) => response,
                // The server was stopped after the load.
                Err(_) if stop.is_cancelled() => break,
                Err(e) => panic!("{e}"),
            };
            assert_eq!(response.status(), 200);
            answered += 1;
        }
        answered
    })
}

#[tokio::test]
async fn idle_cpus_wake_within_the_limit_while_requests_are_in_flight_and_never_after_it_exits() {
    let scratch = Scratch::new();
    let config = scratch.write(
        "serve.yaml",
        "server: {listen: '127.0.0.1:0', admin_socket: 'off', cpu_wake_latency: 0us}
models: [{name: encoder, path: 'builtin:encoder'}]
pools: [{name: cpu, provider: cpu, models: [encoder]}]
",
    );
    let args = ["serve", "--config", config.to_str().unwrap()];
    let writable = std::fs::OpenOptions::new()
        .write(true)
        .open(vramguard::core::wakeup::DEVICE)
        .is_ok();
    if !writable {
        // Where the limit cannot be held, `serve` says so instead of serving without it.
        let out = crate::common::binary()
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{stderr}");
        assert!(
            stderr.contains("server.cpu_wake_latency: cannot open /dev/cpu_dma_latency"),
            "{stderr}"
        );
        return;
    }
    // What other holders (tuned, another server) ask for stays the kernel's limit when idle.
    let before = kernel_wake_limit();
    let server = crate::common::spawn_serving(&args, &[], "vramguard serving");
    assert_eq!(kernel_wake_limit(), before, "nothing is limited before a request");

    let wait = std::time::Duration::from_secs(10);
    let stop = tokio_util::sync::CancellationToken::new();
    let load = keep_busy(server.addr.clone(), stop.clone());
    assert_eq!(until_limit(0, wait).await, 0, "held while requests are in flight");
    stop.cancel();
    assert!(load.await.unwrap() > 0);
    // Lifted a second after the last answer.
    assert_eq!(
        until_limit(before, wait).await,
        before,
        "lifted once the server is idle"
    );

    // A server killed while it holds the limit takes it with it: the kernel drops a request
    // when its file closes.
    let stop = tokio_util::sync::CancellationToken::new();
    let load = keep_busy(server.addr.clone(), stop.clone());
    assert_eq!(until_limit(0, wait).await, 0);
    let pid = server.child.id();
    stop.cancel();
    drop(server);
    load.await.unwrap();
    assert_eq!(
        until_limit(before, std::time::Duration::from_millis(500)).await,
        before,
        "the limit outlived its holder {pid}"
    );
}
