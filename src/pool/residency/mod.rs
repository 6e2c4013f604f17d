//! Which models' sessions a pool holds, and loading and unloading them while the pool serves
//! ([`ModelResidency`], which the pool owns). This file holds the type, the admin's and the idle
//! unload's operations and the worker's bringing a backend up to date; `models.rs` is what the
//! pool is told of each model and what a load answers, `evict.rs` what could make room and the
//! eviction itself, `shares.rs` the models whose identical weights share one session, and
//! `tests.rs` their tests.
//!
//! The pool keeps the set of models it *wants* loaded, with a generation number bumped on each
//! change (both under the queue's lock, `queue.rs`). Each backend remembers which models it has
//! and the generation it last matched; a worker brings an out-of-date backend up to the wanted
//! set before it runs a job on it, and an idle worker does so at once. So a load or an unload
//! reaches idle backends at once and busy ones as soon as their run ends, and a job always runs
//! on a backend that holds its model. A request for a model that is not wanted makes it wanted
//! (an on-demand load): the worker that takes the job loads it first, and that wait is the
//! request's cold start.

mod evict;
mod models;
mod shares;

pub use evict::{ModelState, Resident};
pub use models::{ModelSetup, ResidencyError, ResidencyOutcome};
pub use shares::sharing_at_start;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{PoolConfig, Provider, Residency};
use crate::core::clock::Clock;
use crate::pool::batch::sequences::Sequences;
use crate::pool::metrics::LoadSource;
use crate::pool::queue::{Queue, Slot};
use crate::pool::tier::HostTier;
use models::Models;

/// How long an admin load or unload waits for the pool's runs before giving up.
const OPERATION_BOUND: Duration = Duration::from_secs(60);

/// Which models' sessions a pool holds and wants, and the work of changing that: a pool owns
/// one, sharing its queue (under whose lock the wanted set is kept) with it.
pub struct ModelResidency {
    /// The pool's name, for logs and errors.
    pool: String,
    provider: Provider,
    /// The models the pool serves, in config order.
    served: Vec<String>,
    /// Backends per pool (each builds every wanted model's sessions).
    slots: usize,
    /// The models it serves: how each is held, its bytes and metrics.
    models: Models,
    queue: Arc<Queue>,
    /// The pool's generations: a decoder is held while one is under way.
    sequences: Arc<Sequences>,
    clock: Arc<dyn Clock>,
    /// The service's host tier, which loads after start take their bytes from when it can.
    tier: Option<Arc<HostTier>>,
}

impl std::fmt::Debug for ModelResidency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelResidency")
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl ModelResidency {
    /// The residency of a pool of `config` told `setups` of its models, whose queue is `queue`
    /// and whose loads after start take their bytes from `tier` when it has them.
    pub(super) fn new(
        config: &PoolConfig,
        setups: &[ModelSetup],
        clock: Arc<dyn Clock>,
        tier: Option<Arc<HostTier>>,
        queue: Arc<Queue>,
        sequences: Arc<Sequences>,
    ) -> ModelResidency {
        ModelResidency {
            pool: config.name.clone(),
            provider: config.provider.clone(),
            served: config.models.clone(),
            slots: config.slots(),
            models: Models::new(setups, clock.now()),
            queue,
            sequences,
            clock,
            tier,
        }
    }

    /// A remote pool's server holds its own models: nothing here loads or unloads them.
    fn remote(&self) -> bool {
        matches!(self.provider, Provider::Remote(_))
    }

    /// True when the pool serves `model` (its config lists it), loaded or not.
    pub(super) fn serves(&self, model: &str) -> bool {
        self.served.iter().any(|m| m == model)
    }

    /// A request for `model` arrived: its idle time starts again.
    pub(super) fn touch(&self, model: &str) {
        self.models.touch(model, self.clock.now());
    }

    /// The inputs of `model`'s health-check run, when it has them.
    pub(super) fn probe_of(&self, model: &str) -> Option<Vec<crate::core::tensor::Tensor>> {
        self.models.setups.get(model).and_then(|s| s.probe.as_deref().cloned())
    }
}

impl ModelResidency {
    /// The models whose sessions this pool's backends are built with at start.
    pub(super) fn start_set(&self) -> HashSet<String> {
        let remote = self.remote();
        self.served
            .iter()
            .filter(|m| remote || self.models.residency(m).loaded_at_start())
            .cloned()
            .collect()
    }

