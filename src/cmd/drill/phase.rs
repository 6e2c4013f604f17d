//! The drill's phases, named: what the record, the table and the progress line call each.

use serde::Serialize;

/// A phase of the drill; the JSON record names it by its [`label`](Phase::label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Short requests fit.
    Baseline,
    /// Over the accelerator's profile, within host RAM: redirected before it runs.
    Redirect,
    /// Short and long requests while a competing workload takes more and more of the device.
    Pressure,
    /// An allocator failure injected before a run: retried once on the CPU pool.
    AllocFailure,
    /// A driver reset and restore while unrelated CPU work is in flight.
    DriverReset,
    /// Clients hang up while waiting in the CPU queue.
    CancelInQueue,
    /// Streamed generations failing before and after their first token.
    Streams,
    /// Requests that must not run twice, failing after they started.
    NonReplayable,
    /// Client retries with idempotency keys.
    Idempotency,
    /// Embeddings requests under pressure, after allocator failures and through a driver reset.
    Embeddings,
    /// Three models that do not fit together, requests alternating between them, a pinned one.
    Residency,
    /// A background service's request while interactive requests wait.
    Background,
    /// A long transcription at rest, after an allocator failure, and through a driver reset.
    Speech,
    /// The accelerator's worker process killed with work of every kind in flight.
    WorkerLost,
}

impl Phase {
    /// Every phase, in the order they run.
    pub const ALL: [Phase; 14] = [
        Phase::Baseline,
        Phase::Redirect,
        Phase::Pressure,
        Phase::AllocFailure,
        Phase::DriverReset,
        Phase::CancelInQueue,
        Phase::Streams,
        Phase::NonReplayable,
        Phase::Idempotency,
        Phase::Embeddings,
        Phase::Residency,
        Phase::Background,
        Phase::Speech,
        Phase::WorkerLost,
    ];

    /// Its name: in the table, the progress line and the JSON record.
    pub fn label(self) -> &'static str {
        match self {
            Phase::Baseline => "baseline",
            Phase::Redirect => "redirect",
            Phase::Pressure => "pressure",
            Phase::AllocFailure => "alloc_failure",
            Phase::DriverReset => "driver_reset",
            Phase::CancelInQueue => "cancel_in_queue",
            Phase::Streams => "streams",
            Phase::NonReplayable => "non_replayable",
            Phase::Idempotency => "idempotency",
            Phase::Residency => "residency",
            Phase::Background => "background",
            Phase::Embeddings => "embeddings",
            Phase::Speech => "speech",
            Phase::WorkerLost => "worker_lost",
        }
    }

    /// The fault it injects, in one line (through the admin API's `/admin/sim`), for phases
    /// that inject one: the errors it causes are what the phase expects.
    pub fn injects(self) -> Option<&'static str> {
        match self {
            Phase::Pressure => Some("an external workload holds a rising share of the device, up to 85% (pressure)"),
            Phase::AllocFailure => {
                Some("the accelerator's next run fails to allocate, before each request (fail_next)")
            }
            Phase::DriverReset => Some("a driver reset: every accelerator run fails until a restore (driver_reset)"),
            Phase::CancelInQueue => Some("clients hang up while their requests wait in the CPU pool's queue"),
            Phase::Streams => Some(
                "accelerator runs fail to allocate before and after a stream's first token (fail_next, pass_first)",
            ),
            Phase::NonReplayable => {
                Some("accelerator runs fail to allocate after non-replayable requests started (fail_next, pass_first)")
            }
            Phase::Residency => Some("an external workload leaves room for two of the three dense models (pressure)"),
            Phase::Embeddings => Some(
                "an external workload holds 85% of the device, then allocator failures (fail_next), then a driver reset",
            ),
            Phase::Speech => Some(
                "an allocator failure before a transcription's first window (fail_next), then driver resets mid-transcription (driver_reset)",
            ),
            Phase::WorkerLost => Some(
                "the accelerator's worker process is killed (SIGKILL) with work of every kind in flight (kill_worker)",
            ),
            Phase::Baseline | Phase::Redirect | Phase::Idempotency | Phase::Background => None,
        }
    }

    /// Its place in the run, counting from 1.
    pub fn number(self) -> usize {
        Phase::ALL.iter().position(|&p| p == self).map_or(0, |i| i + 1)
    }
}
