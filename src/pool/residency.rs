//! Which models' sessions a pool holds, and loading and unloading them while the pool serves.
//!
//! The pool keeps the set of models it *wants* loaded, with a generation number bumped on each
//! change (both under the queue's lock, `queue.rs`). Each backend remembers which models it has
//! and the generation it last matched; a worker brings an out-of-date backend up to the wanted
//! set before it runs a job on it, and an idle worker does so at once. So a load or an unload
//! reaches idle backends at once and busy ones as soon as their run ends, and a job always runs
//! on a backend that holds its model. A request for a model that is not wanted makes it wanted
//! (an on-demand load): the worker that takes the job loads it first, and that wait is the
//! request's cold start.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::config::{Provider, Residency};
use crate::pool::queue::Slot;
use crate::pool::shared::Pool;

/// A model's serialized bytes, kept to build its sessions again after an unload.
pub type ModelBytesRef = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Metric handles of one model on one pool.
#[derive(Debug, Clone)]
pub struct ModelMetrics {
    /// `vramguard_model_resident{model,pool}`
    pub resident: Gauge,
    /// `vramguard_model_loads_total{model,pool,reason="start"}`
    pub loads_start: Counter,
    /// `vramguard_model_loads_total{model,pool,reason="on_demand"}`
    pub loads_on_demand: Counter,
    /// `vramguard_model_loads_total{model,pool,reason="requested"}`
    pub loads_requested: Counter,
    /// `vramguard_model_unloads_total{model,pool,reason="requested"}`
    pub unloads_requested: Counter,
    /// `vramguard_model_unloads_total{model,pool,reason="failed"}`: a load that failed.
    pub unloads_failed: Counter,
    /// `vramguard_model_load_duration_seconds{model,pool}`: one per session built.
    pub load_duration: Histogram,
    /// `vramguard_cold_start_seconds{model,pool}`: what a request waited for its model's load.
    pub cold_start: Histogram,
}

/// Buckets of load and cold-start durations, in seconds.
pub const LOAD_BUCKETS: [f64; 10] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0];

impl ModelMetrics {
    /// Handles registered nowhere (tests, benches).
    pub fn detached() -> Self {
        ModelMetrics {
            resident: Gauge::default(),
            loads_start: Counter::default(),
            loads_on_demand: Counter::default(),
            loads_requested: Counter::default(),
            unloads_requested: Counter::default(),
            unloads_failed: Counter::default(),
            load_duration: Histogram::new(LOAD_BUCKETS),
            cold_start: Histogram::new(LOAD_BUCKETS),
        }
    }
}

/// What a pool knows of one model it serves.
#[derive(Clone)]
pub struct ModelSetup {
    /// Model name.
    pub name: String,
    /// When its sessions exist.
    pub residency: Residency,
    /// Its bytes, for loads after start.
    pub bytes: ModelBytesRef,
    /// Its metric handles on this pool.
    pub metrics: ModelMetrics,
}

impl std::fmt::Debug for ModelSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelSetup")
            .field("name", &self.name)
            .field("residency", &self.residency)
            .finish_non_exhaustive()
    }
}

/// What a load or unload did on one pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResidencyOutcome {
    /// Its sessions were built.
    Loaded,
    /// Its sessions were dropped.
    Unloaded,
    /// It already was as asked.
    Already,
}

impl ResidencyOutcome {
    /// As the admin API answers it.
    pub fn label(self) -> &'static str {
        match self {
            ResidencyOutcome::Loaded => "loaded",
            ResidencyOutcome::Unloaded => "unloaded",
            ResidencyOutcome::Already => "already",
        }
    }
}

/// Why a load or unload could not be done.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResidencyError {
    /// The model is `pinned`: never unloaded.
    #[error("model `{model}` is pinned (models[].residency: pinned): it is never unloaded")]
    Pinned {
        /// Model name.
        model: String,
    },
    /// A remote pool's server holds its own sessions.
    #[error("pool `{pool}` is remote: its server loads and unloads its own models")]
    Remote {
        /// Pool name.
        pool: String,
    },
    /// It did not finish within the bound.
    #[error("pool `{pool}`: {what} of `{model}` did not finish within {waited:?}")]
    Timeout {
        /// Pool name.
        pool: String,
        /// Model name.
        model: String,
        /// `load` or `unload`.
        what: &'static str,
        /// How long it was waited for.
        waited: Duration,
    },
    /// Building a session failed.
    #[error("pool `{pool}` could not load `{model}`: {reason}")]
    Failed {
        /// Pool name.
        pool: String,
        /// Model name.
        model: String,
        /// Why.
        reason: String,
    },
}

/// The pool's models, as given at start.
#[derive(Debug, Default)]
pub(super) struct Models {
    setups: HashMap<String, ModelSetup>,
}