    /// Count the loads the pool started with (a model that shares another's session at start
    /// loaded nothing: it is resident, with no load of its own).
    pub(super) fn record_start_loads(&self) {
        let start = self.start_set();
        let setups: Vec<_> = self.models.setups.values().cloned().collect();
        let shares = shares::sharing_at_start(&setups, &start);
        for model in start {
            if let Some(metrics) = self.models.metrics(&model) {
                if !shares.contains_key(&model) {
                    metrics.loads_start.inc();
                }
                metrics.resident.set(1);
            }
        }
    }

    /// Count where the sessions its workers started with took their bytes from: one load per
    /// worker of each `(model, source)` (their seconds are not observed: a worker builds all
    /// its models at once).
    pub fn record_start_sources(&self, sources: &[(String, LoadSource)]) {
        for (model, source) in sources {
            if let Some(metrics) = self.models.metrics(model) {
                metrics.loads_from[source.index()].inc_by(self.slots as u64);
            }
        }
    }

    /// True when `model`'s sessions are loaded here (every model of a remote pool is).
    pub fn is_resident(&self, model: &str) -> bool {
        match self.models.metrics(model) {
            Some(metrics) => metrics.resident.get() == 1,
            None => self.serves(model),
        }
    }

    /// True while `model` is being loaded here: wanted (by a load or a request), its sessions
    /// not built yet.
    pub fn is_loading(&self, model: &str) -> bool {
        !self.is_resident(model) && self.queue.is_wanted(model)
    }

    /// The admin's load: every backend builds `model`'s sessions (idle ones at once, busy ones
    /// after their run). Blocking: run it off the async runtime.
    pub fn load_model(&self, model: &str) -> Result<ResidencyOutcome, ResidencyError> {
        self.not_remote()?;
        // A model whose weights another loaded name holds here shares them: no load.
        let shared = self.shares_loaded(model);
        let Some(generation) = self.queue.want(model) else {
            return Ok(ResidencyOutcome::Already);
        };
        if let Some(metrics) = self.models.metrics(model).filter(|_| !shared) {
            metrics.loads_requested.inc();
        }
        // Loaded on purpose: its idle time starts now, not at its last request.
        self.touch(model);
        self.await_backends(model, "load", generation)?;
        if self.is_resident(model) {
            Ok(ResidencyOutcome::Loaded)
        } else {
            Err(ResidencyError::Failed {
                pool: self.pool.clone(),
                model: model.to_string(),
                reason: "its sessions could not be built (see the log)".into(),
            })
        }
    }

    /// The admin's unload: waits for `model`'s queued and running requests here, then every
    /// backend drops its sessions (idle ones at once, busy ones after their run). Other models'
    /// requests go on. Blocking: run it off the async runtime.
    pub fn unload_model(&self, model: &str) -> Result<ResidencyOutcome, ResidencyError> {
        self.not_remote()?;
        if self.models.residency(model) == Residency::Pinned {
            return Err(ResidencyError::Pinned {
                model: model.to_string(),
            });
        }
        let until = Instant::now() + OPERATION_BOUND;
        let generation = match self.queue.unwant(model, until) {
            Ok(Some(generation)) => generation,
            Ok(None) => return Ok(ResidencyOutcome::Already),
            Err(()) => return Err(self.timeout(model, "unload")),
        };
        if let Some(metrics) = self.models.metrics(model) {
            metrics.resident.set(0);
            metrics.unloads_requested.inc();
        }
        self.await_backends(model, "unload", generation)?;
        Ok(ResidencyOutcome::Unloaded)
    }

    /// Unload every model that had no request here for its `idle_unload`, as an admin unload
    /// would (a model with jobs queued or running is not idle); returns the models unloaded.
    /// Blocking: run it off the async runtime.
    pub fn unload_idle(&self) -> Vec<String> {
        if self.remote() {
            return Vec::new();
        }
        let now = self.clock.now();
        let mut unloaded = Vec::new();
        for model in self.models.idle_at(now) {
            let Some(idle) = self.models.setups.get(model).and_then(|s| s.idle_unload) else {
                continue;
            };
            if self.models.residency(model) == Residency::Pinned {
                continue;
            }
            let still_idle = || self.models.idle_for(model, self.models.millis(self.clock.now()), idle);
            let Some(generation) = self.queue.unwant_idle(model, still_idle) else {
                continue;
            };
            if let Some(metrics) = self.models.metrics(model) {
                metrics.resident.set(0);
                metrics.unloads_idle.inc();
            }
            tracing::info!(pool = %self.pool, %model, idle_unload = ?idle, "unloading an idle model");
            if let Err(e) = self.await_backends(model, "idle unload", generation) {
                tracing::warn!(pool = %self.pool, %model, error = %e, "idle unload still under way");
            }
            unloaded.push(model.to_string());
        }
        unloaded
    }

