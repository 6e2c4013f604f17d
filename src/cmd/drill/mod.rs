//! `vramguard drill`: the acceptance drill, as a command anyone can run.
//!
//! It squeezes a simulated accelerator while sending real requests over HTTP, phase by phase
//! (a baseline, a pre-admission redirect, rising external pressure, an injected allocator
//! failure, a driver reset and restore with CPU work in flight, cancellations in the CPU queue,
//! streamed generations failing before and after their first token, non-replayable requests
//! and a chat offering tools, idempotent client retries), records what happened to every
//! request, and checks the pass criteria: nothing run twice, nothing accepted lost,
//! replayed generations token for token the same, the breaker recovering, every redirected
//! answer saying it was degraded, and host memory never under its reserve.
//!
//! By default it starts its own server on loopback (a 96 MiB simulated accelerator, a CPU pool,
//! the bundled encoder and decoder fixture); `--target` drives a running one started with the
//! drill's config (`vramguard drill --print-config`), with `VRAMGUARD_ADMIN_TOKEN` for its admin
//! API. The drill only ever talks to the target it was given.

mod report;

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Value, json};

pub use report::{Criterion, PhaseSummary, Report};

/// The decoder fixture, carried in the binary so the drill runs anywhere.
const DECODER_MODEL: &[u8] = include_bytes!("../../../models/decoder/model.onnx");
const DECODER_TOKENIZER: &[u8] = include_bytes!("../../../models/decoder/tokenizer.json");

/// Names in the drill's config, which a `--target` must serve too.
const DEVICE: &str = "sim0";
const GPU: &str = "gpu";
const CPU: &str = "cpu";
const ENCODER: &str = "encoder";
const CPU_ONLY: &str = "classifier";
const DECODER: &str = "chat";

/// The config of the drill's own server, with the decoder fixture's model and tokenizer at
/// `model` and `tokenizer`.
fn config_yaml(model: &str, tokenizer: &str) -> String {
    format!(
        "# The config `vramguard drill` serves itself, and what a --target must serve.
server:
  listen: 127.0.0.1:8090
  admin_token_env: VRAMGUARD_ADMIN_TOKEN
  admin_socket: 'off'
devices:
  - {{name: {DEVICE}, kind: simulated, capacity: 96MiB}}
models:
  - {{name: {ENCODER}, path: 'builtin:encoder', context: {{input: input, axis: 1, keep: end}}}}
  - {{name: {CPU_ONLY}, path: 'builtin:classifier'}}
  - {{name: {DECODER}, path: '{model}', tokenizer: '{tokenizer}', chat_template: 'builtin:chatml'}}
pools:
  - {{name: {GPU}, provider: simulated, device: {DEVICE}, models: [{ENCODER}, {DECODER}], workers: 2,
     intra_threads: 1, queue: {{capacity: 64, max_wait: 20s}}, fallback: {CPU}, memory: {{arena_shrinkage: true}},
     breaker: {{failures: 3, window: 30s, cooldown: 2s}}}}
  - {{name: {CPU}, provider: cpu, models: [{ENCODER}, {CPU_ONLY}, {DECODER}], workers: 1, intra_threads: 1,
     queue: {{capacity: 64, max_wait: 30s}}}}
host:
  reserve: 1GiB
policy:
  path: 'builtin:default'
  fallback: {{action: admit}}
  params: {{cpu_pool: {CPU}, reserve_bytes: 8MiB, min_context_tokens: 16, defer_ms: 20, defer_max_queue: 2}}
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

/// The config the drill serves itself, for starting a `--target` the same way. The decoder
/// fixture's paths are relative to the config file: save it at the top of a vramguard checkout
/// (or point them at a copy of `models/decoder/`).
pub fn print_config() -> String {
    config_yaml("models/decoder/model.onnx", "models/decoder/tokenizer.json")
}

/// One request as the drill saw it.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// Phase it belongs to.
    pub phase: &'static str,
    /// Its request id.
    pub id: String,
    /// What was sent (`encoder seq 32`, `chat stream`, …).
    pub kind: String,
    /// What the phase expected of it.
    pub expect: &'static str,
    /// Milliseconds from the drill's start to sending it.
    pub sent_ms: f64,
    /// Milliseconds until its answer ended (or the client gave up).
    pub latency_ms: f64,
    /// HTTP status; none when no answer came.
    pub status: Option<u16>,
    /// The pool that served it (`x-vramguard-pool`).
    pub pool: Option<String>,
    /// The admission decision (`x-vramguard-decision`).
    pub decision: Option<String>,
    /// Why it was retried on the fallback (`parameters.reason`), if it was.
    pub retry: Option<String>,
    /// When the retry's run started on the CPU pool, ms after the server received the request
    /// (`parameters.retry_started_ms`).
    pub cpu_started_ms: Option<f64>,
    /// The first failure it met: an error message, or a stream's error event.
    pub first_failure: Option<String>,
    /// `x-vramguard-degraded`, when it was served degraded.
    pub degraded: Option<String>,
    /// The answer was the stored one of an earlier request with its idempotency key.
    pub replayed: bool,
    /// The answer carried the request id it was sent with (`x-request-id`).
    pub id_kept: bool,
    /// The client kept its connection until the answer ended (false: it hung up on purpose).
    pub connection_held: bool,
    /// A generation's text, for token equivalence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Whether it met the phase's expectation.
    pub as_expected: bool,
}

/// Live samples of `/status` per phase.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Samples {
    /// Largest queue age seen in any pool.
    pub max_queue_age_ms: u64,
    /// Lowest `MemAvailable` seen.
    pub min_host_available: Option<u64>,
}

