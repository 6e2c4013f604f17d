//! The running service: ONNX Runtime, models with their signatures, pools and metrics, built
//! from a validated [`Config`] before any port is bound.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;

use crate::config::{Config, ConfigError, DeviceKind, ModelConfig, Provider};
use crate::metrics::{Metrics, PoolDeviceLabels, PoolLabels};
use crate::model;
use crate::onnx::{self, ModelSignature, OnnxRuntime, OrtBackend, RuntimeError, SessionOptions};
use crate::pool::{Backend, Pool};

/// A model with the signature read from ONNX Runtime.
#[derive(Debug, Clone)]
pub struct ModelEntry {
    /// Its configuration.
    pub config: ModelConfig,
    /// Inputs and outputs.
    pub signature: ModelSignature,
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
    /// Metric handles.
    pub metrics: Metrics,
    /// The registry they are registered in.
    pub registry: Registry,
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
        let mut pools = Vec::new();
        for pool_config in &config.pools {
            pools.push(start_pool(rt, &config, &models, pool_config)?);
        }
        let (metrics, registry) = Metrics::new(&rt.version);
        Ok(Engine {
            onnxruntime_version: rt.version.clone(),
            config,
            models,
            pools,
            metrics,
            registry,
        })
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

    /// Refresh the gauges that are read from live state, just before a scrape.
    pub fn refresh_gauges(&self) {
        for pool in &self.pools {
            let labels = PoolLabels {
                pool: pool.name().to_string(),
            };
            let load = pool.load();
            self.metrics
                .queue_depth
                .get_or_create(&labels)
                .set(load.queue_depth as i64);
            self.metrics
                .queue_oldest_age
                .get_or_create(&labels)
                .set(load.oldest_age.as_secs_f64());
            self.metrics.inflight.get_or_create(&labels).set(load.inflight as i64);
            if let Some(stats) = pool.arena_stats() {
                let labels = PoolDeviceLabels {
                    pool: pool.name().to_string(),
                    device: pool.config.device.clone(),
                };
                let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
                self.metrics
                    .allocator_reserved
                    .get_or_create(&labels)
                    .set(gauge(stats.reserved_bytes));
                self.metrics
                    .allocator_active
                    .get_or_create(&labels)
                    .set(gauge(stats.active_bytes));
                self.metrics
                    .allocator_peak_active
                    .get_or_create(&labels)
                    .set(gauge(stats.peak_active_bytes));
            }
        }
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
    };
    let mut entries = Vec::new();
    for (i, m) in config.models.iter().enumerate() {
        let bytes = model::load_bytes(&m.source).map_err(|e| invalid(format!("models[{i}].path"), e))?;
        // A CPU session reads the signature even when every accelerator pool is unavailable.
        let session = onnx::build_session(rt, &bytes, &probe_options).map_err(|e| {
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
        entries.push(ModelEntry {
            config: m.clone(),
            signature,
        });
    }
    Ok(entries)
}

fn start_pool(
    rt: &OnnxRuntime,
    config: &Config,
    models: &[ModelEntry],
    pool: &crate::config::PoolConfig,
) -> Result<Arc<Pool>, StartError> {
    let device_kind = config.devices.iter().find(|d| d.name == pool.device).map(|d| d.kind);
    let kind_label = device_kind.map(|k| k.label()).unwrap_or("host");
    let mut device_index = 0;
    match (&pool.provider, device_kind) {
        (Provider::Simulated, Some(DeviceKind::Simulated { capacity })) => rt.ensure_simulated_arena(capacity)?,
        (Provider::Cuda(_), Some(DeviceKind::Nvidia { index })) => {
            device_index = index;
            match crate::device::nvidia_device_count() {
                Ok(n) if index < n => {}
                Ok(n) => {
                    let reason = format!("NVIDIA device {index} does not exist (NVML sees {n})");
                    tracing::error!(pool = %pool.name, %reason, "pool unavailable");
                    return Ok(Pool::unavailable(pool.clone(), kind_label, reason));
                }
                Err(reason) => {
                    tracing::error!(pool = %pool.name, %reason, "pool unavailable");
                    return Ok(Pool::unavailable(pool.clone(), kind_label, reason));
                }
            }
        }
        _ => {}
    }
    let sources: Vec<(String, std::borrow::Cow<'static, [u8]>)> = models
        .iter()
        .filter(|m| pool.models.contains(&m.config.name))
        .map(|m| {
            model::load_bytes(&m.config.source)
                .map(|b| (m.config.name.clone(), b))
                .map_err(|e| ConfigError::Invalid {
                    file: config.source.clone(),
                    key: format!("pools.{}.models", pool.name),
                    message: e,
                })
        })
        .collect::<Result<_, _>>()?;
    let borrowed: Vec<(String, &[u8])> = sources.iter().map(|(n, b)| (n.clone(), b.as_ref())).collect();
    let options = SessionOptions {
        provider: pool.provider.clone(),
        device_index,
        intra_threads: pool.intra_threads,
    };
    let mut backends: Vec<Box<dyn Backend>> = Vec::new();
    for _ in 0..pool.workers {
        match OrtBackend::load(rt, &borrowed, &options) {
            Ok(b) => backends.push(Box::new(b)),
            Err(reason) => {
                // Never fall back to the CPU silently: the pool is unavailable and says why.
                tracing::error!(pool = %pool.name, provider = pool.provider.label(), %reason, "pool unavailable");
                return Ok(Pool::unavailable(pool.clone(), kind_label, reason));
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
    Ok(Pool::start(pool.clone(), kind_label, backends))
}
