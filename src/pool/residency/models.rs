//! What a pool is told of each model it serves (how it is held, its bytes, its metric
//! handles), and what a load or unload answers. Plain types: `mod.rs` does the work.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::config::Residency;
use crate::pool::metrics::{LoadSource, ModelMetrics};

/// What a pool knows of one model it serves.
#[derive(Clone)]
pub struct ModelSetup {
    /// Model name.
    pub name: String,
    /// When its sessions exist.
    pub residency: Residency,
    /// How long without a request before it is unloaded; `None`: never.
    pub idle_unload: Option<Duration>,
    /// Eviction takes lower priorities first.
    pub priority: i64,
    /// How long after a load eviction leaves it alone.
    pub min_residency: Duration,
    /// Its weights on this pool when loaded (every worker's sessions).
    pub weights_bytes: u64,
    /// The models on this pool whose weights are identical to its own, in config order, itself
    /// among them: they share one session per backend (`shares.rs`). Empty when none.
    pub weights_group: Vec<String>,
    /// It serves text generation: a generation holds it between its runs.
    pub generates: bool,
    /// Its smallest valid inputs, for the run that gives an idle pool's arena memory back.
    pub probe: Option<Arc<Vec<crate::core::tensor::Tensor>>>,
    /// Its bytes and folder, for loads after start.
    pub bytes: crate::core::model::ModelBytes,
    /// Its metric handles on this pool.
    pub metrics: ModelMetrics,
}

impl std::fmt::Debug for ModelSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelSetup")
            .field("name", &self.name)
            .field("residency", &self.residency)
            .field("idle_unload", &self.idle_unload)
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

/// The pool's models, as given at start, and when each last had a request.
#[derive(Debug)]
pub(super) struct Models {
    pub(super) setups: HashMap<String, ModelSetup>,
    /// What `last_request` counts from.
    epoch: Instant,
    /// Per model: milliseconds from `epoch` to its last request. An atomic, so the request
    /// path records it without a lock.
    last_request: HashMap<String, AtomicU64>,
    /// Per model: milliseconds from `epoch` to when its sessions were last built everywhere
    /// (0 for those built at start).
    loaded_at: HashMap<String, AtomicU64>,
    /// Per model: microseconds its sessions last took to build after the start (0: not yet).
    load_micros: HashMap<String, AtomicU64>,
    /// The same per source of its bytes, in [`LoadSource::ALL`]'s order.
    load_micros_from: HashMap<String, [AtomicU64; 3]>,
}

impl Models {
    pub(super) fn new(setups: &[ModelSetup], now: Instant) -> Models {
        Models {
            setups: setups.iter().map(|s| (s.name.clone(), s.clone())).collect(),
            epoch: now,
            last_request: setups.iter().map(|s| (s.name.clone(), AtomicU64::new(0))).collect(),
            loaded_at: setups.iter().map(|s| (s.name.clone(), AtomicU64::new(0))).collect(),
            load_micros: setups.iter().map(|s| (s.name.clone(), AtomicU64::new(0))).collect(),
            load_micros_from: setups.iter().map(|s| (s.name.clone(), Default::default())).collect(),
        }
    }

    /// One backend built `model`'s sessions from `source`'s bytes in `took`.
    pub(super) fn load_took(&self, model: &str, source: LoadSource, took: Duration) {
        let micros = (took.as_micros() as u64).max(1);
        if let Some(last) = self.load_micros.get(model) {
            last.store(micros, Ordering::SeqCst);
        }
        if let Some(by_source) = self.load_micros_from.get(model) {
            by_source[source.index()].store(micros, Ordering::SeqCst);
        }
    }

    /// How long `model`'s sessions last took to build from `source`'s bytes, when they were.
    pub(super) fn last_load_from(&self, model: &str, source: LoadSource) -> Option<Duration> {
        let micros = self.load_micros_from.get(model)?[source.index()].load(Ordering::SeqCst);
        (micros > 0).then(|| Duration::from_micros(micros))
    }

    /// How long `model`'s sessions last took to build, when they were built after the start.
    pub(super) fn last_load(&self, model: &str) -> Option<Duration> {
        let micros = self.load_micros.get(model)?.load(Ordering::SeqCst);
        (micros > 0).then(|| Duration::from_micros(micros))
    }

    /// `model`'s sessions were built at `now`.
    pub(super) fn loaded(&self, model: &str, now: Instant) {
        if let Some(at) = self.loaded_at.get(model) {
            at.store(self.millis(now), Ordering::SeqCst);
        }
    }

    /// How long ago `model` was last loaded and last asked for, at `now`.
    pub(super) fn ages(&self, model: &str, now: Instant) -> (Duration, Duration) {
        let now = self.millis(now);
        let age = |map: &HashMap<String, AtomicU64>| {
            Duration::from_millis(now.saturating_sub(map.get(model).map_or(0, |at| at.load(Ordering::SeqCst))))
        };
        (age(&self.loaded_at), age(&self.last_request))
    }

    /// A request for `model` arrived at `now`.
    pub(super) fn touch(&self, model: &str, now: Instant) {
        if let Some(last) = self.last_request.get(model) {
            last.fetch_max(self.millis(now), Ordering::SeqCst);
        }
    }

    /// The models with an `idle_unload` that had no request for that long at `now`.
    pub(super) fn idle_at(&self, now: Instant) -> Vec<&str> {
        let now = self.millis(now);
        self.setups
            .values()
            .filter(|s| s.idle_unload.is_some_and(|idle| self.idle_for(&s.name, now, idle)))
            .map(|s| s.name.as_str())
            .collect()
    }

    /// True when `model` had no request for `idle` at `now` (milliseconds from the epoch).
    pub(super) fn idle_for(&self, model: &str, now: u64, idle: Duration) -> bool {
        self.last_request
            .get(model)
            // Strictly more whole milliseconds: both ends are rounded down, so never early.
            .is_some_and(|last| now.saturating_sub(last.load(Ordering::SeqCst)) > idle.as_millis() as u64)
    }

    /// `now` as milliseconds from the epoch.
    pub(super) fn millis(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64
    }

    /// The shortest `idle_unload` of these models, when any has one.
    pub(super) fn shortest_idle_unload(&self) -> Option<Duration> {
        self.setups.values().filter_map(|s| s.idle_unload).min()
    }

    /// Its metrics, when the pool was told of the model.
    pub(super) fn metrics(&self, model: &str) -> Option<&ModelMetrics> {
        self.setups.get(model).map(|s| &s.metrics)
    }

    /// How `model` is held (resident when the pool was told nothing of it).
    pub(super) fn residency(&self, model: &str) -> Residency {
        self.setups.get(model).map(|s| s.residency).unwrap_or_default()
    }
}
