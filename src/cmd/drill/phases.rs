//! The drill's phases, in the order they run: what each sends and what it expects of every
//! request. Between two phases the target is settled ([`Drill::settle`]), so each starts from a
//! healthy device.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Value, json};

use super::phase::Phase;
use super::record::{Failure, Record};
use super::{CPU, DECODER, Drill, ENCODER, GPU};
use crate::core::snapshot::Action;
use crate::protocol::headers::REPLAYABLE_HEADER;
use crate::runtime::estimate::MemoryProfile;
use crate::serve::lifecycle::NotRetried;

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
    /// What the speech phase's target counted of its transcriptions.
    pub speech: Option<super::SpeechFacts>,
    /// The residency phase's evictions, loads and rates.
    pub residency: Option<super::ResidencyFacts>,
    /// What the background phase saw of its interactive load and the wait it caused.
    pub background: Option<super::BackgroundFacts>,
    /// The worker_lost phase's kill, the worker that came back and how long that took.
    pub worker_lost: Option<super::WorkerFacts>,
}

/// Request sizes measured against the target's device, so that the phases scale with it.
struct Sizes {
    /// The device's capacity, bytes.
    capacity: u64,
    /// Tokens of a request taking about a third of the device.
    long: usize,
    /// Tokens of a request needing more than all of it.
    oversized: usize,
}

impl Sizes {
    async fn measure(drill: &Drill) -> Result<Sizes, String> {
        let model: Value = drill.get_json(&format!("/v2/models/{ENCODER}")).await?;
        // The server's own profile type, read back; without one nothing is "over" and the
        // fallbacks below apply.
        let profile: Option<MemoryProfile> = serde_json::from_value(model["parameters"]["memory_profile"].clone()).ok();
        let estimate = |seq: usize| {
            profile
                .as_ref()
                .map_or(0, |p| p.estimate_tokens(seq as u64, 1).total_bytes)
        };
        let capacity = drill
            .status()
            .await?
            .devices
            .get(super::DEVICE)
            .map_or(96 << 20, |d| d.memory.total_bytes);
        let first_over = |share: f64, step: usize, up_to: usize, otherwise: usize| {
            (16..=up_to)
                .step_by(step)
                .find(|&s| estimate(s) as f64 > capacity as f64 * share)
                .unwrap_or(otherwise)
        };
        Ok(Sizes {
            capacity,
            long: first_over(1.0 / 3.0, 16, 4096, 512),
            oversized: first_over(1.2, 64, 16384, 4096),
        })
    }
}

/// Run every phase, in order; what is not per request comes back as [`Facts`].
pub(super) async fn run(drill: &Arc<Drill>) -> Result<Facts, String> {
    let mut facts = Facts::default();
    super::residency::stand_aside(drill).await?;
    let sizes = Sizes::measure(drill).await?;
    baseline(drill).await;
    redirect(drill, &sizes).await;
    facts.pressure_steps = pressure(drill, &sizes).await?;
    drill.settle().await?;
    alloc_failure(drill).await?;
    drill.settle().await?;
    facts.breaker_recovery_ms = driver_reset(drill).await?;
    drill.settle().await?;
    (facts.hung_up, facts.cancelled_counted) = cancel_in_queue(drill, &sizes).await;
    drill.settle().await?;
    facts.token_equivalence = streams(drill).await?;
    drill.settle().await?;
    facts.duplicate_runs += non_replayable(drill).await?;
    drill.settle().await?;
    facts.duplicate_runs += idempotency(drill).await?;
    drill.settle().await?;
    // Before the residency phase: its restore reloads the accelerator's resident models in the
    // background, and a load still under way when worker_lost kills the worker fails (and logs).
    super::embeddings::run(drill).await?;
    drill.settle().await?;
    facts.residency = Some(super::residency::run(drill).await?);
    drill.settle().await?;
    facts.background = Some(super::background::run(drill).await?);
    drill.settle().await?;
    // After the residency phase, which sizes its room to the byte: the speech phase's restores
    // leave the accelerator's arenas as they find them only once they have settled.
    facts.speech = Some(super::speech::run(drill).await?);
    drill.settle().await?;
    facts.worker_lost = Some(super::worker::run(drill).await?);
    drill.settle().await?;
    Ok(facts)
}

