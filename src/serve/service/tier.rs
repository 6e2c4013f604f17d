//! The service's host tier: built before the pools (they load through it), sized once the
//! host's memory is known, its `host_tier: warm` models put into it at start, and asked before
//! it holds more whether the host keeps its reserve.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::Config;
use crate::pool::{HostRoom, HostTier, Pool};
use crate::runtime::onnx::OptimizedCache;
use crate::serve::metrics::Metrics;
use crate::telemetry::exporter::SnapshotStore;

use super::{BackendFactory, ModelEntry};

/// The host tier, unless `host.model_cache` is 0 or the backends cannot optimize models.
pub(super) fn host_tier(
    backends: &dyn BackendFactory,
    config: &Config,
    store: &Arc<SnapshotStore>,
    promised: &Arc<AtomicU64>,
    metrics: &Metrics,
) -> Option<Arc<HostTier>> {
    if config.host_tier.budget == Some(0) {
        return None;
    }
    let rt = backends.optimizer()?;
    let (store, promised) = (Arc::clone(store), Arc::clone(promised));
    // What the host-RAM guard counts (`lifecycle::run::host_keeps_reserve`): available memory,
    // less what running CPU work was promised, less these bytes, stays above the reserve.
    let room: HostRoom = Arc::new(move |bytes| {
        let host = store.latest().snapshot.host.clone();
        host.mem_total_bytes == 0
            || host
                .mem_available_bytes
                .saturating_sub(promised.load(Ordering::SeqCst))
                .saturating_sub(bytes)
                >= host.reserve_bytes
    });
    let cache = OptimizedCache::new(config.host_tier.optimized_cache.clone());
    // Sized by `size_and_warm` once the host has been read (nothing is admitted before).
    Some(Arc::new(HostTier::new(
        rt,
        cache,
        0,
        room,
        metrics.residency.tier.clone(),
    )))
}

/// Size `tier` from the host's first reading (or `host.model_cache`), then put the
/// `host_tier: warm` models into it, each for the first pool that serves it and has a tier.
pub(super) fn size_and_warm(
    tier: &HostTier,
    config: &Config,
    store: &SnapshotStore,
    models: &[ModelEntry],
    pools: &[Arc<Pool>],
) {
    let host = store.latest().snapshot.host.clone();
    tier.set_budget(config.host_tier.budget_on(host.mem_total_bytes, config.host_reserve));
    for entry in models.iter().filter(|m| m.config.host_tier_warm) {
        let name = &entry.config.name;
        let Some(pool) = pools
            .iter()
            .find(|p| p.serves(name) && crate::runtime::onnx::cache_form(p.provider()).is_some())
        else {
            tracing::warn!(model = %name, "host_tier: warm, but no pool that serves it has a host tier");
            continue;
        };
        match tier.warm(name, entry.config.priority, &entry.bytes, pool.provider()) {
            Ok(source) => tracing::info!(model = %name, ?source, "model warmed into the host tier"),
            Err(reason) => tracing::warn!(model = %name, %reason, "model not warmed into the host tier"),
        }
    }
}
