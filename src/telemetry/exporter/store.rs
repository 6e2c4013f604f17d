//! Where the sampler publishes its samples and every reader (`/metrics`, `/status`, the policy)
//! takes the latest.

use std::sync::{Arc, RwLock};
use std::time::Instant;

use crate::core::snapshot::Snapshot;

/// The latest sample.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// Devices, pools, host and processes.
    pub snapshot: Arc<Snapshot>,
    /// vramguard's own resident memory.
    pub self_resident_bytes: u64,
    /// Increases with every sample (lets readers cache what they derive from a snapshot).
    pub generation: u64,
    /// When it was taken.
    pub taken_at: Option<Instant>,
}

/// Where the sampler publishes and everyone else reads.
#[derive(Debug, Default)]
pub struct SnapshotStore {
    current: RwLock<Sample>,
}

impl SnapshotStore {
    /// The latest sample (cheap: clones an `Arc`).
    pub fn latest(&self) -> Sample {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Make `sample` the latest, numbered one after the last.
    pub(super) fn publish(&self, mut sample: Sample) {
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        sample.generation = current.generation + 1;
        *current = sample;
    }
}