async fn baseline(drill: &Arc<Drill>) {
    let count = drill.n(8, 40);
    drill.begin(Phase::Baseline, count);
    drill
        .concurrently(count, 4, |d, i| async move {
            d.encoder(Phase::Baseline, &format!("baseline-{i}"), 32, &[], None, "ok on gpu")
                .await
                .judge(|r| r.served_on(GPU))
        })
        .await;
}

async fn redirect(drill: &Arc<Drill>, sizes: &Sizes) {
    let count = drill.n(2, 6);
    let oversized = sizes.oversized;
    drill.begin(Phase::Redirect, count);
    drill
        .concurrently(count, 1, move |d, i| async move {
            let id = format!("redirect-{i}");
            d.encoder(
                Phase::Redirect,
                &id,
                oversized,
                &[],
                None,
                "redirected to cpu, degraded",
            )
            .await
            .judge(|r| r.served_on(CPU) && r.decision == Some(Action::Redirect) && r.degraded.is_some())
        })
        .await;
}

/// Returns the pressure applied at each step.
async fn pressure(drill: &Arc<Drill>, sizes: &Sizes) -> Result<Vec<u64>, String> {
    let steps = [0.0, 0.25, 0.5, 0.7, 0.85];
    let per_step = drill.n(6, 24);
    let long = sizes.long;
    let mut applied = Vec::new();
    drill.begin(Phase::Pressure, per_step * steps.len());
    for (k, share) in steps.iter().enumerate() {
        applied.push(drill.squeeze((sizes.capacity as f64 * share) as u64).await?);
        drill
            .concurrently(per_step, 4, move |d, i| async move {
                let seq = if i % 3 == 2 { long } else { 32 };
                d.encoder(
                    Phase::Pressure,
                    &format!("pressure-{k}-{i}"),
                    seq,
                    &[],
                    None,
                    "ok, any pool",
                )
                .await
                .judge(|r| r.status == Some(200))
            })
            .await;
    }
    drill.admin(json!({"pressure": 0})).await?;
    Ok(applied)
}

async fn alloc_failure(drill: &Arc<Drill>) -> Result<(), String> {
    let count = drill.n(2, 3);
    drill.begin(Phase::AllocFailure, count);
    for i in 0..count {
        drill.admin(json!({"fail_next": 1})).await?;
        drill
            .encoder(
                Phase::AllocFailure,
                &format!("alloc-{i}"),
                32,
                &[],
                None,
                "retried on cpu",
            )
            .await
            .judge(|r| r.served_on(CPU) && r.retry.is_some() && r.cpu_started_ms.is_some())
            .keep(drill);
    }
    Ok(())
}

/// Returns how long the accelerator pool took to serve again after the restore.
async fn driver_reset(drill: &Arc<Drill>) -> Result<Option<f64>, String> {
    let count = drill.n(4, 12);
    drill.begin(Phase::DriverReset, count * 2 + 1);
    let cpu_work = {
        let d = Arc::clone(drill);
        tokio::spawn(async move {
            d.concurrently(count, 2, |d, i| async move {
                d.classifier(Phase::DriverReset, &format!("cpu-work-{i}"))
                    .await
                    .judge(|r| r.served_on(CPU))
            })
            .await
        })
    };
    drill.admin(json!({"driver_reset": true})).await?;
    drill
        .concurrently(count, 2, |d, i| async move {
            let id = format!("reset-{i}");
            d.encoder(Phase::DriverReset, &id, 32, &[], None, "served on cpu while reset")
                .await
                .judge(|r| r.served_on(CPU) && r.degraded.is_some())
        })
        .await;
    let _ = cpu_work.await;
    drill.admin(json!({"fail_next": 0})).await?;
    let restored = Instant::now();
    drill.restore_gpu().await?;
    Ok(drill
        .until_served_on_gpu(restored, Duration::from_secs(60), Some(Phase::DriverReset))
        .await)
}

