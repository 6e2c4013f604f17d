//! The [`Pool`] itself: the state its public API (`pool/mod.rs`) and its worker threads
//! (`worker.rs`) share. It lives in a module of its own so that both can use it without the
//! one importing the other.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use crate::config::PoolConfig;
use crate::core::snapshot::DeviceClass;
use crate::pool::batch::sequences::Sequences;
use crate::pool::batch::{Batch, Batches, StepPool};
use crate::pool::context::{PoolContext, Respawn};
use crate::pool::health::Health;
use crate::pool::job::{InferJob, JobResult, PoolError};
use crate::pool::load::RunTimes;
use crate::pool::process::WorkerHost;
use crate::pool::queue::Queue;
use crate::pool::residency::ModelResidency;
use crate::pool::supervise::{Supervised, Supervisor};

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
    // Its four parts, each a type with its own methods in its own file.
    /// The bounded queue and its idle backends (shared with `residency`, whose wanted set it
    /// keeps under its lock).
    pub(super) queue: Arc<Queue>,
    /// Which models' sessions it holds and wants, and the work of changing that.
    pub(super) residency: ModelResidency,
    /// Its circuit breaker and recent allocator failures.
    pub(super) health: Health,
    /// Its worker process, when it is process-isolated, and what watches it.
    pub(super) supervisor: Supervisor,
    pub(super) availability: RwLock<Availability>,
    pub(super) respawn: Option<Respawn>,
    /// Set by the sampler: the next finished run refreshes the arena statistics.
    pub(super) stats_wanted: AtomicBool,
    /// Largest working-memory estimate run so far: a run above it may set a new arena peak, so
    /// its statistics are read to check the estimate.
    pub(super) largest_estimate: AtomicU64,
    pub(super) context: PoolContext,
    /// Mean run time, for the delay estimate.
    pub(super) runs: RunTimes,
    pub(super) workers: Mutex<Vec<JoinHandle<()>>>,
    /// Text generations on this pool and the KV cache they hold.
    pub sequences: Arc<Sequences>,
    /// Runs in progress on its backends, and runs started so far: a measured run that
    /// overlapped another cannot tell its own peak in an arena they share.
    pub(super) running: std::sync::atomic::AtomicUsize,
    pub(super) runs_started: AtomicU64,
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
        let health = Health::new(
            &config.name,
            &config.provider,
            config.breaker,
            Arc::clone(&context.clock),
            context.metrics.clone(),
        );
        let queue = Arc::new(Queue::default());
        let sequences = Arc::new(Sequences::default());
        let residency = ModelResidency::new(
            &config,
            &context.models,
            Arc::clone(&context.clock),
            context.tier.clone(),
            Arc::clone(&queue),
            Arc::clone(&sequences),
        );
        let supervisor = Supervisor::new(&config.name, context.metrics.worker.clone());
        Pool {
            config,
            device_kind,
            availability: RwLock::new(availability),
            respawn: None,
            stats_wanted: AtomicBool::new(true),
            largest_estimate: AtomicU64::new(0),
            queue,
            residency,
            context,
            runs: RunTimes::default(),
            health,
            workers: Mutex::new(Vec::new()),
            sequences,
            running: std::sync::atomic::AtomicUsize::new(0),
            runs_started: AtomicU64::new(0),
            supervisor,
            keeps_caches: AtomicBool::new(false),
            batches: Batches::default(),
        }
    }

    /// Pool name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// Run its backends in `host`'s worker processes: its supervisor watches them and replaces
    /// the lost.
    pub fn supervise(self: &Arc<Self>, host: Arc<WorkerHost>) {
        let pool: Weak<Pool> = Arc::downgrade(self);
        self.supervisor.supervise(pool, host);
    }

    /// Its circuit breaker and recent allocator failures.
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// Which models' sessions it holds, loading and unloading them.
    pub fn residency(&self) -> &ModelResidency {
        &self.residency
    }

    /// Its worker process, when it is process-isolated.
    pub fn supervisor(&self) -> &Supervisor {
        &self.supervisor
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
        self.health.breaker_permit()
    }

    fn submit(&self, job: InferJob) -> Result<oneshot::Receiver<JobResult>, PoolError> {
        Pool::submit(self, job)
    }
}

impl Supervised for Pool {
    fn name(&self) -> &str {
        Pool::name(self)
    }

    fn is_shutting_down(&self) -> bool {
        self.queue.is_closed()
    }

    fn rebuild(&self) -> Result<usize, String> {
        Pool::rebuild(self)
    }

    fn health(&self) -> &Health {
        &self.health
    }

    fn supervisor(&self) -> &Supervisor {
        &self.supervisor
    }
}
