//! Policy evaluation cost: `policies/default.rhai` deciding for one request against a realistic
//! snapshot (2 devices, 3 pools, 20 processes), building the script's inputs included, versus
//! the same decision written as a plain Rust function, in one run.
//!
//! `cargo bench --bench policy` prints criterion's estimates, then per scenario: criterion's
//! median, the median and p99 of 100 000 individually timed evaluations (timer included), the
//! Rust baseline's criterion median and the ratio of the two criterion medians; the figures of
//! `admit_live_pools`, `admit_cpu` and `redirect` go to `target/bench/policy.json` (the p99's
//! spread is that of ten blocks of 10 000 evaluations). Scenarios:
//! - `admit_live_pools`: the same with the pools' load read live as the script reads a pool
//!   ([`StateView::with_live_load`]), the view itself built once per sample: what the server
//!   does for every request.
//! - `admit_cpu`: that admit for a request the router put on the CPU pool, the script's other
//!   admit path (and the one the overhead bench's server takes on every request).
//! - `admit`: the common case (the request fits), through [`PolicyHandle::decide_view`] with the
//!   snapshot's script view cached and cloned per call, as `Service::policy_view` hands it out
//!   while nothing moved;
//! - `redirect`: the longest path through the script (no fit, no deferral, no shrink, CPU);
//! - `admit_fresh_snapshot`: the same admit with the snapshot converted for this call only
//!   (what every call would cost without the cache, i.e. right after each sampler tick).
//!
//! - cold caches (`admit_live_pools`, `admit_cpu` and the Rust baseline's `admit_cpu`): the
//!   median of evaluations that each start after 64 MiB were written elsewhere
//!   ([`sampled_cold`]), as in the server at seq 1024, where requests come milliseconds apart;
//!   `POLICY_BENCH_LOOP=admit_cpu_cold:<count>` loops over that for cachegrind's
//!   `--cache-sim=yes` (the difference of two counts gives one evaluation's misses).
//!
//! For a profiler or an allocation count, `POLICY_BENCH_LOOP=<scenario>:<count>` runs just that
//! many evaluations of one scenario and exits, without criterion, e.g.
//! `POLICY_BENCH_LOOP=admit_live_pools:100000 perf record -g target/release/deps/policy-<hash>`;
//! counting `malloc` calls (`perf probe -x libc.so.6 malloc`) at two counts gives the
//! allocations per evaluation.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::Criterion;
use vramguard::config::PolicySource;
use vramguard::core::snapshot::{
    BreakerState, Decision, DeviceClass, DeviceState, Estimate, EstimateSource, HostState, PoolState, ProcessState,
    ProviderKind, RequestInfo, ServiceState, Snapshot,
};
use vramguard::policy::{LiveLoad, Params, PolicyHandle, PolicySettings, PoolLoadNow, StateView};
use vramguard::testing::bench::{Figure, Machine, Target, out_dir, percentile, record};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
const TIMED_EVALUATIONS: usize = 100_000;
/// Evaluations timed with cold caches ([`sampled_cold`]), and what is written before each.
const COLD_EVALUATIONS: usize = 300;
const EVICTING_BYTES: usize = 64 << 20;

fn params() -> Params {
    let mut p = Params::new();
    p.insert("cpu_pool".into(), "cpu".into());
    p.insert("reserve_bytes".into(), (512 * MIB).into());
    p.insert("min_context_tokens".into(), 64.into());
    p.insert("defer_ms".into(), 50.into());
    p.insert("defer_max_queue".into(), 2.into());
    p
}

