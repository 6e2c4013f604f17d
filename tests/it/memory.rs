//! Host memory is returned after a burst (issue 10): the real `vramguard serve` binary takes
//! four concurrent large requests with large JSON answers, its resident memory climbs by
//! hundreds of MiB, and `vramguard_process_resident_memory_bytes` then comes back near where it
//! started instead of staying at the peak.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;
use vramguard::testing::Scratch;
use vramguard::testing::process::Serving;

const MIB: u64 = 1 << 20;

/// A `vramguard serve` process, killed when dropped.
struct Server {
    process: Serving,
    url: String,
    /// Its config; removed after the process is gone (fields drop in order).
    _dir: Scratch,
}

impl Server {
    /// Start the binary on a loopback port the kernel picks with a CPU pool of two workers (the
    /// default arena settings); [`Server::wait_ready`] waits until it is ready.
    fn start() -> Server {
        let dir = Scratch::new();
        let config = dir.write(
            "config.yaml",
            "models: [{name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}}]\n\
             pools: [{name: cpu, provider: cpu, models: [encoder], workers: 2}]\n\
             host: {reserve: 256MiB}\n\
             server: {admin_socket: 'off'}\n",
        );
        let process = crate::common::spawn_serving(
            &["serve", "--config", config.to_str().unwrap(), "--listen", "127.0.0.1:0"],
            &[],
            "vramguard serving",
        );
        Server {
            url: format!("http://{}", process.addr),
            process,
            _dir: dir,
        }
    }

    fn pid(&self) -> u32 {
        self.process.child.id()
    }

    async fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            assert!(self.process.child.try_wait().unwrap().is_none(), "vramguard exited");
            if let Ok(r) = reqwest::get(format!("{}/v2/health/ready", self.url)).await
                && r.status() == StatusCode::OK
            {
                return;
            }
            assert!(Instant::now() < deadline, "vramguard not ready within 60 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `vramguard_process_resident_memory_bytes` as exported.
    async fn exported_resident(&self) -> u64 {
        let text = reqwest::get(format!("{}/metrics", self.url))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("vramguard_process_resident_memory_bytes "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .expect("resident memory is exported") as u64
    }
}

/// Resident memory of `pid` as the kernel reports it.
pub(crate) fn resident(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resident_memory_returns_near_its_baseline_after_a_burst() {
    let mut server = Server::start();
    server.wait_ready().await;
    // Settle: one small request, then the baseline.
    let small = json!({"inputs": [{"name": "input", "shape": [1, 8, 64], "datatype": "FP32", "data": vec![0.5; 512]}]});
    let client = reqwest::Client::new();
    let infer = format!("{}/v2/models/encoder/infer", server.url);
    assert_eq!(
        client.post(&infer).json(&small).send().await.unwrap().status(),
        StatusCode::OK
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let baseline = server.exported_resident().await;

    // Four concurrent requests of 16×1024×64 FP32 (4 MiB of binary input each) whose answers
    // are asked for as JSON (tens of MB each), the CPU arena growing to hundreds of MiB.
    let header = json!({
        "inputs": [{"name": "input", "shape": [16, 1024, 64], "datatype": "FP32",
                    "parameters": {"binary_data_size": 16 * 1024 * 64 * 4}}]
    })
    .to_string();
    let mut body = header.clone().into_bytes();
    body.resize(header.len() + 16 * 1024 * 64 * 4, 0);
    let burst: Vec<_> = (0..4)
        .map(|_| {
            let request = client
                .post(&infer)
                .header("Inference-Header-Content-Length", header.len())
                .body(body.clone());
            tokio::spawn(async move {
                let response = request.send().await.unwrap();
                let status = response.status();
                let _ = response.bytes().await.unwrap();
                status
            })
        })
        .collect();
    let pid = server.pid();
    let mut peak = 0;
    while !burst.iter().all(|t| t.is_finished()) {
        peak = peak.max(resident(pid));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for task in burst {
        assert_eq!(task.await.unwrap(), StatusCode::OK);
    }
    assert!(
        peak > baseline + 200 * MIB,
        "the burst must grow the process for this test to mean anything: baseline {} MiB, peak {} MiB",
        baseline / MIB,
        peak / MIB
    );

    // Within 5 s (the pool gives its arena's blocks back after 1 s without a run, and the
    // exporter samples every second), the exported figure is back within 64 MiB of the baseline.
    let burst_over = Instant::now();
    let deadline = burst_over + Duration::from_secs(5);
    let mut after = server.exported_resident().await;
    while after > baseline + 64 * MIB && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        after = server.exported_resident().await;
    }
    eprintln!(
        "resident memory: baseline {} MiB, peak {} MiB, {} MiB {:.1} s after the burst",
        baseline / MIB,
        peak / MIB,
        after / MIB,
        burst_over.elapsed().as_secs_f64()
    );
    assert!(
        after <= baseline + 64 * MIB,
        "resident memory stayed up: baseline {} MiB, peak {} MiB, after {} MiB",
        baseline / MIB,
        peak / MIB,
        after / MIB
    );
}
