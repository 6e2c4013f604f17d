//! The worker_lost phase: the accelerator pool's worker process is killed (SIGKILL, the admin
//! API's `kill_worker`) while replayable, non-replayable and streamed work is in flight there
//! and unrelated work runs on the CPU pool; nothing may be lost or run twice, and the server
//! must bring a new worker back and close the breaker by its own health check.
//!
//! Closed-loop lanes send replayable encoder requests, non-replayable ones
//! (`x-vramguard-replayable: false`), streamed chat generations and CPU-only classifier
//! requests. Once every kind has a request outstanding and `/status` shows the
//! `gpu` pool running one, the worker is killed, and the accelerator lanes send nothing more
//! (what was already sent is answered); the classifier lanes go on until the pool is back.
//! From the kill, `/status` alone is polled until the pool has a worker of another pid and a
//! closed breaker (at most [`RECOVERY`]): that is the phase's recovery time, with no user
//! traffic on the accelerator to close the breaker.
//!
//! What each request must get: a replayable one 200 (on the accelerator, or retried once on the
//! CPU pool with reason `worker_lost`); a non-replayable one 200 on the accelerator, a 503 whose
//! error says `reason: worker_lost`, `retried: false` and its `request_id` (never from the CPU
//! pool), or 200 on the CPU pool *without* a retry: one admitted while the breaker was already
//! open (or the worker away) goes to the fallback before it ran anywhere, which is its one run.
//! Only a non-replayable request answered by the CPU pool as a retry ran twice ([`ran_twice`],
//! counted in the drill's `duplicate executions`). A stream must be 200 and end with `[DONE]` or
//! an error event; a classifier request 200 on the CPU pool.
//!
//! It runs last, after `background`: a killed worker takes the accelerator's sessions and arena
//! with it and the new one loads the pool's models afresh, which would disturb the residency
//! phase's starting state (its dense models stood aside, their load times, its pinned model
//! resident in every sample) if it ran before it; after it, nothing is left to disturb, and the
//! drill's settle afterwards leaves the target serving on the accelerator as it found it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use super::client::Drill;
use super::criterion::Criterion;
use super::phase::Phase;
use super::record::{Failure, Judged, Record};
use super::{CPU, DECODER, ENCODER, GPU};
use crate::core::snapshot::BreakerState;
use crate::protocol::headers::REPLAYABLE_HEADER;

/// How long the server may take, from the kill, to have a new worker and a closed breaker.
const RECOVERY: Duration = Duration::from_secs(30);
/// How long to wait for every kind to have a request outstanding and the pool one
/// running before killing the worker anyway.
const IN_FLIGHT_WITHIN: Duration = Duration::from_secs(10);
/// The pause between two of the CPU lane's requests, so that its bounded count lasts past the
/// worker's return.
const CPU_PACE: Duration = Duration::from_millis(10);
/// Tokens of each encoder request: a run long enough that the worker holds some when it dies.
const SEQ: usize = 512;
/// What ends a non-replayable encoder request's kind.
const NOT_REPLAYABLE: &str = ", not replayable";
/// A streamed generation's kind.
const STREAM_KIND: &str = "POST /v1/chat/completions stream";

/// What the worker_lost phase saw beside its requests.
#[derive(Debug, Default, Clone, Serialize)]
pub struct WorkerFacts {
    /// The accelerator pool's worker before the kill (`/status` `pools[].worker_pid`).
    pub worker_pid_before: Option<u32>,
    /// The pid the kill answered with (`killed_worker_pid`).
    pub killed_worker_pid: Option<u64>,
    /// The pool's worker once it was back.
    pub worker_pid_after: Option<u32>,
    /// Milliseconds from the drill's start to the moment every kind was seen in flight, just
    /// before the kill was asked for.
    pub kill_ms: f64,
    /// Milliseconds from the drill's start to the kill's answer (the worker killed).
    pub killed_ms: f64,
    /// Runs `/status` showed on the accelerator pool just before the kill.
    pub gpu_inflight_at_kill: usize,
    /// From the kill to `/status` showing a new worker and a closed breaker, with no
    /// accelerator traffic sent meanwhile; none when that took longer than 30 s.
    pub recovery_ms: Option<f64>,
    /// `vramguard_worker_restarts_total{pool="gpu",reason="exited"}` rose by this much.
    pub restarts_counted: f64,
    /// `vramguard_worker_up{pool="gpu"}` once the pool was back.
    pub worker_up: f64,
    /// `vramguard_failovers_total{reason="worker_lost"}` rose by this much: the runs the lost
    /// worker held that were retried or continued on the fallback (streams' among them, which a
    /// client sees only as the pool their events name).
    pub failovers_counted: f64,
}

