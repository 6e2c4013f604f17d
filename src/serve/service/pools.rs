//! Starting a configured pool: its workers' backends (ONNX Runtime sessions, or a remote
//! server's client), or the pool kept as unavailable with the reason.

use std::sync::Arc;

use crate::config::{Config, PoolConfig, Provider};
use crate::core::backend::Backend;
use crate::core::snapshot::DeviceClass;
use crate::pool::remote::RemoteBackend;
use crate::pool::{LoadSource, ModelSetup, Pool, PoolContext, Respawn};
use crate::serve::metrics::Metrics;

use super::{BackendFactory, ModelEntry};
use crate::core::model::{ModelBytes, ModelData};

/// Start `pool` with one backend per worker. The same factory rebuilds a worker's backend after
/// a panic, from the same model bytes.
pub(super) fn start_pool(
    backends: &Arc<dyn BackendFactory>,
    config: &Config,
    models: &[ModelEntry],
    pool: &PoolConfig,
    context: PoolContext,
    metrics: &Metrics,
) -> Arc<Pool> {
    let device_kind = config.pool_class(pool);
    let mut sources = Vec::new();
    let build: Respawn = match &pool.provider {
        // Its workers forward to the remote server: no sessions, no model bytes.
        Provider::Remote(options) => {
            let options = options.clone();
            let metrics = metrics.remote.of_pool(&pool.name);
            let max_response_bytes = config.server.max_response_bytes;
            Arc::new(move || {
                RemoteBackend::new(options.clone(), metrics.clone(), max_response_bytes)
                    .map(|b| Box::new(b) as Box<dyn Backend>)
            })
        }
        _ => {
            // An `on_demand` model's sessions are built by its first request, not here. The
            // others start from their optimized bytes when the host tier or the optimized
            // cache has them (a restart skips optimizing), else from their ONNX bytes. A model
            // whose weights are identical to an earlier one's shares that one's sessions.
            let starting = models
                .iter()
                .filter(|m| pool.models.contains(&m.config.name) && m.config.residency.loaded_at_start())
                .map(|m| m.config.name.clone())
                .collect::<std::collections::HashSet<_>>();
            let shares = crate::pool::sharing_at_start(&context.models, &starting);
            let owned: Vec<(String, ModelBytes)> = models
                .iter()
                .filter(|m| starting.contains(&m.config.name) && !shares.contains_key(&m.config.name))
                .map(|m| {
                    let name = m.config.name.clone();
                    let bytes = match &context.tier {
                        Some(tier) => {
                            let (bytes, source) = tier.fetch(&name, m.config.priority, &m.bytes, &pool.provider);
                            sources.push((name.clone(), source));
                            bytes
                        }
                        None => {
                            sources.push((name.clone(), LoadSource::disk));
                            m.bytes.clone()
                        }
                    };
                    (name, bytes)
                })
                .collect();
            let backends = Arc::clone(backends);
            let pool = pool.clone();
            Arc::new(move || {
                let borrowed: Vec<(String, ModelData<'_>)> = owned.iter().map(|(n, b)| (n.clone(), b.data())).collect();
                let mut backend = backends.backend(&pool, &borrowed)?;
                for (name, with) in &shares {
                    backend.loader(name)?.share_model(name, with)?;
                }
                Ok(backend)
            })
        }
    };
    let mut workers: Vec<Box<dyn Backend>> = Vec::new();
    for _ in 0..pool.slots() {
        match build() {
            Ok(b) => workers.push(b),
            Err(reason) => {
                // Never fall back to the CPU silently: the pool is unavailable and says why.
                tracing::error!(pool = %pool.name, provider = pool.provider.label(), %reason, "pool unavailable");
                return Pool::unavailable(pool.clone(), device_kind, reason, context);
            }
        }
    }
    tracing::info!(
        pool = %pool.name,
        provider = pool.provider.label(),
        device = %pool.device,
        simulated = device_kind == DeviceClass::Simulated,
        workers = pool.workers,
        "pool ready"
    );
    let host = backends.worker_host(&pool.name);
    let mut context = context;
    if host.is_some() {
        context.metrics.worker = Some(metrics.workers.of_pool(&pool.name));
    }
    let started = Pool::start(pool.clone(), device_kind, workers, Some(build), context);
    started.residency().record_start_sources(&sources);
    if let Some(host) = host {
        tracing::info!(pool = %pool.name, pid = host.pid(), "pool runs in its worker process");
        started.supervise(host);
    }
    started
}

/// How `pool` holds each model it serves, with the bytes to load it again and its metrics.
/// When its backends `share` sessions, the models whose weights are identical (equal
/// [`ModelEntry::weights_key`]) are told of each other.
pub(super) fn model_setups(
    metrics: &Metrics,
    models: &[ModelEntry],
    pool: &PoolConfig,
    share: bool,
) -> Vec<ModelSetup> {
    let served: Vec<&ModelEntry> = models.iter().filter(|m| pool.models.contains(&m.config.name)).collect();
    let group = |m: &ModelEntry| -> Vec<String> {
        let same: Vec<String> = served
            .iter()
            .filter(|o| o.weights_key.is_some() && o.weights_key == m.weights_key)
            .map(|o| o.config.name.clone())
            .collect();
        match share && same.len() > 1 {
            true => same,
            false => Vec::new(),
        }
    };
    served
        .iter()
        .map(|m| ModelSetup {
            name: m.config.name.clone(),
            residency: m.config.residency,
            idle_unload: m.config.idle_unload,
            priority: m.config.priority,
            min_residency: m.config.min_residency,
            weights_bytes: super::observe::weights_for(pool, m),
            weights_group: group(m),
            generates: m.generates_text(),
            probe: m.probe_inputs().ok().map(Arc::new),
            bytes: m.bytes.clone(),
            metrics: metrics.residency.handles(&m.config.name, &pool.name),
        })
        .collect()
}