/// The CPU pool is kept busy with oversized requests, and clients behind them hang up.
/// Returns the clients that hung up and the cancellations the server counted.
async fn cancel_in_queue(drill: &Arc<Drill>, sizes: &Sizes) -> (u64, f64) {
    let (busy, leaving) = (drill.n(3, 6), drill.n(4, 10));
    let oversized = sizes.oversized;
    drill.begin(Phase::CancelInQueue, busy + leaving);
    let before = drill.cancelled().await;
    let fill = {
        let d = Arc::clone(drill);
        tokio::spawn(async move {
            d.concurrently(busy, busy, move |d, i| async move {
                d.encoder(
                    Phase::CancelInQueue,
                    &format!("busy-{i}"),
                    oversized,
                    &[],
                    None,
                    "ok on cpu",
                )
                .await
                .judge(|r| r.served_on(CPU))
            })
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    drill
        .concurrently(leaving, leaving, move |d, i| async move {
            let patience = Duration::from_millis(60 + 10 * i as u64);
            let id = format!("leaves-{i}");
            d.encoder(
                Phase::CancelInQueue,
                &id,
                oversized,
                &[],
                Some(patience),
                "client hangs up while queued",
            )
            .await
            .judge(|r| !r.connection_held || r.status == Some(200))
        })
        .await;
    let _ = fill.await;
    let hung_up = drill
        .records()
        .iter()
        .filter(|r| r.phase == Phase::CancelInQueue && !r.connection_held)
        .count() as u64;
    (hung_up, drill.settle_cancelled(before, hung_up).await)
}

/// A reference, then one failing before its first token and one failing after it (both must
/// give the reference's tokens), then a non-replayable one failing after its first token.
/// Returns whether each replayed one gave the reference's text.
async fn streams(drill: &Arc<Drill>) -> Result<Vec<(String, bool)>, String> {
    drill.begin(Phase::Streams, 4);
    let prompt = "The accelerator ran out of memory, so";
    let body = json!({"model": DECODER, "prompt": prompt, "max_tokens": 24, "temperature": 0.8,
                      "seed": 7, "stream": true});
    let stream = |id: &'static str, headers: &'static [(&'static str, &'static str)], expect| {
        drill.stream(Phase::Streams, id, "/v1/completions", &body, headers, expect)
    };
    let clean = |r: &Record| r.status == Some(200) && r.first_failure.is_none();
    let reference = stream("stream-reference", &[], "ok").await.judge(clean).keep(drill);
    drill.until_gpu_closed(RECOVERY).await;
    drill.admin(json!({"fail_next": 1})).await?;
    let before_first = stream("stream-fails-before-first", &[], "replayed on cpu")
        .await
        .judge(clean)
        .keep(drill);
    drill.until_gpu_closed(RECOVERY).await;
    drill.admin(json!({"pass_first": 4, "fail_next": 1})).await?;
    let after_first = stream("stream-fails-after-first", &[], "continued on cpu")
        .await
        .judge(|r| clean(r) && r.pool.as_deref() == Some(CPU))
        .keep(drill);
    let equivalence = [
        ("failed before its first token", &before_first),
        ("failed after its first token", &after_first),
    ]
    .map(|(name, record)| {
        (
            name.to_string(),
            reference.text.is_some() && record.text == reference.text,
        )
    });
    // A non-replayable stream failing after its first token ends with an error event that says
    // how many tokens the client has.
    drill.until_gpu_closed(RECOVERY).await;
    drill.admin(json!({"pass_first": 4, "fail_next": 1})).await?;
    let expect = "error event after its tokens, not replayed";
    stream("stream-non-replayable", &[(REPLAYABLE_HEADER, "false")], expect)
        .await
        .judge(|r| {
            r.status == Some(200)
                && matches!(
                    r.first_failure,
                    Some(Failure::StreamError {
                        tokens_sent: Some(_),
                        ..
                    })
                )
        })
        .keep(drill);
    drill.admin(json!({"fail_next": 0, "pass_first": 0})).await?;
    Ok(equivalence.to_vec())
}

/// How long a phase waits for the accelerator's breaker to close before injecting its fault:
/// the drill's cooldown (2 s) and a health check, with room to spare.
const RECOVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// An encoder request and a chat offering tools (a tool call may have acted), each failing
/// after it started; neither may run on the CPU pool. Returns the CPU pool's runs meanwhile.
async fn non_replayable(drill: &Arc<Drill>) -> Result<u64, String> {
    drill.begin(Phase::NonReplayable, 2);
    // The streams before this one failed three runs: the breaker may be open for its cooldown.
    drill.until_gpu_closed(RECOVERY).await;
    let cpu_runs = drill.cpu_requests().await;
    drill.admin(json!({"fail_next": 1})).await?;
    let headers = [(REPLAYABLE_HEADER, "false")];
    drill
        .encoder(
            Phase::NonReplayable,
            "non-replayable-encoder",
            32,
            &headers,
            None,
            "503, not retried",
        )
        .await
        .judge(|r| r.status == Some(503) && r.pool.as_deref() != Some(CPU))
        .keep(drill);
    drill.until_gpu_closed(RECOVERY).await;
    drill.admin(json!({"pass_first": 2, "fail_next": 1})).await?;
    let tools = json!([{"type": "function", "function": {"name": "free_vram"}}]);
    let body = json!({"model": DECODER, "max_tokens": 8, "temperature": 0, "tools": tools,
                      "messages": [{"role": "user", "content": "Is there memory?"}]});
    // The answer's message carries the server's own reason for not retrying, word for word.
    let not_retried = NotRetried::ToolsStarted.to_string();
    let expect = "503 after its first token, never run again";
    drill
        .generate(
            Phase::NonReplayable,
            "chat-with-tools",
            "/v1/chat/completions",
            &body,
            expect,
        )
        .await
        .judge(|r| {
            r.status == Some(503)
                && r.first_failure
                    .as_ref()
                    .and_then(Failure::refusal)
                    .is_some_and(|m| m.contains(&not_retried))
        })
        .keep(drill);
    drill.admin(json!({"fail_next": 0, "pass_first": 0})).await?;
    Ok(drill.cpu_requests().await.saturating_sub(cpu_runs))
}

/// Concurrent duplicates and a late one per key. Returns the runs beyond one per key.
async fn idempotency(drill: &Arc<Drill>) -> Result<u64, String> {
    let keys = drill.n(2, 6);
    drill.begin(Phase::Idempotency, keys * 3);
    let mut duplicates = 0;
    for k in 0..keys {
        let key = format!("drill-{}-{k}", std::process::id());
        let retry = |suffix: &str| {
            let (d, key, id) = (Arc::clone(drill), key.clone(), format!("{key}-{suffix}"));
            tokio::spawn(async move { d.keyed(Phase::Idempotency, &id, &key).await })
        };
        let (first, second) = (retry("a"), retry("b"));
        let (a, b) = (
            first.await.map_err(|e| e.to_string())?,
            second.await.map_err(|e| e.to_string())?,
        );
        let late = drill.keyed(Phase::Idempotency, &format!("{key}-c"), &key).await;
        let runs = [&a, &b, &late]
            .iter()
            .filter(|r| r.status == Some(200) && !r.replayed)
            .count();
        duplicates += runs.saturating_sub(1) as u64;
        for record in [a, b, late] {
            record.judge(|r| r.status == Some(200)).keep(drill);
        }
    }
    Ok(duplicates)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_serialise_as_their_labels_in_order() {
        let labels: Vec<Value> = Phase::ALL.iter().map(|p| serde_json::to_value(p).unwrap()).collect();
        assert_eq!(
            labels,
            [
                "baseline",
                "redirect",
                "pressure",
                "alloc_failure",
                "driver_reset",
                "cancel_in_queue",
                "streams",
                "non_replayable",
                "idempotency",
                "embeddings",
                "residency",
                "background",
                "speech",
                "worker_lost"
            ]
        );
        assert_eq!(Phase::Baseline.number(), 1);
        assert_eq!(Phase::Background.number(), 12);
        assert_eq!(Phase::Embeddings.number(), 10);
        assert_eq!(Phase::WorkerLost.number(), 14);
        assert!(Phase::ALL.iter().all(|p| serde_json::to_value(p).unwrap() == p.label()));
    }
}
