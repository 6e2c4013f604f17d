//! The running service, assembled from its [`Parts`] before any port is bound: models with their
//! signatures and memory profiles, pools with their workers, metrics, the memory sampler and the
//! admission policy. Production parts come from ONNX Runtime and the machine
//! ([`Parts::onnxruntime`]); tests pass a fake [`BackendFactory`], no memory sources and a clock
//! they control, so the whole request lifecycle runs without ONNX Runtime.

mod components;
mod cpus;
mod factory;
mod kind;
mod models;
mod observe;
mod onnxruntime;
mod parts;
mod policy;
mod pools;
mod rooms;
mod services;
mod tier;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::registry::Registry;

use crate::config::{Config, ConfigError};
use crate::core::clock::Clock;
use crate::core::snapshot::ProviderKind;
use crate::core::wakeup::WakeLimit;
use crate::device::simulated::SimulatedDevice;
use crate::policy::PolicyHandle;
use crate::pool::activity::Activity;
use crate::pool::degraded::Degraded;
use crate::pool::{HostTier, Pool, PoolContext};
use crate::runtime::onnx::RuntimeError;
use crate::serve::idempotency::{IdempotencyCache, StoredResponse};
use crate::serve::metrics::Metrics;
use crate::telemetry::exporter::{LiveCollector, Sampler, SnapshotStore};
use crate::telemetry::services::ServicesCollector;

pub use crate::serve::metrics::UNKNOWN_MODEL;
pub use components::{Component, WeightsKey};
pub use factory::BackendFactory;
pub use kind::{Api, Generator, Kind};
pub use models::ModelEntry;
pub use onnxruntime::OrtFactory;
pub use parts::Parts;
pub use rooms::{Eviction, Rooms};
pub use services::{Ask, HeldBack, Services, Slot};

use models::load_models;
use policy::{PolicyState, load_policy};
use pools::{model_setups, start_pool};

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// ONNX Runtime could not be loaded.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A model in the config cannot be served (names the file and key).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The policy does not compile, fails its own test cases, or fails on this config.
    #[error("{0}")]
    Policy(String),
}

/// Everything a request is served from.
pub struct Service {
    /// The configuration it was built from.
    pub config: Config,
    /// The inference runtime's version (ONNX Runtime's in production).
    pub runtime_version: String,
    /// Models in config order.
    pub models: Vec<ModelEntry>,
    /// Pools in config order (routing prefers earlier pools).
    pub pools: Vec<Arc<Pool>>,
    /// Simulated devices (at most one per process).
    pub simulated: Vec<Arc<SimulatedDevice>>,
    /// Metric handles.
    pub metrics: Arc<Metrics>,
    /// The registry they are registered in (with the live collector).
    pub registry: Registry,
    /// The latest memory snapshot.
    pub store: Arc<SnapshotStore>,
    /// Notified to take a sample now (e.g. after simulated pressure changed).
    pub resample: Arc<tokio::sync::Notify>,
    sampler: Mutex<Option<Sampler>>,
    /// The admission policy.
    pub policy: Arc<PolicyHandle>,
    /// The policy's view of the latest sample (its pools read their load live).
    policy_state: Mutex<Option<PolicyState>>,
    /// Time source shared with the pools.
    pub clock: Arc<dyn Clock>,
    /// Degraded mode, computed from the pools when asked.
    pub degraded: Arc<Degraded>,
    /// Responses of `idempotency-key` requests, so each key executes at most once.
    pub idempotency: IdempotencyCache<StoredResponse>,
    /// Bytes promised to runs admitted to host pools and not finished yet.
    host_promised: Arc<std::sync::atomic::AtomicU64>,
    /// The host tier (`host.model_cache`), when the backends can optimize models.
    pub tier: Option<Arc<HostTier>>,
    /// The policy's last decisions, for `/status`.
    pub decisions: crate::policy::recent::RecentDecisions,
    /// Requests accepted and not answered, waiting or running.
    pub activity: Arc<Activity>,
    /// Each service's budgets and what it runs and holds now.
    pub services: Arc<Services>,
    /// `make_room`'s per-device locks and its recent evictions.
    pub rooms: Rooms,
    /// [`weights_beside`] of every pool and model it serves: fixed once the pools are built,
    /// and read by every request's never-fits check.
    weights_beside: HashMap<(String, String), u64>,
    /// `server.cpu_wake_latency`, held while requests are in flight.
    wake_limit: Option<WakeLimit>,
}

