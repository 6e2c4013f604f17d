//! The running service: ONNX Runtime, models with their signatures, pools and metrics, built
//! from a validated [`Config`] before any port is bound.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::registry::Registry;

use crate::clock::SystemClock;
use crate::config::{Config, ConfigError, DeviceKind, ModelConfig, PolicySource, Provider};
use crate::device::MemorySource;
use crate::device::host::HostSource;
use crate::device::nvml::NvmlSource;
use crate::device::simulated::{SimulatedDevice, SimulatedSource};
use crate::estimate::{self, MemoryProfile, ProfileSource};
use crate::exporter::{LiveCollector, Sampler, SnapshotStore};
use crate::metrics::{Metrics, PolicyInfoLabels, ResultLabels};
use crate::model;
use crate::onnx::{self, ModelSignature, OnnxRuntime, OrtBackend, RuntimeError, SessionOptions};
use crate::policy::{PolicyHandle, PolicySettings, StateView};
use crate::pool::{Backend, Pool, PoolContext, PoolLoad};
use crate::snapshot::Snapshot;

/// A model with the signature read from ONNX Runtime.
#[derive(Debug, Clone)]
pub struct ModelEntry {
    /// Its configuration.
    pub config: ModelConfig,
    /// Inputs and outputs.
    pub signature: ModelSignature,
    /// What its runs need, for request estimates.
    pub profile: MemoryProfile,
    /// The ONNX bytes, read once and shared by every pool's sessions.
    pub bytes: ModelBytes,
}

/// A model's serialized bytes (borrowed for builtin models); `Debug` shows only the size.
#[derive(Clone)]
pub struct ModelBytes(pub std::borrow::Cow<'static, [u8]>);

impl std::fmt::Debug for ModelBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ModelBytes({} bytes)", self.0.len())
    }
}

impl ModelEntry {
    /// Context length and batch of a request's inputs: the context axis' length (0 without
    /// one) and the first axis of the context input (or of the first input).
    pub fn shape_of(&self, inputs: &[crate::tensor::Tensor]) -> (u64, u64) {
        let dim = |name: &str, axis: usize| {
            inputs
                .iter()
                .find(|t| t.name == name)
                .and_then(|t| t.shape.get(axis))
                .map_or(0, |d| (*d).max(0) as u64)
        };
        match &self.config.context {
            Some(ctx) => {
                let batch = if ctx.axis == 0 { 1 } else { dim(&ctx.input, 0) };
                (dim(&ctx.input, ctx.axis), batch.max(1))
            }
            None => {
                let first = self.signature.inputs.first().map(|s| s.name.as_str()).unwrap_or("");
                (0, dim(first, 0).max(1))
            }
        }
    }

    /// The estimate for a request's inputs.
    pub fn estimate(&self, inputs: &[crate::tensor::Tensor]) -> crate::snapshot::Estimate {
        let (tokens, batch) = self.shape_of(inputs);
        self.profile.estimate(tokens, batch)
    }
}

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

/// Everything the HTTP layer serves from.
pub struct Engine {
    /// The configuration it was built from.
    pub config: Config,
    /// ONNX Runtime version.
    pub onnxruntime_version: String,
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
    /// The policy's cached view of the latest sample and the pools' live load.
    policy_state: Mutex<Option<PolicyState>>,
}