    /// How often [`ModelResidency::unload_idle`] should run: a quarter of the shortest `idle_unload`
    /// (between 50 ms and 10 s), so a model goes at most that late; `None` when no model here
    /// has one.
    pub fn idle_check_interval(&self) -> Option<Duration> {
        if self.remote() {
            return None;
        }
        self.models
            .shortest_idle_unload()
            .map(|d| (d / 4).clamp(Duration::from_millis(50), Duration::from_secs(10)))
    }

    fn not_remote(&self) -> Result<(), ResidencyError> {
        match self.provider {
            Provider::Remote(_) => Err(ResidencyError::Remote {
                pool: self.pool.clone(),
            }),
            _ => Ok(()),
        }
    }

    pub(super) fn await_backends(
        &self,
        model: &str,
        what: &'static str,
        generation: u64,
    ) -> Result<(), ResidencyError> {
        if self
            .queue
            .await_generation(generation, Instant::now() + OPERATION_BOUND)
        {
            Ok(())
        } else {
            Err(self.timeout(model, what))
        }
    }

    fn timeout(&self, model: &str, what: &'static str) -> ResidencyError {
        ResidencyError::Timeout {
            pool: self.pool.clone(),
            model: model.to_string(),
            what,
            waited: OPERATION_BOUND,
        }
    }

    /// A job for `model` made it wanted: an on-demand load.
    pub(super) fn record_on_demand(&self, model: &str) {
        // (Not whether it is resident itself: a worker may have loaded it since.)
        if self.shares_loaded(model) {
            // It will share what another name holds here: no load.
            return;
        }
        if let Some(metrics) = self.models.metrics(model) {
            metrics.loads_on_demand.inc();
        }
    }

    /// Bring `slot`'s backend up to the `wanted` models of `generation`; returns how long each
    /// model it loaded took, or why it failed. Runs on a worker thread, outside the queue's
    /// lock.
    pub(super) fn reconcile(
        &self,
        slot: &mut Slot,
        wanted: &HashSet<String>,
        generation: u64,
    ) -> HashMap<String, Result<Duration, String>> {
        let mut loads = HashMap::new();
        for model in slot.loaded.difference(wanted).cloned().collect::<Vec<_>>() {
            if let Some(residency) = slot.backend.residency() {
                residency.unload_model(&model);
            }
            slot.loaded.remove(&model);
            tracing::info!(pool = %self.pool, %model, "sessions dropped");
        }
        for model in wanted.difference(&slot.loaded).cloned().collect::<Vec<_>>() {
            if self.share_in(slot, &model) {
                continue;
            }
            let started = Instant::now();
            let mut source = LoadSource::disk;
            let result = match self.models.setups.get(&model) {
                Some(setup) => {
                    let bytes = match &self.tier {
                        Some(tier) => {
                            let (bytes, from) = tier.fetch(&model, setup.priority, &setup.bytes, &self.provider);
                            source = from;
                            bytes
                        }
                        None => setup.bytes.clone(),
                    };
                    slot.backend
                        .loader(&model)
                        .and_then(|residency| residency.load_model(&model, bytes.data()))
                }
                None => Err(format!("pool `{}` has no bytes of `{model}`", self.pool)),
            };
            let took = started.elapsed();
            match &result {
                Ok(()) => {
                    slot.loaded.insert(model.clone());
                    tracing::info!(pool = %self.pool, %model, seconds = took.as_secs_f64(), ?source, "sessions built");
                    if let Some(metrics) = self.models.metrics(&model) {
                        metrics.load_duration.observe(took.as_secs_f64());
                        metrics.loads_from[source.index()].inc();
                        metrics.load_seconds_from[source.index()].observe(took.as_secs_f64());
                        self.models.load_took(&model, source, took);
                        if self.queue.is_wanted(&model) {
                            metrics.resident.set(1);
                            self.models.loaded(&model, self.clock.now());
                        }
                    }
                }
                Err(reason) => {
                    tracing::error!(pool = %self.pool, %model, %reason, "loading the model failed");
                    if self.queue.drop_failed(&model)
                        && let Some(metrics) = self.models.metrics(&model)
                    {
                        metrics.resident.set(0);
                        metrics.unloads_failed.inc();
                    }
                }
            }
            loads.insert(model, result.map(|()| took));
        }
        slot.generation = generation;
        loads
    }

    /// Record `model`'s cold start: a job waited `waited` for its load.
    pub(super) fn record_cold_start(&self, model: &str, waited: Duration) {
        if let Some(metrics) = self.models.metrics(model) {
            metrics.cold_start.observe(waited.as_secs_f64());
        }
    }
}

#[cfg(test)]
mod tests;
