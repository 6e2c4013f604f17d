//! The seam between the request path and whatever runs models: the [`Backend`] trait (ONNX
//! Runtime sessions in production, fakes in tests) and the capabilities a backend may have
//! beside running, the errors a run can end with, and the allocator statistics a backend may
//! report. Plain types only, so pools, the lifecycle and the ONNX Runtime code all depend on
//! this module and never on each other.

use crate::core::tensor::{Tensor, TensorData, TensorView};

/// Runs models; one instance per worker thread, so it may hold non-shareable sessions.
///
/// Beside running, a backend may have capabilities: sessions it loads and unloads
/// ([`Residency`]), generations' caches it keeps ([`Generations`]), allocator statistics
/// ([`Arenas`]), a process it runs on that can be lost ([`Liveness`]), runs that can be stopped
/// ([`Interrupts`]). Each is an accessor without a default: a backend, and above all a wrapper
/// around one, says for each whether it has it (a wrapper: what it forwards), so none is lost
/// by leaving it out.
pub trait Backend: Send {
    /// Run `model` on `inputs`, returning the `outputs` asked for (all when empty). `meta` is
    /// the request's identity and limits, for a backend that hands the request on.
    fn run(
        &mut self,
        model: &str,
        inputs: Vec<Tensor>,
        outputs: &[String],
        meta: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError>;
    /// [`run`](Self::run) on inputs borrowed from bytes that lie elsewhere (a worker process's
    /// shared memory). A backend that can read them in place does; this one decodes them first.
    fn run_views(
        &mut self,
        model: &str,
        inputs: &[TensorView<'_>],
        outputs: &[String],
        meta: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        let tensors = inputs
            .iter()
            .map(TensorView::to_tensor)
            .collect::<Result<Vec<_>, _>>()
            .map_err(BackendError::InvalidInput)?;
        self.run(model, tensors, outputs, meta)
    }
    /// [`run`](Self::run) on inputs the caller keeps (a replayable request's, which its
    /// fallback may run again): the runtime reads them where they lie through
    /// [`run_views`](Self::run_views) rather than taking a copy. A backend that copies its inputs
    /// anyway (to a worker process) overrides this to read them directly.
    fn run_borrowed(
        &mut self,
        model: &str,
        inputs: &[Tensor],
        outputs: &[String],
        meta: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        match inputs.iter().map(Tensor::view).collect::<Option<Vec<_>>>() {
            Some(views) => self.run_views(model, &views, outputs, meta),
            None => self.run(model, inputs.to_vec(), outputs, meta),
        }
    }
    /// Its sessions, loaded and unloaded by name; `None` for a backend that holds none of its
    /// own (a remote pool's client).
    fn residency(&mut self) -> Option<&mut dyn Residency>;
    /// The generations whose KV caches it keeps where its runtime is; `None` for a backend
    /// that keeps none (a remote pool's client: its server keeps its own, and a generation on
    /// it carries its cache with each step).
    fn generations(&mut self) -> Option<&mut dyn Generations>;
    /// Its allocator statistics; `None` for a backend without an arena of its own.
    fn arenas(&mut self) -> Option<&mut dyn Arenas>;
    /// Whether what it runs on is still there; `None` for a backend in the pool's own process,
    /// which is never lost.
    fn liveness(&self) -> Option<&dyn Liveness>;
    /// Stopping its run in progress; `None` when runs cannot be stopped.
    fn interrupts(&mut self) -> Option<&mut dyn Interrupts>;
}

impl dyn Backend + '_ {
    /// Its sessions, or why `name` cannot be loaded on it: it holds none.
    pub fn loader(&mut self, name: &str) -> Result<&mut dyn Residency, String> {
        self.residency()
            .ok_or_else(|| format!("this backend cannot load `{name}`: it holds no sessions"))
    }

    /// The caches it keeps, or the error a prompt or a step run on a backend that keeps none
    /// ends with.
    pub fn caches(&mut self) -> Result<&mut dyn Generations, BackendError> {
        self.generations()
            .ok_or_else(|| BackendError::Runtime("this backend keeps no generation caches".into()))
    }
}

/// A backend's sessions ([`Backend::residency`]): built and dropped by name while it serves.
pub trait Residency {
    /// Build `name`'s session from `model` (its graph, and the folder of its external data),
    /// replacing one it already has.
    fn load_model(&mut self, name: &str, model: crate::core::model::ModelData<'_>) -> Result<(), String>;
    /// Drop `name`'s session, if it has one; its memory goes back to the allocator once no
    /// other name shares it ([`Residency::share_model`]).
    fn unload_model(&mut self, name: &str);
    /// Serve `name` from the session `with` holds (their weights are identical): no second
    /// copy is built. A backend that cannot share says why, and `name` is then loaded.
    fn share_model(&mut self, name: &str, with: &str) -> Result<(), String>;
    /// Give the allocator's free memory back to the host or device: called when the pool has
    /// been idle a while, never between a busy pool's runs. `probe(model)` gives the smallest
    /// valid inputs of a model, for a backend whose allocator shrinks only at the end of a run
    /// (ONNX Runtime's arena).
    fn release_memory(&mut self, probe: &dyn Fn(&str) -> Option<Vec<Tensor>>);
}

/// The generations whose KV caches a backend keeps between runs, where its runtime is
/// ([`Backend::generations`]).
pub trait Generations {
    /// Run decoder `model`'s prompt (`inputs`: a decoder's first pass, as
    /// [`step_inputs`](crate::runtime::decoder::step_inputs) builds it) and keep its KV cache
    /// where the runtime is, as sequence `seq`'s (replacing any it had). Only the last
    /// position's logits come back: `logits`, FP32 `[1, vocab]`.
    fn prefill(
        &mut self,
        model: &str,
        seq: u64,
        inputs: Vec<Tensor>,
        meta: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError>;
    /// [`prefill`](Self::prefill) of several sequences' prompts (`inputs`: each one's first
    /// pass, one after another) as one run where the backend can: `logits` `[1, vocab]` for
    /// each, in `seqs`' order. This one runs them one at a time, which gives the same answers.
    fn prefill_many(
        &mut self,
        model: &str,
        seqs: &[u64],
        inputs: Vec<Tensor>,
        meta: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        let per = inputs.len() / seqs.len().max(1);
        let mut inputs = inputs.into_iter();
        let mut out = Vec::new();
        for &seq in seqs {
            out.extend(self.prefill(model, seq, inputs.by_ref().take(per).collect(), meta)?);
        }
        Ok(out)
    }
    /// One step of `model`'s generations whose caches it keeps: copy the caches of
    /// `step.forks`, drop those of `step.ended`, then run each row's next token, all rows as
    /// one batch. Returns `logits`,
    /// FP32 `[rows, vocab]`, in row order. A row whose cache it does not hold at that row's
    /// `past` fails the step with [`BackendError::CacheMissing`] (nothing else is changed), so
    /// the caller prefills it again from its tokens.
    fn decode(&mut self, model: &str, step: &DecodeStep, meta: &RunMeta) -> Result<Vec<Tensor>, BackendError>;
}

/// A backend's allocator statistics ([`Backend::arenas`]), read when its caller decides: each
/// read costs a C API call (~10 µs), or a worker process's answer.
pub trait Arenas {
    /// Statistics as of the last refresh: the arena of the model that ran (or was refreshed
    /// for) last, which a run's memory is measured against.
    fn arena_stats(&self) -> Option<ArenaStats>;
    /// Statistics of everything the backend holds as of the last
    /// [`refresh_arena_stats`](Self::refresh_arena_stats): every arena its sessions allocate
    /// from, each counted once, summed. What its pool publishes.
    fn held_arena_stats(&self) -> Option<ArenaStats>;
    /// Read the allocator statistics again.
    fn refresh_arena_stats(&mut self);
    /// Read the statistics of the arena `model`'s runs allocate from, before a measured run.
    fn refresh_arena_stats_for(&mut self, model: &str);
}

/// Whether what a backend runs on is still there ([`Backend::liveness`]): a worker process
/// that can die or be replaced.
pub trait Liveness {
    /// Whether what it runs on is gone (a worker process that died or was replaced): the pool
    /// replaces it before its next job.
    fn lost(&self) -> bool;
    /// Why its worker process is gone, when a run found its connection closed while that
    /// process is still the pool's worker (its supervisor has not reaped it yet: a process
    /// holding a CUDA context is reaped only after the driver has torn the context down).
    fn worker_gone(&self) -> Option<String>;
}

/// Stopping a backend's run in progress ([`Backend::interrupts`]).
pub trait Interrupts {
    /// A handle that stops this backend's run in progress from another thread (the run then
    /// ends with [`BackendError::Cancelled`]).
    fn interrupt_handle(&self) -> Interrupt;
    /// Forget a stop meant for an earlier run. Called before the handle is given out for the
    /// next run, never at the start of `run`: a stop that arrives between the two must end that
    /// run, not be wiped by it.
    fn clear_interrupt(&mut self);
}

/// What a run carries besides its tensors: the request's identity and limits. A backend that
/// hands the request on to another server (a remote pool) sends them with it; local backends
/// ignore them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunMeta {
    /// Request id (`x-request-id`), kept end to end.
    pub request_id: String,
    /// When the client stops caring.
    pub deadline: Option<std::time::Instant>,
    /// The client's `idempotency-key`, when it sent one.
    pub idempotency_key: Option<String>,
    /// Client priority (`x-vramguard-priority`).
    pub priority: i64,
    /// False when the request must never be retried automatically once started.
    pub replayable: bool,
    /// True when the client allows its context to be cut.
    pub allow_shrink: bool,
}

/// One step of the generations a backend keeps caches for ([`Generations::decode`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DecodeStep {
    /// The rows that run, in the order their logits come back.
    pub rows: Vec<DecodeRow>,
    /// Sequences whose caches are dropped first (finished, failed, their client gone).
    pub ended: Vec<u64>,
    /// Caches copied before anything else, where the backend keeps them (never through the
    /// host): generations that share a prompt's run (OpenAI's `n`) each go on from a copy.
    #[serde(default)]
    pub forks: Vec<Fork>,
}

/// A sequence's cache copied as other sequences' ([`DecodeStep::forks`]): they hold what it
/// holds, at its position. A fork whose sequence the backend does not hold is skipped: the
/// new sequences' rows then fail with [`BackendError::CacheMissing`] and are prefilled again.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Fork {
    /// The sequence copied.
    pub from: u64,
    /// The sequences made of it (one not held yet each).
    pub to: Vec<u64>,
}

