//! The running service, assembled from its [`Parts`] before any port is bound: models with their
//! signatures and memory profiles, pools with their workers, metrics, the memory sampler and the
//! admission policy. Production parts come from ONNX Runtime and the machine
//! ([`Parts::onnxruntime`]); tests pass a fake [`BackendFactory`], no memory sources and a clock
//! they control, so the whole request lifecycle runs without ONNX Runtime.

mod onnxruntime;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::registry::Registry;

use crate::config::{Config, ConfigError, DeviceKind, ModelConfig, PoolConfig, Provider};
use crate::core::backend::Backend;
use crate::core::clock::{Clock, SystemClock};
use crate::core::snapshot::{DeviceClass, Snapshot};
use crate::device::MemorySource;
use crate::device::simulated::{SimulatedDevice, SimulatedSource};
use crate::policy::{PolicyHandle, StateView};
use crate::pool::activity::Activity;
use crate::pool::degraded::Degraded;
use crate::pool::{Pool, PoolContext, Respawn};
use crate::runtime::estimate::{MemoryProfile, ProfileSource};
use crate::runtime::onnx::{ModelSignature, RuntimeError};
use crate::serve::idempotency::{IdempotencyCache, StoredResponse};
use crate::serve::remote::RemoteBackend;
use crate::telemetry::exporter::{LiveCollector, Sampler, SnapshotStore};
use crate::telemetry::metrics::{Metrics, PolicyInfoLabels, ReloadResult, ResultLabels};

pub use onnxruntime::OrtFactory;

/// Builds what runs models: the seam between the service and ONNX Runtime.
pub trait BackendFactory: Send + Sync {
    /// The runtime's version, for `/v2` and `vramguard_build_info`.
    fn runtime_version(&self) -> String;
    /// Read a model's inputs and outputs.
    fn signature(&self, model: &ModelConfig, bytes: &[u8]) -> Result<ModelSignature, String>;
    /// Measure what the model's runs need (called only when the config gives no profile).
    fn measure_profile(&self, model: &ModelConfig, bytes: &[u8], signature: &ModelSignature) -> MemoryProfile;
    /// Build one worker's backend for `pool`, holding `models` (name and bytes). An error makes
    /// the pool unavailable with that reason; it never falls back to another provider.
    fn backend(&self, pool: &PoolConfig, models: &[(String, &[u8])]) -> Result<Box<dyn Backend>, String>;
}

/// What a service is assembled from.
pub struct Parts {
    /// Builds backends and reads model signatures.
    pub backends: Arc<dyn BackendFactory>,
    /// Memory sources the sampler reads (host, NVML, simulated devices).
    pub sources: Vec<Box<dyn MemorySource>>,
    /// Simulated devices (their arenas back the `simulated` pools).
    pub simulated: Vec<Arc<SimulatedDevice>>,
    /// Time source for queue stamps and ages.
    pub clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for Parts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parts")
            .field("sources", &self.sources.iter().map(|s| s.label()).collect::<Vec<_>>())
            .field("simulated", &self.simulated)
            .finish_non_exhaustive()
    }
}

impl Parts {
    /// Production parts: ONNX Runtime (loaded from the configured library), the simulated
    /// devices the config declares, the host and NVML memory sources, the system clock.
    pub fn onnxruntime(config: &Config) -> Result<Parts, StartError> {
        let rt = crate::runtime::onnx::runtime(config.onnxruntime_library.as_deref())?;
        let mut simulated = Vec::new();
        for device in &config.devices {
            if let DeviceKind::Simulated { capacity } = device.kind {
                let opened =
                    SimulatedDevice::open(rt, &device.name, capacity).map_err(|message| ConfigError::Invalid {
                        file: config.source.clone(),
                        key: format!("devices.{}", device.name),
                        message,
                    })?;
                tracing::info!(device = %device.name, capacity = %crate::telemetry::logging::human_bytes(capacity), "SIMULATED accelerator ready");
                simulated.push(Arc::new(opened));
            }
        }
        let mut sources = crate::device::sources(config);
        sources.extend(
            simulated
                .iter()
                .map(|d| Box::new(SimulatedSource::new(Arc::clone(d))) as Box<dyn MemorySource>),
        );
        Ok(Parts {
            backends: Arc::new(OrtFactory::new(rt, config, simulated.clone())),
            sources,
            simulated,
            clock: Arc::new(SystemClock),
        })
    }
}