impl Models {
    pub(super) fn new(setups: &[ModelSetup]) -> Models {
        Models {
            setups: setups.iter().map(|s| (s.name.clone(), s.clone())).collect(),
        }
    }

    /// Its metrics, when the pool was told of the model.
    fn metrics(&self, model: &str) -> Option<&ModelMetrics> {
        self.setups.get(model).map(|s| &s.metrics)
    }

    /// How `model` is held (resident when the pool was told nothing of it).
    fn residency(&self, model: &str) -> Residency {
        self.setups.get(model).map(|s| s.residency).unwrap_or_default()
    }
}

/// How long an admin load or unload waits for the pool's runs before giving up.
const OPERATION_BOUND: Duration = Duration::from_secs(60);

impl Pool {
    /// The models whose sessions this pool's backends are built with at start.
    pub(super) fn start_set(&self) -> HashSet<String> {
        let remote = matches!(self.config.provider, Provider::Remote(_));
        self.config
            .models
            .iter()
            .filter(|m| remote || self.models.residency(m).loaded_at_start())
            .cloned()
            .collect()
    }

    /// Count the loads the pool started with.
    pub(super) fn record_start_loads(&self) {
        for model in self.start_set() {
            if let Some(metrics) = self.models.metrics(&model) {
                metrics.loads_start.inc();
                metrics.resident.set(1);
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

    /// The admin's load: every backend builds `model`'s sessions (idle ones at once, busy ones
    /// after their run). Blocking: run it off the async runtime.
    pub fn load_model(&self, model: &str) -> Result<ResidencyOutcome, ResidencyError> {
        self.not_remote()?;
        let Some(generation) = self.queue.want(model) else {
            return Ok(ResidencyOutcome::Already);
        };
        if let Some(metrics) = self.models.metrics(model) {
            metrics.loads_requested.inc();
        }
        self.await_backends(model, "load", generation)?;
        if self.is_resident(model) {
            Ok(ResidencyOutcome::Loaded)
        } else {
            Err(ResidencyError::Failed {
                pool: self.name().to_string(),
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

    fn not_remote(&self) -> Result<(), ResidencyError> {
        match self.config.provider {
            Provider::Remote(_) => Err(ResidencyError::Remote {
                pool: self.name().to_string(),
            }),
            _ => Ok(()),
        }
    }

    fn await_backends(&self, model: &str, what: &'static str, generation: u64) -> Result<(), ResidencyError> {
        if self.queue.await_generation(generation, Instant::now() + OPERATION_BOUND) {
            Ok(())
        } else {
            Err(self.timeout(model, what))
        }
    }

    fn timeout(&self, model: &str, what: &'static str) -> ResidencyError {
        ResidencyError::Timeout {
            pool: self.name().to_string(),
            model: model.to_string(),
            what,
            waited: OPERATION_BOUND,
        }
    }

    /// A job for `model` made it wanted: an on-demand load.
    pub(super) fn record_on_demand(&self, model: &str) {
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
            slot.backend.unload_model(&model);
            slot.loaded.remove(&model);
            tracing::info!(pool = self.name(), %model, "sessions dropped");
        }
        for model in wanted.difference(&slot.loaded).cloned().collect::<Vec<_>>() {
            let started = Instant::now();
            let result = match self.models.setups.get(&model) {
                Some(setup) => slot.backend.load_model(&model, setup.bytes.as_ref().as_ref()),
                None => Err(format!("pool `{}` has no bytes of `{model}`", self.name())),
            };
            let took = started.elapsed();
            match &result {
                Ok(()) => {
                    slot.loaded.insert(model.clone());
                    tracing::info!(pool = self.name(), %model, seconds = took.as_secs_f64(), "sessions built");
                    if let Some(metrics) = self.models.metrics(&model) {
                        metrics.load_duration.observe(took.as_secs_f64());
                        if self.queue.is_wanted(&model) {
                            metrics.resident.set(1);
                        }
                    }
                }
                Err(reason) => {
                    tracing::error!(pool = self.name(), %model, %reason, "loading the model failed");
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
        self.refresh_after_change(slot);
        loads
    }

    /// Allocator statistics after sessions came or went: what the weights now hold.
    fn refresh_after_change(&self, slot: &mut Slot) {
        slot.backend.refresh_arena_stats();
        self.publish_stats(slot.backend.as_ref());
    }

    /// Record `model`'s cold start: a job waited `waited` for its load.
    pub(super) fn record_cold_start(&self, model: &str, waited: Duration) {
        if let Some(metrics) = self.models.metrics(model) {
            metrics.cold_start.observe(waited.as_secs_f64());
        }
    }
}