impl DecodeStep {
    /// Bytes a row crosses into the runtime: its token, its position and its attention-mask
    /// column, INT64 each.
    pub const ROW_BYTES: u64 = 24;
    /// The output in which a backend that keeps caches reports the bytes of its batch's masked
    /// slots' caches (`[bytes]`, INT64), counted on the host as the pool's KV cache.
    pub const PADDING: &'static str = "padding_bytes";
    /// The output in which a backend that keeps caches reports the shape of a model's batch
    /// after a step: `[rows, slots]`, INT64, the rows whose caches it holds (prompts run and
    /// not joined yet included) and the positions they share once together. Admission charges
    /// a generation joining it the padding it brings ([`crate::pool::batch::sequences::padding_tokens`]).
    pub const BATCH: &'static str = "batch_shape";
    /// The output in which a backend that keeps caches reports what its step moved between the
    /// host and the runtime: `[bytes in, bytes out]`, INT64. A batch's masked rows (a member
    /// that was late, or gone) cross too, so this can be more than the step's own rows.
    pub const CROSSED: &'static str = "crossed_bytes";
    /// Every report a decode step's outputs may carry beside its `logits`: counts for the
    /// host, not outputs of the model.
    pub const REPORTS: [&'static str; 3] = [Self::PADDING, Self::BATCH, Self::CROSSED];

    /// The `N` counts a backend reported in `outputs` under `report` (one of
    /// [`REPORTS`](Self::REPORTS)), when it did, as INT64 `[N]` (a negative reads as 0).
    pub fn reported<const N: usize>(outputs: &[Tensor], report: &str) -> Option<[u64; N]> {
        let tensor = outputs.iter().find(|t| t.name == report)?;
        let TensorData::Int64(values) = &tensor.data else {
            return None;
        };
        let values: &[i64; N] = values.as_slice().try_into().ok()?;
        Some(values.map(|n| n.max(0) as u64))
    }
}

/// One sequence's next token in a [`DecodeStep`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DecodeRow {
    /// The sequence (numbered by whoever prefilled it).
    pub seq: u64,
    /// Its next token.
    pub token: u32,
    /// Positions of it the cache holds before this token (prompt and tokens so far): checked
    /// against the backend's, so a cache that missed a step is never used.
    pub past: u64,
}

