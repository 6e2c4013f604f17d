//! What `make_room` shares across requests: one eviction at a time per device (two requests
//! making room at once would each evict for itself), and the recent evictions `/status` shows.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

/// How many evictions `/status` keeps.
const KEPT: usize = 20;

/// One model unloaded to admit another's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Eviction {
    /// When.
    pub at: SystemTime,
    /// The pool it was unloaded from.
    pub pool: String,
    /// That pool's device.
    pub device: String,
    /// The model unloaded.
    pub model: String,
    /// Its weights on that pool, as measured at its load.
    pub freed_bytes: u64,
    /// The model whose request it made room for.
    pub for_model: String,
    /// That request's id.
    pub for_request: String,
}

/// Per-device eviction locks and the recent evictions.
#[derive(Debug, Default)]
pub struct Rooms {
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    recent: Mutex<VecDeque<Eviction>>,
}

impl Rooms {
    /// The lock that serializes making room on `device`.
    pub fn lock_for(&self, device: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(locks.entry(device.to_string()).or_default())
    }

    /// Keep `eviction` for `/status` (the oldest goes past [`KEPT`]).
    pub fn record(&self, eviction: Eviction) {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        if recent.len() == KEPT {
            recent.pop_front();
        }
        recent.push_back(eviction);
    }

    /// The recent evictions, newest first.
    pub fn recent(&self) -> Vec<Eviction> {
        let recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        recent.iter().rev().cloned().collect()
    }
}
