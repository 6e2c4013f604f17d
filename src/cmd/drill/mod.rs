//! `vramguard drill`: the acceptance drill, as a command anyone can run.
//!
//! It squeezes a simulated accelerator while sending real requests over HTTP, phase by phase (a
//! baseline, a pre-admission redirect, rising external pressure, an injected allocator failure, a
//! driver reset and restore with CPU work in flight, cancellations in the CPU queue, streamed
//! generations failing before and after their first token, non-replayable requests and a chat
//! offering tools, idempotent client retries, embeddings under pressure and faults, three models
//! that do not fit on the device together beside a pinned one, a background service's request
//! while interactive ones wait, a long transcription through an allocator failure and driver
//! resets, the accelerator's worker process killed with every kind of work in flight), records what
//! happened to every request, and checks the pass criteria: nothing run twice, nothing accepted
//! lost, replayed generations token for token the same, the breaker recovering, every redirected
//! answer saying it was degraded, host memory never under its reserve, device memory never over its
//! capacity, and eviction taking only what it may, background work giving way to interactive work,
//! and a lost worker replaced with its breaker closed by the server's own probe.
//!
//! By default it starts its own server on loopback (a 96 MiB simulated accelerator, a CPU pool, the
//! bundled encoder, embedder, Whisper and decoder fixture, the dense models it writes); `--target`
//! drives a running one started with the drill's config (`vramguard drill --print-config`, the
//! dense models written beside it with `--write-models`), with `VRAMGUARD_ADMIN_TOKEN` for its
//! admin API. The drill only ever talks to the target it was given.
//!
//! `phases.rs` says what each phase sends and expects (`phase.rs` names them), `client.rs` sends
//! it, `record.rs` keeps what came back, `report.rs` judges it by its criteria (`criterion.rs`);
//! `embeddings.rs`, `residency.rs`, `background.rs`, `speech.rs` and `worker.rs` (worker_lost) are
//! the last five phases, `embeddings.rs` judging its answers' vectors itself and the others with
//! criteria of their own (`seen.rs` is what the residency phase saw of `/status`); `server.rs` is
//! the drill's own server and `progress.rs` its terminal line.

mod background;
mod client;
mod criterion;
mod embeddings;
mod phase;
mod phases;
mod progress;
mod record;
mod report;
mod residency;
mod seen;
mod server;
mod speech;
mod worker;

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::protocol::status::StatusReport;
pub use background::BackgroundFacts;
use client::Drill;
pub use criterion::Criterion;
pub use phase::Phase;
pub use phases::Facts;
pub use record::{Failure, Record, Samples};
pub use report::{PhaseSummary, Report};
pub use residency::ResidencyFacts;
use server::OwnServer;
pub use speech::SpeechFacts;
pub use worker::WorkerFacts;

/// Names in the drill's config, which a `--target` must serve too.
const DEVICE: &str = "sim0";
const GPU: &str = "gpu";
const CPU: &str = "cpu";
const ENCODER: &str = "encoder";
const CPU_ONLY: &str = "classifier";
const DECODER: &str = "chat";
/// The bundled embedder, on both pools: the embeddings phase's model.
const EMBEDDER: &str = "embed";
/// The bundled Whisper, on both pools: the speech phase's model.
const SPEECH: &str = "whisper";
/// The workspace its profile gives a window, MiB (the printed config says why it is given).
const SPEECH_WORKSPACE_MIB: u64 = 80;
/// The dense models of the residency phase, their weights' seeds and priorities: `dense_b` has
/// the lowest priority, `dense_c` loads on demand.
const DENSE: [DenseModel; 3] = [
    DenseModel {
        name: "dense_a",
        seed: 41,
        priority: 5,
        on_demand: false,
    },
    DenseModel {
        name: "dense_b",
        seed: 42,
        priority: 1,
        on_demand: false,
    },
    DenseModel {
        name: "dense_c",
        seed: 43,
        priority: 5,
        on_demand: true,
    },
];
/// Mebibytes of each dense model's weight (twice that on the accelerator: its two workers hold
/// a session each). Small, because the phase sizes its room with pressure, not with the weights,
/// and the other phases' restores build the pool's fresh backends beside the old ones, which
/// hold every resident model's weights until replaced: with 4 MiB, the restore after the
/// pressure phase sometimes took the device's arena past its 96 MiB.
const DENSE_MIB: u64 = 1;
/// The dense models' `min_residency`, seconds: short, so the phase need not wait long for it.
const MIN_RESIDENCY_S: u64 = 2;
/// The policy's device reserve (`policy.params.reserve_bytes`).
const RESERVE_BYTES: u64 = 8 << 20;
/// The background phase's services and their models, on the CPU pool: the background one's
/// (a copy of the bundled classifier) gives way to the interactive one's (a copy of the bundled
/// encoder), which run one at a time.
const BACKGROUND_SERVICE: &str = "batch";
const BACKGROUND_MODEL: &str = "digest";
const INTERACTIVE_SERVICE: &str = "assistant";
const INTERACTIVE_MODEL: &str = "assist";
/// A small model pinned on the accelerator, which the residency phase must never see evicted.
const PINNED: &str = "keeper";
/// Where the printed config expects the dense models, relative to the config file.
const DENSE_DIR: &str = "drill-models";

