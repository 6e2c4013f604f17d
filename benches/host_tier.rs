//! Cold start from each tier (issue 54): what loading a model after an unload costs when its
//! bytes come from its ONNX file's bytes (`host.model_cache: 0`, vramguard before the host
//! tier), from the optimized cache on disk, and from the host tier, against the time to copy
//! the weights once in memory on this machine (the bus limit here; on a GPU, weights ÷ PCIe).
//!
//! The release binary on loopback; per model, on a `cpu` pool (the host tier serves CPU and
//! simulated pools, see `runtime::onnx::cache_form`), the admin API unloads the model and loads it again: that call's latency is the
//! cold start less a run (request arrival to model ready). The metric
//! `vramguard_model_session_loads_total{source}` checks each load came from the source meant.
//!
//! Models: the bench decoder (`benches/larger_decoder.py`, ~150 MB, into
//! `target/bench/decoder-large`) and PP-OCRv4's text detector (`VRAMGUARD_PPOCR_DET`: the
//! `ch_PP-OCRv4_det_infer.onnx` of the `rapidocr-onnxruntime` wheel); either is skipped when
//! absent. `cargo bench --bench host_tier [-- --runs N]`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use reqwest::blocking::Client;
use serde_json::json;
use vramguard::testing::Scratch;
use vramguard::testing::bench::{Figure, Machine, Target, arg, out_dir, record, series_value};
use vramguard::testing::process::{Serving, spawn_serving};

const TOKEN: &str = "bench-admin-token";

/// Where a load's bytes come from, as the config makes it.
#[derive(Clone, Copy, PartialEq)]
enum Source {
    Disk,
    OptimizedCache,
    HostTier,
}

impl Source {
    fn label(self) -> &'static str {
        match self {
            Source::Disk => "disk",
            Source::OptimizedCache => "optimized_cache",
            Source::HostTier => "host_tier",
        }
    }

    /// `host:` and the model's extra keys: no tier at all; a tier that admits nothing (one
    /// byte), so loads read the cache; a tier that holds the model from the start.
    fn config(self) -> (&'static str, &'static str) {
        match self {
            Source::Disk => ("model_cache: 0", ""),
            Source::OptimizedCache => ("model_cache: 1", ""),
            Source::HostTier => ("model_cache: 4GiB", ", host_tier: warm"),
        }
    }
}

fn main() {
    let (started, machine) = (Instant::now(), Machine::now());
    let runs: usize = arg("--runs", 7);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut models: Vec<(&str, PathBuf)> = Vec::new();
    let decoder = root.join("target/bench/decoder-large/model.onnx");
    match decoder.is_file() {
        true => models.push(("decoder", decoder)),
        false => eprintln!("no {}: run benches/larger_decoder.py (see its doc)", decoder.display()),
    }
    match std::env::var_os("VRAMGUARD_PPOCR_DET").map(PathBuf::from) {
        Some(det) if det.is_file() => models.push(("ppocr_det", det)),
        _ => eprintln!("VRAMGUARD_PPOCR_DET unset or missing: the PP-OCRv4 detector is skipped"),
    }
    let mut figures = Vec::new();
    for (name, path) in &models {
        let copy = copy_once(path);
        // CPU pools: a simulated pool builds the same sessions, into its capped arena (CUDA
        // pools load from the ONNX bytes still, see `runtime::onnx::cache_form`).
        for pool in ["cpu"] {
            let scratch = Scratch::new();
            let mut medians = Vec::new();
            for source in [Source::Disk, Source::OptimizedCache, Source::HostTier] {
                let samples = cold_starts(&scratch, name, path, pool, source, runs);
                let median = samples[samples.len() / 2];
                medians.push(median);
                let mut figure = Figure::of_samples(
                    format!("{name} on {pool}: cold start from {}", source.label()),
                    "ms",
                    &samples,
                );
                if source == Source::HostTier {
                    figure = figure.target(Target::AtMost(medians[0] * 0.2)).note(format!(
                        "{:.0}% of disk's {:.1} ms; {:.1}× copying the weights once ({copy:.1} ms)",
                        median / medians[0] * 100.0,
                        medians[0],
                        median / copy
                    ));
                }
                figures.push(figure);
            }
        }
        figures.push(Figure::of_runs(
            format!("{name}: copying its file's bytes once in memory"),
            "ms",
            &[copy],
        ));
        figures.extend(memory_per_worker(name, path));
    }
    record(
        "host_tier",
        &out_dir(env!("CARGO_TARGET_TMPDIR")),
        machine,
        started,
        figures,
    );
}

