//! Worker pools: a bounded queue in front of dedicated worker threads and a set of inference
//! [`Backend`](crate::core::backend::Backend)s (ONNX Runtime sessions in production, fakes in
//! tests), one per worker. A queued job is taken by a worker thread together with an idle
//! backend; inference never runs on the async runtime, whose callers await a oneshot reply. A
//! backend that panics is replaced.
//!
//! This file is the pool's public API: starting, submitting, restoring, shutting down. The
//! [`Pool`](crate::pool::Pool) itself is in `shared.rs`, used by this file and by the worker
//! threads (`worker.rs`, which look for work a while before sleeping: `patience.rs`). A pool
//! owns its parts, each a type with its own methods in its own place:
//! - the queue (`queue.rs`, `Queue`): the bounded queue and its idle backends;
//! - its residency (`residency/`, [`ModelResidency`]): which models' sessions it holds and
//!   wants, loading and unloading them (what it is told of each, what could make room, the
//!   models whose identical weights share one session), taking the bytes of a load after start
//!   from the host tier when it has them (`tier.rs`);
//! - its health (`health.rs`, [`Health`]): the circuit breaker and recent allocator failures;
//! - its supervisor (`supervise.rs`, [`Supervisor`]): its worker process when it is
//!   process-isolated, watched and replaced when lost.
//!
//! Beside them: `job.rs` a job and its errors, `context.rs` what a pool is given, `load.rs` the
//! load and delay estimate, `activity.rs` the requests waiting and running, `degraded.rs`
//! degraded mode, `arena.rs` the allocator statistics. `batch/` holds the generations stepped
//! together (continuous batching) and their counts. `metrics/` holds the metric families pools
//! record into.
//!
//! The backends that do not run models in this process sit here beside each other: `process/`
//! (a worker process of the pool's own, which the supervisor watches) and `remote.rs` (another
//! server, for a remote pool); the one that does is the runtime's (`runtime::onnx`).

pub mod activity;
mod arena;
pub mod batch;
mod context;
pub mod degraded;
mod health;
mod job;
mod load;
pub mod metrics;
mod patience;
pub mod process;
mod queue;
pub mod remote;
mod residency;
mod shared;
mod supervise;
pub mod tier;
mod worker;

pub use context::{PoolContext, Respawn};
pub use health::{CheckFailure, Health};
pub use job::{InferJob, Inputs, JobResult, PoolError, RunCancel, RunMemory, RunOp};
pub use load::PoolLoad;
pub use metrics::LoadSource;
pub use metrics::{ModelMetrics, PoolMetrics, WorkerHandles};
pub use residency::sharing_at_start;
pub use residency::{ModelResidency, ModelSetup, ModelState, ResidencyError, ResidencyOutcome, Resident};
pub use shared::{Availability, Pool};
pub use supervise::Supervisor;
pub use tier::{HostRoom, HostTier};
pub use worker::MAX_PROMPTS;