/// A dense model of the drill's config.
struct DenseModel {
    name: &'static str,
    seed: u64,
    priority: i64,
    on_demand: bool,
}

impl DenseModel {
    /// Its file's name.
    fn file(&self) -> String {
        format!("{}.onnx", self.name)
    }

    /// Its `models:` entry, its file in `dir`.
    fn entry(&self, dir: &str) -> String {
        format!(
            "  - {{name: {}, path: '{dir}/{}', priority: {}, min_residency: {MIN_RESIDENCY_S}s{}}}\n",
            self.name,
            self.file(),
            self.priority,
            if self.on_demand { ", residency: on_demand" } else { "" }
        )
    }
}

/// Write the dense models of the drill's config into `dir` (made if missing); their paths.
pub fn write_models(dir: &std::path::Path) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    DENSE
        .iter()
        .map(|m| {
            let path = dir.join(m.file());
            let bytes = crate::runtime::onnx::dense::Dense::of_mib(m.seed, DENSE_MIB).to_onnx();
            std::fs::write(&path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            Ok(path)
        })
        .collect()
}

/// The config of the drill's own server, with the decoder fixture's model and tokenizer at
/// `model` and `tokenizer`, the dense models in `dense_dir`.
fn config_yaml(model: &str, tokenizer: &str, dense_dir: &str) -> String {
    let dense: String = DENSE.iter().map(|m| m.entry(dense_dir)).collect();
    let names = DENSE.map(|m| m.name).join(", ");
    format!(
        "# The config `vramguard drill` serves itself, and what a --target must serve.
server:
  listen: 127.0.0.1:8090
  admin_token_env: VRAMGUARD_ADMIN_TOKEN
  admin_socket: 'off'
devices:
  - {{name: {DEVICE}, kind: simulated, capacity: 192MiB}}
# The encoder, the decoder, the embedder and the Whisper have the highest priority: the residency
# phase's dense models can never evict them, and, of lower priority, do not count as staying
# beside them in the most the device could ever give their requests. (An embedder of the default
# priority, 0, was the first victim of dense_c's make_room once it had been resident past the
# default min_residency, as on a loaded machine, and its room let dense_b stay.)
models:
  - {{name: {ENCODER}, path: 'builtin:encoder', priority: 10, context: {{input: input, axis: 1, keep: end}}}}
  - {{name: {CPU_ONLY}, path: 'builtin:classifier'}}
  - {{name: {DECODER}, path: '{model}', tokenizer: '{tokenizer}', chat_template: 'builtin:chatml', priority: 10}}
  - {{name: {PINNED}, path: 'builtin:classifier', residency: pinned}}
  - {{name: {BACKGROUND_MODEL}, path: 'builtin:classifier', service: {BACKGROUND_SERVICE}}}
  - {{name: {INTERACTIVE_MODEL}, path: 'builtin:encoder', service: {INTERACTIVE_SERVICE}}}
  - {{name: {EMBEDDER}, path: 'builtin:embedder', tokenizer: 'builtin:embedder', priority: 10}}
# A window of the Whisper peaks at 76 MB of the device's arena (encoder, decoder and caches);
# the profile measured at load says 137 MB, which a device of this size cannot reliably give
# beside the others, and would send the speech phase's windows to the CPU pool before the faults
# it injects: its profile is given by hand, as measured on the simulated device.
  - {{name: {SPEECH}, path: 'builtin:whisper', priority: 10, memory_profile: {{weights: 2MiB, workspace: {SPEECH_WORKSPACE_MIB}MiB}}}}
{dense}# The background service gives way to interactive requests that wait: those of `{INTERACTIVE_SERVICE}`,
# which runs one at a time, and of every other model (each its own interactive service).
services:
  - {{name: {BACKGROUND_SERVICE}, class: background}}
  - {{name: {INTERACTIVE_SERVICE}, class: interactive, concurrency: 1}}
pools:
  - {{name: {GPU}, provider: simulated, device: {DEVICE}, models: [{ENCODER}, {DECODER}, {PINNED}, {EMBEDDER}, {SPEECH}, {names}], workers: 2,
     intra_threads: 1, queue: {{capacity: 64, max_wait: 20s}}, fallback: {CPU}, memory: {{arena_shrinkage: true}},
     breaker: {{failures: 3, window: 30s, cooldown: 2s}}}}
  - {{name: {CPU}, provider: cpu, models: [{ENCODER}, {CPU_ONLY}, {BACKGROUND_MODEL}, {INTERACTIVE_MODEL}, {DECODER}, {PINNED}, {EMBEDDER}, {SPEECH}, {names}], workers: 1, intra_threads: 1,
     queue: {{capacity: 64, max_wait: 30s}}}}
host:
  reserve: 1GiB
policy:
  path: 'builtin:default'
  fallback: {{action: admit}}
  params: {{cpu_pool: {CPU}, reserve_bytes: {RESERVE_BYTES}, min_context_tokens: 16, defer_ms: 20, defer_max_queue: 2}}
"
    )
}

