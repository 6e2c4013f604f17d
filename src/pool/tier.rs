//! The host tier: models' optimized forms (see `runtime::onnx::optimized`) kept in host memory
//! within a budget (`host.model_cache`), so a model evicted from a device or unloaded for
//! idleness loads again from memory: no protobuf to parse, no graph to optimize, no weights to
//! read from disk. For a CPU pool an entry is the mapped entry's weights file, mapped by the
//! service and so resident in the page cache: a load maps the pages already there (in a worker
//! process too), and every session of the model shares them. For a simulated pool it is the
//! ORT-format bytes, which a load copies into the device's arena, as to a GPU.
//!
//! A load after start asks the tier first, then the optimized cache on disk, then takes the
//! model's ONNX bytes; a load from the ONNX bytes optimizes the model once in the background
//! (writing the cache entry and filling the tier). The tier never takes the host below its
//! reserve (the host's reading is asked before an entry is admitted) and gives memory back,
//! least valuable first (lowest priority, then least recently used: eviction's order), when
//! the budget or the host needs it. One tier per service, shared by its CPU and simulated pools
//! (see `runtime::onnx::cache_form` for why CUDA pools load from the ONNX bytes still).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::config::Provider;
use crate::core::model::ModelBytes;
use crate::pool::metrics::{LoadSource, TierMetrics};
use crate::runtime::onnx::{Cached, Form, OnnxRuntime, OptimizedCache, cache_form};

/// Whether the host can hold `bytes` more and keep its reserve (the service's reading).
pub type HostRoom = Arc<dyn Fn(u64) -> bool + Send + Sync>;

/// One model's optimized form in the tier.
struct Entry {
    model: String,
    /// Its bytes, and for a CPU pool the mapping of its weights that keeps them resident.
    cached: Cached,
    priority: i64,
    used: Instant,
}

impl Entry {
    fn size(&self) -> u64 {
        self.cached.size()
    }
}

#[derive(Default)]
struct Entries {
    by_key: HashMap<String, Entry>,
    /// Keys being optimized in the background.
    optimizing: HashSet<String>,
}

/// The host tier and the optimized cache behind it.
pub struct HostTier {
    rt: &'static OnnxRuntime,
    cache: OptimizedCache,
    budget: AtomicU64,
    room: HostRoom,
    entries: Mutex<Entries>,
    metrics: TierMetrics,
}

impl std::fmt::Debug for HostTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTier")
            .field("budget", &self.budget())
            .field("bytes", &self.bytes())
            .finish_non_exhaustive()
    }
}