/// Asks the background sampler for a sample and waits for it.
#[derive(Debug, Clone)]
pub struct Resampler {
    notify: Arc<tokio::sync::Notify>,
    store: Arc<SnapshotStore>,
}

impl Resampler {
    /// Ask for a sample now and wait (up to a second) until it is published.
    pub async fn now(self) {
        let before = self.store.latest().generation;
        self.notify.notify_one();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        while self.store.latest().generation == before && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// Host memory promised to one run; given back when dropped.
#[derive(Debug)]
pub struct HostPromise {
    bytes: u64,
    promised: Arc<std::sync::atomic::AtomicU64>,
}

impl Drop for HostPromise {
    fn drop(&mut self) {
        self.promised.fetch_sub(self.bytes, std::sync::atomic::Ordering::SeqCst);
    }
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("pools", &self.pools)
            .finish_non_exhaustive()
    }
}

impl Service {
    /// Assemble the production service: [`Parts::onnxruntime`], then [`Service::assemble`].
    /// The calling thread moves to `server.cpus`, if given (see [`cpus::place`]).
    pub fn start(mut config: Config) -> Result<Service, StartError> {
        cpus::place(&mut config)?;
        let wake_limit = cpus::wake_limit(&config)?;
        let parts = Parts::onnxruntime(&config)?;
        let mut service = Service::assemble(config, parts)?;
        service.wake_limit = wake_limit;
        Ok(service)
    }

    /// Build every model and pool from `parts`. A pool whose backend cannot be built (no NVIDIA
    /// driver, no CUDA provider library) is kept as *unavailable* with the reason.
    pub fn assemble(config: Config, parts: Parts) -> Result<Service, StartError> {
        let Parts {
            backends,
            sources,
            simulated,
            clock,
        } = parts;
        let runtime_version = backends.runtime_version();
        let models = load_models(backends.as_ref(), &config)?;
        let (metrics, mut registry) = Metrics::new(&runtime_version);
        let metrics = Arc::new(metrics);
        let store = Arc::new(SnapshotStore::default());
        let host_promised: Arc<std::sync::atomic::AtomicU64> = Arc::default();
        let tier = tier::host_tier(backends.as_ref(), &config, &store, &host_promised, &metrics);
        let mut pools = Vec::new();
        for pool_config in &config.pools {
            let context = PoolContext {
                clock: Arc::clone(&clock),
                metrics: metrics.pool_metrics(&pool_config.name, &pool_config.device),
                models: model_setups(&metrics, &models, pool_config, backends.shares_sessions(pool_config)),
                tier: tier.clone(),
            };
            pools.push(start_pool(&backends, &config, &models, pool_config, context, &metrics));
        }
        for pool in &pools {
            for entry in models.iter().filter(|m| pool.serves(&m.config.name)) {
                // Weights another model shares are shown once, under that model's name.
                let shown = match pool.residency().shares_weights_of(&entry.config.name) {
                    Some(_) => 0,
                    None => observe::weights_on(pool, entry),
                };
                metrics.estimates.serving(&entry.config.name, pool.name(), shown);
                let workers = pool.config.workers.max(1) as u64;
                for component in &entry.components {
                    let bytes = if shown == 0 {
                        0
                    } else {
                        component.weights_bytes.saturating_mul(workers)
                    };
                    metrics
                        .estimates
                        .component(&entry.config.name, pool.name(), component.name, bytes);
                }
            }
        }
        metrics.zero_known(models.iter().map(|m| &m.config), &pools);
        for entry in models.iter().filter(|m| m.kind.speech().is_some()) {
            for pool in pools.iter().filter(|p| p.serves(&entry.config.name)) {
                metrics.speech.serving(&entry.config.name, pool.name());
            }
        }
        let degraded = Arc::new(Degraded::new(pools.clone(), Arc::clone(&clock)));
        let activity = Arc::new(Activity::default());
        let idempotency = IdempotencyCache::new(config.server.idempotency.max_entries, config.server.idempotency.ttl);
        idempotency.metrics().register(&mut registry);
        let mut sampler = Sampler::new(
            sources,
            config.exporter.services.clone(),
            config.host_reserve,
            metrics.process.clone(),
            Arc::clone(&store),
        )
        .with_pools(pools.clone(), simulated.clone())
        .with_degraded(Arc::clone(&degraded));
        // One sample before serving, so the first scrape and the first decision see real numbers.
        sampler.sample();
        if let Some(tier) = &tier {
            tier::size_and_warm(tier, &config, &store, &models, &pools);
        }
        let ready: Vec<&str> = pools.iter().filter(|p| p.is_ready()).map(|p| p.name()).collect();
        let policy = Arc::new(load_policy(&config, &models, &ready, &store.latest().snapshot)?);
        metrics.policy.show(&policy.status());
        registry.register_collector(Box::new(
            LiveCollector::new(Arc::clone(&store), pools.clone(), simulated.clone())
                .serving(Arc::clone(&degraded), Arc::clone(&activity)),
        ));
        let services = Arc::new(Services::new(&config, &models, &pools));
        let devices = config.devices.iter().map(|d| d.name.clone()).collect();
        registry.register_collector(Box::new(
            ServicesCollector::new(&config, devices, Arc::clone(&store)).serving(Arc::clone(&services) as _),
        ));
        let weights_beside = weights_beside(&pools, &models);
        Ok(Service {
            runtime_version,
            config,
            models,
            pools,
            simulated,
            metrics,
            registry,
            store,
            resample: Arc::new(tokio::sync::Notify::new()),
            sampler: Mutex::new(Some(sampler)),
            policy,
            policy_state: Mutex::new(None),
            clock,
            degraded,
            idempotency,
            host_promised,
            tier,
            decisions: Default::default(),
            activity,
            services,
            rooms: Rooms::default(),
            weights_beside,
            wake_limit: None,
        })
    }

