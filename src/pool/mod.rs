//! Worker pools: a bounded queue in front of dedicated worker threads and a set of inference
//! [`Backend`]s (ONNX Runtime sessions in production, fakes in tests), one per worker. A queued
//! job is taken by a worker thread together with an idle backend; inference never runs on the
//! async runtime, whose callers await a oneshot reply. A backend that panics is replaced.

pub mod activity;
pub mod degraded;
pub mod sequences;

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;

use crate::config::{PoolConfig, Provider};
use crate::core::backend::{AllocFailureKind, ArenaStats, Backend, BackendError, Interrupt, RunMeta};
use crate::core::breaker::{Breaker, Failure, Permit};
use crate::core::clock::{Clock, SystemClock};
use crate::core::snapshot::{BreakerState, DeviceClass};
use crate::core::tensor::Tensor;
use crate::pool::activity::Progress;

/// How far back `alloc_failures_recent` looks.
pub const RECENT_FAILURE_WINDOW: Duration = Duration::from_secs(60);

/// Metric handles a pool records into from its worker threads.
#[derive(Debug, Clone)]
pub struct PoolMetrics {
    /// `vramguard_queue_wait_seconds{pool}`
    pub queue_wait: Histogram,
    /// `vramguard_allocator_failures_total{pool, device, kind="oom"}`
    pub oom_failures: Counter,
    /// `vramguard_allocator_failures_total{pool, device, kind="driver"}`
    pub driver_failures: Counter,
    /// `vramguard_breaker_recovery_seconds{pool}`: from the breaker opening to closing again.
    pub breaker_recovery: Histogram,
}

impl PoolMetrics {
    /// Handles registered nowhere (tests, benches).
    pub fn detached() -> Self {
        Self {
            queue_wait: Histogram::new([0.001, 0.01, 0.1, 1.0, 10.0]),
            oom_failures: Counter::default(),
            driver_failures: Counter::default(),
            breaker_recovery: Histogram::new([1.0, 10.0, 60.0, 600.0]),
        }
    }
}

/// What a pool needs from its surroundings besides its config and backends.
#[derive(Debug, Clone)]
pub struct PoolContext {
    /// Time source for queue stamps and ages.
    pub clock: Arc<dyn Clock>,
    /// Metric handles.
    pub metrics: PoolMetrics,
}

impl Default for PoolContext {
    fn default() -> Self {
        Self {
            clock: Arc::new(SystemClock),
            metrics: PoolMetrics::detached(),
        }
    }
}

/// Builds a fresh backend for a worker whose backend panicked (its state cannot be trusted).
pub type Respawn = Arc<dyn Fn() -> Result<Box<dyn Backend>, String> + Send + Sync>;

/// One unit of work for a pool.
#[derive(Debug)]
pub struct InferJob {
    /// The request's identity and limits (its id for logs, its deadline).
    pub meta: RunMeta,
    /// Model name.
    pub model: String,
    /// Validated inputs.
    pub inputs: Vec<Tensor>,
    /// Outputs asked for, empty for all.
    pub outputs: Vec<String>,
    /// The admission estimate of the run's working memory (context + workspace), checked
    /// against what the arena actually needed.
    pub estimate_bytes: Option<u64>,
    /// The breaker's half-open probe: its outcome closes or re-opens the breaker.
    pub probe: bool,
    /// Lets the caller stop the job: skipped if still queued, interrupted if running.
    pub cancel: RunCancel,
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
    fn start(&self, interrupt: Option<Interrupt>) -> bool {
        let mut state = self.lock();
        if state.cancelled {
            return false;
        }
        state.interrupt = interrupt;
        state.progress.started();
        true
    }

