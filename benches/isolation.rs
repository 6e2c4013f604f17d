//! What process isolation costs: the same simulated pool (one worker, one intra-op thread)
//! served by two `vramguard serve` processes, one with `isolation: thread` and one with
//! `isolation: process`, the bundled encoder at seq 128 and 1024 in binary tensors; and how
//! long a killed worker takes to serve again.
//!
//! `cargo bench --bench isolation [-- --runs N --seconds S --kills K]`. Figures go to
//! `target/bench/isolation.json`.
//!
//! - Added median latency at concurrency 1 (process less thread): in each run, the median of
//!   the differences within 4 pairs of 1 s measurements, which one goes first alternating
//!   ([`Paired`]). Saturated throughput (4 connections) as a share of the thread pool's,
//!   measured in turn within each run, so drift of a shared machine shows as spread. The load
//!   generator is wrk, a separate process.
//! - The same saturated pair again with the pool on a CPU of its own (the last one,
//!   `pools[].cpus`) and the server's threads on the others (`server.cpus`), on a machine with
//!   two CPUs or more: on shared CPUs, a worker process and vramguard's threads take turns on a
//!   core, each switch of address space costing both their warm caches.
//! - Recovery: K times, 5.2 s apart (a worker lost sooner after its start waits out a longer
//!   backoff, as a crash loop), the worker process is killed with SIGKILL (`kill -9`, as the
//!   kernel's OOM killer or a crash would) while idle, and `/status` is polled every 2 ms until a new
//!   worker pid shows with the breaker closed: the supervisor found the death, started a new
//!   process, rebuilt the pool's sessions there, and its health check's probe passed. No request
//!   is sent meanwhile.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use vramguard::core::cpus::CpuSet;
use vramguard::testing::Scratch;
use vramguard::testing::bench::server::{self, Server, Stats, wrk, wrk_script};
use vramguard::testing::bench::{Figure, Machine, Paired, Target, arg, encoder_binary_body, out_dir, record};

const SEQS: [usize; 2] = [128, 1024];
const SATURATING_CONNECTIONS: usize = 4;
/// Pairs of 1 s measurements at concurrency 1 in each run.
const C1_PAIRS: usize = 4;
const INFER_PATH: &str = "/v2/models/encoder/infer";

