//! Failover cost: the time from an allocator failure on the accelerator pool to the start of
//! the retry on the CPU pool, excluding both runs. The service is the real one (policy,
//! lifecycle, pools, metrics) on backends that only take timestamps, so what is measured is
//! vramguard's own work: the error travelling back, the retry decision, re-queueing, and the
//! CPU worker picking the job up.
//!
//! `cargo bench --bench failover [-- --runs N]` prints the median, p95 and p99 against the
//! issue's target (median ≤ 2 ms); the figures go to `target/bench/failover.json`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vramguard::core::backend::{AllocFailureKind, Backend, BackendError, RunMeta};
use vramguard::core::tensor::Tensor;
use vramguard::serve::lifecycle;
use vramguard::testing::bench::{Figure, Machine, Target, arg, out_dir, record};
use vramguard::testing::fakes::{FakeFactory, encoder_request, service};
use vramguard::testing::{ADMIT_ALL, Scratch, config};

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

    vramguard::testing::fakes::lacks!(residency, generations, arenas, liveness, interrupts);
}

fn main() {
    let (started, machine) = (Instant::now(), Machine::now());
    let runs: usize = arg("--runs", 2000);
    let scratch = Scratch::new();
    // The breaker never opens here: every run is a fresh failure and retry.
    let yaml = format!(
        "devices: [{{name: gpu0, kind: simulated, capacity: 1GiB}}]\n\
         models: [{{name: encoder, path: 'builtin:encoder', context: {{input: input, axis: 1}}}}]\n\
         pools:\n\
         - {{name: gpu, provider: simulated, device: gpu0, models: [encoder], fallback: cpu,\n\
             breaker: {{failures: 1000000, window: 1s, cooldown: 1s}}}}\n\
         - {{name: cpu, provider: cpu, models: [encoder]}}\n\
         host: {{reserve: 0}}\n{}",
        scratch.policy(ADMIT_ALL)
    );
    let marks = Arc::new(Mutex::new(Marks::default()));
    let backends = {
        let marks = Arc::clone(&marks);
        FakeFactory::new(move |pool| {
            Ok(Box::new(Timed {
                fails: pool.name == "gpu",
                marks: Arc::clone(&marks),
            }) as Box<dyn Backend>)
        })
    };
    let service = service(config::validated(&yaml), Arc::new(backends));
    // The runtime `vramguard serve` would have.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
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
                let served = lifecycle::infer(&service, encoder_request(128, 0.5))
                    .await
                    .expect("retried on cpu");
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
    record(
        "failover",
        &out_dir(env!("CARGO_TARGET_TMPDIR")),
        machine,
        started,
        figures,
    );
}