/// The kinds of request the phase sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Replayable,
    NonReplayable,
    Stream,
    Cpu,
}

impl Kind {
    const ALL: [Kind; 4] = [Kind::Replayable, Kind::NonReplayable, Kind::Stream, Kind::Cpu];

    /// The kind of one of the phase's records.
    fn of(record: &Record) -> Kind {
        if record.kind.ends_with(NOT_REPLAYABLE) {
            Kind::NonReplayable
        } else if record.kind == STREAM_KIND {
            Kind::Stream
        } else if record.kind.starts_with(ENCODER) {
            Kind::Replayable
        } else {
            Kind::Cpu
        }
    }

    fn label(self) -> &'static str {
        match self {
            Kind::Replayable => "replayable",
            Kind::NonReplayable => "non-replayable",
            Kind::Stream => "streams",
            Kind::Cpu => "cpu work",
        }
    }

    /// Whether `record`, of this kind, was answered as it should be.
    fn expected(self, r: &Record) -> bool {
        match self {
            Kind::Replayable => r.status == Some(200),
            Kind::NonReplayable => {
                r.served_on(GPU)
                    || (r.served_on(CPU) && r.retry.is_none())
                    || (r.status == Some(503) && r.pool.as_deref() != Some(CPU) && refused_for_worker_lost(r))
            }
            Kind::Stream => {
                r.status == Some(200)
                    && (r.done == Some(true) || matches!(r.first_failure, Some(Failure::StreamError { .. })))
            }
            Kind::Cpu => r.served_on(CPU),
        }
    }
}

/// A 503 that says the worker was lost, that it was not retried, and which request it was.
fn refused_for_worker_lost(r: &Record) -> bool {
    r.error.as_ref().is_some_and(|e| {
        e.reason.as_deref() == Some("worker_lost")
            && e.retried == Some(false)
            && e.request_id.as_deref() == Some(r.id.as_str())
    })
}

/// The phase's non-replayable requests that ran twice: answered by the CPU pool as a retry
/// (`parameters.reason`) after their run on the accelerator. One sent to the CPU pool before it
/// ran (the breaker already open when it was admitted) ran once.
pub(super) fn ran_twice(records: &[Record]) -> u64 {
    records
        .iter()
        .filter(|r| r.phase == Phase::WorkerLost && Kind::of(r) == Kind::NonReplayable)
        .filter(|r| r.pool.as_deref() == Some(CPU) && r.retry.is_some())
        .count() as u64
}

/// Requests outstanding per kind, and whether the lanes are to stop.
#[derive(Default)]
struct Lanes {
    outstanding: [AtomicUsize; 4],
    stop_accelerator: AtomicBool,
    stop_cpu: AtomicBool,
}

impl Lanes {
    fn every_kind_outstanding(&self) -> bool {
        self.outstanding.iter().all(|n| n.load(Ordering::Relaxed) > 0)
    }
}

/// One request of `kind`, number `i` of its lane.
async fn send(drill: &Drill, kind: Kind, lane: usize, i: usize) -> Judged {
    let id = format!("worker-{}-{lane}-{i}", kind.label().replace(' ', "-"));
    let record = match kind {
        Kind::Replayable => {
            let expect = "200, on gpu or retried on cpu";
            drill.encoder(Phase::WorkerLost, &id, SEQ, &[], None, expect).await
        }
        Kind::NonReplayable => {
            let expect = "200 on gpu, on cpu before it ran, or 503 worker_lost";
            let kind = format!("{ENCODER} seq {SEQ}{NOT_REPLAYABLE}");
            let record = Record::new(Phase::WorkerLost, &id, kind, expect, drill.elapsed_ms());
            let headers = [(REPLAYABLE_HEADER, "false")];
            drill.send_encoder(ENCODER, record, SEQ, &headers, None).await
        }
        Kind::Stream => {
            let body = json!({"model": DECODER, "max_tokens": 48, "temperature": 0, "stream": true,
                              "messages": [{"role": "user", "content": "Tell me about memory."}]});
            let expect = "200, complete or ending with an error event";
            drill
                .stream(Phase::WorkerLost, &id, "/v1/chat/completions", &body, &[], expect)
                .await
        }
        Kind::Cpu => drill.classifier(Phase::WorkerLost, &id).await,
    };
    record.judge(|r| kind.expected(r))
}