    /// The run ended: nothing may interrupt this backend on this job's behalf any more.
    fn end(&self) {
        self.lock().interrupt = None;
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
        why: String,
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

struct Queued {
    job: InferJob,
    enqueued: Instant,
    reply: oneshot::Sender<JobResult>,
}

#[derive(Default)]
struct QueueState {
    jobs: VecDeque<Queued>,
    closed: bool,
    inflight: usize,
    /// Backends no one is running: a worker thread takes one with each queued job.
    idle: Vec<Box<dyn Backend>>,
}

/// A snapshot of a pool's load.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PoolLoad {
    /// Waiting requests.
    pub queue_depth: usize,
    /// Age of the oldest waiting request.
    pub oldest_age: Duration,
    /// Requests being run.
    pub inflight: usize,
    /// Estimated wait before a new request would finish: the queue ahead of it and the work in
    /// flight, spread over the workers, times the mean run time.
    pub estimated_delay: Duration,
}

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
    availability: RwLock<Availability>,
    /// Backends still usable; when the last one is lost the pool becomes unavailable.
    live_backends: AtomicUsize,
    respawn: Option<Respawn>,
    /// Set by the sampler: the next finished run refreshes the arena statistics.
    stats_wanted: AtomicBool,
    /// Largest working-memory estimate run so far: a run above it may set a new arena peak, so
    /// its statistics are read to check the estimate.
    largest_estimate: AtomicU64,
    state: Mutex<QueueState>,
    wake: Condvar,
    arena: Mutex<Option<ArenaStats>>,
    recent_failures: Mutex<VecDeque<Instant>>,
    context: PoolContext,
    /// Exponentially weighted mean run time in microseconds, for the delay estimate.
    mean_run_us: AtomicU64,
    workers: Mutex<Vec<JoinHandle<()>>>,
    breaker: Mutex<Breaker>,
    /// Text generations on this pool and the KV cache they hold.
    pub sequences: Arc<sequences::Sequences>,
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
    /// Start a pool with one worker thread per backend.
    /// A worker whose backend panics answers that request with an error and continues with a
    /// backend from `respawn`; without one (or when it fails) that worker stops.
    pub fn start(
        config: PoolConfig,
        device_kind: DeviceClass,
        backends: Vec<Box<dyn Backend>>,
        respawn: Option<Respawn>,
        context: PoolContext,
    ) -> Arc<Pool> {
        let mut pool = Self::new(config, device_kind, Availability::Ready, context);
        pool.live_backends = AtomicUsize::new(backends.len());
        pool.respawn = respawn;
        let mut backends = backends;
        for backend in &mut backends {
            // Statistics before the first run show what loading the weights reserved.
            backend.refresh_arena_stats();
            pool.publish_stats(backend.as_ref());
        }
        let workers = backends.len();
        pool.lock().idle = backends;
        let pool = Arc::new(pool);
        let mut handles = Vec::new();
        for i in 0..workers {
            let worker_pool = Arc::clone(&pool);
            let handle = std::thread::Builder::new()
                .name(format!("{}-worker-{i}", pool.config.name))
                .spawn(move || worker_pool.work())
                .expect("spawning a worker thread");
            handles.push(handle);
        }
        *pool.workers.lock().unwrap_or_else(|e| e.into_inner()) = handles;
        pool
    }

    /// A pool that could not start; every submission is answered with the reason.
    pub fn unavailable(
        config: PoolConfig,
        device_kind: DeviceClass,
        reason: String,
        context: PoolContext,
    ) -> Arc<Pool> {
        Arc::new(Self::new(
            config,
            device_kind,
            Availability::Unavailable(reason),
            context,
        ))
    }

    fn new(config: PoolConfig, device_kind: DeviceClass, availability: Availability, context: PoolContext) -> Pool {
        let breaker = Mutex::new(Breaker::new(config.breaker));
        Pool {
            config,
            device_kind,
            availability: RwLock::new(availability),
            live_backends: AtomicUsize::new(0),
            respawn: None,
            stats_wanted: AtomicBool::new(true),
            largest_estimate: AtomicU64::new(0),
            state: Mutex::new(QueueState::default()),
            wake: Condvar::new(),
            arena: Mutex::new(None),
            recent_failures: Mutex::new(VecDeque::new()),
            context,
            mean_run_us: AtomicU64::new(0),
            breaker,
            workers: Mutex::new(Vec::new()),
            sequences: Arc::default(),
        }
    }

    /// Pool name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// Provider.
    pub fn provider(&self) -> &Provider {
        &self.config.provider
    }