impl HostTier {
    /// A tier of `budget` bytes before `cache`, asking `room` before it holds more.
    pub fn new(
        rt: &'static OnnxRuntime,
        cache: OptimizedCache,
        budget: u64,
        room: HostRoom,
        metrics: TierMetrics,
    ) -> HostTier {
        metrics.budget.set(budget as i64);
        HostTier {
            rt,
            cache,
            budget: AtomicU64::new(budget),
            room,
            entries: Mutex::default(),
            metrics,
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Its budget in bytes.
    pub fn budget(&self) -> u64 {
        self.budget.load(Ordering::SeqCst)
    }

    /// Set its budget (once the host's memory is known); entries over it are let go.
    pub fn set_budget(&self, budget: u64) {
        self.budget.store(budget, Ordering::SeqCst);
        self.metrics.budget.set(budget as i64);
        let held = self.bytes();
        if held > budget {
            self.shed(held - budget);
        }
    }

    /// The bytes it holds.
    pub fn bytes(&self) -> u64 {
        self.entries().by_key.values().map(Entry::size).sum()
    }

    /// Whether `model`'s optimized bytes are in it (for any provider).
    pub fn holds(&self, model: &str) -> bool {
        self.entries().by_key.values().any(|e| e.model == model)
    }

    /// The models whose optimized bytes it holds, sorted.
    pub fn models(&self) -> Vec<String> {
        let mut models: Vec<String> = self.entries().by_key.values().map(|e| e.model.clone()).collect();
        models.sort();
        models.dedup();
        models
    }

    /// What to build `model`'s sessions on a `provider` pool from, and where it came from: its
    /// optimized bytes from the tier or the cache, else `onnx` (and the model is optimized in
    /// the background for next time).
    pub fn fetch(
        self: &Arc<Self>,
        model: &str,
        priority: i64,
        onnx: &ModelBytes,
        provider: &Provider,
    ) -> (ModelBytes, LoadSource) {
        let Some((key, form)) = self.key(model, onnx, provider) else {
            return (onnx.clone(), LoadSource::disk);
        };
        if let Some(entry) = self.entries().by_key.get_mut(&key) {
            entry.used = Instant::now();
            return (entry.cached.bytes.clone(), LoadSource::host_tier);
        }
        if let Some(cached) = self.cache.read(&key, form, onnx.data().folder) {
            let bytes = cached.bytes.clone();
            self.admit(&key, model, priority, cached);
            return (bytes, LoadSource::optimized_cache);
        }
        self.optimize_later(key, form, model, priority, onnx);
        (onnx.clone(), LoadSource::disk)
    }

    /// Put `model`'s optimized bytes into the tier now (`models[].host_tier: warm`): from the
    /// cache, or optimized on this thread. Returns where they came from, or why not.
    pub fn warm(
        &self,
        model: &str,
        priority: i64,
        onnx: &ModelBytes,
        provider: &Provider,
    ) -> Result<LoadSource, String> {
        let (key, form) = self
            .key(model, onnx, provider)
            .ok_or_else(|| format!("pool provider `{}` has no host tier", provider.label()))?;
        if self.entries().by_key.contains_key(&key) {
            return Ok(LoadSource::host_tier);
        }
        let (cached, source) = match self.cache.read(&key, form, onnx.data().folder) {
            Some(cached) => (cached, LoadSource::optimized_cache),
            None => (self.cache.write(self.rt, &key, form, onnx)?, LoadSource::disk),
        };
        match self.admit(&key, model, priority, cached) {
            true => Ok(source),
            false => Err("the host tier has no room for it (budget or host reserve)".into()),
        }
    }

    /// Give back at least `bytes` of host memory, least valuable entries first; answers what
    /// was given back.
    pub fn shed(&self, bytes: u64) -> u64 {
        let mut entries = self.entries();
        let mut freed = 0;
        while freed < bytes {
            let Some(key) = least_valuable(&entries.by_key, i64::MAX) else {
                break;
            };
            if let Some(entry) = entries.by_key.remove(&key) {
                freed += entry.size();
                tracing::info!(model = %entry.model, bytes = entry.size(), "host tier gave its bytes back for the host's reserve");
            }
        }
        self.publish(&entries);
        freed
    }

    /// The key of `model`'s entry for a `provider` pool, and its form, when it has one.
    fn key(&self, model: &str, onnx: &ModelBytes, provider: &Provider) -> Option<(String, Form)> {
        let form = cache_form(provider)?;
        match OptimizedCache::key(self.rt, onnx, form) {
            Ok(key) => Some((key, form)),
            Err(reason) => {
                tracing::warn!(%model, %reason, "no optimized cache key: loading from its file");
                None
            }
        }
    }

    /// Optimize `model` on a thread of its own (once per key at a time), then keep the result.
    fn optimize_later(self: &Arc<Self>, key: String, form: Form, model: &str, priority: i64, onnx: &ModelBytes) {
        if !self.entries().optimizing.insert(key.clone()) {
            return;
        }
        let (tier, model, onnx, started_for) = (Arc::clone(self), model.to_string(), onnx.clone(), key.clone());
        let spawned = std::thread::Builder::new().name("optimize".into()).spawn(move || {
            let started = Instant::now();
            match tier.cache.write(tier.rt, &key, form, &onnx) {
                Ok(cached) => {
                    tracing::info!(%model, seconds = started.elapsed().as_secs_f64(), "model optimized once into the optimized cache");
                    tier.admit(&key, &model, priority, cached);
                }
                Err(reason) => tracing::warn!(%model, %reason, "optimizing the model for the optimized cache failed"),
            }
            tier.entries().optimizing.remove(&key);
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the optimizing thread");
            self.entries().optimizing.remove(&started_for);
        }
    }

    /// Keep `cached` as `key`'s entry when the budget (after letting less valuable entries go)
    /// and the host's reserve allow; true when kept.
    fn admit(&self, key: &str, model: &str, priority: i64, cached: Cached) -> bool {
        let size = cached.size();
        let mut entries = self.entries();
        if entries.by_key.contains_key(key) {
            return true;
        }
        let budget = self.budget();
        let mut held: u64 = entries.by_key.values().map(Entry::size).sum();
        // Only entries of no higher priority give way to it.
        while held + size > budget {
            let Some(victim) = least_valuable(&entries.by_key, priority) else {
                break;
            };
            if let Some(entry) = entries.by_key.remove(&victim) {
                held -= entry.size();
            }
        }
        let kept = held + size <= budget && (self.room)(size);
        if kept {
            entries.by_key.insert(
                key.to_string(),
                Entry {
                    model: model.to_string(),
                    cached,
                    priority,
                    used: Instant::now(),
                },
            );
        } else {
            tracing::info!(%model, bytes = size, budget, "not kept in the host tier: no room within its budget or above the host's reserve");
        }
        self.publish(&entries);
        kept
    }

    fn publish(&self, entries: &Entries) {
        let held: u64 = entries.by_key.values().map(Entry::size).sum();
        self.metrics.bytes.set(held as i64);
        let models: HashSet<&str> = entries.by_key.values().map(|e| e.model.as_str()).collect();
        self.metrics.show(&models);
    }
}

/// The key of the least valuable entry of no more than `priority`: lowest priority, then least
/// recently used.
fn least_valuable(entries: &HashMap<String, Entry>, priority: i64) -> Option<String> {
    entries
        .iter()
        .filter(|(_, e)| e.priority <= priority)
        .min_by_key(|(_, e)| (e.priority, e.used))
        .map(|(key, _)| key.clone())
}
