//! Models whose weights are identical (the same graph files by content, found by
//! `serve::service`) share one session per backend: each name keeps its own wanted state,
//! request counters and generations, and the weights are counted once. The pool is told which
//! of its models share ([`ModelSetup::weights_group`]); a backend's first session of a group is
//! built, the others share it ([`Residency::share_model`](crate::core::backend::Residency)),
//! and the session stays while any name of the group is loaded.
//!
//! What the figures say: `/status` and `vramguard_model_memory_bytes` show a group's weights
//! under its first name on the pool ([`ModelResidency::shares_weights_of`] names it for the others); a
//! service's budget is charged on the group's first *resident* name ([`ModelResidency::weights_charged`]);
//! evicting a name frees its weights only when no other name of its group stays
//! ([`ModelResidency::weights_freed_by`]); and a request needs no load while any name of its group is
//! loaded ([`ModelResidency::holds_weights_of`]).

use std::collections::{HashMap, HashSet};

use super::ModelResidency;
use super::models::ModelSetup;
use crate::pool::queue::Slot;

/// Of the models a backend starts with (`starting`), those that share the session of another
/// of them: the name each shares, the first of its group (in config order) that starts. The
/// others build their own sessions.
pub fn sharing_at_start(setups: &[ModelSetup], starting: &HashSet<String>) -> HashMap<String, String> {
    setups
        .iter()
        .filter(|s| starting.contains(&s.name))
        .filter_map(|s| {
            let first = s.weights_group.iter().find(|m| starting.contains(*m))?;
            (*first != s.name).then(|| (s.name.clone(), first.clone()))
        })
        .collect()
}

impl ModelResidency {
    /// The names on this pool whose weights are `model`'s, in config order, `model` among
    /// them; empty when it shares them with none.
    fn weights_group(&self, model: &str) -> &[String] {
        self.models
            .setups
            .get(model)
            .map_or(&[], |s| s.weights_group.as_slice())
    }

    /// The model whose weights `model` shares here, under whose name they are shown: the first
    /// of its group; `None` for that one and for a model that shares with none.
    pub fn shares_weights_of(&self, model: &str) -> Option<&str> {
        self.weights_group(model)
            .first()
            .filter(|first| *first != model)
            .map(String::as_str)
    }

    /// True when `model` and `other` (another model) share one session here.
    pub fn shares_sessions_of(&self, model: &str, other: &str) -> bool {
        model != other && self.weights_group(model).iter().any(|m| m == other)
    }

    /// Its weights here when loaded, as shown (counted once per group: on its first name).
    pub fn weights_shown(&self, model: &str) -> u64 {
        match self.shares_weights_of(model) {
            Some(_) => 0,
            None => self.models.setups.get(model).map_or(0, |s| s.weights_bytes),
        }
    }

    /// True when `model`'s weights are loaded here: its own, or those of a model it shares
    /// them with. A request of it then loads nothing.
    pub fn holds_weights_of(&self, model: &str) -> bool {
        self.is_resident(model) || self.shares_loaded(model)
    }

    /// True when another model whose weights are `model`'s is loaded here: `model` would
    /// share its session, and load nothing.
    pub(super) fn shares_loaded(&self, model: &str) -> bool {
        self.weights_group(model)
            .iter()
            .any(|other| other != model && self.is_resident(other))
    }

    /// The weights charged to `model` here now: its weights while it is resident and no
    /// earlier name of its group is (a group's weights count once, on its first resident
    /// name); else 0.
    pub fn weights_charged(&self, model: &str) -> u64 {
        let earlier = self
            .weights_group(model)
            .iter()
            .take_while(|m| *m != model)
            .any(|m| self.is_resident(m));
        match self.is_resident(model) && !earlier {
            true => self.models.setups.get(model).map_or(0, |s| s.weights_bytes),
            false => 0,
        }
    }

    /// What unloading `model` here would give back: its weights, unless another name of its
    /// group stays loaded (the session stays for it).
    pub fn weights_freed_by(&self, model: &str) -> u64 {
        let others = self
            .weights_group(model)
            .iter()
            .any(|m| m != model && self.is_resident(m));
        match others {
            true => 0,
            false => self.models.setups.get(model).map_or(0, |s| s.weights_bytes),
        }
    }

    /// Let `slot`'s backend serve `model` from the session of a model of its group it holds,
    /// when it holds one: true when it does (nothing was built, no load is counted). A
    /// backend that cannot share says why, and `model` is then loaded as any other.
    pub(super) fn share_in(&self, slot: &mut Slot, model: &str) -> bool {
        let Some(with) = self
            .weights_group(model)
            .iter()
            .find(|m| *m != model && slot.loaded.contains(*m))
        else {
            return false;
        };
        match slot.backend.loader(model).and_then(|r| r.share_model(model, with)) {
            Ok(()) => {
                slot.loaded.insert(model.to_string());
                tracing::info!(pool = %self.pool, %model, shares = %with, "sessions shared");
                if self.queue.is_wanted(model) {
                    if let Some(metrics) = self.models.metrics(model) {
                        metrics.resident.set(1);
                    }
                    self.models.loaded(model, self.clock.now());
                }
                true
            }
            Err(reason) => {
                tracing::warn!(pool = %self.pool, %model, shares = %with, %reason, "sessions not shared: loading its own");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(name: &str, group: &[&str]) -> ModelSetup {
        ModelSetup {
            name: name.into(),
            residency: crate::config::Residency::Resident,
            idle_unload: None,
            priority: 0,
            min_residency: std::time::Duration::ZERO,
            weights_bytes: 0,
            weights_group: group.iter().map(|m| m.to_string()).collect(),
            generates: false,
            probe: None,
            bytes: crate::core::model::ModelBytes::inline(Vec::new()),
            metrics: crate::pool::ModelMetrics::detached(),
        }
    }

    #[test]
    fn at_start_a_group_builds_its_first_starting_session_and_the_others_share_it() {
        let group = ["a", "b", "c"];
        let setups = [
            setup("a", &group),
            setup("b", &group),
            setup("c", &group),
            setup("d", &[]),
        ];
        let starting = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<HashSet<_>>();
        let shares = sharing_at_start(&setups, &starting(&["a", "b", "c", "d"]));
        assert_eq!(
            shares,
            HashMap::from([("b".into(), "a".into()), ("c".into(), "a".into())])
        );
        // `a` loads on demand: `b` builds, `c` shares it.
        let shares = sharing_at_start(&setups, &starting(&["b", "c", "d"]));
        assert_eq!(shares, HashMap::from([("c".into(), "b".into())]));
        assert!(sharing_at_start(&setups, &starting(&["c", "d"])).is_empty());
    }
}