fn snapshot() -> Snapshot {
    let device = |used: u64, reserved: u64, active: u64| DeviceState {
        kind: DeviceClass::Nvml,
        total_bytes: 80 * GIB,
        used_bytes: used,
        free_bytes: 80 * GIB - used,
        reserved_bytes: reserved,
        active_bytes: active,
        headroom_bytes: 80 * GIB - used + reserved - active,
    };
    let pool = |provider: ProviderKind, device: &str, breaker: BreakerState, queue: u64, delay: u64| PoolState {
        provider,
        device: device.into(),
        breaker,
        queue_depth: queue,
        queue_oldest_age_ms: queue * 40,
        inflight: 1,
        concurrency: 2,
        alloc_failures_recent: 0,
        est_delay_ms: delay,
        max_context: 0,
        sequences_waiting: 0,
        sequences_running: 1,
        kv_cache_bytes: 64 << 20,
    };
    let services = ["ollama", "comfyui", "whisper", "vramguard", "other"];
    Snapshot {
        devices: BTreeMap::from([
            ("gpu0".into(), device(70 * GIB, 6 * GIB, 5 * GIB)),
            ("gpu1".into(), device(40 * GIB, 2 * GIB, GIB)),
        ]),
        pools: BTreeMap::from([
            (
                "gpu".into(),
                pool(ProviderKind::Cuda, "gpu0", BreakerState::Closed, 1, 120),
            ),
            (
                "gpu-b".into(),
                pool(ProviderKind::Cuda, "gpu1", BreakerState::Closed, 0, 80),
            ),
            (
                "cpu".into(),
                pool(ProviderKind::Cpu, "host", BreakerState::Closed, 3, 4000),
            ),
        ]),
        host: HostState {
            mem_available_bytes: 48 * GIB,
            mem_total_bytes: 128 * GIB,
            reserve_bytes: 8 * GIB,
        },
        processes: (0..20u32)
            .map(|i| ProcessState {
                pid: 4000 + i,
                name: format!("worker-{i}"),
                service: services[i as usize % services.len()].into(),
                device: if i % 2 == 0 { "gpu0" } else { "gpu1" }.into(),
                used_bytes: (1 + u64::from(i % 7)) * GIB,
            })
            .collect(),
        degraded: false,
        // The services a request reads under a budget: its own, with memory on both devices.
        services: BTreeMap::from([(
            "encoder".into(),
            ServiceState {
                budget_bytes: 24 * GIB,
                memory_bytes: BTreeMap::from([("gpu0".into(), 6 * GIB), ("gpu1".into(), 0)]),
                ..ServiceState::default()
            },
        )]),
        models: Default::default(),
    }
}

fn request(context_tokens: u64, context_bytes: u64) -> RequestInfo {
    RequestInfo {
        id: "0b6f3c1e-2f4d-4b7a-9a51-6d2c8e0f1a77".into(),
        model: "encoder".into(),
        pool: "gpu".into(),
        service: "encoder".into(),
        context_tokens,
        max_new_tokens: 0,
        batch: 1,
        priority: 0,
        replayable: true,
        allow_shrink: true,
        deadline_ms: 30_000,
        estimate: Estimate {
            weights_bytes: 4 * GIB,
            context_bytes,
            workspace_bytes: 256 * MIB,
            total_bytes: 4 * GIB + context_bytes + 256 * MIB,
            source: EstimateSource::Profile,
        },
        dims: [("batch".to_string(), 1), ("seq".to_string(), context_tokens)].into(),
        load_bytes: 0,
        evictable_bytes: 0,
    }
}

/// Fits the 11 GiB headroom of `gpu0` less its reserve: the admit path.
fn admit_request() -> RequestInfo {
    request(4096, 2 * GIB)
}

/// The same request on the CPU pool (as the router places it when no accelerator pool serves the
/// model, and as the overhead bench's server runs every request): the host has room.
fn cpu_request() -> RequestInfo {
    RequestInfo {
        pool: "cpu".into(),
        ..admit_request()
    }
}

/// Needs 20 GiB: more than `gpu0` has even once its in-flight work finishes, and the context
/// that would fit (51 tokens) is under the 64-token floor, so the script walks every branch
/// before redirecting to the CPU pool, which has 40 GiB above the host reserve.
fn redirect_request() -> RequestInfo {
    request(100, 20 * GIB)
}