    /// The weights that always stay loaded beside `model` on `pool`'s memory, whatever a
    /// request of it does (see [`weights_beside`]); `None` for a remote pool, whose memory is
    /// another server's.
    pub(crate) fn weights_beside(&self, pool: &Pool, model: &str) -> Option<u64> {
        memory_of(pool)?;
        Some(
            self.weights_beside
                .get(&(pool.name().to_string(), model.to_string()))
                .copied()
                .unwrap_or(0),
        )
    }

    /// The weights `pool` holds of `entry`'s model when it is loaded there: every worker
    /// builds its own sessions.
    pub fn weights_on(&self, pool: &Pool, entry: &ModelEntry) -> u64 {
        observe::weights_on(pool, entry)
    }

    /// The sampler, for the server to run in the background (taken once).
    pub fn take_sampler(&self) -> Option<Sampler> {
        self.sampler.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Ask the background sampler for a sample now and wait (up to a second) until it is
    /// published, so a change just made is visible to the next reader.
    pub async fn resample_now(&self) {
        self.resampler().now().await;
    }

    /// What [`Service::resample_now`] needs, to take a sample from a task of its own.
    pub fn resampler(&self) -> Resampler {
        Resampler {
            notify: Arc::clone(&self.resample),
            store: Arc::clone(&self.store),
        }
    }

    /// Bytes promised to host-pool runs that have not finished.
    pub fn host_committed(&self) -> u64 {
        self.host_promised.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Promise `bytes` of host memory to a run until the returned guard is dropped.
    pub fn promise_host_memory(&self, bytes: u64) -> HostPromise {
        self.host_promised.fetch_add(bytes, std::sync::atomic::Ordering::SeqCst);
        HostPromise {
            bytes,
            promised: Arc::clone(&self.host_promised),
        }
    }

    /// Count a request moved from `from` to `to`; moving work off an accelerator for memory
    /// (an out-of-memory retry, a policy redirect) also marks degraded mode. A driver retry
    /// does not: the breaker it opened is degraded mode's cause, and ends with it.
    pub fn failover(&self, from: &Pool, to: &Pool, reason: crate::serve::metrics::FailoverReason) {
        use crate::serve::metrics::FailoverLabels;
        self.metrics
            .failover
            .failovers
            .get_or_create(&FailoverLabels {
                from: from.name().to_string(),
                to: to.name().to_string(),
                reason,
            })
            .inc();
        if reason.moves_for_memory() {
            self.degraded.memory_redirect(from.name(), to.name());
        }
    }

    /// Look a simulated device up by name.
    pub fn simulated_device(&self, name: &str) -> Option<&Arc<SimulatedDevice>> {
        self.simulated.iter().find(|d| d.name == name)
    }

    /// Look a model up by name.
    pub fn model(&self, name: &str) -> Option<&ModelEntry> {
        self.models.iter().find(|m| m.config.name == name)
    }

    /// The model names, comma-separated, for messages that list what exists.
    pub fn model_names(&self) -> String {
        self.models
            .iter()
            .map(|m| m.config.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Look a pool up by name.
    pub fn pool(&self, name: &str) -> Option<&Arc<Pool>> {
        self.pools.iter().find(|p| p.name() == name)
    }

    /// True while every model can be served by some pool. An open breaker does not count
    /// against it: readiness feeds load balancers, and the CPU path still serves (degraded
    /// mode says the rest).
    pub fn ready(&self) -> bool {
        self.models
            .iter()
            .all(|m| self.pools.iter().any(|p| p.serves(&m.config.name) && p.is_ready()))
    }

    /// Stop every pool: queued work is answered at once, running work has until `deadline`
    /// (the server's one shutdown deadline) to finish. Blocking: run it off the async runtime.
    pub fn shutdown(&self, deadline: Instant) {
        for pool in &self.pools {
            pool.close();
        }
        for pool in &self.pools {
            if !pool.join_until(deadline) {
                tracing::warn!(pool = pool.name(), "workers still running at the shutdown deadline");
            }
        }
        // The process may exit with references to the pools still held (threads that wake on
        // their next tick): worker processes and their folders go now, not with the last one.
        for pool in &self.pools {
            pool.supervisor().close_worker();
        }
    }
}

/// The memory a pool's models are loaded in and its runs take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Memory<'a> {
    /// The host's (a CPU pool).
    Host,
    /// An accelerator device's, by name (a CUDA or simulated pool).
    Device(&'a str),
}

/// Where `pool`'s models live: `None` for a remote pool, whose memory is another server's.
pub(crate) fn memory_of(pool: &Pool) -> Option<Memory<'_>> {
    match pool.provider().kind() {
        ProviderKind::Remote => None,
        ProviderKind::Cpu => Some(Memory::Host),
        ProviderKind::Cuda | ProviderKind::Simulated => Some(Memory::Device(pool.config.device.as_str())),
    }
}

/// For every pool and each model it serves, the weights that always stay loaded beside it on
/// the pool's memory, whatever a request of it does: on the host every other model's (CPU pools
/// keep theirs); on an accelerator those `make_room` can never take for it, the pinned models'
/// and those of higher priority (and its own on the device's other pools). The weights of a
/// model it shares them with on its own pool are its own, not beside it.
fn weights_beside(pools: &[Arc<Pool>], models: &[ModelEntry]) -> HashMap<(String, String), u64> {
    let mut table = HashMap::new();
    for pool in pools {
        let Some(memory) = memory_of(pool) else { continue };
        for model in models.iter().filter(|m| pool.serves(&m.config.name)) {
            let mut beside = 0u64;
            // A group that shares weights on a pool holds them there once.
            let mut counted = std::collections::HashSet::new();
            for other in pools.iter().filter(|p| memory_of(p) == Some(memory)) {
                for entry in models.iter().filter(|m| other.serves(&m.config.name)) {
                    let own = entry.config.name == model.config.name;
                    let shared = pool
                        .residency()
                        .shares_sessions_of(&model.config.name, &entry.config.name);
                    if Arc::ptr_eq(other, pool) && (own || shared) {
                        continue;
                    }
                    let stays = match memory {
                        Memory::Host => true,
                        Memory::Device(_) => {
                            own || entry.config.residency == crate::config::Residency::Pinned
                                || entry.config.priority > model.config.priority
                        }
                    };
                    let name = entry.config.name.as_str();
                    let holder = other.residency().shares_weights_of(name).unwrap_or(name).to_string();
                    if stays && counted.insert((other.name().to_string(), holder)) {
                        beside = beside.saturating_add(observe::weights_on(other, entry));
                    }
                }
            }
            table.insert((pool.name().to_string(), model.config.name.clone()), beside);
        }
    }
    table
}