use std::sync::{Arc, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::config::{PoolConfig, Provider};
use crate::core::backend::Backend;
use crate::core::snapshot::{BreakerState, DeviceClass};

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
        pool.respawn = respawn;
        let mut backends = backends;
        for backend in &mut backends {
            // Statistics before the first run show what loading the weights reserved
            // (published as each is stocked).
            if let Some(arenas) = backend.arenas() {
                arenas.refresh_arena_stats();
            }
        }
        let workers = backends.len();
        let keeps = !backends.is_empty() && backends.iter_mut().all(|b| b.generations().is_some());
        pool.keeps_caches.store(keeps, std::sync::atomic::Ordering::Relaxed);
        pool.queue.release_when_idle(pool.config.idle_release);
        pool.queue.stock(backends, pool.residency.start_set());
        pool.residency.record_start_loads();
        let pool = Arc::new(pool);
        pool.spawn_workers(workers);
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

    /// Whether its backends keep generations' KV caches where their runtime is, so a
    /// generation's steps run in its [`batch`](Self::batch) (a remote pool's do not: each
    /// step carries its cache).
    pub fn keeps_caches(&self) -> bool {
        self.keeps_caches.load(std::sync::atomic::Ordering::Relaxed)
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
        ) && !self.queue.is_closed()
    }

    /// True once shutdown has started.
    pub fn is_shutting_down(&self) -> bool {
        self.queue.is_closed()
    }

    /// Why it cannot take work now, or `None` when it can.
    pub fn unready_reason(&self) -> Option<String> {
        match self.availability() {
            Availability::Unavailable(reason) => Some(reason),
            Availability::Ready if self.queue.is_closed() => Some("shutting down".into()),
            Availability::Ready => None,
        }
    }

    /// True when this pool serves `model`, whether or not its sessions are loaded now (a
    /// request for it loads them).
    pub fn serves(&self, model: &str) -> bool {
        self.residency.serves(model)
    }

    /// Current queue depth, oldest age, in-flight count and delay estimate, read under one lock.
    pub fn load(&self) -> PoolLoad {
        let now = self.context.clock.now();
        self.queue.load(now, self.runs.mean(), self.config.workers)
    }

    /// The breaker as the policy sees it: a pool that cannot take work at all reads as open.
    pub fn breaker_view(&self) -> BreakerState {
        if self.is_ready() {
            self.health.breaker_state()
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
        (!self.health.breaker_allows()).then(|| {
            format!(
                "its circuit breaker is open after {}",
                self.health.breaker_tripped().unwrap_or_default()
            )
        })
    }

    /// Rebuild the pool's backends (an operator's restore after a driver reset): the breaker
    /// opens, every idle backend is replaced by a fresh one from the factory (one still running
    /// finishes its run and is kept), a pool that had lost its backends becomes ready again,
    /// and the next health check is the breaker's probe. Blocking: run it off the async
    /// runtime.
    /// Returns how many backends were built.
    pub fn restore(&self) -> Result<usize, String> {
        if self.respawn.is_none() {
            return Err(format!("pool `{}` cannot rebuild its backends", self.name()));
        }
        self.health.force_open();
        // A process-isolated pool's worker is replaced: only a new process recovers from a
        // sticky driver fault.
        if let Some(host) = self.supervisor.host() {
            self.supervisor.replace_worker(host)?;
        }
        self.rebuild()
    }

    /// Replace every idle backend by a fresh one (the breaker is open; it goes half-open, and
    /// the next health check is its probe); returns how many workers' sessions were rebuilt.
    pub(crate) fn rebuild(&self) -> Result<usize, String> {
        let respawn = self
            .respawn
            .clone()
            .ok_or_else(|| format!("pool `{}` cannot rebuild its backends", self.name()))?;
        // The old sessions go first: a device that holds the weights once may not hold them
        // twice, and after a driver fault they are no use anyway.
        drop(self.queue.take_idle());
        let mut fresh = Vec::with_capacity(self.config.slots());
        for _ in 0..self.config.slots() {
            match respawn() {
                Ok(mut backend) => {
                    if let Some(arenas) = backend.arenas() {
                        arenas.refresh_arena_stats();
                    }
                    fresh.push(queue::Slot::fresh(backend, self.residency.start_set()));
                }
                Err(reason) => {
                    tracing::error!(pool = self.name(), %reason, "restore failed: the breaker stays open");
                    // What was built still serves; the pool is unavailable only with none left.
                    let built = fresh.len();
                    self.queue.restock(fresh, self.config.slots());
                    if built == 0 && self.load().inflight == 0 {
                        *self.availability.write().unwrap_or_else(PoisonError::into_inner) =
                            Availability::Unavailable(format!("restore failed: {reason}"));
                    }
                    self.queue.wake_all();
                    return Err(reason);
                }
            }
        }
        // Counted before the workers are woken: one may take a fresh backend at once (the
        // health check's probe).
        let built = self.queue.restock(fresh, self.config.slots());
        *self.availability.write().unwrap_or_else(PoisonError::into_inner) = Availability::Ready;
        self.health.restored();
        self.queue.wake_all();
        tracing::info!(
            pool = self.name(),
            built,
            "pool restored: the next health check is the breaker's probe"
        );
        Ok(built.div_ceil(self.config.lanes()))
    }

    /// Give the free allocator memory of backends that ran back as soon as each is idle, even
    /// while the pool is busy (host memory nears its reserve). Only for pools that return it
    /// when idle (`memory.idle_release`).
    pub fn release_soon(&self) {
        if self.config.idle_release.is_some() {
            self.queue.release_soon();
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
        let model = job.model.clone();
        if !job.probe {
            // A health check is no activity: only requests keep a model from its idle unload.
            self.residency.touch(&model);
        }
        // A job for a model this pool serves but does not hold loads it first (a cold start);
        // a remote pool's server holds its own models.
        let load = self.serves(&model) && !matches!(self.config.provider, Provider::Remote(_));
        let (reply, loads) = self.queue.push(
            job,
            self.context.clock.now(),
            self.name(),
            self.config.queue_capacity,
            load,
        )?;
        if loads {
            self.residency.record_on_demand(&model);
        }
        Ok(reply)
    }

    /// Stop taking work: queued jobs are answered `ShuttingDown` now; running ones go on.
    pub fn close(&self) {
        for queued in self.queue.close() {
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
}

#[cfg(test)]
mod tests;