/// A cached policy view and what it was built from.
struct PolicyState {
    generation: u64,
    loads: Vec<[u64; 5]>,
    /// The sample's view as sampled (devices, host, processes are shared from it).
    base: StateView,
    /// `base` with the pools' live load.
    view: StateView,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("pools", &self.pools)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Load ONNX Runtime, every model and every pool. A pool whose provider cannot start (no
    /// NVIDIA driver, no CUDA provider library) is kept as *unavailable* with the reason.
    pub fn start(config: Config) -> Result<Engine, StartError> {
        let rt = onnx::runtime(config.onnxruntime_library.as_deref())?;
        let models = load_models(rt, &config)?;
        let (metrics, mut registry) = Metrics::new(&rt.version);
        let metrics = Arc::new(metrics);
        let mut simulated = Vec::new();
        for device in &config.devices {
            if let DeviceKind::Simulated { capacity } = device.kind {
                let opened =
                    SimulatedDevice::open(rt, &device.name, capacity).map_err(|message| ConfigError::Invalid {
                        file: config.source.clone(),
                        key: format!("devices.{}", device.name),
                        message,
                    })?;
                tracing::info!(device = %device.name, capacity, "SIMULATED accelerator ready");
                simulated.push(Arc::new(opened));
            }
        }
        let mut pools = Vec::new();
        for pool_config in &config.pools {
            let context = PoolContext {
                clock: Arc::new(SystemClock),
                metrics: metrics.pool_metrics(&pool_config.name, &pool_config.device),
            };
            pools.push(start_pool(rt, &config, &models, pool_config, context)?);
        }
        let store = Arc::new(SnapshotStore::default());
        let mut sources = device_sources(&config);
        sources.extend(
            simulated
                .iter()
                .map(|d| Box::new(SimulatedSource::new(Arc::clone(d))) as Box<dyn MemorySource>),
        );
        let mut sampler = Sampler::new(
            sources,
            config.exporter.services.clone(),
            config.host_reserve,
            Arc::clone(&metrics),
            Arc::clone(&store),
        )
        .with_pools(pools.clone(), simulated.clone());
        // One sample before serving, so the first scrape and the first decision see real numbers.
        sampler.sample();
        let ready: Vec<&str> = pools.iter().filter(|p| p.is_ready()).map(|p| p.name()).collect();
        let policy = Arc::new(load_policy(&config, &models, &ready, &store.latest().snapshot)?);
        let status = policy.status();
        metrics
            .policy_info
            .get_or_create(&PolicyInfoLabels {
                path: status.origin,
                sha256: status.sha256,
            })
            .set(1);
        registry.register_collector(Box::new(LiveCollector::new(
            Arc::clone(&store),
            pools.clone(),
            simulated.clone(),
        )));
        Ok(Engine {
            onnxruntime_version: rt.version.clone(),
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
        })
    }

    /// The policy's view of the world: the latest sample with every pool's live queue, in-flight
    /// count, recent failures and delay estimate. Converting a snapshot for the script is most
    /// of an evaluation's cost, so the view is cached: a new sample rebuilds it, a pool's load
    /// moving rebuilds only its pools.
    pub fn policy_view(&self) -> StateView {
        let sample = self.store.latest();
        let live: Vec<(PoolLoad, u64)> = self
            .pools
            .iter()
            .map(|p| (p.load(), p.alloc_failures_recent()))
            .collect();
        // Ages and delays are quantised so a waiting request does not force a rebuild on every
        // decision while nothing else moves.
        let loads: Vec<[u64; 5]> = live
            .iter()
            .map(|(load, failures)| {
                [
                    load.queue_depth as u64,
                    load.inflight as u64,
                    load.oldest_age.as_millis() as u64 / 100,
                    *failures,
                    load.estimated_delay.as_millis() as u64 / 10,
                ]
            })
            .collect();
        let mut cached = self.policy_state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(state) = cached.as_ref()
            && state.generation == sample.generation
            && state.loads == loads
        {
            return state.view.clone();
        }
        let mut pools = sample.snapshot.pools.clone();
        for (pool, (load, failures)) in self.pools.iter().zip(&live) {
            if let Some(state) = pools.get_mut(pool.name()) {
                state.queue_depth = load.queue_depth as u64;
                state.inflight = load.inflight as u64;
                state.queue_oldest_age_ms = load.oldest_age.as_millis() as u64;
                state.alloc_failures_recent = *failures;
                state.est_delay_ms = load.estimated_delay.as_millis() as u64;
            }
        }
        let base = match cached.take() {
            Some(state) if state.generation == sample.generation => state.base,
            _ => StateView::new(&sample.snapshot),
        };
        let view = base.with_pools(&pools);
        *cached = Some(PolicyState {
            generation: sample.generation,
            loads,
            base,
            view: view.clone(),
        });
        view
    }

    /// Reload the policy (admin endpoint, file watcher) and account for it in the metrics.
    pub fn reload_policy(&self) -> Result<crate::policy::PolicyStatus, String> {
        let result = self.policy.reload();
        let label = if result.is_ok() { "ok" } else { "error" };
        self.metrics
            .policy_reloads
            .get_or_create(&ResultLabels { result: label.into() })
            .inc();
        match result {
            Ok(_) => {
                let status = self.policy.status();
                self.metrics.policy_info.clear();
                self.metrics
                    .policy_info
                    .get_or_create(&PolicyInfoLabels {
                        path: status.origin.clone(),
                        sha256: status.sha256.clone(),
                    })
                    .set(1);
                Ok(status)
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// The sampler, for the server to run in the background (taken once).
    pub fn take_sampler(&self) -> Option<Sampler> {
        self.sampler.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Ask the background sampler for a sample now and wait (up to a second) until it is
    /// published, so a change just made is visible to the next reader.
    pub async fn resample_now(&self) {
        let before = self.store.latest().generation;
        self.resample.notify_one();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        while self.store.latest().generation == before && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(2)).await;
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

    /// Look a pool up by name.
    pub fn pool(&self, name: &str) -> Option<&Arc<Pool>> {
        self.pools.iter().find(|p| p.name() == name)
    }

    /// True when some pool can take work.
    pub fn ready(&self) -> bool {
        self.pools.iter().any(|p| p.is_ready())
    }

    /// Stop every pool: queued work is answered, running work gets `grace` to finish.
    pub fn shutdown(&self, grace: Duration) {
        for pool in &self.pools {
            if !pool.shutdown(grace) {
                tracing::warn!(pool = pool.name(), "workers still running after the grace period");
            }
        }
    }
}

/// The host source, plus NVML when an NVIDIA driver answers. Without one, NVML is reported
/// absent once here, not as an error on every sample.
pub fn device_sources(config: &Config) -> Vec<Box<dyn MemorySource>> {
    let mut sources: Vec<Box<dyn MemorySource>> = vec![Box::new(HostSource)];
    let names: HashMap<u32, String> = config
        .devices
        .iter()
        .filter_map(|d| match d.kind {
            DeviceKind::Nvidia { index } => Some((index, d.name.clone())),
            DeviceKind::Simulated { .. } => None,
        })
        .collect();
    match NvmlSource::open(names) {
        Ok(source) => sources.push(Box::new(source)),
        Err(reason) => tracing::info!(%reason, "no NVIDIA devices will be reported"),
    }
    sources
}

/// Load the configured policy (a file, or a builtin one from the binary), then try it once per
/// model and ready pool on the first snapshot: a script that fails on this config's params is
/// refused before any port is bound.
fn load_policy(
    config: &Config,
    models: &[ModelEntry],
    ready_pools: &[&str],
    snapshot: &Snapshot,
) -> Result<PolicyHandle, StartError> {
    let mut params = match &config.policy.source {
        PolicySource::Builtin(name) => crate::policy::builtin::default_params(name),
        PolicySource::File(_) => crate::policy::Params::new(),
    };
    params.extend(config.policy.params.clone());
    let settings = PolicySettings {
        fallback: config.policy.fallback.clone(),
        params,
    };
    let handle =
        PolicyHandle::load(config.policy.source.clone(), settings).map_err(|e| StartError::Policy(e.to_string()))?;
    // Pools that could not start (no CUDA here) never reach the policy; they are not tried.
    let requests = crate::policy::smoke_requests(
        config,
        |pool| ready_pools.contains(&pool.name.as_str()),
        |model, tokens| {
            let entry = models.iter().find(|m| m.config.name == model.name);
            entry.map(|m| m.profile.estimate(tokens, 1)).unwrap_or_default()
        },
    );
    crate::policy::smoke_test(&handle.current().script, &requests, snapshot).map_err(|e| {
        StartError::Policy(format!(
            "{}: policy `{}` fails with this config (check policy.params): {e}",
            config.source,
            handle.origin()
        ))
    })?;
    tracing::info!(policy = %handle.origin(), sha256 = %handle.status().sha256, "policy loaded");
    Ok(handle)
}

fn load_models(rt: &OnnxRuntime, config: &Config) -> Result<Vec<ModelEntry>, ConfigError> {
    let invalid = |key: String, message: String| ConfigError::Invalid {
        file: config.source.clone(),
        key,
        message,
    };
    let probe_options = SessionOptions {
        provider: Provider::Cpu,
        device_index: 0,
        intra_threads: 1,
        arena_shrinkage: false,
    };
    let mut entries = Vec::new();
    for (i, m) in config.models.iter().enumerate() {
        let bytes = model::load_bytes(&m.source).map_err(|e| invalid(format!("models[{i}].path"), e))?;
        // A CPU session reads the signature even when every accelerator pool is unavailable.
        let mut session = onnx::build_session(rt, &bytes, &probe_options).map_err(|e| {
            invalid(
                format!("models[{i}].path"),
                format!("ONNX Runtime cannot load `{}`: {e}", m.source),
            )
        })?;
        let signature = onnx::signature(&session).map_err(|e| {
            invalid(
                format!("models[{i}].path"),
                format!("`{}` cannot be served: {e}", m.source),
            )
        })?;
        if let Some(ctx) = &m.context {
            let input = signature.inputs.iter().find(|s| s.name == ctx.input).ok_or_else(|| {
                invalid(
                    format!("models[{i}].context.input"),
                    format!(
                        "model `{}` has no input `{}`; its inputs are: {}",
                        m.name,
                        ctx.input,
                        signature
                            .inputs
                            .iter()
                            .map(|s| s.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
            })?;
            if ctx.axis >= input.shape.len() {
                return Err(invalid(
                    format!("models[{i}].context.axis"),
                    format!(
                        "input `{}` has rank {}, so axis {} does not exist",
                        ctx.input,
                        input.shape.len(),
                        ctx.axis
                    ),
                ));
            }
            if input.shape[ctx.axis] != -1 {
                return Err(invalid(
                    format!("models[{i}].context.axis"),
                    format!(
                        "axis {} of `{}` is fixed at {}; a context axis must be dynamic",
                        ctx.axis, ctx.input, input.shape[ctx.axis]
                    ),
                ));
            }
        }
        let profile = match &m.profile {
            Some(p) => MemoryProfile {
                weights_bytes: p.weights_bytes.unwrap_or(bytes.len() as u64),
                workspace_bytes: p.workspace_bytes as f64,
                per_token_bytes: p.per_token_bytes,
                per_token_squared_bytes: p.per_token_squared_bytes,
                source: ProfileSource::Config,
            },
            None => {
                let info = ort::memory::MemoryInfo::new(
                    ort::memory::AllocationDevice::CPU,
                    0,
                    ort::memory::AllocatorType::Arena,
                    ort::memory::MemoryType::Default,
                );
                match info.and_then(|info| ort::memory::Allocator::new(&session, info)) {
                    Ok(allocator) => estimate::measure(
                        &mut session,
                        &allocator,
                        &signature,
                        m.context.as_ref(),
                        bytes.len() as u64,
                    ),
                    Err(e) => MemoryProfile {
                        weights_bytes: bytes.len() as u64,
                        workspace_bytes: 0.0,
                        per_token_bytes: 0.0,
                        per_token_squared_bytes: 0.0,
                        source: ProfileSource::Unmeasured { reason: e.to_string() },
                    },
                }
            }
        };
        match &profile.source {
            ProfileSource::Unmeasured { reason } => tracing::warn!(
                model = %m.name,
                %reason,
                "memory profile not measured; estimates count weights only (set models[].memory_profile)"
            ),
            _ => tracing::info!(
                model = %m.name,
                weights_bytes = profile.weights_bytes,
                workspace_bytes = profile.workspace_bytes,
                per_token_bytes = profile.per_token_bytes,
                per_token_squared_bytes = profile.per_token_squared_bytes,
                "memory profile"
            ),
        }
        entries.push(ModelEntry {
            config: m.clone(),
            signature,
            profile,
            bytes: ModelBytes(bytes),
        });
    }
    Ok(entries)
}

fn start_pool(
    rt: &OnnxRuntime,
    config: &Config,
    models: &[ModelEntry],
    pool: &crate::config::PoolConfig,
    context: PoolContext,
) -> Result<Arc<Pool>, StartError> {
    let device_kind = config.devices.iter().find(|d| d.name == pool.device).map(|d| d.kind);
    let kind_label = device_kind.map(|k| k.label()).unwrap_or("host");
    let mut device_index = 0;
    if let (Provider::Cuda(_), Some(DeviceKind::Nvidia { index })) = (&pool.provider, device_kind) {
        device_index = index;
        let missing = match crate::device::nvidia_device_count() {
            Ok(n) if index < n => None,
            Ok(n) => Some(format!("NVIDIA device {index} does not exist (NVML sees {n})")),
            Err(reason) => Some(reason),
        };
        if let Some(reason) = missing {
            tracing::error!(pool = %pool.name, %reason, "pool unavailable");
            return Ok(Pool::unavailable(pool.clone(), kind_label, reason, context));
        }
    }
    let borrowed: Vec<(String, &[u8])> = models
        .iter()
        .filter(|m| pool.models.contains(&m.config.name))
        .map(|m| (m.config.name.clone(), m.bytes.0.as_ref()))
        .collect();
    let options = SessionOptions {
        provider: pool.provider.clone(),
        device_index,
        intra_threads: pool.intra_threads,
        arena_shrinkage: pool.arena_shrinkage,
    };
    let mut backends: Vec<Box<dyn Backend>> = Vec::new();
    for _ in 0..pool.workers {
        match OrtBackend::load(rt, &borrowed, &options) {
            Ok(b) => backends.push(Box::new(b)),
            Err(reason) => {
                // Never fall back to the CPU silently: the pool is unavailable and says why.
                tracing::error!(pool = %pool.name, provider = pool.provider.label(), %reason, "pool unavailable");
                return Ok(Pool::unavailable(pool.clone(), kind_label, reason, context));
            }
        }
    }
    tracing::info!(
        pool = %pool.name,
        provider = pool.provider.label(),
        device = %pool.device,
        simulated = kind_label == "simulated",
        workers = pool.workers,
        "pool ready"
    );
    Ok(Pool::start(pool.clone(), kind_label, backends, context))
}