/// A model with its signature and memory profile.
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
    /// Its KV-cache layout, when it is a decoder with past key values.
    pub decoder: Option<crate::runtime::decoder::DecoderLayout>,
    /// Its tokenizer, when it is a decoder that serves text generation.
    pub tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    /// Its chat template, when it serves `/v1/chat/completions`.
    pub chat: Option<Arc<crate::runtime::chat::ChatTemplate>>,
}

/// A model's serialized bytes (borrowed for builtin models), shared by every pool's workers and
/// kept for rebuilding a worker's backend; `Debug` shows only the size.
#[derive(Clone)]
pub struct ModelBytes(Arc<std::borrow::Cow<'static, [u8]>>);

impl ModelBytes {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for ModelBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ModelBytes({} bytes)", self.0.len())
    }
}

impl ModelEntry {
    /// Context length and batch of a request's inputs: the context axis' length (0 without
    /// one) and the first axis of the context input (or of the first input).
    pub fn shape_of(&self, inputs: &[crate::core::tensor::Tensor]) -> (u64, u64) {
        let dim = |name: &str, axis: usize| {
            inputs
                .iter()
                .find(|t| t.name == name)
                .and_then(|t| t.shape.get(axis))
                .map_or(0, |d| (*d).max(0) as u64)
        };
        if self.decoder.is_some() {
            // The cache holds every position the attention mask covers: past and new tokens.
            return (dim("attention_mask", 1), dim("input_ids", 0).max(1));
        }
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
    pub fn estimate(&self, inputs: &[crate::core::tensor::Tensor]) -> crate::core::snapshot::Estimate {
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
    /// The policy's last decisions, for `/status`.
    pub decisions: crate::policy::recent::RecentDecisions,
    /// Requests accepted and not answered, waiting or running.
    pub activity: Arc<Activity>,
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

/// The policy's view of one sample: built once per sample, shared by every evaluation.
struct PolicyState {
    generation: u64,
    view: Arc<StateView>,
}

/// The pools' load as the policy reads it, live, when a script reads `state.pools[name]`.
#[derive(Debug)]
struct PoolsNow(Vec<Arc<Pool>>);

impl crate::policy::LiveLoad for PoolsNow {
    fn pool_load(&self, name: &str) -> Option<crate::policy::PoolLoadNow> {
        let pool = self.0.iter().find(|p| p.name() == name)?;
        let load = pool.load();
        let sequences = pool.sequences.now();
        Some(crate::policy::PoolLoadNow {
            queue_depth: load.queue_depth as u64,
            queue_oldest_age_ms: load.oldest_age.as_millis() as u64,
            inflight: load.inflight as u64,
            alloc_failures_recent: pool.alloc_failures_recent(),
            est_delay_ms: load.estimated_delay.as_millis() as u64,
            breaker: pool.breaker_view(),
            sequences_waiting: sequences.waiting,
            sequences_running: sequences.running,
            kv_cache_bytes: sequences.kv_bytes,
        })
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
    pub fn start(config: Config) -> Result<Service, StartError> {
        let parts = Parts::onnxruntime(&config)?;
        Service::assemble(config, parts)
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
        let mut pools = Vec::new();
        for pool_config in &config.pools {
            let context = PoolContext {
                clock: Arc::clone(&clock),
                metrics: metrics.pool_metrics(&pool_config.name, &pool_config.device),
            };
            pools.push(start_pool(&backends, &config, &models, pool_config, context, &metrics));
        }
        let degraded = Arc::new(Degraded::new(pools.clone(), Arc::clone(&clock)));
        let activity = Arc::new(Activity::default());
        let idempotency = IdempotencyCache::new(config.server.idempotency.max_entries, config.server.idempotency.ttl);
        idempotency.metrics().register(&mut registry);
        let store = Arc::new(SnapshotStore::default());
        let mut sampler = Sampler::new(
            sources,
            config.exporter.services.clone(),
            config.host_reserve,
            Arc::clone(&metrics),
            Arc::clone(&store),
        )
        .with_pools(pools.clone(), simulated.clone())
        .with_degraded(Arc::clone(&degraded));
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
        registry.register_collector(Box::new(
            LiveCollector::new(Arc::clone(&store), pools.clone(), simulated.clone())
                .serving(Arc::clone(&degraded), Arc::clone(&activity)),
        ));
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
            host_promised: Arc::default(),
            decisions: Default::default(),
            activity,
        })
    }

    /// The policy's view of the world: the latest sample, converted for the script once per
    /// sample, whose pools read their queue, in-flight count, recent failures and delay
    /// estimate live when the script looks at them.
    pub fn policy_view(&self) -> Arc<StateView> {
        let sample = self.store.latest();
        let mut cached = self.policy_state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(state) = cached.as_ref()
            && state.generation == sample.generation
        {
            return Arc::clone(&state.view);
        }
        let live: Arc<dyn crate::policy::LiveLoad> = Arc::new(PoolsNow(self.pools.clone()));
        let view = Arc::new(StateView::new(&sample.snapshot).with_live_load(live));
        *cached = Some(PolicyState {
            generation: sample.generation,
            view: Arc::clone(&view),
        });
        view
    }

    /// Reload the policy (admin endpoint, file watcher) and account for it in the metrics.
    pub fn reload_policy(&self) -> Result<crate::policy::PolicyStatus, String> {
        let result = self.policy.reload();
        let label = if result.is_ok() {
            ReloadResult::ok
        } else {
            ReloadResult::error
        };
        self.metrics
            .policy_reloads
            .get_or_create(&ResultLabels { result: label })
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
    /// (a retry after an allocator failure, a policy redirect) also marks degraded mode.
    pub fn failover(&self, from: &Pool, to: &Pool, reason: crate::telemetry::metrics::FailoverReason) {
        use crate::telemetry::metrics::{FailoverLabels, FailoverReason};
        self.metrics
            .failovers
            .get_or_create(&FailoverLabels {
                from: from.name().to_string(),
                to: to.name().to_string(),
                reason,
            })
            .inc();
        if matches!(
            reason,
            FailoverReason::oom_retry | FailoverReason::driver_retry | FailoverReason::policy_redirect
        ) {
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
    }
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
    let handle = PolicyHandle::load(config.policy.source.clone(), crate::policy::settings_for(config))
        .map_err(|e| StartError::Policy(e.to_string()))?;
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

fn load_models(backends: &dyn BackendFactory, config: &Config) -> Result<Vec<ModelEntry>, ConfigError> {
    let invalid = |key: String, message: String| ConfigError::Invalid {
        file: config.source.clone(),
        key,
        message,
    };
    let mut entries = Vec::new();
    for (i, m) in config.models.iter().enumerate() {
        let bytes = crate::core::model::load_bytes(&m.source).map_err(|e| invalid(format!("models[{i}].path"), e))?;
        let signature = backends.signature(m, &bytes).map_err(|e| {
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
                        signature.input_names()
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
        let decoder = crate::runtime::decoder::DecoderLayout::detect(&signature)
            .transpose()
            .map_err(|e| invalid(format!("models[{i}].path"), format!("`{}`: {e}", m.source)))?;
        if decoder.is_some() && m.context.is_some() {
            return Err(invalid(
                format!("models[{i}].context"),
                "a decoder's context is its attention mask, read from the graph; remove `context`".to_string(),
            ));
        }
        let profile = match (&m.profile, decoder) {
            (None, Some(layout)) => MemoryProfile {
                weights_bytes: bytes.len() as u64,
                workspace_bytes: 0.0,
                // The cache for every position, and the logits of a prompt's positions.
                per_token_bytes: (layout.kv_bytes_per_token() + layout.logits_bytes_per_token()) as f64,
                per_token_squared_bytes: 0.0,
                source: ProfileSource::KvCache {
                    layers: layout.layers,
                    kv_heads: layout.kv_heads,
                    head_size: layout.head_size,
                    kv_bytes_per_token: layout.kv_bytes_per_token(),
                },
            },
            _ => match &m.profile {
                Some(p) => MemoryProfile {
                    weights_bytes: p.weights_bytes.unwrap_or(bytes.len() as u64),
                    workspace_bytes: p.workspace_bytes as f64,
                    per_token_bytes: p.per_token_bytes,
                    per_token_squared_bytes: p.per_token_squared_bytes,
                    source: ProfileSource::Config,
                },
                None => backends.measure_profile(m, &bytes, &signature),
            },
        };
        match &profile.source {
            ProfileSource::Unmeasured { reason } => tracing::warn!(
                model = %m.name,
                %reason,
                "memory profile not measured; estimates count weights only (set models[].memory_profile)"
            ),
            _ => tracing::info!(
                model = %m.name,
                weights = %crate::telemetry::logging::human_bytes(profile.weights_bytes),
                workspace = %crate::telemetry::logging::human_bytes(profile.workspace_bytes.round() as u64),
                per_token_bytes = format_args!("{:.1}", profile.per_token_bytes),
                per_token_squared_bytes = format_args!("{:.1}", profile.per_token_squared_bytes),
                "memory profile"
            ),
        }
        let tokenizer = match (&m.tokenizer, decoder) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(invalid(
                    format!("models[{i}].tokenizer"),
                    format!(
                        "`{}` is not a decoder with past key values (inputs `input_ids`, `attention_mask`, `past_key_values.N.key/value`), so it cannot generate text",
                        m.source
                    ),
                ));
            }
            (Some(path), Some(_)) => Some(Arc::new(tokenizers::Tokenizer::from_file(path).map_err(|e| {
                invalid(
                    format!("models[{i}].tokenizer"),
                    format!("cannot read `{}`: {e}", path.display()),
                )
            })?)),
        };
        let chat = chat_template(m).map_err(|e| invalid(format!("models[{i}].chat_template"), e))?;
        entries.push(ModelEntry {
            config: m.clone(),
            signature,
            profile,
            bytes: ModelBytes(Arc::new(bytes)),
            decoder,
            tokenizer,
            chat,
        });
    }
    Ok(entries)
}

/// The chat template of model `m`: the configured one, else the `chat_template` of the
/// `tokenizer_config.json` beside its tokenizer (how Hugging Face ships models), else none.
fn chat_template(m: &ModelConfig) -> Result<Option<Arc<crate::runtime::chat::ChatTemplate>>, String> {
    use crate::runtime::chat::ChatTemplate;
    let Some(tokenizer) = &m.tokenizer else {
        return Ok(None);
    };
    let template = match &m.chat_template {
        Some(source) => Some(ChatTemplate::load(source)?),
        None => {
            let beside = tokenizer.with_file_name("tokenizer_config.json");
            match std::fs::read_to_string(&beside) {
                Ok(text) => ChatTemplate::from_tokenizer_config(&text, &beside.display().to_string())?,
                Err(_) => None,
            }
        }
    };
    if let Some(t) = &template {
        tracing::info!(model = %m.name, template = %t.origin, "chat template");
    }
    Ok(template.map(Arc::new))
}

/// Start `pool` with one backend per worker. The same factory rebuilds a worker's backend after
/// a panic, from the same model bytes.
fn start_pool(
    backends: &Arc<dyn BackendFactory>,
    config: &Config,
    models: &[ModelEntry],
    pool: &PoolConfig,
    context: PoolContext,
    metrics: &Metrics,
) -> Arc<Pool> {
    let device_kind = config.pool_class(pool);
    let build: Respawn = match &pool.provider {
        // Its workers forward to the remote server: no sessions, no model bytes.
        Provider::Remote(options) => {
            let options = options.clone();
            let metrics = metrics.remote_metrics(&pool.name);
            let max_response_bytes = config.server.max_response_bytes;
            Arc::new(move || {
                RemoteBackend::new(options.clone(), metrics.clone(), max_response_bytes)
                    .map(|b| Box::new(b) as Box<dyn Backend>)
            })
        }
        _ => {
            let owned: Vec<(String, ModelBytes)> = models
                .iter()
                .filter(|m| pool.models.contains(&m.config.name))
                .map(|m| (m.config.name.clone(), m.bytes.clone()))
                .collect();
            let backends = Arc::clone(backends);
            let pool = pool.clone();
            Arc::new(move || {
                let borrowed: Vec<(String, &[u8])> = owned.iter().map(|(n, b)| (n.clone(), b.as_slice())).collect();
                backends.backend(&pool, &borrowed)
            })
        }
    };
    let mut workers: Vec<Box<dyn Backend>> = Vec::new();
    for _ in 0..pool.workers {
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
    Pool::start(pool.clone(), device_kind, workers, Some(build), context)
}