    /// Whether it runs.
    pub fn availability(&self) -> Availability {
        self.availability.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// True when it runs and is not shutting down.
    pub fn is_ready(&self) -> bool {
        matches!(
            *self.availability.read().unwrap_or_else(PoisonError::into_inner),
            Availability::Ready
        ) && !self.lock().closed
    }

    /// True once shutdown has started.
    pub fn is_shutting_down(&self) -> bool {
        self.lock().closed
    }

    /// Why it cannot take work now, or `None` when it can.
    pub fn unready_reason(&self) -> Option<String> {
        match self.availability() {
            Availability::Unavailable(reason) => Some(reason),
            Availability::Ready if self.lock().closed => Some("shutting down".into()),
            Availability::Ready => None,
        }
    }

    /// Ask the workers to read their allocator statistics after their next run (the sampler
    /// calls this; reading them after every run would cost every request a C API call).
    pub fn want_arena_stats(&self) {
        self.stats_wanted.store(true, Ordering::Relaxed);
    }

    /// True when this pool serves `model`.
    pub fn serves(&self, model: &str) -> bool {
        self.config.models.iter().any(|m| m == model)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        // A worker that panicked mid-run must not take the queue down with it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Current queue depth, oldest age, in-flight count and delay estimate, read under one lock.
    pub fn load(&self) -> PoolLoad {
        let now = self.context.clock.now();
        let mean = Duration::from_micros(self.mean_run_us.load(Ordering::Relaxed));
        let state = self.lock();
        let ahead = (state.jobs.len() + state.inflight + 1) as u32;
        PoolLoad {
            estimated_delay: mean * ahead.div_ceil(self.config.workers.max(1) as u32),
            queue_depth: state.jobs.len(),
            // Computed when asked, so a request stuck in the queue shows its growing age even
            // while nothing is dequeued.
            oldest_age: state
                .jobs
                .front()
                .map(|q| now.saturating_duration_since(q.enqueued))
                .unwrap_or_default(),
            inflight: state.inflight,
        }
    }

    /// Latest allocator statistics reported by a worker.
    pub fn arena_stats(&self) -> Option<ArenaStats> {
        *self.arena.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Allocator failures within [`RECENT_FAILURE_WINDOW`].
    pub fn alloc_failures_recent(&self) -> u64 {
        let now = self.context.clock.now();
        let mut recent = self.recent_failures.lock().unwrap_or_else(|e| e.into_inner());
        while recent
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > RECENT_FAILURE_WINDOW)
        {
            recent.pop_front();
        }
        recent.len() as u64
    }

    fn record_failure(&self, kind: AllocFailureKind) {
        match kind {
            AllocFailureKind::Oom => self.context.metrics.oom_failures.inc(),
            AllocFailureKind::Driver => self.context.metrics.driver_failures.inc(),
        };
        let now = self.context.clock.now();
        self.recent_failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(now);
        let mut breaker = self.breaker();
        if breaker.failure(kind, now) {
            let why = breaker.tripped().map(|w| w.to_string()).unwrap_or_default();
            tracing::warn!(pool = self.name(), %why, cooldown_s = self.config.breaker.cooldown.as_secs(), "circuit breaker opened: new work goes to other pools");
        }
    }

    /// A remote pool's server failed (`why`): it counts against the breaker like an allocator
    /// failure, but not as one (`alloc_failures_recent` is about memory).
    fn record_remote_failure(&self, why: &str) {
        let mut breaker = self.breaker();
        if breaker.failure(Failure::Remote(why.to_string()), self.context.clock.now()) {
            let why = breaker.tripped().map(|w| w.to_string()).unwrap_or_default();
            tracing::warn!(pool = self.name(), %why, cooldown_s = self.config.breaker.cooldown.as_secs(), "circuit breaker opened: new work goes to other pools");
        }
    }

    /// Whether a health check of the remote server is worth making now, and whether it is the
    /// breaker's probe: `None` while the breaker is open (only its cooldown ends that) or its
    /// probe is out, `Some(true)` when the check is the probe, so a healthy remote closes the
    /// breaker without a client's request being the test.
    pub fn health_check_permit(&self) -> Option<bool> {
        match self.breaker().permit(self.context.clock.now()) {
            Permit::Run => Some(false),
            Permit::Probe => Some(true),
            Permit::Denied => None,
        }
    }

    /// The outcome of a health check taken with [`Pool::health_check_permit`]: a failure counts
    /// against the breaker (re-opening it when the check was the probe), a success as the
    /// probe closes it.
    pub fn health_checked(&self, result: Result<(), String>) {
        match result {
            Ok(()) => self.record_success(),
            Err(why) => self.record_remote_failure(&format!("health check: {why}")),
        }
    }

    fn breaker(&self) -> std::sync::MutexGuard<'_, Breaker> {
        self.breaker.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The circuit breaker's state now.
    pub fn breaker_state(&self) -> BreakerState {
        self.breaker().state(self.context.clock.now())
    }

    /// Why the breaker is not closed, when it is not.
    pub fn breaker_tripped(&self) -> Option<String> {
        let mut breaker = self.breaker();
        breaker.state(self.context.clock.now());
        breaker.tripped().map(|w| w.to_string())
    }

    /// The breaker as the policy sees it: a pool that cannot take work at all reads as open.
    pub fn breaker_view(&self) -> BreakerState {
        if self.is_ready() {
            self.breaker_state()
        } else {
            BreakerState::Open
        }
    }

    /// Why a request could not be placed here now (unavailable, shutting down, breaker open),
    /// or `None` when it could.
    pub fn refusal(&self) -> Option<String> {
        if let Some(why) = self.unready_reason() {
            return Some(why);
        }
        (!self.breaker_allows()).then(|| {
            format!(
                "its circuit breaker is open after {}",
                self.breaker_tripped().unwrap_or_default()
            )
        })
    }

    /// Whether the breaker would let a request through now (without taking the probe).
    pub fn breaker_allows(&self) -> bool {
        self.breaker().would_permit(self.context.clock.now())
    }

    /// Take the breaker's permission for one request: `Ok(true)` when it is the half-open
    /// probe (mark the job so its outcome settles the breaker).
    pub fn breaker_permit(&self) -> Result<bool, PoolError> {
        let mut breaker = self.breaker();
        match breaker.permit(self.context.clock.now()) {
            Permit::Run => Ok(false),
            Permit::Probe => Ok(true),
            Permit::Denied => Err(PoolError::BreakerOpen {
                pool: self.name().to_string(),
                why: breaker.tripped().map(|w| w.to_string()).unwrap_or_default(),
            }),
        }
    }

    /// Rebuild the pool's backends (an operator's restore after a driver reset): the breaker
    /// opens, every idle backend is replaced by a fresh one from the factory (one still running
    /// finishes its run and is kept), a pool that had lost its backends becomes ready again,
    /// and the next request is the breaker's probe. Blocking: run it off the async runtime.
    /// Returns how many backends were built.
    pub fn restore(&self) -> Result<usize, String> {
        let respawn = self
            .respawn
            .clone()
            .ok_or_else(|| format!("pool `{}` cannot rebuild its backends", self.name()))?;
        self.breaker().force_open(self.context.clock.now());
        let mut fresh = Vec::with_capacity(self.config.workers);
        for _ in 0..self.config.workers {
            match respawn() {
                Ok(mut backend) => {
                    backend.refresh_arena_stats();
                    fresh.push(backend);
                }
                Err(reason) => {
                    tracing::error!(pool = self.name(), %reason, "restore failed: the breaker stays open");
                    return Err(reason);
                }
            }
        }
        let old = {
            let mut state = self.lock();
            fresh.truncate(self.config.workers.saturating_sub(state.inflight));
            self.live_backends.store(fresh.len() + state.inflight, Ordering::SeqCst);
            std::mem::replace(&mut state.idle, fresh)
        };
        drop(old);
        *self.availability.write().unwrap_or_else(PoisonError::into_inner) = Availability::Ready;
        self.breaker().restored();
        self.wake.notify_all();
        let built = self.lock().idle.len();
        tracing::info!(
            pool = self.name(),
            built,
            "pool restored: the next request is the breaker's probe"
        );
        Ok(built)
    }

    /// A probe that will not run after all (it was refused before reaching the queue).
    pub fn probe_unused(&self) {
        self.breaker().probe_unused();
    }

    /// A run finished without an allocator failure: a half-open breaker closes.
    fn record_success(&self) {
        let recovered = self.breaker().success(self.context.clock.now());
        if let Some(took) = recovered {
            self.context.metrics.breaker_recovery.observe(took.as_secs_f64());
            tracing::info!(
                pool = self.name(),
                open_for_s = took.as_secs_f64(),
                "circuit breaker closed: the probe succeeded"
            );
        }
    }

    /// Queue a job; the receiver yields its result. Refused at once when the pool is
    /// unavailable, shutting down or full.
    pub fn submit(&self, job: InferJob) -> Result<oneshot::Receiver<JobResult>, PoolError> {
        if let Availability::Unavailable(reason) = self.availability() {
            return Err(PoolError::Unavailable {
                pool: self.name().to_string(),
                reason,
            });
        }
        let (reply, rx) = oneshot::channel();
        let mut state = self.lock();
        if state.closed {
            return Err(PoolError::ShuttingDown {
                pool: self.name().to_string(),
            });
        }
        if state.jobs.len() >= self.config.queue_capacity {
            return Err(PoolError::QueueFull {
                pool: self.name().to_string(),
                capacity: self.config.queue_capacity,
            });
        }
        state.jobs.push_back(Queued {
            job,
            enqueued: self.context.clock.now(),
            reply,
        });
        drop(state);
        self.wake.notify_one();
        Ok(rx)
    }

    /// Stop taking work: queued jobs are answered `ShuttingDown` now; running ones go on.
    pub fn close(&self) {
        let drained: Vec<Queued> = {
            let mut state = self.lock();
            state.closed = true;
            state.jobs.drain(..).collect()
        };
        self.wake.notify_all();
        for queued in drained {
            let _ = queued.reply.send(Err(PoolError::ShuttingDown {
                pool: self.name().to_string(),
            }));
        }
    }

    /// Wait until `until` for the workers to finish their running jobs; false if some were still
    /// running then (they are left to finish on their own threads).
    pub fn join_until(&self, until: Instant) -> bool {
        let handles: Vec<JoinHandle<()>> =
            std::mem::take(&mut *self.workers.lock().unwrap_or_else(PoisonError::into_inner));
        let mut all_done = true;
        for handle in handles {
            while !handle.is_finished() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(2));
            }
            if handle.is_finished() {
                let _ = handle.join();
            } else {
                all_done = false;
            }
        }
        all_done
    }

