//! Failover cost: the time from an allocator failure on the accelerator pool to the start of
//! the retry on the CPU pool, excluding both runs. The service is the real one (policy,
//! lifecycle, pools, metrics) on backends that only take timestamps, so what is measured is
//! vramguard's own work: the error travelling back, the retry decision, re-queueing, and the
//! CPU worker picking the job up.
//!
//! `cargo bench --bench failover [-- --runs N]` prints the median, p95 and p99 against the
//! issue's target (median ≤ 2 ms); the figures go to `target/bench/failover.json`.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Figure, Machine, Target, record};
use vramguard::config::{ModelConfig, PoolConfig, RawConfig, parse_yaml};
use vramguard::core::backend::{AllocFailureKind, ArenaStats, Backend, BackendError, RunMeta};
use vramguard::core::clock::SystemClock;
use vramguard::core::tensor::{DataType, Tensor, TensorData};
use vramguard::runtime::estimate::{MemoryProfile, ProfileSource};
use vramguard::runtime::onnx::{ModelSignature, TensorSpec};
use vramguard::serve::lifecycle::{self, Request};
use vramguard::serve::service::{BackendFactory, Parts, Service};

/// When the last failure was returned and when the last retry started.
#[derive(Default)]
struct Marks {
    failed_at: Option<Instant>,
    retry_started_at: Option<Instant>,
}

/// The `gpu` pool's backend always fails; the `cpu` pool's echoes. Both take timestamps.
struct Timed {
    fails: bool,
    marks: Arc<Mutex<Marks>>,
}

impl Backend for Timed {
    fn run(&mut self, _: &str, inputs: Vec<Tensor>, _: &[String], _: &RunMeta) -> Result<Vec<Tensor>, BackendError> {
        if self.fails {
            self.marks.lock().unwrap().failed_at = Some(Instant::now());
            return Err(BackendError::Allocation {
                kind: AllocFailureKind::Oom,
                message: "BFCArena::AllocateRawInternal (bench)".into(),
            });
        }
        self.marks.lock().unwrap().retry_started_at = Some(Instant::now());
        Ok(inputs)
    }

    fn arena_stats(&self) -> Option<ArenaStats> {
        None
    }
}

struct Factory(Arc<Mutex<Marks>>);

impl BackendFactory for Factory {
    fn runtime_version(&self) -> String {
        "bench".into()
    }

    fn signature(&self, _: &ModelConfig, _: &[u8]) -> Result<ModelSignature, String> {
        let spec = TensorSpec {
            name: "input".into(),
            datatype: DataType::Fp32,
            shape: vec![-1, -1, 4],
            symbols: vec![],
        };
        Ok(ModelSignature {
            inputs: vec![spec.clone()],
            outputs: vec![spec],
        })
    }

    fn measure_profile(&self, _: &ModelConfig, bytes: &[u8], _: &ModelSignature) -> MemoryProfile {
        MemoryProfile {
            weights_bytes: bytes.len() as u64,
            workspace_bytes: 0.0,
            per_token_bytes: 64.0,
            per_token_squared_bytes: 0.0,
            source: ProfileSource::Config,
        }
    }

    fn backend(&self, pool: &PoolConfig, _: &[(String, &[u8])]) -> Result<Box<dyn Backend>, String> {
        Ok(Box::new(Timed {
            fails: pool.name == "gpu",
            marks: Arc::clone(&self.0),
        }))
    }
}

