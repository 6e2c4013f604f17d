//! The [`Pool`] itself: the state its public API (`pool/mod.rs`) and its worker threads
//! (`worker.rs`) share. It lives in a module of its own so that both can use it without the
//! one importing the other.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::oneshot;

use crate::config::PoolConfig;
use crate::core::breaker::Breaker;
use crate::core::snapshot::DeviceClass;
use crate::pool::batch::sequences::Sequences;
use crate::pool::batch::{Batch, Batches, StepPool};
use crate::pool::context::{PoolContext, Respawn};
use crate::pool::job::{InferJob, JobResult, PoolError};
use crate::pool::load::RunTimes;
use crate::pool::models::Models;
use crate::pool::queue::Queue;

/// Whether a pool can take work.
#[derive(Debug, Clone, PartialEq)]
pub enum Availability {
    /// Workers are running.
    Ready,
    /// It could not start; the reason is shown in `/status` and logs.
    Unavailable(String),
}

/// A pool of workers behind a bounded queue.
pub struct Pool {
    /// Validated configuration.
    pub config: PoolConfig,
    /// What kind of device it runs on.
    pub device_kind: DeviceClass,
    pub(super) availability: RwLock<Availability>,
    pub(super) respawn: Option<Respawn>,
    /// Set by the sampler: the next finished run refreshes the arena statistics.
    pub(super) stats_wanted: AtomicBool,
    /// Largest working-memory estimate run so far: a run above it may set a new arena peak, so
    /// its statistics are read to check the estimate.
    pub(super) largest_estimate: AtomicU64,
    pub(super) queue: Queue,
    pub(super) recent_failures: Mutex<VecDeque<Instant>>,
    pub(super) context: PoolContext,
    /// The models it serves: how each is held, its bytes and metrics.
    pub(super) models: Models,
    /// Mean run time, for the delay estimate.
    pub(super) runs: RunTimes,
    pub(super) workers: Mutex<Vec<JoinHandle<()>>>,
    pub(super) breaker: Mutex<Breaker>,
    /// Text generations on this pool and the KV cache they hold.
    pub sequences: Arc<Sequences>,
    /// Runs in progress on its backends, and runs started so far: a measured run that
    /// overlapped another cannot tell its own peak in an arena they share.
    pub(super) running: std::sync::atomic::AtomicUsize,
    pub(super) runs_started: AtomicU64,
    /// Its worker process, when it is process-isolated.
    pub(super) worker_host: std::sync::OnceLock<Arc<crate::pool::process::WorkerHost>>,
    /// Its backends keep generations' KV caches where their runtime is.
    pub(super) keeps_caches: AtomicBool,
    /// Each model's generations, stepped as one batch (made on first use).
    pub(super) batches: Batches,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("name", &self.config.name)
            .field("availability", &self.availability)
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// A pool with no backends and no workers yet.
    pub(super) fn new(
        config: PoolConfig,
        device_kind: DeviceClass,
        availability: Availability,
        context: PoolContext,
    ) -> Pool {
        let breaker = Mutex::new(Breaker::new(config.breaker));
        Pool {
            config,
            device_kind,
            availability: RwLock::new(availability),
            respawn: None,
            stats_wanted: AtomicBool::new(true),
            largest_estimate: AtomicU64::new(0),
            queue: Queue::default(),
            recent_failures: Mutex::new(VecDeque::new()),
            models: Models::new(&context.models, context.clock.now()),
            context,
            runs: RunTimes::default(),
            breaker,
            workers: Mutex::new(Vec::new()),
            sequences: Arc::default(),
            running: std::sync::atomic::AtomicUsize::new(0),
            runs_started: AtomicU64::new(0),
            worker_host: std::sync::OnceLock::new(),
            keeps_caches: AtomicBool::new(false),
            batches: Batches::default(),
        }
    }

    /// Pool name.
    pub fn name(&self) -> &str {
        &self.config.name
    }
}

impl Pool {
    /// `model`'s batch on this pool, its stepper started on first use (on the caller's tokio
    /// runtime).
    pub fn batch(self: &Arc<Self>, model: &str) -> Arc<Batch> {
        self.batches.of(self, model)
    }
}

impl StepPool for Pool {
    fn name(&self) -> &str {
        Pool::name(self)
    }

    fn sequences(&self) -> &Arc<Sequences> {
        &self.sequences
    }

    fn breaker_permit(&self) -> Result<(), PoolError> {
        Pool::breaker_permit(self)
    }

    fn submit(&self, job: InferJob) -> Result<oneshot::Receiver<JobResult>, PoolError> {
        Pool::submit(self, job)
    }
}