/// `default.rhai`'s decision, written in Rust against the same data: the baseline.
fn rust_default(
    req: &RequestInfo,
    state: &Snapshot,
    reserve: u64,
    min_tokens: u64,
    defer_ms: u64,
    max_queue: u64,
) -> Decision {
    let cpu_can_take = |cpu: &PoolState, need: u64| {
        cpu.breaker != BreakerState::Open
            && need as i128 <= state.host.mem_available_bytes as i128 - state.host.reserve_bytes as i128
            && (cpu.max_context == 0 || req.context_tokens <= cpu.max_context)
            && (req.deadline_ms == 0 || cpu.est_delay_ms <= req.deadline_ms)
    };
    let Some(pool) = state.pools.get(&req.pool) else {
        return Decision::Reject {
            reason: "unknown pool".into(),
        };
    };
    let need = req.estimate.context_bytes + req.estimate.workspace_bytes;
    if pool.provider == ProviderKind::Cpu {
        return if cpu_can_take(pool, need) {
            Decision::Admit { pool: None }
        } else {
            Decision::Reject {
                reason: "the CPU pool cannot take it".into(),
            }
        };
    }
    let device = &state.devices[&pool.device];
    let room = device.headroom_bytes as i128 - reserve as i128;
    if pool.breaker != BreakerState::Open {
        if need as i128 <= room && (pool.max_context == 0 || req.context_tokens <= pool.max_context) {
            return Decision::Admit { pool: None };
        }
        if pool.inflight > 0
            && pool.queue_depth <= max_queue
            && need as i128 <= room + device.active_bytes as i128
            && (req.deadline_ms == 0 || defer_ms < req.deadline_ms)
        {
            return Decision::Defer { ms: defer_ms };
        }
        let n = req.context_tokens as i128;
        let for_context = room - req.estimate.workspace_bytes as i128;
        if n > 0 && req.estimate.context_bytes > 0 && for_context > 0 {
            let mut tokens = for_context * n / req.estimate.context_bytes as i128;
            if pool.max_context > 0 {
                tokens = tokens.min(pool.max_context as i128);
            }
            if tokens < n && tokens >= min_tokens as i128 && req.allow_shrink {
                return Decision::ShrinkContext { tokens: tokens as u64 };
            }
        }
    }
    match state.pools.get("cpu") {
        Some(cpu) if cpu_can_take(cpu, need) => Decision::Redirect { pool: "cpu".into() },
        _ => Decision::Reject {
            reason: format!("needs {need} bytes"),
        },
    }
}

/// Individually timed calls, in order (the timer's own cost, ~20 ns, included).
fn sampled(mut f: impl FnMut()) -> Vec<Duration> {
    for _ in 0..1000 {
        f();
    }
    let mut samples = Vec::with_capacity(TIMED_EVALUATIONS);
    for _ in 0..TIMED_EVALUATIONS {
        let started = Instant::now();
        f();
        samples.push(started.elapsed());
    }
    samples
}

/// Write through `buffer`, larger than the last-level cache, so that what runs next finds none
/// of its data (nor, where the caches include the instruction cache, its code) in them.
fn evict_caches(buffer: &mut [u8], round: usize) {
    for line in buffer.chunks_mut(64) {
        line[0] = line[0].wrapping_add(round as u8);
    }
    black_box(buffer);
}

/// Evaluations that each start with cold caches, as in the server at seq 1024, where requests
/// come milliseconds apart with ONNX Runtime's run between. Kinder than the server: the branch
/// predictors and the TLBs keep what the last evaluation left there.
fn sampled_cold(mut f: impl FnMut()) -> Vec<Duration> {
    let mut other_work = vec![0u8; EVICTING_BYTES];
    let mut samples = Vec::with_capacity(COLD_EVALUATIONS);
    for round in 0..COLD_EVALUATIONS {
        evict_caches(&mut other_work, round);
        let started = Instant::now();
        f();
        samples.push(started.elapsed());
    }
    samples
}

/// The figures of one scenario: the median with p5–p95 of every sample, and the p99 of each
/// of ten blocks of samples, so that the p99 has a spread too.
fn scenario_figures(name: &str, samples: &[Duration]) -> Vec<Figure> {
    // Issue 23's targets: the longest path (a redirect) may take twice the common one.
    let median_target = if name == "redirect" { 6.0 } else { 3.0 };
    let micros: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    let p99s: Vec<f64> = micros
        .chunks(micros.len() / 10)
        .map(|block| {
            let mut block = block.to_vec();
            block.sort_by(f64::total_cmp);
            vramguard::testing::bench::quantile(&block, 0.99)
        })
        .collect();
    vec![
        Figure::of_samples(format!("policy eval median, {name}"), "µs", &micros).target(Target::AtMost(median_target)),
        Figure::of_runs(format!("policy eval p99, {name}"), "µs", &p99s)
            .target(Target::AtMost(10.0))
            .note(format!("spread: the p99 of each of {} blocks of samples", p99s.len())),
    ]
}

/// Criterion's median for `policy/<name>`, read back from the estimates it just wrote.
fn criterion_median(dir: &Path, name: &str) -> Option<Duration> {
    let text = std::fs::read_to_string(dir.join("policy").join(name).join("new/estimates.json")).ok()?;
    let value: serde_json::Value = serde_json::from_str(&text).ok()?;
    let nanos = value.get("median")?.get("point_estimate")?.as_f64()?;
    Some(Duration::from_secs_f64(nanos / 1e9))
}