/// A closed-loop lane of `kind`: at most `most` requests, until its stop flag is set (the CPU
/// lane's pauses between them).
fn lane(drill: &Arc<Drill>, lanes: &Arc<Lanes>, kind: Kind, lane: usize, most: usize) -> tokio::task::JoinHandle<()> {
    let (drill, lanes) = (Arc::clone(drill), Arc::clone(lanes));
    tokio::spawn(async move {
        let slot = kind as usize;
        let stop = match kind {
            Kind::Cpu => &lanes.stop_cpu,
            _ => &lanes.stop_accelerator,
        };
        for i in 0..most {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            lanes.outstanding[slot].fetch_add(1, Ordering::Relaxed);
            let judged = send(&drill, kind, lane, i).await;
            lanes.outstanding[slot].fetch_sub(1, Ordering::Relaxed);
            judged.keep(&drill);
            if kind == Kind::Cpu {
                tokio::time::sleep(CPU_PACE).await;
            }
        }
    })
}

/// The accelerator pool's worker pid, breaker and runs, as `/status` says now.
async fn gpu(drill: &Drill) -> Option<(Option<u32>, BreakerState, usize)> {
    let status = drill.status().await.ok()?;
    let pool = status.pool(GPU)?;
    Some((pool.worker_pid, pool.breaker, pool.inflight))
}

/// The worker restarts the target has counted for the accelerator pool, reason `exited`.
async fn restarts(drill: &Drill) -> f64 {
    let labels = format!("pool=\"{GPU}\",reason=\"exited\"");
    drill.counted("vramguard_worker_restarts_total{", &labels).await
}

/// The failovers the target has counted for a lost worker.
async fn failovers(drill: &Drill) -> f64 {
    drill
        .counted("vramguard_failovers_total{", "reason=\"worker_lost\"")
        .await
}