/// What each worker after the first adds to the server's memory (issue 54's "weights once
/// per machine"), in threads and in a worker process, with the model loaded at start from its
/// file (`model_cache: 0`) and from the optimized cache (a restart; on a CPU pool its sessions
/// map the entry's weights file), against the model's weights (its file). Each figure is
/// measured both as `VmRSS` (a page counts in every process that maps it) and as `Pss` (a
/// shared page counts 1/n in each of the n processes that map it), summed over the server and
/// its worker processes.
fn memory_per_worker(model: &str, path: &Path) -> Vec<Figure> {
    const WORKERS: usize = 3;
    let weights = std::fs::metadata(path).unwrap().len() as f64 / MIB;
    let scratch = Scratch::new();
    let cache = scratch.path().join("optimized");
    let resident = |source: Source, isolation: &str, workers: usize| {
        let budget = if source == Source::Disk { "0" } else { "4GiB" };
        let yaml = format!(
            "server: {{listen: '127.0.0.1:0', admin_socket: 'off'}}\n\
             host: {{reserve: 256MiB, model_cache: {budget}, optimized_cache: '{}'}}\n\
             models:\n  - {{name: {model}, path: '{}'}}\n\
             pools:\n  - {{name: p, provider: cpu, models: [{model}], workers: {workers}, isolation: {isolation}}}\n",
            cache.display(),
            path.display(),
        );
        let file = scratch.write(&format!("{model}-{}-{isolation}-{workers}.yaml", source.label()), yaml);
        let serving = spawn_serving(
            env!("CARGO_BIN_EXE_vramguard"),
            &["serve", "--config", file.to_str().unwrap()],
            &[],
            "vramguard serving",
        );
        let series = format!(
            "vramguard_model_session_loads_total{{model=\"{model}\",pool=\"p\",source=\"{}\"}}",
            source.label()
        );
        let loads = series_value(&serving.metrics(&Client::new()), &series);
        assert!(loads >= 1.0, "{model}: the sessions from {}", source.label());
        memory(serving.child.id())
    };
    let mut figures = Vec::new();
    for isolation in ["thread", "process"] {
        for source in [Source::Disk, Source::OptimizedCache] {
            if source == Source::OptimizedCache {
                wait_for_entry(&cache, model, path);
            }
            let (one, many) = (resident(source, isolation, 1), resident(source, isolation, WORKERS));
            for (measure, per_worker) in [
                ("VmRSS", (many.0 - one.0) / (WORKERS - 1) as f64),
                ("Pss", (many.1 - one.1) / (WORKERS - 1) as f64),
            ] {
                figures.push(
                    Figure::of_runs(
                        format!(
                            "{model}: {measure} per extra worker ({isolation} isolation), loaded from {}",
                            source.label()
                        ),
                        "MiB",
                        &[per_worker],
                    )
                    .note(format!(
                        "{:.0}% of its {weights:.1} MiB of weights (1 and {WORKERS} workers after start, \
                         server and worker processes; 1 worker: VmRSS {:.1}, Pss {:.1} MiB)",
                        per_worker / weights * 100.0,
                        one.0,
                        one.1
                    )),
                );
            }
        }
    }
    figures
}

const MIB: f64 = 1024.0 * 1024.0;

/// The resident memory of `pid` and its descendants (its worker process): `VmRSS` and `Pss`
/// summed, in MiB.
fn memory(pid: u32) -> (f64, f64) {
    let kib = |text: &str, field: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0.0)
    };
    let (mut rss, mut pss) = (0.0, 0.0);
    let mut pending = vec![pid];
    while let Some(pid) = pending.pop() {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
        rss += kib(&status, "VmRSS:") / 1024.0;
        pss += kib(&rollup, "Pss:") / 1024.0;
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten();
        for task in tasks {
            let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            pending.extend(children.split_whitespace().filter_map(|c| c.parse::<u32>().ok()));
        }
    }
    (rss, pss)
}