/// What `vramguard drill` was asked.
#[derive(Debug, Clone)]
pub struct Options {
    /// A running server (`http://host:port`); without it the drill starts its own.
    pub target: Option<String>,
    /// The target's admin token (its `server.admin_token_env`).
    pub admin_token: Option<String>,
    /// Where to write the full record as JSON.
    pub json: Option<PathBuf>,
    /// Fewer requests per phase: under a minute.
    pub quick: bool,
}

/// The config the drill serves itself, for starting a `--target` the same way. Its paths are
/// relative to the config file: save it at the top of a vramguard checkout (or point the
/// decoder's at a copy of `models/decoder/`), and write the dense models beside it with
/// `vramguard drill --write-models drill-models` ([`write_models`]).
pub fn print_config() -> String {
    config_yaml("models/decoder/model.onnx", "models/decoder/tokenizer.json", DENSE_DIR)
}

/// Run the drill and judge it. `Err` is a drill that could not run (no target, no simulated
/// device, a server that would not start); a run whose criteria fail is an `Ok` report that
/// says which.
pub fn run(options: &Options) -> Result<Report, String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    runtime.block_on(run_async(options))
}

/// Drill the target, or a server of the drill's own that is stopped however the drill ends (an
/// error, SIGINT or SIGTERM included), so that its worker processes and folders go with it.
async fn run_async(options: &Options) -> Result<Report, String> {
    let interrupted = crate::cmd::signal::shutdown();
    let (own, base, token) = match &options.target {
        Some(url) => {
            let token = options.admin_token.clone().ok_or(
                "--target needs the target's admin token in VRAMGUARD_ADMIN_TOKEN (its server.admin_token_env)",
            )?;
            (None, url.trim_end_matches('/').to_string(), token)
        }
        None => {
            let server = OwnServer::start().await?;
            let base = format!("http://{}", server.addr);
            let token = server.token.clone();
            (Some(server), base, token)
        }
    };
    let result = tokio::select! {
        result = drill(options, base, token) => result,
        () = interrupted => Err("interrupted by a signal".to_string()),
    };
    if let Some(server) = own {
        server.stop().await;
    }
    result
}

async fn drill(options: &Options, base: String, token: String) -> Result<Report, String> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .map_err(|e| format!("cannot build an HTTP client: {e}"))?;
    let status_url = format!("{base}/status");
    let mut status: StatusReport = client::get_json(&client, &status_url)
        .await
        .map_err(|e| format!("{base} does not answer /status: {e}"))?;
    check_target(&status)?;
    // A server that has just started may not have sampled its devices yet, and its policy then
    // has no memory to go by: wait for the first sample (at most 30 s).
    let waiting_since = Instant::now();
    while status.sample_age_ms.is_none() {
        if waiting_since.elapsed() > Duration::from_secs(30) {
            return Err(format!("{base} has not sampled its devices within 30 s"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        status = client::get_json(&client, &status_url).await?;
    }
    let host_reserve = status.host.reserve_bytes;
    let drill = Arc::new(Drill {
        client,
        base,
        token,
        started: Instant::now(),
        quick: options.quick,
        records: Mutex::new(Vec::new()),
        phase: Mutex::new(Phase::Baseline),
        samples: Mutex::new(BTreeMap::new()),
        seen: Mutex::new(seen::Seen::default()),
        progress: progress::Progress::new(std::io::stderr().is_terminal()),
    });
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = tokio::spawn(client::sample(Arc::clone(&drill), Arc::clone(&sampling)));
    let result = phases::run(&drill).await;
    sampling.store(false, Ordering::Relaxed);
    let _ = sampler.await;
    drill.progress.done();
    // Leave the target as found: no pressure, no injected failures.
    let _ = drill
        .admin(json!({"pressure": 0, "fail_next": 0, "pass_first": 0}))
        .await;
    let facts = result?;
    let records = drill.records();
    let samples = drill.samples.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let report = Report::judge(
        &Phase::ALL,
        records,
        samples,
        facts,
        host_reserve,
        drill.started.elapsed(),
    );
    if let Some(path) = &options.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(report)
}

/// The target must be the drill's kind of server: a simulated device to squeeze, the pools
/// and models of the drill's config.
fn check_target(status: &StatusReport) -> Result<(), String> {
    if !status.devices.get(DEVICE).is_some_and(|d| d.simulated) {
        return Err(format!(
            "the target has no simulated device `{DEVICE}` to squeeze; start it with the drill's config (vramguard drill --print-config)"
        ));
    }
    for pool in [GPU, CPU] {
        if status.pool(pool).is_none() {
            return Err(format!(
                "the target has no pool `{pool}`; start it with the drill's config (vramguard drill --print-config)"
            ));
        }
    }
    Ok(())
}