/// The server under test, with its pool's `isolation`, and where it runs: `placed` gives the
/// server's threads and the pool their own CPUs (`server.cpus`, `pools[].cpus`).
fn config(isolation: &str, placed: Option<&(CpuSet, CpuSet)>) -> String {
    let (server_cpus, pool_cpus) = match placed {
        Some((server, pool)) => (format!(", cpus: '{server}'"), format!(", cpus: '{pool}'")),
        None => (String::new(), String::new()),
    };
    format!(
        "devices: [{{name: sim0, kind: simulated, capacity: 2GiB}}]
models:
  - {{name: encoder, path: 'builtin:encoder', context: {{input: input, axis: 1, keep: end}}}}
pools:
  - {{name: gpu, provider: simulated, device: sim0, models: [encoder], workers: 1, intra_threads: 1,
     isolation: {isolation}, queue: {{capacity: 256}}{pool_cpus}}}
policy:
  path: 'builtin:default'
  params: {{cpu_pool: gpu, reserve_bytes: 32MiB, min_context_tokens: 16, defer_ms: 25, defer_max_queue: 4}}
server: {{admin_socket: 'off'{server_cpus}}}
"
    )
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// A checked binary request to `server`, and its wrk script.
fn script(scratch: &Scratch, server: &Server, name: &str, seq: usize) -> std::path::PathBuf {
    let (header_length, body) = encoder_binary_body(seq);
    let response = server.post(
        INFER_PATH,
        "application/octet-stream",
        &[("inference-header-content-length", header_length.to_string())],
        body.clone(),
    );
    assert_eq!(response.status(), StatusCode::OK, "{name}: {:?}", response.headers());
    assert_eq!(
        response.headers().get("x-vramguard-pool").and_then(|v| v.to_str().ok()),
        Some("gpu")
    );
    wrk_script(
        scratch,
        &format!("{name}-{seq}"),
        &body,
        &[
            ("Content-Type", "application/octet-stream".into()),
            ("Inference-Header-Content-Length", header_length.to_string()),
        ],
    )
}

fn status(server: &Server) -> Value {
    reqwest::blocking::get(server.url("/status")).unwrap().json().unwrap()
}

/// The gpu pool's worker pid and whether its breaker is closed.
fn worker(server: &Server) -> (Option<u64>, bool) {
    let status = status(server);
    let pool = status["pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "gpu")
        .cloned()
        .unwrap();
    (pool["worker_pid"].as_u64(), pool["breaker"] == "closed")
}

/// Kill the worker and time until a new one serves with the breaker closed.
fn recovery(server: &Server) -> Duration {
    let (Some(old), true) = worker(server) else {
        panic!("no healthy worker to kill: {}", status(server))
    };
    let killed = Instant::now();
    let ok = std::process::Command::new("kill")
        .args(["-9", &old.to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    loop {
        if let (Some(pid), true) = worker(server)
            && pid != old
        {
            return killed.elapsed();
        }
        assert!(killed.elapsed() < Duration::from_secs(60), "no new worker after 60 s");
        std::thread::sleep(Duration::from_millis(2));
    }
}

struct Run {
    /// Median latency at concurrency 1 (µs), thread then process, in alternating pairs.
    c1: Paired,
    thread_saturated: Stats,
    process_saturated: Stats,
    /// Saturated, with the pool on a CPU of its own (thread, process); none on one CPU.
    placed: Option<(Stats, Stats)>,
}

fn figures(seq: usize, runs: &[Run]) -> Vec<Figure> {
    let of = |name: &str, unit: &str, f: &dyn Fn(&Run) -> f64| {
        Figure::of_runs(
            format!("{name}, seq {seq}"),
            unit,
            &runs.iter().map(f).collect::<Vec<_>>(),
        )
    };
    let c = SATURATING_CONNECTIONS;
    let mut figures = vec![
        of("thread isolation latency c1", "µs", &|r| r.c1.median_a()),
        of("process isolation latency c1", "µs", &|r| r.c1.median_b()),
        of("added latency c1 (process − thread)", "µs", &|r| {
            r.c1.median_difference()
        })
        .target(Target::AtMost(30.0))
        .note(Paired::note(
            C1_PAIRS,
            "differences",
            "1 s measurements (thread, process isolation)",
        )),
        of(&format!("thread isolation throughput c{c}"), "req/s", &|r| {
            r.thread_saturated.per_second
        }),
        of(&format!("process isolation throughput c{c}"), "req/s", &|r| {
            r.process_saturated.per_second
        }),
        of("saturated throughput, process / thread", "%", &|r| {
            100.0 * r.process_saturated.per_second / r.thread_saturated.per_second
        })
        .target(Target::AtLeast(95.0)),
    ];
    if runs.iter().all(|r| r.placed.is_some()) {
        let placed = |r: &Run| {
            r.placed
                .as_ref()
                .map(|(t, p)| (t.per_second, p.per_second))
                .unwrap_or_default()
        };
        figures.extend([
            of(
                &format!("thread isolation throughput c{c}, pool on its own CPU"),
                "req/s",
                &|r| placed(r).0,
            ),
            of(
                &format!("process isolation throughput c{c}, pool on its own CPU"),
                "req/s",
                &|r| placed(r).1,
            ),
            of(
                "saturated throughput, process / thread, pool on its own CPU",
                "%",
                &|r| {
                    let (t, p) = placed(r);
                    100.0 * p / t
                },
            )
            .target(Target::AtLeast(95.0))
            .note("server.cpus: all but the last CPU; pools[].cpus: the last"),
        ]);
    }
    figures
}

fn main() {
    let (started, machine) = (Instant::now(), Machine::now());
    let (runs, seconds) = (arg("--runs", 3usize), arg("--seconds", 2.0f64).max(1.0) as u64);
    let kills = arg("--kills", 20usize);
    let version = server::wrk_version().unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(2);
    });
    let scratch = Scratch::new();
    let bin = env!("CARGO_BIN_EXE_vramguard");
    let thread = Server::vramguard(bin, &scratch, "thread", &config("thread", None));
    let process = Server::vramguard(bin, &scratch, "process", &config("process", None));
    // The same pair with the pool on the last CPU and the server's threads on the others.
    let cpus = CpuSet::current().expect("this thread's CPUs");
    let placement = (cpus.len() >= 2).then(|| {
        let last = cpus.iter().last().expect("a CPU");
        (
            CpuSet::new(cpus.iter().filter(|&c| c != last)).expect("another CPU"),
            CpuSet::new([last]).expect("a CPU"),
        )
    });
    let placed = placement.as_ref().map(|placement| {
        (
            Server::vramguard(bin, &scratch, "thread-placed", &config("thread", Some(placement))),
            Server::vramguard(bin, &scratch, "process-placed", &config("process", Some(placement))),
        )
    });
    let scripts: Vec<_> = SEQS
        .iter()
        .map(|&seq| {
            let t = script(&scratch, &thread, "thread", seq);
            let p = script(&scratch, &process, "process", seq);
            // Warm-up: connections, worker threads, allocators.
            wrk(&thread.url(INFER_PATH), &t, SATURATING_CONNECTIONS, 1);
            wrk(&process.url(INFER_PATH), &p, SATURATING_CONNECTIONS, 1);
            let placed = placed.as_ref().map(|(thread, process)| {
                let pt = script(&scratch, thread, "thread-placed", seq);
                let pp = script(&scratch, process, "process-placed", seq);
                wrk(&thread.url(INFER_PATH), &pt, SATURATING_CONNECTIONS, 1);
                wrk(&process.url(INFER_PATH), &pp, SATURATING_CONNECTIONS, 1);
                (pt, pp)
            });
            (t, p, placed)
        })
        .collect();
    let mut results: Vec<Vec<Run>> = SEQS.iter().map(|_| Vec::new()).collect();
    let (t_url, p_url) = (thread.url(INFER_PATH), process.url(INFER_PATH));
    let c = SATURATING_CONNECTIONS;
    for run in 0..runs {
        for ((seq, (t, p, scripts_placed)), out) in SEQS.iter().zip(&scripts).zip(&mut results) {
            eprintln!("isolation: run {}/{runs}, seq {seq}", run + 1);
            // Tens of µs between two medians of ~3 ms: measured in pairs (see `Paired`).
            let c1 = Paired::measure(
                C1_PAIRS,
                || us(wrk(&t_url, t, 1, 1).median),
                || us(wrk(&p_url, p, 1, 1).median),
            );
            out.push(Run {
                c1,
                thread_saturated: wrk(&t_url, t, c, seconds),
                process_saturated: wrk(&p_url, p, c, seconds),
                placed: placed
                    .as_ref()
                    .zip(scripts_placed.as_ref())
                    .map(|((ts, ps), (pt, pp))| {
                        (
                            wrk(&ts.url(INFER_PATH), pt, c, seconds),
                            wrk(&ps.url(INFER_PATH), pp, c, seconds),
                        )
                    }),
            });
        }
    }
    let mut recoveries = Vec::new();
    for k in 0..kills {
        eprintln!("isolation: kill {}/{kills}", k + 1);
        // A worker lost within 5 s of its start is taken for a crash loop and restarted after a
        // longer backoff: each one here has served longer than that.
        std::thread::sleep(Duration::from_millis(5200));
        recoveries.push(recovery(&process).as_secs_f64() * 1e3);
    }
    drop((thread, process, placed));
    println!();
    println!(
        "isolation: bundled encoder, batch 1, one simulated pool of 1 worker × 1 intra-op thread, isolation thread vs process, {runs} runs of {seconds} s per measurement"
    );
    println!("client: wrk {version}, 1 thread, a separate process; saturated = {c} connections");
    let mut figures: Vec<Figure> = SEQS
        .iter()
        .zip(&results)
        .flat_map(|(&seq, runs)| figures(seq, runs))
        .collect();
    if !recoveries.is_empty() {
        figures.push(
            Figure::of_runs("worker killed to serving again (probe passed)", "ms", &recoveries)
                .target(Target::AtMost(2000.0))
                .note(format!(
                    "{} kills with SIGKILL, idle pool; includes rebuilding the sessions",
                    recoveries.len()
                )),
        );
    }
    record(
        "isolation",
        &out_dir(env!("CARGO_TARGET_TMPDIR")),
        machine,
        started,
        figures,
    );
}