/// Run the phase.
pub(super) async fn run(drill: &Arc<Drill>) -> Result<WorkerFacts, String> {
    let (per_lane, streams, cpu) = (drill.n(20, 60), drill.n(3, 6), drill.n(120, 300));
    drill.begin(Phase::WorkerLost, 4 * per_lane + 2 * streams + cpu);
    let mut facts = WorkerFacts::default();
    let before = gpu(drill).await.ok_or(format!("`/status` has no pool `{GPU}`"))?;
    facts.worker_pid_before = before.0;
    let (restarts_before, failovers_before) = (restarts(drill).await, failovers(drill).await);
    let lanes = Arc::new(Lanes::default());
    let tasks = vec![
        lane(drill, &lanes, Kind::Replayable, 0, per_lane),
        lane(drill, &lanes, Kind::Replayable, 1, per_lane),
        lane(drill, &lanes, Kind::NonReplayable, 0, per_lane),
        lane(drill, &lanes, Kind::NonReplayable, 1, per_lane),
        lane(drill, &lanes, Kind::Stream, 0, streams),
        lane(drill, &lanes, Kind::Stream, 1, streams),
        lane(drill, &lanes, Kind::Cpu, 0, cpu),
    ];
    // Kill it while every kind is outstanding and the worker runs one of them.
    let waiting = Instant::now();
    while waiting.elapsed() < IN_FLIGHT_WITHIN {
        let running = gpu(drill).await.map_or(0, |(_, _, inflight)| inflight);
        // Taken as the lanes are read: a request they count is then between its send and its
        // answer, so its record spans this moment or the kill after it.
        facts.kill_ms = drill.elapsed_ms();
        if running > 0 && lanes.every_kind_outstanding() {
            facts.gpu_inflight_at_kill = running;
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let killed = Instant::now();
    let answer = drill.admin_answer(json!({"kill_worker": true})).await;
    facts.killed_ms = drill.elapsed_ms();
    lanes.stop_accelerator.store(true, Ordering::Relaxed);
    facts.killed_worker_pid = answer?["killed_worker_pid"].as_u64();
    // Nothing more goes to the accelerator: its own health check must close the breaker.
    while killed.elapsed() < RECOVERY {
        if let Some((Some(pid), BreakerState::Closed, _)) = gpu(drill).await
            && Some(pid) != facts.worker_pid_before
        {
            facts.worker_pid_after = Some(pid);
            facts.recovery_ms = Some(killed.elapsed().as_secs_f64() * 1000.0);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    lanes.stop_cpu.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.map_err(|e| format!("a worker_lost lane failed: {e}"))?;
    }
    facts.restarts_counted = restarts(drill).await - restarts_before;
    facts.failovers_counted = failovers(drill).await - failovers_before;
    facts.worker_up = drill.counted("vramguard_worker_up{", &format!("pool=\"{GPU}\"")).await;
    Ok(facts)
}

/// How the phase's requests of each kind fared: sent, in flight at the kill, and answered how.
/// In flight at the kill: its record spans some moment from when every kind was seen in flight
/// (`kill_ms`) to the kill's answer (`killed_ms`). A CPU request is a few milliseconds, so one
/// the lanes counted may have ended its record just before the kill was asked for; the work
/// that ran across the kill is what the criterion is about.
fn tally(records: &[&Record], (kill_ms, killed_ms): (f64, f64)) -> (String, bool) {
    let mut parts = Vec::new();
    let mut held_each = true;
    for kind in Kind::ALL {
        let of: Vec<&&Record> = records.iter().filter(|r| Kind::of(r) == kind).collect();
        let held = of
            .iter()
            .filter(|r| r.sent_ms <= killed_ms && r.sent_ms + r.latency_ms >= kill_ms)
            .count();
        let count = |f: &dyn Fn(&Record) -> bool| of.iter().filter(|r| f(r)).count();
        let detail = match kind {
            Kind::Replayable => format!(
                "{} retried on cpu",
                count(&|r| r.retry.as_deref() == Some("worker_lost"))
            ),
            Kind::NonReplayable => format!(
                "{} refused worker_lost, {} on cpu before running",
                count(&|r| r.status == Some(503) && refused_for_worker_lost(r)),
                count(&|r| r.served_on(CPU))
            ),
            Kind::Stream => format!(
                "{} ended with an error event",
                count(&|r| matches!(r.first_failure, Some(Failure::StreamError { .. })))
            ),
            Kind::Cpu => format!("{} on cpu", count(&|r| r.served_on(CPU))),
        };
        held_each &= held > 0;
        parts.push(format!(
            "{} {} ({held} in flight at the kill, {detail})",
            kind.label(),
            of.len()
        ));
    }
    (parts.join("; "), held_each)
}

/// The phase's criteria: every kind of request answered as it expects, with each accelerator
/// kind and CPU work in flight at the kill; and a new worker, whose probe closed the breaker in time.
pub(super) fn criteria(records: &[Record], facts: Option<&WorkerFacts>) -> Vec<Criterion> {
    const ANSWERED: &str = "worker_lost: each kind answered as it expects";
    const BACK: &str = "worker_lost: new worker, breaker closed by probe";
    let Some(facts) = facts else {
        return [ANSWERED, BACK]
            .map(|name| Criterion {
                name,
                measured: "the phase did not run".into(),
                passed: false,
            })
            .to_vec();
    };
    let ours: Vec<&Record> = records.iter().filter(|r| r.phase == Phase::WorkerLost).collect();
    let (tallied, held_each) = tally(&ours, (facts.kill_ms, facts.killed_ms));
    let measured = format!(
        "{tallied}; {} failovers for worker_lost counted",
        facts.failovers_counted
    );
    let unexpected = ours.iter().filter(|r| !r.as_expected).count();
    let answered = Criterion {
        name: ANSWERED,
        measured: if unexpected == 0 {
            measured
        } else {
            format!("{unexpected} not as expected; {measured}")
        },
        passed: unexpected == 0 && held_each,
    };
    let pid = |p: Option<u64>| p.map_or_else(|| "none".to_string(), |p| p.to_string());
    let replaced = facts.worker_pid_after.is_some() && facts.worker_pid_after != facts.worker_pid_before;
    let back = Criterion {
        name: BACK,
        measured: format!(
            "worker {} killed ({} running), {} back {}; restarts counted {}, worker up {}",
            pid(facts.killed_worker_pid),
            facts.gpu_inflight_at_kill,
            pid(facts.worker_pid_after.map(u64::from)),
            facts.recovery_ms.map_or_else(
                || format!("not within {} s", RECOVERY.as_secs()),
                |ms| format!("{ms:.0} ms after the kill, no accelerator traffic")
            ),
            facts.restarts_counted,
            facts.worker_up
        ),
        passed: replaced
            && facts.killed_worker_pid.is_some()
            && facts.killed_worker_pid == facts.worker_pid_before.map(u64::from)
            && facts.recovery_ms.is_some()
            && facts.restarts_counted >= 1.0
            && facts.worker_up == 1.0,
    };
    vec![answered, back]
}

#[cfg(test)]
mod tests {
    use super::super::record::ErrorFields;
    use super::*;

    fn answered(id: &str, kind: &str, status: u16, pool: &str) -> Record {
        Record {
            status: Some(status),
            pool: Some(pool.into()),
            id_kept: true,
            ..Record::new(Phase::WorkerLost, id, kind.into(), "", 0.0)
        }
    }

    #[test]
    fn a_non_replayable_request_runs_twice_only_when_the_fallback_answers_it_as_a_retry() {
        let kind = format!("{ENCODER} seq {SEQ}{NOT_REPLAYABLE}");
        let on_gpu = answered("a", &kind, 200, GPU);
        // Admitted while the breaker was open: sent to the CPU pool before it ran, once.
        let before_running = answered("b", &kind, 200, CPU);
        let mut retried = answered("c", &kind, 200, CPU);
        retried.retry = Some("worker_lost".into());
        let mut refused = answered("d", &kind, 503, GPU);
        refused.error = Some(ErrorFields {
            reason: Some("worker_lost".into()),
            retried: Some(false),
            request_id: Some("d".into()),
        });
        let mut nameless = refused.clone();
        nameless.error.as_mut().unwrap().request_id = None;
        let mut replayable = answered("e", &format!("{ENCODER} seq {SEQ}"), 200, CPU);
        replayable.retry = Some("worker_lost".into());
        let records = [on_gpu, before_running, retried, refused, nameless, replayable];
        let verdicts: Vec<bool> = records.iter().map(|r| Kind::of(r).expected(r)).collect();
        assert_eq!(verdicts, [true, true, false, true, false, true]);
        assert_eq!(ran_twice(&records), 1);
        assert_eq!(Kind::of(&records[5]), Kind::Replayable);
    }

    #[test]
    fn a_stream_must_end_with_done_or_an_error_event_and_the_phase_must_have_run() {
        let mut cut = answered("s", STREAM_KIND, 200, CPU);
        cut.done = Some(false);
        assert!(!Kind::Stream.expected(&cut), "cut off without an end");
        let mut errored = cut.clone();
        errored.first_failure = Some(Failure::StreamError {
            event: "{}".into(),
            tokens_sent: Some(3),
        });
        assert!(Kind::Stream.expected(&errored));
        cut.done = Some(true);
        assert!(Kind::Stream.expected(&cut));
        let missing = criteria(&[], None);
        assert_eq!(missing.len(), 2);
        assert!(missing.iter().all(|c| !c.passed));
        let facts = WorkerFacts {
            worker_pid_before: Some(7),
            killed_worker_pid: Some(7),
            worker_pid_after: Some(7),
            recovery_ms: Some(100.0),
            restarts_counted: 1.0,
            worker_up: 1.0,
            ..WorkerFacts::default()
        };
        let back = &criteria(&[], Some(&facts))[1];
        assert!(!back.passed, "the same pid is not a new worker: {}", back.measured);
    }

    /// A record in flight at the kill spans some moment from when every kind was seen in
    /// flight to the kill's answer: a short CPU request that ended between the two counts.
    #[test]
    fn in_flight_at_the_kill_is_any_moment_from_every_kind_seen_to_the_kill_answered() {
        let at = |id: &str, kind: &str, sent_ms: f64, latency_ms: f64| Record {
            sent_ms,
            latency_ms,
            ..answered(id, kind, 200, GPU)
        };
        let long = |id: &str, kind: &str| at(id, kind, 0.0, 1000.0);
        let accelerator = [
            long("r", &format!("{ENCODER} seq {SEQ}")),
            long("n", &format!("{ENCODER} seq {SEQ}{NOT_REPLAYABLE}")),
            long("s", STREAM_KIND),
        ];
        let in_flight = |cpu: Record| {
            let mut records: Vec<&Record> = accelerator.iter().collect();
            records.push(&cpu);
            tally(&records, (100.0, 104.0)).1
        };
        assert!(
            in_flight(at("c", "classifier", 98.0, 3.0)),
            "ended while the kill was asked for"
        );
        assert!(
            in_flight(at("c", "classifier", 103.0, 2.0)),
            "sent while the kill was asked for"
        );
        assert!(
            !in_flight(at("c", "classifier", 95.0, 4.0)),
            "ended before every kind was seen"
        );
        assert!(!in_flight(at("c", "classifier", 105.0, 2.0)), "sent after the kill");
    }
}