/// Start a server with the host tier on so `model`'s first load from its file writes its
/// optimized cache entry, and wait for it.
fn wait_for_entry(cache: &Path, model: &str, path: &Path) {
    if has_entry(cache) {
        return;
    }
    let scratch = Scratch::new();
    let yaml = format!(
        "server: {{listen: '127.0.0.1:0', admin_socket: 'off'}}\n\
         host: {{reserve: 256MiB, optimized_cache: '{}'}}\n\
         models:\n  - {{name: {model}, path: '{}'}}\n\
         pools:\n  - {{name: p, provider: cpu, models: [{model}], workers: 1}}\n",
        cache.display(),
        path.display(),
    );
    let file = scratch.write("write-entry.yaml", yaml);
    let _serving = spawn_serving(
        env!("CARGO_BIN_EXE_vramguard"),
        &["serve", "--config", file.to_str().unwrap()],
        &[],
        "vramguard serving",
    );
    let deadline = Instant::now() + Duration::from_secs(300);
    while !has_entry(cache) {
        assert!(Instant::now() < deadline, "no optimized cache entry was written");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The best of five copies of `path`'s bytes in memory, in milliseconds.
fn copy_once(path: &Path) -> f64 {
    let bytes = std::fs::read(path).unwrap();
    (0..5)
        .map(|_| {
            let started = Instant::now();
            let copy = std::hint::black_box(bytes.clone());
            let took = started.elapsed().as_secs_f64() * 1e3;
            drop(copy);
            took
        })
        .fold(f64::MAX, f64::min)
}

/// `runs` cold starts (unload, then load through the admin API) of `model` on a `pool` pool
/// with its bytes from `source`, in milliseconds, sorted.
fn cold_starts(scratch: &Scratch, model: &str, path: &Path, pool: &str, source: Source, runs: usize) -> Vec<f64> {
    let (host, extra) = source.config();
    let cache = scratch.path().join("optimized");
    let yaml = format!(
        "server: {{listen: '127.0.0.1:0', admin_socket: 'off', admin_token_env: VRAMGUARD_BENCH_TOKEN}}\n\
         host: {{reserve: 256MiB, {host}, optimized_cache: '{}'}}\n\
         models:\n  - {{name: {model}, path: '{}', residency: on_demand{extra}}}\n\
         pools:\n  - {{name: p, provider: {pool}, models: [{model}], workers: 1}}\n",
        cache.display(),
        path.display(),
    );
    let file = scratch.write(&format!("{model}-{pool}-{}.yaml", source.label()), yaml);
    let serving = spawn_serving(
        env!("CARGO_BIN_EXE_vramguard"),
        &["serve", "--config", file.to_str().unwrap()],
        &[("VRAMGUARD_BENCH_TOKEN", TOKEN)],
        "vramguard serving",
    );
    let client = Client::new();
    if source == Source::OptimizedCache {
        // The first load from the ONNX bytes writes the cache entry in the background.
        admin(&client, &serving, model, "load");
        let deadline = Instant::now() + Duration::from_secs(300);
        while !has_entry(&cache) {
            assert!(Instant::now() < deadline, "no optimized cache entry was written");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let series = format!(
        "vramguard_model_session_loads_total{{model=\"{model}\",pool=\"p\",source=\"{}\"}}",
        source.label()
    );
    let mut samples = Vec::with_capacity(runs);
    for _ in 0..runs {
        admin(&client, &serving, model, "unload");
        let before = series_value(&serving.metrics(&client), &series);
        let started = Instant::now();
        admin(&client, &serving, model, "load");
        samples.push(started.elapsed().as_secs_f64() * 1e3);
        let after = series_value(&serving.metrics(&client), &series);
        assert!(
            after > before,
            "{model} on {pool}: the load came from {}",
            source.label()
        );
    }
    samples.sort_by(f64::total_cmp);
    samples
}

/// Whether `dir` holds an optimized cache entry: a CPU pool's is one once its record
/// (`<key>.sum`, written last) is there; a simulated pool's is its `<key>.ort`.
fn has_entry(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .filter_map(Result::ok)
            .any(|e| e.path().extension().is_some_and(|x| x == "sum" || x == "ort"))
    })
}

fn admin(client: &Client, serving: &Serving, model: &str, what: &str) {
    let response = client
        .post(format!("http://{}/admin/models/{model}/{what}", serving.addr))
        .bearer_auth(TOKEN)
        .json(&json!({}))
        .send()
        .unwrap();
    assert!(
        response.status().is_success(),
        "{what}: {}",
        response.text().unwrap_or_default()
    );
}