/// Live load read from the snapshot's own pool numbers (the server reads its pools' queues).
#[derive(Debug)]
struct SampledLoad(Arc<Snapshot>);

impl LiveLoad for SampledLoad {
    fn pool_load(&self, pool: &str) -> Option<PoolLoadNow> {
        self.0.pools.get(pool).map(|p| PoolLoadNow {
            queue_depth: p.queue_depth,
            queue_oldest_age_ms: p.queue_oldest_age_ms,
            inflight: p.inflight,
            alloc_failures_recent: p.alloc_failures_recent,
            est_delay_ms: p.est_delay_ms,
            breaker: p.breaker,
            sequences_waiting: p.sequences_waiting,
            sequences_running: p.sequences_running,
            kv_cache_bytes: p.kv_cache_bytes,
        })
    }
}

fn micros(d: Duration) -> String {
    format!("{:.2} µs", d.as_secs_f64() * 1e6)
}

fn main() {
    let (started, machine) = (Instant::now(), Machine::now());
    let settings = PolicySettings {
        fallback: Decision::Reject {
            reason: "policy failed".into(),
        },
        params: params(),
    };
    // Loading runs the policy's own test cases, exactly as the server does.
    let handle = PolicyHandle::load(PolicySource::File("policies/default.rhai".into()), settings)
        .expect("policies/default.rhai loads");
    let script = handle.current().script.clone();
    let snapshot = Arc::new(snapshot());
    let (admit, redirect, on_cpu) = (admit_request(), redirect_request(), cpu_request());
    let baseline = |req: &RequestInfo| rust_default(req, &snapshot, 512 * MIB, 64, 50, 2);

    assert_eq!(
        handle.decide(&admit, &snapshot).decision,
        Decision::Admit { pool: None }
    );
    assert_eq!(
        handle.decide(&redirect, &snapshot).decision,
        Decision::Redirect { pool: "cpu".into() }
    );
    assert_eq!(baseline(&admit), handle.decide(&admit, &snapshot).decision);
    assert_eq!(baseline(&redirect), handle.decide(&redirect, &snapshot).decision);
    assert_eq!(
        handle.decide(&on_cpu, &snapshot).decision,
        Decision::Admit { pool: None }
    );
    assert_eq!(baseline(&on_cpu), handle.decide(&on_cpu, &snapshot).decision);
    assert!(handle.decide(&admit, &snapshot).error.is_none());

    // What the server keeps between requests while the snapshot and the pools are unchanged.
    let cached = StateView::new(&snapshot);
    if let Ok(spec) = std::env::var("POLICY_BENCH_LOOP") {
        let (name, count) = spec.split_once(':').expect("POLICY_BENCH_LOOP=<scenario>:<count>");
        let count: usize = count.parse().expect("a count of evaluations");
        let live = StateView::new(&snapshot).with_live_load(Arc::new(SampledLoad(snapshot.clone())));
        let mut other_work = match name {
            "admit_cpu_cold" => vec![0u8; EVICTING_BYTES],
            _ => Vec::new(),
        };
        for _ in 0..count {
            let evaluation = match name {
                "admit" => handle.decide_view(black_box(&admit), &black_box(&cached).clone()),
                "redirect" => handle.decide_view(black_box(&redirect), &black_box(&cached).clone()),
                "admit_live_pools" => script.decide_view(black_box(&admit), black_box(&live)),
                "admit_cpu" => script.decide_view(black_box(&on_cpu), black_box(&live)),
                "admit_cpu_cold" => {
                    evict_caches(&mut other_work, 1);
                    script.decide_view(black_box(&on_cpu), black_box(&live))
                }
                "admit_fresh_snapshot" => script.decide(black_box(&admit), black_box(&snapshot)),
                other => panic!("no scenario {other}"),
            };
            black_box(evaluation);
        }
        return;
    }
    let output = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("criterion");
    let mut c = Criterion::default()
        .output_directory(&output)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    {
        let mut group = c.benchmark_group("policy");
        group.bench_function("admit", |b| {
            b.iter(|| handle.decide_view(black_box(&admit), &black_box(&cached).clone()))
        });
        group.bench_function("redirect", |b| {
            b.iter(|| handle.decide_view(black_box(&redirect), &black_box(&cached).clone()))
        });
        group.bench_function("admit_fresh_snapshot", |b| {
            b.iter(|| script.decide(black_box(&admit), black_box(&snapshot)))
        });
        let live = StateView::new(&snapshot).with_live_load(Arc::new(SampledLoad(snapshot.clone())));
        group.bench_function("admit_live_pools", |b| {
            b.iter(|| script.decide_view(black_box(&admit), black_box(&live)))
        });
        group.bench_function("admit_cpu", |b| {
            b.iter(|| script.decide_view(black_box(&on_cpu), black_box(&live)))
        });
        group.bench_function("rust_admit", |b| b.iter(|| baseline(black_box(&admit))));
        group.bench_function("rust_admit_cpu", |b| b.iter(|| baseline(black_box(&on_cpu))));
        group.bench_function("rust_redirect", |b| b.iter(|| baseline(black_box(&redirect))));
        group.finish();
    }
    c.final_summary();

    // The ratio compares criterion's medians: per-call timing of a 16 ns function would mostly
    // measure the clock. The sampled columns give the script's own distribution.
    println!();
    println!(
        "{:<22} {:>16} {:>14} {:>14} {:>22} {:>8}",
        "scenario", "criterion median", "median", "p99", "Rust baseline (crit.)", "ratio"
    );
    let live = StateView::new(&snapshot).with_live_load(Arc::new(SampledLoad(snapshot.clone())));
    let rows: [(&str, &str, &RequestInfo, u8); 5] = [
        ("admit", "rust_admit", &admit, 0),
        ("redirect", "rust_redirect", &redirect, 0),
        ("admit_live_pools", "rust_admit", &admit, 1),
        ("admit_cpu", "rust_admit_cpu", &on_cpu, 1),
        ("admit_fresh_snapshot", "rust_admit", &admit, 2),
    ];
    let mut figures = Vec::new();
    for (name, rust_name, req, view) in rows {
        let mut samples = match view {
            0 => sampled(|| {
                black_box(handle.decide_view(black_box(req), &black_box(&cached).clone()));
            }),
            1 => sampled(|| {
                black_box(script.decide_view(black_box(req), black_box(&live)));
            }),
            _ => sampled(|| {
                black_box(script.decide(black_box(req), black_box(&snapshot)));
            }),
        };
        if matches!(name, "admit_live_pools" | "admit_cpu" | "redirect") {
            figures.extend(scenario_figures(name, &samples));
        }
        samples.sort();
        let (median, p99) = (percentile(&samples, 0.5), percentile(&samples, 0.99));
        let script = criterion_median(&output, name);
        let rust = criterion_median(&output, rust_name);
        let ratio = match (script, rust) {
            (Some(s), Some(r)) => format!("{:.0}x", s.as_secs_f64() / r.as_secs_f64().max(1e-12)),
            _ => "n/a".to_string(),
        };
        println!(
            "{name:<22} {:>16} {:>14} {:>14} {:>22} {ratio:>8}",
            script.map_or("n/a".to_string(), micros),
            micros(median),
            micros(p99),
            rust.map_or("n/a".to_string(), |d| format!("{:.1} ns", d.as_secs_f64() * 1e9)),
        );
    }
    println!("targets (issue 23): median ≤ 3 µs for an admit, ≤ 6 µs for `redirect`; p99 ≤ 10 µs (inputs included)");
    println!();
    let cold: [(&str, &dyn Fn()); 3] = [
        ("admit_live_pools", &|| {
            black_box(script.decide_view(black_box(&admit), black_box(&live)));
        }),
        ("admit_cpu", &|| {
            black_box(script.decide_view(black_box(&on_cpu), black_box(&live)));
        }),
        ("rust_admit_cpu", &|| {
            black_box(baseline(black_box(&on_cpu)));
        }),
    ];
    for (name, evaluate) in cold {
        let mut samples = sampled_cold(evaluate);
        let values: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
        figures.push(
            Figure::of_samples(format!("policy eval median, {name}, cold caches"), "µs", &values).note(format!(
                "{COLD_EVALUATIONS} evaluations, each after {} MiB written elsewhere (the server's case at seq 1024)",
                EVICTING_BYTES >> 20
            )),
        );
        samples.sort();
        println!(
            "{name:<22} cold caches: median {}, p90 {} ({COLD_EVALUATIONS} evaluations, each after {} MiB written elsewhere)",
            micros(percentile(&samples, 0.5)),
            micros(percentile(&samples, 0.9)),
            EVICTING_BYTES >> 20,
        );
    }
    record(
        "policy",
        &out_dir(env!("CARGO_TARGET_TMPDIR")),
        machine,
        started,
        figures,
    );
}
