//! One unit of work for a pool, the caller's handle to stop it, and why it may produce nothing.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::core::backend::{BackendError, DecodeStep, Interrupt, RunMeta};
use crate::core::tensor::Tensor;
use crate::pool::activity::Progress;
use crate::runtime::estimate::learned::Observation;

/// One unit of work for a pool.
#[derive(Debug)]
pub struct InferJob {
    /// The request's identity and limits (its id for logs, its deadline).
    pub meta: RunMeta,
    /// Model name.
    pub model: String,
    /// Validated inputs.
    pub inputs: Inputs,
    /// Outputs asked for, empty for all.
    pub outputs: Vec<String>,
    /// What the backend does with them: a plain run, or a generation's prompt or step whose
    /// KV cache the backend keeps.
    pub op: RunOp,
    /// The admission estimate of the run's working memory (context + workspace), checked
    /// against what the arena actually needed.
    pub estimate_bytes: Option<u64>,
    /// What the run is measured to take, for the caller's estimates.
    pub memory: RunMemory,
    /// A health check's run, not a request's: kept out of the queue's wait times and the
    /// delay estimate; its outcome is settled by the check (see `Health::health_checked`).
    pub probe: bool,
    /// Lets the caller stop the job: skipped if still queued, interrupted if running.
    pub cancel: RunCancel,
}

/// A job's inputs, shared with the request that may run them once more on its fallback: the
/// request keeps a second reference instead of a copy. While it does, the backend runs them
/// borrowed ([`Backend::run_borrowed`](crate::core::backend::Backend::run_borrowed)); when the
/// job holds the only reference, the backend takes them.
#[derive(Debug, Clone, Default)]
pub struct Inputs(Arc<Vec<Tensor>>);

impl Inputs {
    /// Whether another holder (a request keeping them for a retry) shares them.
    pub fn is_shared(&self) -> bool {
        Arc::strong_count(&self.0) > 1
    }

    /// The tensors, taken when no one else holds them and copied otherwise.
    pub fn into_vec(self) -> Vec<Tensor> {
        Arc::try_unwrap(self.0).unwrap_or_else(|shared| shared.as_ref().clone())
    }
}

impl From<Vec<Tensor>> for Inputs {
    fn from(tensors: Vec<Tensor>) -> Self {
        Inputs(Arc::new(tensors))
    }
}

impl std::ops::Deref for Inputs {
    type Target = [Tensor];

    fn deref(&self) -> &[Tensor] {
        &self.0
    }
}

/// What a job asks of the backend.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum RunOp {
    /// Run the model on the inputs and answer the outputs asked for.
    #[default]
    Run,
    /// A decoder's prompt: run it and keep its KV cache as this sequence's
    /// ([`Generations::prefill`](crate::core::backend::Generations::prefill)).
    Prefill(u64),
    /// Several decoders' prompts, run as one padded batch where the backend can (their
    /// inputs one after another); the worker makes it of prompts that waited together.
    PrefillMany(Vec<u64>),
    /// One batched step of generations whose caches the backend keeps (no inputs).
    Decode(DecodeStep),
}

/// A caller's handle to stop its job: before it starts the worker skips it, while it runs the
/// backend's run is interrupted (ONNX Runtime's terminate flag), after it ends nothing happens.
#[derive(Clone, Default)]
pub struct RunCancel(Arc<Mutex<CancelState>>);

#[derive(Default)]
struct CancelState {
    cancelled: bool,
    interrupt: Option<Interrupt>,
    /// The request the job belongs to: running from its first run's start.
    progress: Progress,
}

impl std::fmt::Debug for RunCancel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunCancel")
            .field("cancelled", &self.lock().cancelled)
            .finish()
    }
}

impl RunCancel {
    /// A handle for a job of the request whose progress is `progress`.
    pub fn for_request(progress: Progress) -> Self {
        RunCancel(Arc::new(Mutex::new(CancelState {
            progress,
            ..CancelState::default()
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CancelState> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stop the job. The interrupt is called under the lock the worker takes to end the run,
    /// so it can never reach a later run of the same backend.
    pub fn cancel(&self) {
        let mut state = self.lock();
        state.cancelled = true;
        if let Some(interrupt) = state.interrupt.take() {
            interrupt();
        }
    }

    /// The run starts with `interrupt`; false if the job was cancelled already.
    pub(super) fn start(&self, interrupt: Option<Interrupt>) -> bool {
        let mut state = self.lock();
        if state.cancelled {
            return false;
        }
        state.interrupt = interrupt;
        state.progress.started();
        true
    }

    /// The run ended: nothing may interrupt this backend on this job's behalf any more.
    pub(super) fn end(&self) {
        self.lock().interrupt = None;
    }
}

/// What a worker measured of a run's working memory, for the caller to read once the answer is
/// in. A run is measured when the caller asks (reading the arena costs a C API call before and
/// after) and whenever it fails to allocate (the arena's free memory then is a lower bound).
#[derive(Debug, Clone, Default)]
pub struct RunMemory {
    wanted: bool,
    seen: Arc<Mutex<Option<Observation>>>,
}

impl RunMemory {
    /// Measure the run.
    pub fn wanted() -> RunMemory {
        RunMemory {
            wanted: true,
            ..RunMemory::default()
        }
    }

    /// Whether the caller asked for a measurement.
    pub fn is_wanted(&self) -> bool {
        self.wanted
    }

    /// What was measured, once.
    pub fn take(&self) -> Option<Observation> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    pub(super) fn record(&self, observation: Observation) {
        *self.seen.lock().unwrap_or_else(PoisonError::into_inner) = Some(observation);
    }
}

/// Why a job produced no outputs.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum PoolError {
    /// The queue is at capacity.
    #[error("pool `{pool}` queue is full ({capacity} waiting)")]
    QueueFull {
        /// Pool name.
        pool: String,
        /// Its capacity.
        capacity: usize,
    },
    /// The request waited longer than the pool's `max_wait`.
    #[error("pool `{pool}` did not start the request within {}ms", waited.as_millis())]
    QueueTimeout {
        /// Pool name.
        pool: String,
        /// How long it waited.
        waited: Duration,
    },
    /// The client's deadline passed before the work could finish.
    #[error("deadline exceeded in pool `{pool}`")]
    DeadlineExceeded {
        /// Pool name.
        pool: String,
    },
    /// The pool is not taking work (shutting down).
    #[error("pool `{pool}` is shutting down")]
    ShuttingDown {
        /// Pool name.
        pool: String,
    },
    /// The pool's circuit breaker is open (or its one probe is out).
    #[error("pool `{pool}` is not taking work: its circuit breaker is open after {why}")]
    BreakerOpen {
        /// Pool name.
        pool: String,
        /// Why it opened.
        why: crate::core::breaker::Tripped,
    },
    /// The pool could not be started (e.g. no CUDA provider); the reason says why.
    #[error("pool `{pool}` is unavailable: {reason}")]
    Unavailable {
        /// Pool name.
        pool: String,
        /// Why.
        reason: String,
    },
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// What a finished job sends back.
pub type JobResult = Result<Vec<Tensor>, PoolError>;