    /// [`Pool::close`], then [`Pool::join_until`] `grace` from now.
    pub fn shutdown(&self, grace: Duration) -> bool {
        self.close();
        self.join_until(Instant::now() + grace)
    }

    /// The next queued job and an idle backend to run it on, waiting for both.
    fn next_job(&self) -> Option<(Queued, Box<dyn Backend>)> {
        let mut state = self.lock();
        loop {
            if !state.jobs.is_empty()
                && let Some(backend) = state.idle.pop()
            {
                let job = state.jobs.pop_front().expect("checked non-empty");
                state.inflight += 1;
                return Some((job, backend));
            }
            if state.closed {
                return None;
            }
            state = self.wake.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn work(&self) {
        while let Some((Queued { job, enqueued, reply }, mut backend)) = self.next_job() {
            let waited = self.context.clock.now().saturating_duration_since(enqueued);
            self.context.metrics.queue_wait.observe(waited.as_secs_f64());
            let skip = if reply.is_closed() {
                // The client went away while queued: do not spend the device on it.
                tracing::debug!(request_id = %job.meta.request_id, pool = self.name(), "client gone before start; skipped");
                Some(None)
            } else if waited > self.config.max_wait {
                Some(Some(Err(PoolError::QueueTimeout {
                    pool: self.name().to_string(),
                    waited,
                })))
            } else if job.meta.deadline.is_some_and(|d| self.context.clock.now() >= d) {
                Some(Some(Err(PoolError::DeadlineExceeded {
                    pool: self.name().to_string(),
                })))
            } else if !{
                backend.clear_interrupt();
                job.cancel.start(backend.interrupt_handle())
            } {
                // Cancelled while queued. Registered last, so only a job that runs holds the
                // backend's interrupt (and `run_one` always ends it).
                tracing::debug!(request_id = %job.meta.request_id, pool = self.name(), "cancelled before start; skipped");
                Some(None)
            } else {
                None
            };
            let result = if let Some(skipped) = skip {
                if job.probe {
                    self.probe_unused();
                }
                skipped
            } else {
                let (result, kept) = self.run_one(backend, job);
                backend = match kept {
                    Some(backend) => backend,
                    None => {
                        self.finish(None);
                        let _ = reply.send(result);
                        continue;
                    }
                };
                Some(result)
            };
            self.finish(Some(backend));
            if let Some(result) = result {
                let _ = reply.send(result);
            }
        }
    }

    /// A run is over: its backend (unless it was lost) is idle again, and a worker is woken if
    /// work is waiting for it.
    fn finish(&self, backend: Option<Box<dyn Backend>>) {
        let mut state = self.lock();
        state.inflight -= 1;
        let waiting = !state.jobs.is_empty();
        if let Some(backend) = backend {
            state.idle.push(backend);
        }
        drop(state);
        if waiting {
            self.wake.notify_one();
        }
    }

    /// Run one job. A panicking backend is caught here: the request gets
    /// [`BackendError::Panicked`] and the backend is replaced by a fresh one, since the old one
    /// may hold half-updated state; `None` comes back when no replacement could be built.
    fn run_one(&self, mut backend: Box<dyn Backend>, job: InferJob) -> (JobResult, Option<Box<dyn Backend>>) {
        let started = Instant::now();
        let before = backend.arena_stats();
        let estimate = job.estimate_bytes.unwrap_or(0);
        let job_probe = job.probe;
        let run = std::panic::catch_unwind(AssertUnwindSafe(|| {
            backend.run(&job.model, job.inputs, &job.outputs, &job.meta)
        }));
        job.cancel.end();
        self.record_run(started.elapsed());
        let result = match run {
            Ok(result) => result,
            Err(panic) => {
                let message = panic_message(panic.as_ref());
                tracing::error!(request_id = %job.meta.request_id, pool = self.name(), model = %job.model, panic = %message, "the backend panicked; replacing it");
                drop(backend);
                let replacement = match &self.respawn {
                    Some(respawn) => respawn(),
                    None => Err("this pool cannot rebuild a backend".into()),
                };
                let kept = match replacement {
                    Ok(fresh) => Some(fresh),
                    Err(reason) => {
                        self.lose_backend(reason);
                        None
                    }
                };
                return (Err(PoolError::Backend(BackendError::Panicked(message))), kept);
            }
        };
        // Statistics cost a C API call: read them when the sampler asked, after a failure, or
        // when this run may have set a new peak (its estimate is the largest yet) so the
        // estimate can be checked against what the arena really needed.
        let new_largest = estimate > self.largest_estimate.fetch_max(estimate, Ordering::Relaxed);
        if self.stats_wanted.swap(false, Ordering::Relaxed) || new_largest || result.is_err() {
            backend.refresh_arena_stats();
            self.publish_stats(backend.as_ref());
            if new_largest {
                check_estimate(
                    &job.meta.request_id,
                    job.estimate_bytes,
                    before,
                    backend.arena_stats(),
                    &result,
                );
            }
        }
        match &result {
            Err(BackendError::Allocation { kind, .. }) => self.record_failure(*kind),
            Err(BackendError::Remote { kind, message }) => self.record_remote_failure(&format!("{kind}: {message}")),
            Ok(_) => self.record_success(),
            // Not the device's fault (bad input, a model error): the breaker does not move,
            // but a probe that ended this way hands the turn on.
            Err(_) if job_probe => self.probe_unused(),
            Err(_) => {}
        }
        match &result {
            Err(BackendError::Cancelled) => {
                tracing::debug!(request_id = %job.meta.request_id, pool = self.name(), "run stopped: the client went away")
            }
            Err(e) => {
                tracing::warn!(request_id = %job.meta.request_id, pool = self.name(), model = %job.model, error = %e, "inference failed")
            }
            Ok(_) => {}
        }
        (result.map_err(PoolError::from), Some(backend))
    }

    fn publish_stats(&self, backend: &dyn Backend) {
        if let Some(stats) = backend.arena_stats() {
            *self.arena.lock().unwrap_or_else(PoisonError::into_inner) = Some(stats);
        }
    }

    /// A backend could not be replaced. When the last one is gone the pool becomes unavailable
    /// and answers what is still queued, so nothing waits for a backend that will not come.
    fn lose_backend(&self, reason: String) {
        tracing::error!(pool = self.name(), %reason, "a backend is lost: it panicked and could not be rebuilt");
        if self.live_backends.fetch_sub(1, Ordering::SeqCst) > 1 {
            return;
        }
        let reason = format!("every backend is lost: {reason}");
        *self.availability.write().unwrap_or_else(PoisonError::into_inner) = Availability::Unavailable(reason.clone());
        let drained: Vec<Queued> = self.lock().jobs.drain(..).collect();
        for queued in drained {
            let _ = queued.reply.send(Err(PoolError::Unavailable {
                pool: self.name().to_string(),
                reason: reason.clone(),
            }));
        }
    }

    fn record_run(&self, took: Duration) {
        let sample = took.as_micros().min(u64::MAX as u128) as u64;
        let old = self.mean_run_us.load(Ordering::Relaxed);
        let new = if old == 0 { sample } else { (old * 7 + sample) / 8 };
        self.mean_run_us.store(new, Ordering::Relaxed);
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// Log when an admission estimate turned out too low for a real run, with both numbers. The
/// arena's all-time peak moves only when a run needs more than any before it; that run's need
/// is the new peak minus what was already in use.
fn check_estimate(
    request_id: &str,
    estimate: Option<u64>,
    before: Option<ArenaStats>,
    after: Option<ArenaStats>,
    result: &Result<Vec<Tensor>, BackendError>,
) {
    let Some(estimate) = estimate else { return };
    if let Err(BackendError::Allocation { message, .. }) = result {
        tracing::warn!(request_id, estimate_bytes = estimate, onnxruntime = %message, "memory estimate too low: the run did not fit");
        return;
    }
    if let (Some(before), Some(after)) = (before, after)
        && after.peak_active_bytes > before.peak_active_bytes
    {
        let needed = after.peak_active_bytes.saturating_sub(before.active_bytes);
        if needed > estimate {
            tracing::warn!(
                request_id,
                estimate_bytes = estimate,
                measured_bytes = needed,
                "memory estimate too low"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::tensor::TensorData;
    use std::sync::mpsc;

    /// A backend that echoes its inputs, optionally blocking until released.
    struct Echo {
        gate: Option<Arc<Mutex<mpsc::Receiver<()>>>>,
    }

    impl Backend for Echo {
        fn run(
            &mut self,
            _: &str,
            inputs: Vec<Tensor>,
            _: &[String],
            _: &RunMeta,
        ) -> Result<Vec<Tensor>, BackendError> {
            if let Some(gate) = &self.gate {
                gate.lock().unwrap().recv().unwrap();
            }
            Ok(inputs)
        }
        fn arena_stats(&self) -> Option<ArenaStats> {
            None
        }
    }

    fn config(capacity: usize) -> PoolConfig {
        PoolConfig {
            name: "p".into(),
            provider: Provider::Cpu,
            device: "host".into(),
            models: vec!["m".into()],
            workers: 1,
            intra_threads: 1,
            queue_capacity: capacity,
            max_wait: Duration::from_secs(60),
            arena_shrinkage: false,
            max_context: None,
            breaker: crate::core::breaker::BreakerConfig::default(),
            fallback: None,
        }
    }

    fn job(v: f32) -> InferJob {
        InferJob {
            meta: RunMeta::default(),
            model: "m".into(),
            inputs: vec![Tensor {
                name: "x".into(),
                shape: vec![1],
                data: TensorData::Fp32(vec![v]),
            }],
            outputs: vec![],
            estimate_bytes: None,
            probe: false,
            cancel: RunCancel::default(),
        }
    }

    fn gated(capacity: usize) -> (Arc<Pool>, mpsc::Sender<()>) {
        let (tx, rx) = mpsc::channel();
        let gate = Arc::new(Mutex::new(rx));
        let pool = Pool::start(
            config(capacity),
            DeviceClass::Host,
            vec![Box::new(Echo { gate: Some(gate) })],
            None,
            PoolContext::default(),
        );
        (pool, tx)
    }

    fn wait_until(mut f: impl FnMut() -> bool) {
        for _ in 0..2000 {
            if f() {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("condition not reached");
    }

    #[test]
    fn a_full_queue_refuses_and_accepted_work_completes() {
        let (pool, release) = gated(1);
        let first = pool.submit(job(1.0)).unwrap();
        wait_until(|| pool.load().inflight == 1);
        let second = pool.submit(job(2.0)).unwrap();
        assert_eq!(pool.load().queue_depth, 1);
        assert_eq!(
            pool.submit(job(3.0)).unwrap_err(),
            PoolError::QueueFull {
                pool: "p".into(),
                capacity: 1
            }
        );
        release.send(()).unwrap();
        release.send(()).unwrap();
        assert_eq!(
            first.blocking_recv().unwrap().unwrap()[0].data,
            TensorData::Fp32(vec![1.0])
        );
        assert_eq!(
            second.blocking_recv().unwrap().unwrap()[0].data,
            TensorData::Fp32(vec![2.0])
        );
        assert!(pool.shutdown(Duration::from_secs(1)));
    }

    #[test]
    fn shutdown_answers_queued_work_and_lets_running_work_finish() {
        let (pool, release) = gated(4);
        let running = pool.submit(job(1.0)).unwrap();
        wait_until(|| pool.load().inflight == 1);
        let queued = pool.submit(job(2.0)).unwrap();
        let closer = {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || pool.shutdown(Duration::from_secs(5)))
        };
        wait_until(|| !pool.is_ready());
        assert_eq!(
            queued.blocking_recv().unwrap().unwrap_err(),
            PoolError::ShuttingDown { pool: "p".into() }
        );
        assert!(matches!(pool.submit(job(3.0)), Err(PoolError::ShuttingDown { .. })));
        release.send(()).unwrap();
        assert!(running.blocking_recv().unwrap().is_ok());
        assert!(closer.join().unwrap());
    }

    #[test]
    fn a_request_whose_client_left_is_not_run() {
        let (pool, release) = gated(4);
        let running = pool.submit(job(1.0)).unwrap();
        wait_until(|| pool.load().inflight == 1);
        drop(pool.submit(job(2.0)).unwrap());
        let third = pool.submit(job(3.0)).unwrap();
        release.send(()).unwrap();
        // Only one more release: if the abandoned job ran, the third would never finish.
        release.send(()).unwrap();
        assert!(running.blocking_recv().unwrap().is_ok());
        assert_eq!(
            third.blocking_recv().unwrap().unwrap()[0].data,
            TensorData::Fp32(vec![3.0])
        );
        pool.shutdown(Duration::from_secs(1));
    }

    #[test]
    fn an_expired_deadline_is_reported_without_running() {
        let pool = Pool::start(
            config(4),
            DeviceClass::Host,
            vec![Box::new(Echo { gate: None })],
            None,
            PoolContext::default(),
        );
        let mut j = job(1.0);
        j.meta.deadline = Some(Instant::now());
        let rx = pool.submit(j).unwrap();
        assert_eq!(
            rx.blocking_recv().unwrap().unwrap_err(),
            PoolError::DeadlineExceeded { pool: "p".into() }
        );
        pool.shutdown(Duration::from_secs(1));
    }

    #[test]
    fn queue_age_grows_while_a_request_waits_and_the_wait_is_recorded() {
        let clock = Arc::new(crate::core::clock::ManualClock::default());
        let metrics = PoolMetrics::detached();
        let (tx, rx) = mpsc::channel();
        let gate = Arc::new(Mutex::new(rx));
        let context = PoolContext {
            clock: clock.clone(),
            metrics: metrics.clone(),
        };
        let pool = Pool::start(
            config(4),
            DeviceClass::Host,
            vec![Box::new(Echo { gate: Some(gate) })],
            None,
            context,
        );
        let running = pool.submit(job(1.0)).unwrap();
        wait_until(|| pool.load().inflight == 1);
        let waiting = pool.submit(job(2.0)).unwrap();
        assert_eq!(pool.load().oldest_age, Duration::ZERO);
        clock.advance(Duration::from_secs(7));
        assert_eq!(pool.load().oldest_age, Duration::from_secs(7));
        clock.advance(Duration::from_secs(5));
        assert_eq!(pool.load().oldest_age, Duration::from_secs(12));
        tx.send(()).unwrap();
        tx.send(()).unwrap();
        running.blocking_recv().unwrap().unwrap();
        waiting.blocking_recv().unwrap().unwrap();
        assert_eq!(pool.load().oldest_age, Duration::ZERO);
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register("wait", "", metrics.queue_wait.clone());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("wait_count 2\n") && text.contains("wait_sum 12.0\n"),
            "{text}"
        );
        pool.shutdown(Duration::from_secs(1));
    }

    /// Fails every run with an arena failure.
    struct Full;

    impl Backend for Full {
        fn run(&mut self, _: &str, _: Vec<Tensor>, _: &[String], _: &RunMeta) -> Result<Vec<Tensor>, BackendError> {
            Err(BackendError::Allocation {
                kind: AllocFailureKind::Oom,
                message: "BFCArena::AllocateRawInternal".into(),
            })
        }
        fn arena_stats(&self) -> Option<ArenaStats> {
            None
        }
    }

    #[test]
    fn allocator_failures_are_counted_and_age_out_of_the_recent_window() {
        let clock = Arc::new(crate::core::clock::ManualClock::default());
        let metrics = PoolMetrics::detached();
        let context = PoolContext {
            clock: clock.clone(),
            metrics: metrics.clone(),
        };
        let pool = Pool::start(config(4), DeviceClass::Host, vec![Box::new(Full)], None, context);
        for _ in 0..2 {
            let result = pool.submit(job(1.0)).unwrap().blocking_recv().unwrap();
            assert!(matches!(
                result,
                Err(PoolError::Backend(BackendError::Allocation { .. }))
            ));
        }
        assert_eq!(metrics.oom_failures.get(), 2);
        assert_eq!(metrics.driver_failures.get(), 0);
        assert_eq!(pool.alloc_failures_recent(), 2);
        clock.advance(RECENT_FAILURE_WINDOW + Duration::from_secs(1));
        assert_eq!(pool.alloc_failures_recent(), 0);
        pool.shutdown(Duration::from_secs(1));
    }

    #[test]
    fn an_unavailable_pool_says_why() {
        let pool = Pool::unavailable(
            config(4),
            DeviceClass::Nvml,
            "no NVIDIA driver".into(),
            PoolContext::default(),
        );
        assert!(!pool.is_ready());
        assert_eq!(
            pool.submit(job(1.0)).unwrap_err().to_string(),
            "pool `p` is unavailable: no NVIDIA driver"
        );
    }
}