/// Stops a backend's run in progress; safe to call from any thread, at any time.
pub type Interrupt = std::sync::Arc<dyn Fn() + Send + Sync>;

/// A failure running a model, classified so callers match on variants, never on strings.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum BackendError {
    /// The allocator could not provide memory (arena cap, CUDA out of memory) or the device failed.
    #[error("{kind} allocation failure: {message}")]
    Allocation {
        /// `oom` or `driver`.
        kind: AllocFailureKind,
        /// ONNX Runtime's message.
        message: String,
    },
    /// ONNX Runtime refused the inputs (a user mistake the HTTP layer did not catch).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// Anything else ONNX Runtime reported.
    #[error("runtime error: {0}")]
    Runtime(String),
    /// The run was stopped through its interrupt handle (its client went away).
    #[error("the run was stopped: its client went away")]
    Cancelled,
    /// The backend panicked; the worker replaced it.
    #[error("the backend panicked: {0}")]
    Panicked(String),
    /// A remote pool's server did not answer as it should: the pool's fault, counted by its
    /// breaker, and a replayable request may move to the fallback pool.
    #[error("remote server failed ({kind}): {message}")]
    Remote {
        /// How.
        kind: RemoteFailure,
        /// What happened, for the client and the log.
        message: String,
    },
    /// A remote pool's server refused the request as the client's mistake (a 4xx): passed on
    /// with its status and message.
    #[error("remote server refused the request ({status}): {message}")]
    RemoteRefused {
        /// The remote's status code.
        status: u16,
        /// The remote's message.
        message: String,
    },
    /// The pool's worker process died, hung or was replaced while it held the run (or before
    /// it could take it): the pool's fault, counted by its breaker, and a replayable request
    /// may move to the fallback pool.
    #[error("worker process lost: {0}")]
    WorkerLost(String),
    /// The backend holds no cache for these sequences at the positions asked (it was
    /// replaced, or the step ran elsewhere): they are prefilled again from their tokens.
    #[error("no generation cache here for sequences {0:?}")]
    CacheMissing(Vec<u64>),
    /// The request's deadline passed before a remote pool's server answered (the client's
    /// limit, not the remote's fault).
    #[error("the deadline passed before the remote server answered")]
    DeadlineExceeded,
}