struct Drill {
    client: reqwest::Client,
    base: String,
    token: String,
    started: Instant,
    quick: bool,
    records: Mutex<Vec<Record>>,
    /// Index of the running phase (for the sampler).
    phase: AtomicUsize,
    samples: Mutex<Vec<Samples>>,
    progress: Progress,
}

/// The phases, in order.
const PHASES: [&str; 9] = [
    "baseline",
    "redirect",
    "pressure",
    "alloc_failure",
    "driver_reset",
    "cancel_in_queue",
    "streams",
    "non_replayable",
    "idempotency",
];

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

async fn run_async(options: &Options) -> Result<Report, String> {
    let mut own = None;
    let (base, token) = match &options.target {
        Some(url) => {
            let token = options.admin_token.clone().ok_or(
                "--target needs the target's admin token in VRAMGUARD_ADMIN_TOKEN (its server.admin_token_env)",
            )?;
            (url.trim_end_matches('/').to_string(), token)
        }
        None => {
            let server = OwnServer::start().await?;
            let base = format!("http://{}", server.addr);
            let token = server.token.clone();
            own = Some(server);
            (base, token)
        }
    };
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .map_err(|e| format!("cannot build an HTTP client: {e}"))?;
    let mut status = get_json(&client, &format!("{base}/status"))
        .await
        .map_err(|e| format!("{base} does not answer /status: {e}"))?;
    check_target(&status)?;
    // A server that has just started may not have sampled its devices yet, and its policy then
    // has no memory to go by: wait for the first sample (at most 30 s).
    let waiting_since = Instant::now();
    while status["sample_age_ms"].is_null() {
        if waiting_since.elapsed() > Duration::from_secs(30) {
            return Err(format!("{base} has not sampled its devices within 30 s"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        status = get_json(&client, &format!("{base}/status")).await?;
    }
    let host_reserve = status["host"]["reserve_bytes"].as_u64().unwrap_or(0);
    let drill = Arc::new(Drill {
        client,
        base,
        token,
        started: Instant::now(),
        quick: options.quick,
        records: Mutex::new(Vec::new()),
        phase: AtomicUsize::new(0),
        samples: Mutex::new(vec![Samples::default(); PHASES.len()]),
        progress: Progress::new(std::io::stderr().is_terminal()),
    });
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = tokio::spawn(sample(Arc::clone(&drill), Arc::clone(&sampling)));
    let result = phases(&drill).await;
    sampling.store(false, Ordering::Relaxed);
    let _ = sampler.await;
    drill.progress.done();
    // Leave the target as found: no pressure, no injected failures.
    let _ = drill
        .admin(json!({"pressure": 0, "fail_next": 0, "pass_first": 0}))
        .await;
    if let Some(server) = own {
        server.stop().await;
    }
    let facts = result?;
    let records = drill.records.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let samples = drill.samples.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let report = Report::judge(&PHASES, records, samples, facts, host_reserve, drill.started.elapsed());
    if let Some(path) = &options.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(report)
}

/// The target must be the drill's kind of server: a simulated device to squeeze, the pools
/// and models of the drill's config.
fn check_target(status: &Value) -> Result<(), String> {
    if status["devices"][DEVICE]["simulated"] != true {
        return Err(format!(
            "the target has no simulated device `{DEVICE}` to squeeze; start it with the drill's config (vramguard drill --print-config)"
        ));
    }
    let pools: Vec<&str> = status["pools"]
        .as_array()
        .map(|p| p.iter().filter_map(|p| p["name"].as_str()).collect())
        .unwrap_or_default();
    for pool in [GPU, CPU] {
        if !pools.contains(&pool) {
            return Err(format!(
                "the target has no pool `{pool}`; start it with the drill's config (vramguard drill --print-config)"
            ));
        }
    }
    Ok(())
}

/// Facts measured along the way that are not per request.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Facts {
    /// From the restore to the accelerator pool's breaker closing and a request served there.
    pub breaker_recovery_ms: Option<f64>,
    /// Generations that were replayed or moved, and whether each gave the reference text.
    pub token_equivalence: Vec<(String, bool)>,
    /// Runs on the CPU pool of requests that must not have been run again.
    pub duplicate_runs: u64,
    /// Requests the server counted `cancelled` during the cancellation phase.
    pub cancelled_counted: f64,
    /// Requests whose client hung up on purpose in that phase.
    pub hung_up: u64,
    /// External pressure applied at each step, bytes (a step asks for a share of the device and
    /// gets what the device can give while vramguard's arena holds its part).
    pub pressure_steps: Vec<u64>,
}

async fn phases(drill: &Arc<Drill>) -> Result<Facts, String> {
    let mut facts = Facts::default();
    let n = |quick: usize, full: usize| if drill.quick { quick } else { full };
    let profile = get_json(&drill.client, &format!("{}/v2/models/{ENCODER}", drill.base)).await?;
    let capacity = get_json(&drill.client, &format!("{}/status", drill.base)).await?["devices"][DEVICE]["total_bytes"]
        .as_u64()
        .unwrap_or(96 << 20);
    let fits = |seq: u64| estimate(&profile["parameters"]["memory_profile"], seq) as f64;
    // A long request takes about a third of the device; an oversized one more than all of it.
    let long = (16..=4096)
        .step_by(16)
        .find(|&s| fits(s) > capacity as f64 / 3.0)
        .unwrap_or(512);
    let oversized = (16..=16384)
        .step_by(64)
        .find(|&s| fits(s) > capacity as f64 * 1.2)
        .unwrap_or(4096);

    // 1. Short requests fit.
    drill.begin(0, n(8, 40));
    drill
        .concurrently(n(8, 40), 4, |d, i| async move {
            d.encoder("baseline", &format!("baseline-{i}"), 32, &[], None, "ok on gpu")
                .await
                .judge(|r| r.status == Some(200) && r.pool.as_deref() == Some(GPU))
        })
        .await;

    // 2. Over the accelerator's profile, within host RAM: redirected before it runs.
    drill.begin(1, n(2, 6));
    drill
        .concurrently(n(2, 6), 1, move |d, i| async move {
            d.encoder(
                "redirect",
                &format!("redirect-{i}"),
                oversized as usize,
                &[],
                None,
                "redirected to cpu, degraded",
            )
            .await
            .judge(|r| {
                r.status == Some(200)
                    && r.pool.as_deref() == Some(CPU)
                    && r.decision.as_deref() == Some("redirect")
                    && r.degraded.is_some()
            })
        })
        .await;

    // 3. Short and long requests while a competing workload takes more and more of the device.
    let steps = [0.0, 0.25, 0.5, 0.7, 0.85];
    let per_step = n(6, 24);
    drill.begin(2, per_step * steps.len());
    for (k, share) in steps.iter().enumerate() {
        let applied = drill.squeeze((capacity as f64 * share) as u64).await?;
        facts.pressure_steps.push(applied);
        drill
            .concurrently(per_step, 4, move |d, i| async move {
                let seq = if i % 3 == 2 { long as usize } else { 32 };
                d.encoder("pressure", &format!("pressure-{k}-{i}"), seq, &[], None, "ok, any pool")
                    .await
                    .judge(|r| r.status == Some(200))
            })
            .await;
    }
    drill.admin(json!({"pressure": 0})).await?;

    drill.settle().await?;

    // 4. An allocator failure injected before a run: retried once on the CPU pool.
    drill.begin(3, n(2, 3));
    for i in 0..n(2, 3) {
        drill.admin(json!({"fail_next": 1})).await?;
        drill
            .encoder("alloc_failure", &format!("alloc-{i}"), 32, &[], None, "retried on cpu")
            .await
            .judge(|r| {
                r.status == Some(200)
                    && r.pool.as_deref() == Some(CPU)
                    && r.retry.is_some()
                    && r.cpu_started_ms.is_some()
            })
            .keep(drill);
    }

    drill.settle().await?;

    // 5. A driver reset and restore while unrelated CPU work is in flight.
    drill.begin(4, n(4, 12) + n(4, 12) + 1);
    let cpu_work = {
        let d = Arc::clone(drill);
        let count = n(4, 12);
        tokio::spawn(async move {
            d.concurrently(count, 2, |d, i| async move {
                d.classifier("driver_reset", &format!("cpu-work-{i}"))
                    .await
                    .judge(|r| r.status == Some(200) && r.pool.as_deref() == Some(CPU))
            })
            .await
        })
    };
    drill.admin(json!({"driver_reset": true})).await?;
    drill
        .concurrently(n(4, 12), 2, |d, i| async move {
            d.encoder(
                "driver_reset",
                &format!("reset-{i}"),
                32,
                &[],
                None,
                "served on cpu while reset",
            )
            .await
            .judge(|r| r.status == Some(200) && r.pool.as_deref() == Some(CPU) && r.degraded.is_some())
        })
        .await;
    let _ = cpu_work.await;
    drill.admin(json!({"fail_next": 0})).await?;
    let restored = Instant::now();
    drill
        .post_admin(&format!("/admin/pools/{GPU}/restore"), json!({}))
        .await?;
    facts.breaker_recovery_ms = drill
        .until_served_on_gpu(restored, Duration::from_secs(60), Some("driver_reset"))
        .await;

    drill.settle().await?;

    // 6. Cancellations while waiting in the CPU queue: the CPU pool is kept busy with oversized
    // requests, and clients behind them hang up.
    let (busy, leaving) = (n(3, 6), n(4, 10));
    drill.begin(5, busy + leaving);
    let before = cancelled(drill).await;
    let fill = {
        let d = Arc::clone(drill);
        tokio::spawn(async move {
            d.concurrently(busy, busy, move |d, i| async move {
                d.encoder(
                    "cancel_in_queue",
                    &format!("busy-{i}"),
                    oversized as usize,
                    &[],
                    None,
                    "ok on cpu",
                )
                .await
                .judge(|r| r.status == Some(200) && r.pool.as_deref() == Some(CPU))
            })
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    drill
        .concurrently(leaving, leaving, move |d, i| async move {
            let patience = Duration::from_millis(60 + 10 * i as u64);
            d.encoder(
                "cancel_in_queue",
                &format!("leaves-{i}"),
                oversized as usize,
                &[],
                Some(patience),
                "client hangs up while queued",
            )
            .await
            .judge(|r| !r.connection_held || r.status == Some(200))
        })
        .await;
    let _ = fill.await;
    facts.hung_up = drill
        .records()
        .iter()
        .filter(|r| r.phase == "cancel_in_queue" && !r.connection_held)
        .count() as u64;
    facts.cancelled_counted = settle_cancelled(drill, before, facts.hung_up).await;

    drill.settle().await?;

    // 7. Streamed generations: a reference, then one failing before its first token and one
    // failing after it; both must give the reference's tokens.
    drill.begin(6, 4);
    let prompt = "The accelerator ran out of memory, so";
    let body = json!({"model": DECODER, "prompt": prompt, "max_tokens": 24, "temperature": 0.8,
                      "seed": 7, "stream": true});
    let reference = drill
        .stream("streams", "stream-reference", "/v1/completions", &body, &[], "ok")
        .await
        .judge(|r| r.status == Some(200) && r.first_failure.is_none())
        .keep(drill);
    drill.admin(json!({"fail_next": 1})).await?;
    let before_first = drill
        .stream(
            "streams",
            "stream-fails-before-first",
            "/v1/completions",
            &body,
            &[],
            "replayed on cpu",
        )
        .await
        .judge(|r| r.status == Some(200) && r.first_failure.is_none())
        .keep(drill);
    drill.admin(json!({"pass_first": 4, "fail_next": 1})).await?;
    let after_first = drill
        .stream(
            "streams",
            "stream-fails-after-first",
            "/v1/completions",
            &body,
            &[],
            "continued on cpu",
        )
        .await
        .judge(|r| r.status == Some(200) && r.first_failure.is_none() && r.pool.as_deref() == Some(CPU))
        .keep(drill);
    for (name, record) in [
        ("failed before its first token", &before_first),
        ("failed after its first token", &after_first),
    ] {
        facts.token_equivalence.push((
            name.to_string(),
            reference.text.is_some() && record.text == reference.text,
        ));
    }
    // A non-replayable stream failing after its first token ends with an error event.
    drill.admin(json!({"pass_first": 4, "fail_next": 1})).await?;
    drill
        .stream(
            "streams",
            "stream-non-replayable",
            "/v1/completions",
            &body,
            &[("x-vramguard-replayable", "false")],
            "error event after its tokens, not replayed",
        )
        .await
        .judge(|r| r.status == Some(200) && r.first_failure.as_deref().is_some_and(|f| f.contains("tokens_sent")))
        .keep(drill);
    drill.admin(json!({"fail_next": 0, "pass_first": 0})).await?;

    drill.settle().await?;

    // 8. Non-replayable requests: an encoder request and a chat offering tools (a tool call may
    // have acted), each failing after it started; neither may run on the CPU pool.
    drill.begin(7, 2);
    let cpu_runs = cpu_requests(drill).await;
    drill.admin(json!({"fail_next": 1})).await?;
    drill
        .encoder(
            "non_replayable",
            "non-replayable-encoder",
            32,
            &[("x-vramguard-replayable", "false")],
            None,
            "503, not retried",
        )
        .await
        .judge(|r| r.status == Some(503) && r.pool.as_deref() != Some(CPU))
        .keep(drill);
    drill.admin(json!({"pass_first": 2, "fail_next": 1})).await?;
    let tools = json!([{"type": "function", "function": {"name": "free_vram"}}]);
    drill
        .generate(
            "non_replayable",
            "chat-with-tools",
            "/v1/chat/completions",
            &json!({"model": DECODER, "max_tokens": 8, "temperature": 0, "tools": tools,
                    "messages": [{"role": "user", "content": "Is there memory?"}]}),
            "503 after its first token, never run again",
        )
        .await
        .judge(|r| r.status == Some(503) && r.first_failure.as_deref().is_some_and(|f| f.contains("tools")))
        .keep(drill);
    drill.admin(json!({"fail_next": 0, "pass_first": 0})).await?;
    facts.duplicate_runs += cpu_requests(drill).await.saturating_sub(cpu_runs);

    drill.settle().await?;

    // 9. Client retries with idempotency keys: concurrent duplicates and a late one.
    let keys = n(2, 6);
    drill.begin(8, keys * 3);
    for k in 0..keys {
        let key = format!("drill-{}-{k}", std::process::id());
        let headers = vec![("idempotency-key".to_string(), key.clone())];
        let first = {
            let d = Arc::clone(drill);
            let h = headers.clone();
            let id = format!("{key}-a");
            tokio::spawn(async move { d.encoder_owned("idempotency", id, 64, h).await })
        };
        let second = {
            let d = Arc::clone(drill);
            let h = headers.clone();
            let id = format!("{key}-b");
            tokio::spawn(async move { d.encoder_owned("idempotency", id, 64, h).await })
        };
        let (a, b) = (
            first.await.map_err(|e| e.to_string())?,
            second.await.map_err(|e| e.to_string())?,
        );
        let late = drill
            .encoder_owned("idempotency", format!("{key}-c"), 64, headers)
            .await;
        let runs = [&a, &b, &late]
            .iter()
            .filter(|r| r.status == Some(200) && !r.replayed)
            .count();
        facts.duplicate_runs += runs.saturating_sub(1) as u64;
        for record in [a, b, late] {
            record.judge(|r| r.status == Some(200)).keep(drill);
        }
    }
    Ok(facts)
}

/// Bytes the memory profile predicts for `seq` tokens.
fn estimate(profile: &Value, seq: u64) -> u64 {
    let f = |k: &str| profile[k].as_f64().unwrap_or(0.0);
    let n = seq as f64;
    (f("weights_bytes") + f("workspace_bytes") + f("per_token_bytes") * n + f("per_token_squared_bytes") * n * n) as u64
}

async fn get_json(client: &reqwest::Client, url: &str) -> Result<Value, String> {
    let response = client.get(url).send().await.map_err(|e| e.to_string())?;
    response.json().await.map_err(|e| e.to_string())
}

/// `vramguard_requests_total` summed over the series carrying `label` (e.g.
/// `outcome="cancelled"`), as the target's `/metrics` says now (0 when it cannot be read).
async fn requests_counted(drill: &Drill, label: &str) -> f64 {
    let Ok(response) = drill.client.get(format!("{}/metrics", drill.base)).send().await else {
        return 0.0;
    };
    let text = response.text().await.unwrap_or_default();
    sum(&text, |l| {
        l.starts_with("vramguard_requests_total{") && l.contains(label)
    })
}

async fn cancelled(drill: &Drill) -> f64 {
    requests_counted(drill, "outcome=\"cancelled\"").await
}

/// Requests the CPU pool has counted, whatever their outcome.
async fn cpu_requests(drill: &Drill) -> u64 {
    requests_counted(drill, &format!("pool=\"{CPU}\"")).await as u64
}

/// A server notices a hang-up when it next touches the connection or the request: wait (at
/// most 5 s) for the cancelled count to reach the hang-ups, and return what it reached.
async fn settle_cancelled(drill: &Drill, before: f64, hung_up: u64) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let counted = cancelled(drill).await - before;
        if counted >= hung_up as f64 || Instant::now() > deadline {
            return counted;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn sum(exposition: &str, wanted: impl Fn(&str) -> bool) -> f64 {
    exposition
        .lines()
        .filter(|l| wanted(l))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Sample `/status` every 50 ms into the running phase's samples.
async fn sample(drill: Arc<Drill>, sampling: Arc<AtomicBool>) {
    while sampling.load(Ordering::Relaxed) {
        if let Ok(status) = get_json(&drill.client, &format!("{}/status", drill.base)).await {
            let age = status["pools"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p["queue_oldest_age_ms"].as_u64())
                .max()
                .unwrap_or(0);
            let available = status["host"]["mem_available_bytes"].as_u64();
            let phase = drill.phase.load(Ordering::Relaxed);
            let mut samples = drill.samples.lock().unwrap_or_else(|e| e.into_inner());
            let s = &mut samples[phase];
            s.max_queue_age_ms = s.max_queue_age_ms.max(age);
            if let Some(a) = available.filter(|&a| a > 0) {
                s.min_host_available = Some(s.min_host_available.map_or(a, |m| m.min(a)));
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A record waiting for its verdict.
struct Judged(Record);

impl Record {
    fn judge(mut self, expected: impl Fn(&Record) -> bool) -> Judged {
        self.as_expected = expected(&self);
        Judged(self)
    }
}

impl Judged {
    /// Keep it in the drill's record, and hand it back.
    fn keep(self, drill: &Drill) -> Record {
        drill.progress.step();
        drill
            .records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.0.clone());
        self.0
    }
}

impl Drill {
    fn begin(&self, phase: usize, requests: usize) {
        self.phase.store(phase, Ordering::Relaxed);
        self.progress.phase(phase, PHASES[phase], requests);
    }

    fn records(&self) -> Vec<Record> {
        self.records.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn elapsed_ms(&self) -> f64 {
        self.started.elapsed().as_secs_f64() * 1000.0
    }

    /// `count` requests made by `make`, at most `parallel` at once; each is kept.
    async fn concurrently<F, Fut>(self: &Arc<Self>, count: usize, parallel: usize, make: F)
    where
        F: Fn(Arc<Drill>, usize) -> Fut + Send + Sync + 'static + Clone,
        Fut: std::future::Future<Output = Judged> + Send + 'static,
    {
        let next = Arc::new(AtomicUsize::new(0));
        let mut lanes = Vec::new();
        for _ in 0..parallel.max(1) {
            let (drill, next, make) = (Arc::clone(self), Arc::clone(&next), make.clone());
            lanes.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        break;
                    }
                    make(Arc::clone(&drill), i).await.keep(&drill);
                }
            }));
        }
        for lane in lanes {
            let _ = lane.await;
        }
    }

    async fn post_admin(&self, path: &str, body: Value) -> Result<(), String> {
        let response = self
            .client
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await
            .map_err(|e| format!("{path}: {e}"))?;
        if !response.status().is_success() {
            let status = response.status();
            let text = response.text().await.unwrap_or_default();
            return Err(format!("{path} answered {status}: {text}"));
        }
        Ok(())
    }

    /// Set the simulated device's pressure or faults.
    async fn admin(&self, body: Value) -> Result<(), String> {
        self.post_admin(&format!("/admin/sim/{DEVICE}"), body).await
    }

    /// Apply `bytes` of external pressure, or as much of it as the device can give now (a
    /// competing workload gets no more than is free either); returns what was applied.
    async fn squeeze(&self, bytes: u64) -> Result<u64, String> {
        let mut want = bytes;
        for _ in 0..5 {
            let response = self
                .client
                .post(format!("{}/admin/sim/{DEVICE}", self.base))
                .bearer_auth(&self.token)
                .json(&json!({"pressure": want}))
                .send()
                .await
                .map_err(|e| format!("/admin/sim/{DEVICE}: {e}"))?;
            if response.status().is_success() {
                return Ok(want);
            }
            let text = response.text().await.unwrap_or_default();
            // "… Available memory of N is smaller than requested bytes of M"
            let available = text
                .split("Available memory of ")
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
                .ok_or_else(|| format!("/admin/sim/{DEVICE} refused {want} bytes of pressure: {text}"))?;
            want = want.min(available.saturating_sub(1 << 20));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(format!("/admin/sim/{DEVICE} kept refusing pressure"))
    }

    /// Poll until a short request is served on the accelerator pool again (its breaker
    /// closed); the first one served there is kept in the record when `phase` is given.
    async fn until_served_on_gpu(&self, since: Instant, within: Duration, phase: Option<&'static str>) -> Option<f64> {
        while since.elapsed() < within {
            let probe = self
                .encoder(
                    phase.unwrap_or("settle"),
                    "recovery-probe",
                    16,
                    &[],
                    None,
                    "served on gpu after the restore",
                )
                .await;
            if probe.pool.as_deref() == Some(GPU) {
                let at = since.elapsed().as_secs_f64() * 1000.0;
                if phase.is_some() {
                    probe.judge(|r| r.status == Some(200)).keep(self);
                }
                return Some(at);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }

    /// Between phases: no pressure, no injected faults, and the accelerator pool serving with a
    /// clean breaker, so each phase starts from a healthy device. A phase's real or injected
    /// allocator failures stay in the breaker's window (and could open it in the next phase),
    /// so when there were some the operator's restore is used, whose probe closes the breaker
    /// and forgets them.
    async fn settle(&self) -> Result<(), String> {
        self.admin(json!({"pressure": 0, "fail_next": 0, "pass_first": 0}))
            .await?;
        let status = get_json(&self.client, &format!("{}/status", self.base)).await?;
        let gpu = status["pools"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"] == GPU)
            .cloned()
            .unwrap_or(Value::Null);
        if gpu["alloc_failures_recent"].as_u64().unwrap_or(0) > 0 || gpu["breaker"] != "closed" {
            self.post_admin(&format!("/admin/pools/{GPU}/restore"), json!({}))
                .await?;
        }
        self.until_served_on_gpu(Instant::now(), Duration::from_secs(60), None)
            .await
            .map(|_| ())
            .ok_or_else(|| format!("pool `{GPU}` did not serve again within 60 s after the previous phase"))
    }

    fn record(&self, phase: &'static str, id: &str, kind: String, expect: &'static str, sent: f64) -> Record {
        Record {
            phase,
            id: id.to_string(),
            kind,
            expect,
            sent_ms: sent,
            latency_ms: 0.0,
            status: None,
            pool: None,
            decision: None,
            retry: None,
            cpu_started_ms: None,
            first_failure: None,
            degraded: None,
            replayed: false,
            id_kept: false,
            connection_held: true,
            text: None,
            as_expected: false,
        }
    }

    async fn encoder_owned(
        &self,
        phase: &'static str,
        id: String,
        seq: usize,
        headers: Vec<(String, String)>,
    ) -> Record {
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        self.encoder(phase, &id, seq, &headers, None, "one run, the rest replayed")
            .await
    }

    /// An encoder request of `seq` tokens in binary tensors; `patience` makes the client hang up.
    async fn encoder(
        &self,
        phase: &'static str,
        id: &str,
        seq: usize,
        headers: &[(&str, &str)],
        patience: Option<Duration>,
        expect: &'static str,
    ) -> Record {
        let input = crate::core::tensor::Tensor {
            name: "input".into(),
            shape: vec![1, seq as i64, 64],
            data: crate::core::tensor::TensorData::Fp32((0..seq * 64).map(|i| (i % 7) as f32 * 0.01).collect()),
        };
        // A client's retry of a keyed request sends the same body: the protocol's `id` is the key.
        let body_id = headers
            .iter()
            .find(|(name, _)| *name == "idempotency-key")
            .map_or(id, |(_, key)| *key);
        let (body, header_len) = crate::protocol::oip::encode_request(body_id, &[input], &["pooled".to_string()]);
        let mut request = self
            .client
            .post(format!("{}/v2/models/{ENCODER}/infer", self.base))
            .header("inference-header-content-length", header_len)
            .header("x-request-id", id);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let sent = self.elapsed_ms();
        let mut record = self.record(phase, id, format!("encoder seq {seq}"), expect, sent);
        let exchange = async {
            let response = request.body(body).send().await?;
            let headers = response.headers().clone();
            let status = response.status().as_u16();
            let bytes = response.bytes().await?;
            Ok::<_, reqwest::Error>((status, headers, bytes))
        };
        let answer = match patience {
            Some(p) => tokio::time::timeout(p, exchange).await.ok(),
            None => Some(exchange.await),
        };
        record.latency_ms = self.elapsed_ms() - sent;
        match answer {
            None => record.connection_held = false,
            Some(Err(e)) => record.first_failure = Some(format!("no answer: {e}")),
            Some(Ok((status, headers, bytes))) => {
                record.status = Some(status);
                read_headers(&mut record, &headers);
                let json_len = headers
                    .get("inference-header-content-length")
                    .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
                    .unwrap_or(bytes.len());
                let head: Value = serde_json::from_slice(&bytes[..json_len.min(bytes.len())]).unwrap_or(Value::Null);
                if status == 200 {
                    record.retry = head["parameters"]["reason"].as_str().map(str::to_string);
                    record.cpu_started_ms = head["parameters"]["retry_started_ms"].as_f64();
                } else {
                    record.first_failure = head["error"].as_str().map(str::to_string);
                }
            }
        }
        record
    }

    /// A request of the CPU-only model.
    async fn classifier(&self, phase: &'static str, id: &str) -> Record {
        let data: Vec<f32> = (0..64 * 16).map(|i| (i % 11) as f32 * 0.1).collect();
        let body = json!({"inputs": [{"name": "features", "shape": [64, 16], "datatype": "FP32", "data": data}]});
        let sent = self.elapsed_ms();
        let mut record = self.record(phase, id, "classifier (cpu only)".into(), "ok on cpu", sent);
        match self
            .client
            .post(format!("{}/v2/models/{CPU_ONLY}/infer", self.base))
            .header("x-request-id", id)
            .json(&body)
            .send()
            .await
        {
            Ok(response) => {
                record.status = Some(response.status().as_u16());
                read_headers(&mut record, response.headers());
                let _ = response.bytes().await;
            }
            Err(e) => record.first_failure = Some(format!("no answer: {e}")),
        }
        record.latency_ms = self.elapsed_ms() - sent;
        record
    }

    /// A whole (not streamed) generation.
    async fn generate(&self, phase: &'static str, id: &str, path: &str, body: &Value, expect: &'static str) -> Record {
        let sent = self.elapsed_ms();
        let mut record = self.record(phase, id, format!("POST {path}"), expect, sent);
        match self
            .client
            .post(format!("{}{path}", self.base))
            .header("x-request-id", id)
            .json(body)
            .send()
            .await
        {
            Ok(response) => {
                record.status = Some(response.status().as_u16());
                read_headers(&mut record, response.headers());
                let answer: Value = response.json().await.unwrap_or(Value::Null);
                record.first_failure = answer["error"]["message"].as_str().map(str::to_string);
                record.text = answer["choices"][0]["message"]["content"]
                    .as_str()
                    .or(answer["choices"][0]["text"].as_str())
                    .map(str::to_string);
            }
            Err(e) => record.first_failure = Some(format!("no answer: {e}")),
        }
        record.latency_ms = self.elapsed_ms() - sent;
        record
    }

    /// A streamed generation, read to its end: its text, and an error event if one came.
    async fn stream(
        &self,
        phase: &'static str,
        id: &str,
        path: &str,
        body: &Value,
        headers: &[(&str, &str)],
        expect: &'static str,
    ) -> Record {
        let sent = self.elapsed_ms();
        let mut record = self.record(phase, id, format!("POST {path} stream"), expect, sent);
        let mut request = self
            .client
            .post(format!("{}{path}", self.base))
            .header("x-request-id", id)
            .json(body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        match request.send().await {
            Ok(response) => {
                record.status = Some(response.status().as_u16());
                read_headers(&mut record, response.headers());
                let text = response.text().await.unwrap_or_default();
                let mut out = String::new();
                for data in text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
                    let Ok(event) = serde_json::from_str::<Value>(data) else {
                        continue;
                    };
                    if !event["error"].is_null() {
                        record.first_failure = Some(event["error"].to_string());
                    }
                    if let Some(pool) = event["vramguard"]["pool"].as_str() {
                        record.pool = Some(pool.to_string());
                    }
                    if let Some(piece) = event["choices"][0]["text"]
                        .as_str()
                        .or(event["choices"][0]["delta"]["content"].as_str())
                    {
                        out.push_str(piece);
                    }
                }
                if record.status == Some(200) {
                    record.text = Some(out);
                } else {
                    let error: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
                    record.first_failure = error["error"]["message"].as_str().map(str::to_string);
                }
            }
            Err(e) => record.first_failure = Some(format!("no answer: {e}")),
        }
        record.latency_ms = self.elapsed_ms() - sent;
        record
    }
}

fn read_headers(record: &mut Record, headers: &reqwest::header::HeaderMap) {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
    record.id_kept = get("x-request-id").as_deref() == Some(record.id.as_str());
    record.pool = get("x-vramguard-pool");
    record.decision = get("x-vramguard-decision");
    record.degraded = get("x-vramguard-degraded");
    record.replayed = headers.contains_key("idempotent-replayed");
}

/// The drill's own server: in this process, on a loopback port, with a random admin token.
struct OwnServer {
    addr: std::net::SocketAddr,
    token: String,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    _dir: TempDir,
}

impl OwnServer {
    async fn start() -> Result<OwnServer, String> {
        let dir = TempDir::new()?;
        std::fs::write(dir.0.join("decoder.onnx"), DECODER_MODEL).map_err(|e| e.to_string())?;
        std::fs::write(dir.0.join("tokenizer.json"), DECODER_TOKENIZER).map_err(|e| e.to_string())?;
        let path = |file: &str| dir.0.join(file).display().to_string();
        let yaml = config_yaml(&path("decoder.onnx"), &path("tokenizer.json"));
        let raw: crate::config::RawConfig =
            crate::config::parse_yaml(&yaml, "drill.yaml").map_err(|e| e.to_string())?;
        let config = raw.validate("drill.yaml", &dir.0).map_err(|e| e.to_string())?;
        let service = tokio::task::spawn_blocking(move || crate::serve::service::Service::start(config))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("the drill's server did not start: {e}"))?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| format!("cannot listen on loopback: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let token = uuid::Uuid::new_v4().to_string();
        let state = crate::http::AppState::with_admin_token(Arc::new(service), Some(token.clone()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(crate::http::serve(state, listener, async {
            let _ = stopped.await;
        }));
        Ok(OwnServer {
            addr,
            token,
            stop,
            task,
            _dir: dir,
        })
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// A folder of its own, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<TempDir, String> {
        let dir = std::env::temp_dir().join(format!(
            "vramguard-drill-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        Ok(TempDir(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Progress on a terminal: the phase, the requests done and a bar; nothing otherwise.
struct Progress {
    on: bool,
    state: Mutex<(usize, &'static str, usize, usize)>,
}

impl Progress {
    fn new(on: bool) -> Progress {
        Progress {
            on,
            state: Mutex::new((0, "", 0, 0)),
        }
    }

    fn phase(&self, index: usize, name: &'static str, requests: usize) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = (index, name, 0, requests);
        self.draw();
    }

    fn step(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).2 += 1;
        self.draw();
    }

    fn draw(&self) {
        if !self.on {
            return;
        }
        let (index, name, done, total) = *self.state.lock().unwrap_or_else(|e| e.into_inner());
        let width = 24;
        let filled = (done.min(total) * width).checked_div(total).unwrap_or(0);
        eprint!(
            "\r\x1b[2K[{}/{}] {:<16} [{}{}] {done}/{total}",
            index + 1,
            PHASES.len(),
            name,
            "#".repeat(filled),
            "-".repeat(width - filled)
        );
    }

    fn done(&self) {
        if self.on {
            eprint!("\r\x1b[2K");
        }
    }
}

/// Percentile `p` (0–100) of `values` (nearest rank); 0 for none.
fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// Records by phase, in phase order.
fn by_phase(records: &[Record]) -> BTreeMap<&'static str, Vec<&Record>> {
    let mut out: BTreeMap<&'static str, Vec<&Record>> = BTreeMap::new();
    for r in records {
        out.entry(r.phase).or_default().push(r);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 3.0);
        assert_eq!(percentile(&v, 95.0), 5.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn the_printed_config_is_a_valid_config() {
        let dir = TempDir::new().unwrap();
        std::fs::write(dir.0.join("decoder.onnx"), DECODER_MODEL).unwrap();
        std::fs::write(dir.0.join("tokenizer.json"), DECODER_TOKENIZER).unwrap();
        let path = |file: &str| dir.0.join(file).display().to_string();
        let yaml = config_yaml(&path("decoder.onnx"), &path("tokenizer.json"));
        let raw: crate::config::RawConfig = crate::config::parse_yaml(&yaml, "drill.yaml").unwrap();
        raw.validate("drill.yaml", &dir.0).unwrap();
        // The printed one, from the top of the repository.
        let raw: crate::config::RawConfig = crate::config::parse_yaml(&print_config(), "drill.yaml").unwrap();
        raw.validate("drill.yaml", Path::new(env!("CARGO_MANIFEST_DIR")))
            .unwrap();
    }
}
