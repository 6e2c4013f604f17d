//! What the `/status` sampler saw of models and evictions while the residency phase ran.

use std::collections::{BTreeMap, BTreeSet};

use super::GPU;
use crate::protocol::status::{EvictionStatus, StatusReport};

/// What the `/status` sampler saw during the phase.
#[derive(Debug, Default, Clone)]
pub(super) struct Seen {
    /// Evictions by (at, pool, model, request), each once.
    pub(super) evictions: BTreeMap<(u64, String, String, String), EvictionStatus>,
    /// Every `loaded_unix` seen per (model, pool).
    pub(super) loads: BTreeMap<(String, String), BTreeSet<u64>>,
    /// A pinned model not resident on the accelerator pool, as `model at +ms`.
    pub(super) pinned_missing: Vec<String>,
}

impl Seen {
    /// Take in one `/status`, read `at_ms` after the drill's start.
    pub(super) fn observe(&mut self, status: &StatusReport, at_ms: f64) {
        for e in &status.evictions {
            let key = (e.at_unix, e.pool.clone(), e.model.clone(), e.for_request.clone());
            self.evictions.entry(key).or_insert_with(|| e.clone());
        }
        for model in &status.models {
            for on in &model.pools {
                if let Some(at) = on.loaded_unix {
                    self.loads
                        .entry((model.name.clone(), on.pool.clone()))
                        .or_default()
                        .insert(at);
                }
                if model.residency == "pinned" && on.pool == GPU && !on.resident {
                    self.pinned_missing.push(format!("{} at +{at_ms:.0} ms", model.name));
                }
            }
        }
    }

    /// The latest load of `model` on `pool` at or before `at_unix`.
    pub(super) fn loaded_before(&self, model: &str, pool: &str, at_unix: u64) -> Option<u64> {
        let loads = self.loads.get(&(model.to_string(), pool.to_string()))?;
        loads.range(..=at_unix).next_back().copied()
    }
}