/// How a remote pool's server failed, as the `kind` label of `vramguard_remote_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RemoteFailure {
    /// No connection could be made (refused, unreachable, connect timeout): nothing was sent.
    Connect,
    /// No answer within the pool's `remote.timeout`.
    Timeout,
    /// It refused the request before running it (429, or 503 other than an allocator failure).
    Overloaded,
    /// A 5xx, a model it does not serve (404), or the connection broke before the answer.
    ServerError,
    /// An answer that is not a valid inference response.
    Protocol,
    /// Its `/v2/health/ready` did not answer 200 (not a request's failure).
    Health,
}

impl RemoteFailure {
    /// Label value.
    pub fn label(self) -> &'static str {
        match self {
            RemoteFailure::Connect => "connect",
            RemoteFailure::Timeout => "timeout",
            RemoteFailure::Overloaded => "overloaded",
            RemoteFailure::ServerError => "server_error",
            RemoteFailure::Protocol => "protocol",
            RemoteFailure::Health => "health",
        }
    }

    /// Whether the remote refused or never got the request: nothing of it ran there.
    pub fn nothing_ran(self) -> bool {
        matches!(self, RemoteFailure::Connect | RemoteFailure::Overloaded)
    }
}

impl prometheus_client::encoding::EncodeLabelValue for RemoteFailure {
    fn encode(&self, encoder: &mut prometheus_client::encoding::LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.label())
    }
}

impl std::fmt::Display for RemoteFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// Kinds of allocation failure, as the `kind` label of `vramguard_allocator_failures_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllocFailureKind {
    /// Not enough memory.
    Oom,
    /// The device or driver failed (reset, lost, unknown CUDA error).
    Driver,
}

impl AllocFailureKind {
    /// Label value.
    pub fn label(self) -> &'static str {
        match self {
            AllocFailureKind::Oom => "oom",
            AllocFailureKind::Driver => "driver",
        }
    }
}

impl prometheus_client::encoding::EncodeLabelValue for AllocFailureKind {
    fn encode(&self, encoder: &mut prometheus_client::encoding::LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.label())
    }
}

impl std::fmt::Display for AllocFailureKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// Statistics of one ONNX Runtime allocator, as `AllocatorGetStats` reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArenaStats {
    /// `TotalAllocated`: bytes the arena has reserved from the device.
    pub reserved_bytes: u64,
    /// `InUse`: bytes held by live tensors.
    pub active_bytes: u64,
    /// `MaxInUse`: peak of `InUse`.
    pub peak_active_bytes: u64,
    /// `NumAllocs`.
    pub allocations: u64,
    /// `NumReserves`.
    pub reserves: u64,
    /// `NumArenaExtensions`.
    pub extensions: u64,
    /// `NumArenaShrinkages`.
    pub shrinkages: u64,
    /// `Limit`: the arena's cap, when it has one (0 means none).
    pub limit_bytes: Option<u64>,
}

impl ArenaStats {
    /// Two arenas' statistics as one: bytes and counts add up, a limit only when both have one.
    /// The peak is the sum of their peaks, an upper bound: they need not have peaked together.
    pub fn plus(self, other: ArenaStats) -> ArenaStats {
        ArenaStats {
            reserved_bytes: self.reserved_bytes + other.reserved_bytes,
            active_bytes: self.active_bytes + other.active_bytes,
            peak_active_bytes: self.peak_active_bytes + other.peak_active_bytes,
            allocations: self.allocations + other.allocations,
            reserves: self.reserves + other.reserves,
            extensions: self.extensions + other.extensions,
            shrinkages: self.shrinkages + other.shrinkages,
            limit_bytes: self.limit_bytes.zip(other.limit_bytes).map(|(a, b)| a + b),
        }
    }
}
