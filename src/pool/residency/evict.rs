//! Eviction, as one pool sees it: which of its resident models could give their memory to
//! another model's request now, and unloading one for that. Which models go, and whether enough
//! comes back, is decided above the pools (`serve::lifecycle::room`), which sees the device.

use std::time::Duration;

use super::ModelResidency;
use crate::config::Residency;
use crate::pool::metrics::LoadSource;

/// A model whose sessions a pool holds, as eviction weighs it.
#[derive(Debug, Clone, PartialEq)]
pub struct Resident {
    /// Model name.
    pub model: String,
    /// Eviction takes lower priorities first.
    pub priority: i64,
    /// Never evicted.
    pub pinned: bool,
    /// Its requests queued or running here now, and for a model that generates text, the
    /// pool's generations under way (between their runs too): a model with any is never
    /// evicted.
    pub busy: usize,
    /// Since its sessions were last built here (since the start for those built then).
    pub since_load: Duration,
    /// Since its last request here (since the start when it had none).
    pub since_request: Duration,
    /// How long after a load eviction leaves it alone.
    pub min_residency: Duration,
    /// How long loading it here again is expected to take: its last load from the host tier
    /// when its optimized bytes are there, else its last load after the start.
    pub last_load: Option<Duration>,
    /// Its weights here (every worker's sessions): what evicting it frees (nothing while
    /// another name of its group, sharing them, stays loaded).
    pub weights_bytes: u64,
}

impl Resident {
    /// Whether eviction may take it now for a request of priority `priority`: not pinned, no
    /// work queued or running, loaded longer than its `min_residency` ago, and of no higher
    /// priority than the request's.
    pub fn evictable_for(&self, priority: i64) -> bool {
        !self.pinned && self.busy == 0 && self.since_load >= self.min_residency && self.priority <= priority
    }
}

/// A model on a pool now, as `/status` and the policy's `state.models` show it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelState {
    /// Eviction takes lower priorities first.
    pub priority: i64,
    /// How it is held.
    pub residency: Residency,
    /// Its weights here when loaded (every worker's sessions); 0 when it shares another
    /// model's, which shows them.
    pub weights_bytes: u64,
    /// The model whose loaded weights it shares here (identical graph files), when it does.
    pub shares_weights_of: Option<String>,
    /// Its sessions are loaded here.
    pub resident: bool,
    /// Since they were last built here (`None` on a remote pool).
    pub since_load: Option<Duration>,
    /// Since its last request here (since the start when it had none).
    pub since_request: Duration,
    /// Its requests running here.
    pub running: usize,
    /// Its requests queued here.
    pub queued: usize,
    /// Its optimized bytes are in the host tier.
    pub host_tier: bool,
    /// What a reload here is expected to take (see [`ModelResidency::expected_reload`]).
    pub reload: Option<Duration>,
}

impl ModelResidency {
    /// `model` on this pool now.
    pub fn model_state(&self, model: &str) -> ModelState {
        let (since_load, since_request) = self.models.ages(model, self.clock.now());
        let (running, queued) = self.queue.counts(model);
        let setup = self.models.setups.get(model);
        ModelState {
            priority: setup.map_or(0, |s| s.priority),
            residency: self.models.residency(model),
            weights_bytes: self.weights_shown(model),
            shares_weights_of: self.shares_weights_of(model).map(str::to_string),
            resident: self.is_resident(model),
            since_load: (!self.remote()).then_some(since_load),
            since_request,
            running,
            queued,
            host_tier: self.in_host_tier(model),
            reload: self.expected_reload(model),
        }
    }

    /// Whether `model`'s optimized bytes are in the host tier.
    fn in_host_tier(&self, model: &str) -> bool {
        self.tier.as_ref().is_some_and(|tier| tier.holds(model))
    }

    /// What loading `model` here again is expected to take: its last load from the host tier
    /// when its bytes are there, else its last load from anywhere (`None`: none since start).
    pub fn expected_reload(&self, model: &str) -> Option<Duration> {
        let from_tier = self
            .in_host_tier(model)
            .then(|| self.models.last_load_from(model, LoadSource::host_tier));
        from_tier.flatten().or_else(|| self.models.last_load(model))
    }

    /// The models whose sessions this pool holds now, with what eviction weighs (none on a
    /// remote pool: its server holds its own).
    pub fn residents(&self) -> Vec<Resident> {
        if self.remote() {
            return Vec::new();
        }
        let now = self.clock.now();
        self.models
            .setups
            .values()
            .filter(|setup| self.is_resident(&setup.name))
            .map(|setup| {
                let (since_load, since_request) = self.models.ages(&setup.name, now);
                Resident {
                    model: setup.name.clone(),
                    priority: setup.priority,
                    pinned: setup.residency == Residency::Pinned,
                    busy: self.queue.busy(&setup.name) + self.generations_holding(&setup.name),
                    since_load,
                    since_request,
                    min_residency: setup.min_residency,
                    last_load: self.expected_reload(&setup.name),
                    weights_bytes: self.weights_freed_by(&setup.name),
                }
            })
            .collect()
    }

    /// The pool's generations under way, when `model` generates text (which of its models a
    /// generation runs is not counted per model: any of them may be in use), else 0.
    fn generations_holding(&self, model: &str) -> usize {
        match self.models.setups.get(model).is_some_and(|s| s.generates) {
            true => {
                let now = self.sequences.now();
                (now.waiting + now.running) as usize
            }
            false => 0,
        }
    }

    /// Unload `model` to make room for another model's request, if it is still idle (nothing
    /// of it queued or running, checked under the queue's lock) and not pinned; true once every
    /// backend has dropped its sessions. Blocking: run it off the async runtime.
    pub fn evict(&self, model: &str) -> bool {
        if self.remote() || self.models.residency(model) == Residency::Pinned {
            return false;
        }
        // A generation between its runs holds no job of the model, only its KV cache.
        let Some(generation) = self.queue.unwant_idle(model, || self.generations_holding(model) == 0) else {
            return false;
        };
        if let Some(metrics) = self.models.metrics(model) {
            metrics.resident.set(0);
            metrics.unloads_evicted.inc();
        }
        tracing::info!(pool = %self.pool, %model, "evicting a model to make room");
        match self.await_backends(model, "eviction", generation) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(pool = %self.pool, %model, error = %e, "eviction still under way");
                false
            }
        }
    }
}