fn main() {
    let (started, machine) = (Instant::now(), Machine::now());
    let args: Vec<String> = std::env::args().collect();
    let runs: usize = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let dir = std::env::temp_dir().join(format!("vramguard-failover-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("admit.rhai");
    std::fs::write(&policy, "fn decide(req, state) { admit() }\n").unwrap();
    // The breaker never opens here: every run is a fresh failure and retry.
    let yaml = format!(
        "devices: [{{name: gpu0, kind: simulated, capacity: 1GiB}}]\n\
         models: [{{name: encoder, path: 'builtin:encoder', context: {{input: input, axis: 1}}}}]\n\
         pools:\n\
         - {{name: gpu, provider: simulated, device: gpu0, models: [encoder], fallback: cpu,\n\
             breaker: {{failures: 1000000, window: 1s, cooldown: 1s}}}}\n\
         - {{name: cpu, provider: cpu, models: [encoder]}}\n\
         host: {{reserve: 0}}\n\
         policy: {{path: '{}', watch_interval: 0s}}\n",
        policy.display()
    );
    let raw: RawConfig = parse_yaml(&yaml, "bench.yaml").unwrap();
    let config = raw
        .validate("bench.yaml", Path::new(env!("CARGO_MANIFEST_DIR")))
        .unwrap();
    let marks = Arc::new(Mutex::new(Marks::default()));
    let parts = Parts {
        backends: Arc::new(Factory(Arc::clone(&marks))),
        sources: Vec::new(),
        simulated: Vec::new(),
        clock: Arc::new(SystemClock),
    };
    let service = Service::assemble(config, parts).unwrap();
    // The runtime `vramguard serve` would have.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let request = || Request {
        meta: RunMeta {
            request_id: "bench".into(),
            replayable: true,
            ..RunMeta::default()
        },
        model: "encoder".into(),
        inputs: vec![Tensor {
            name: "input".into(),
            shape: vec![1, 128, 4],
            data: TensorData::Fp32(vec![0.5; 512]),
        }],
        outputs: vec![],
        max_new_tokens: 0,
        shrinker: None,
        received: tokio::time::Instant::now(),
        progress: Default::default(),
    };
    // Back to back (threads stay hot), then with idle gaps like a lightly loaded server, whose
    // threads park between requests and must be woken.
    let mut results = Vec::new();
    for gap in [Duration::ZERO, Duration::from_millis(2)] {
        let mut added = Vec::with_capacity(runs);
        runtime.block_on(async {
            for i in 0..runs + 100 {
                if !gap.is_zero() {
                    tokio::time::sleep(gap).await;
                }
                let served = lifecycle::infer(&service, request()).await.expect("retried on cpu");
                assert_eq!(served.pool.name(), "cpu");
                let m = marks.lock().unwrap();
                let took = m.retry_started_at.unwrap() - m.failed_at.unwrap();
                // The first runs warm caches up; they are not counted.
                if i >= 100 {
                    added.push(took);
                }
            }
        });
        added.sort();
        results.push((gap, added));
    }
    let _ = std::fs::remove_dir_all(dir);
    let micros = |d: Duration| format!("{:.1} µs", d.as_secs_f64() * 1e6);
    println!("failover: allocator failure on `gpu` → retry starts on `cpu` ({runs} runs each, both runs excluded)");
    let mut worst_median = Duration::ZERO;
    for (gap, added) in &results {
        let at = |p: f64| added[((added.len() - 1) as f64 * p).round() as usize];
        worst_median = worst_median.max(at(0.5));
        println!(
            "  {:<28} median {:>9}   p95 {:>9}   p99 {:>9}   max {:>9}",
            if gap.is_zero() {
                "back to back".to_string()
            } else {
                format!("{} ms idle between requests", gap.as_millis())
            },
            micros(at(0.5)),
            micros(at(0.95)),
            micros(at(0.99)),
            micros(*added.last().unwrap())
        );
    }
    println!(
        "  target: median ≤ 2 ms: {}",
        if worst_median <= Duration::from_millis(2) {
            "MET"
        } else {
            "MISSED"
        }
    );
    let figures = results
        .iter()
        .map(|(gap, added)| {
            let how = if gap.is_zero() {
                "back to back".to_string()
            } else {
                format!("{} ms idle between requests", gap.as_millis())
            };
            Figure::of_samples(
                format!("failover added latency (allocator failure → CPU run start), {how}"),
                "µs",
                &added.iter().map(|d| d.as_secs_f64() * 1e6).collect::<Vec<_>>(),
            )
            .target(Target::AtMost(2000.0))
        })
        .collect();
    record("failover", machine, started, figures);
}
