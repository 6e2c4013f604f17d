//! Which models each pool holds, and their loads, unloads and cold starts: the families and
//! the handles of one model on one pool.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::core::metrics::ModelPoolLabels;

/// Why a model's sessions were built.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum LoadReason {
    /// When the pool started (`resident` and `pinned` models).
    start,
    /// A request for it found it not loaded.
    on_demand,
    /// `POST /admin/models/{model}/load`.
    requested,
}

/// Where a load's bytes came from (`source` of `vramguard_model_session_loads_total`).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum LoadSource {
    /// The model's ONNX bytes: parsed and optimized.
    disk,
    /// The optimized cache's file: read, not optimized again.
    optimized_cache,
    /// The host tier: from memory.
    host_tier,
}

impl LoadSource {
    /// Every source, in the order metrics keep them.
    pub const ALL: [LoadSource; 3] = [LoadSource::disk, LoadSource::optimized_cache, LoadSource::host_tier];

    /// Its place in [`LoadSource::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Why a model's sessions were dropped.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum UnloadReason {
    /// `POST /admin/models/{model}/unload`.
    requested,
    /// No request for its `models[].idle_unload`.
    idle,
    /// Evicted by `make_room` to admit a request of another model.
    evicted,
    /// Its load failed.
    failed,
}

/// `{model, pool, reason}` of a load.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoadLabels {
    /// Model name.
    pub model: String,
    /// Pool name.
    pub pool: String,
    /// Why.
    pub reason: LoadReason,
}

/// `{model, pool, reason}` of an unload.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UnloadLabels {
    /// Model name.
    pub model: String,
    /// Pool name.
    pub pool: String,
    /// Why.
    pub reason: UnloadReason,
}

/// Metric handles of one model on one pool.
#[derive(Debug, Clone)]
pub struct ModelMetrics {
    /// `vramguard_model_resident{model,pool}`
    pub resident: Gauge,
    /// `vramguard_model_loads_total{model,pool,reason="start"}`
    pub loads_start: Counter,
    /// `vramguard_model_loads_total{model,pool,reason="on_demand"}`
    pub loads_on_demand: Counter,
    /// `vramguard_model_loads_total{model,pool,reason="requested"}`
    pub loads_requested: Counter,
    /// `vramguard_model_unloads_total{model,pool,reason="requested"}`
    pub unloads_requested: Counter,
    /// `vramguard_model_unloads_total{model,pool,reason="idle"}`: no request for `idle_unload`.
    pub unloads_idle: Counter,
    /// `vramguard_model_unloads_total{model,pool,reason="evicted"}`: to make room for another.
    pub unloads_evicted: Counter,
    /// `vramguard_model_unloads_total{model,pool,reason="failed"}`: a load that failed.
    pub unloads_failed: Counter,
    /// `vramguard_model_load_duration_seconds{model,pool}`: one per session built.
    pub load_duration: Histogram,
    /// `vramguard_cold_start_seconds{model,pool}`: what a request waited for its model's load.
    pub cold_start: Histogram,
    /// `vramguard_model_session_loads_total{model,pool,source}`, in [`LoadSource::ALL`]'s order.
    pub loads_from: [Counter; 3],
    /// `vramguard_model_session_load_seconds{model,pool,source}`, in [`LoadSource::ALL`]'s order.
    pub load_seconds_from: [Histogram; 3],
}

/// `{model, pool, source}` of a session's load.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    /// Model name.
    pub model: String,
    /// Pool name.
    pub pool: String,
    /// Where its bytes came from.
    pub source: LoadSource,
}

/// `{model}` of the host tier's gauge.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierModelLabels {
    /// Model name.
    pub model: String,
}

/// The host tier's metrics.
#[derive(Debug, Clone, Default)]
pub struct TierMetrics {
    /// `vramguard_host_tier_bytes`: what it holds.
    pub bytes: Gauge,
    /// `vramguard_host_tier_budget_bytes`: `host.model_cache`.
    pub budget: Gauge,
    /// `vramguard_model_host_tier{model}`: 1 while the model's optimized bytes are in it.
    pub models: Family<TierModelLabels, Gauge>,
    shown: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

impl TierMetrics {
    /// The tier now holds `models`: 1 for each, 0 for those it held before.
    pub fn show(&self, models: &std::collections::HashSet<&str>) {
        let mut shown = self.shown.lock().unwrap_or_else(|e| e.into_inner());
        for model in shown.iter() {
            if !models.contains(model.as_str()) {
                self.models
                    .get_or_create(&TierModelLabels { model: model.clone() })
                    .set(0);
            }
        }
        for model in models {
            self.models
                .get_or_create(&TierModelLabels {
                    model: model.to_string(),
                })
                .set(1);
            shown.insert(model.to_string());
        }
    }
}

/// Buckets of load and cold-start durations, in seconds.
const LOAD_BUCKETS: [f64; 10] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0];

impl ModelMetrics {
    /// Handles registered nowhere (tests, benches).
    pub fn detached() -> Self {
        ModelMetrics {
            resident: Gauge::default(),
            loads_start: Counter::default(),
            loads_on_demand: Counter::default(),
            loads_requested: Counter::default(),
            unloads_requested: Counter::default(),
            unloads_idle: Counter::default(),
            unloads_evicted: Counter::default(),
            unloads_failed: Counter::default(),
            load_duration: Histogram::new(LOAD_BUCKETS),
            cold_start: Histogram::new(LOAD_BUCKETS),
            loads_from: Default::default(),
            load_seconds_from: std::array::from_fn(|_| Histogram::new(LOAD_BUCKETS)),
        }
    }
}

/// The residency metrics.
#[derive(Debug)]
pub struct ResidencyMetrics {
    /// `vramguard_model_resident{model,pool}`
    pub resident: Family<ModelPoolLabels, Gauge>,
    /// `vramguard_model_loads_total{model,pool,reason}`
    pub loads: Family<LoadLabels, Counter>,
    /// `vramguard_model_unloads_total{model,pool,reason}`
    pub unloads: Family<UnloadLabels, Counter>,
    /// `vramguard_model_load_duration_seconds{model,pool}`
    pub load_duration: Family<ModelPoolLabels, Histogram>,
    /// `vramguard_cold_start_seconds{model,pool}`
    pub cold_start: Family<ModelPoolLabels, Histogram>,
    /// `vramguard_model_session_loads_total{model,pool,source}`
    pub loads_from: Family<SourceLabels, Counter>,
    /// `vramguard_model_session_load_seconds{model,pool,source}`
    pub load_seconds_from: Family<SourceLabels, Histogram>,
    /// The host tier's.
    pub tier: TierMetrics,
}

impl Default for ResidencyMetrics {
    fn default() -> Self {
        ResidencyMetrics {
            resident: Family::default(),
            loads: Family::default(),
            unloads: Family::default(),
            load_duration: Family::new_with_constructor(|| Histogram::new(LOAD_BUCKETS)),
            cold_start: Family::new_with_constructor(|| Histogram::new(LOAD_BUCKETS)),
            loads_from: Family::default(),
            load_seconds_from: Family::new_with_constructor(|| Histogram::new(LOAD_BUCKETS)),
            tier: TierMetrics::default(),
        }
    }
}

impl ResidencyMetrics {
    /// Register under `registry` (prefixed `vramguard`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "model_resident",
            "1 while the model's sessions are loaded on the pool",
            self.resident.clone(),
        );
        registry.register(
            "model_loads",
            "Loads of a model's sessions on a pool, by reason",
            self.loads.clone(),
        );
        registry.register(
            "model_unloads",
            "Unloads of a model's sessions on a pool, by reason",
            self.unloads.clone(),
        );
        registry.register_with_unit(
            "model_load_duration",
            "Time to build one backend's session of the model",
            Unit::Seconds,
            self.load_duration.clone(),
        );
        registry.register_with_unit(
            "cold_start",
            "Time a request waited for its model to load",
            Unit::Seconds,
            self.cold_start.clone(),
        );
        registry.register(
            "model_session_loads",
            "Sessions of a model built on a pool (at start and after), by where their bytes came from",
            self.loads_from.clone(),
        );
        registry.register_with_unit(
            "model_session_load",
            "Time to build one backend's session of the model after start, by where its bytes came from",
            Unit::Seconds,
            self.load_seconds_from.clone(),
        );
        registry.register_with_unit(
            "host_tier",
            "Optimized model bytes the host tier holds",
            Unit::Bytes,
            self.tier.bytes.clone(),
        );
        registry.register_with_unit(
            "host_tier_budget",
            "The host tier's budget (host.model_cache)",
            Unit::Bytes,
            self.tier.budget.clone(),
        );
        registry.register(
            "model_host_tier",
            "1 while the model's optimized bytes are in the host tier",
            self.tier.models.clone(),
        );
    }

    /// The handles of `model` on `pool` (every series created at 0).
    pub fn handles(&self, model: &str, pool: &str) -> ModelMetrics {
        let labels = ModelPoolLabels {
            model: model.to_string(),
            pool: pool.to_string(),
        };
        let load = |reason| {
            self.loads.get_or_create_owned(&LoadLabels {
                model: model.to_string(),
                pool: pool.to_string(),
                reason,
            })
        };
        let unload = |reason| {
            self.unloads.get_or_create_owned(&UnloadLabels {
                model: model.to_string(),
                pool: pool.to_string(),
                reason,
            })
        };
        ModelMetrics {
            resident: self.resident.get_or_create_owned(&labels),
            loads_start: load(LoadReason::start),
            loads_on_demand: load(LoadReason::on_demand),
            loads_requested: load(LoadReason::requested),
            unloads_requested: unload(UnloadReason::requested),
            unloads_idle: unload(UnloadReason::idle),
            unloads_evicted: unload(UnloadReason::evicted),
            unloads_failed: unload(UnloadReason::failed),
            load_duration: self.load_duration.get_or_create_owned(&labels),
            cold_start: self.cold_start.get_or_create_owned(&labels),
            loads_from: LoadSource::ALL.map(|source| {
                self.loads_from.get_or_create_owned(&SourceLabels {
                    model: model.to_string(),
                    pool: pool.to_string(),
                    source,
                })
            }),
            load_seconds_from: LoadSource::ALL.map(|source| {
                self.load_seconds_from.get_or_create_owned(&SourceLabels {
                    model: model.to_string(),
                    pool: pool.to_string(),
                    source,
                })
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_exists_at_zero_and_shares_the_pools_handles() {
        let metrics = ResidencyMetrics::default();
        let mut registry = Registry::with_prefix("vramguard");
        metrics.register(&mut registry);
        let handles = metrics.handles("enc", "cpu");
        handles.loads_on_demand.inc();
        handles.resident.set(1);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            r#"vramguard_model_resident{model="enc",pool="cpu"} 1"#,
            r#"vramguard_model_loads_total{model="enc",pool="cpu",reason="on_demand"} 1"#,
            r#"vramguard_model_loads_total{model="enc",pool="cpu",reason="start"} 0"#,
            r#"vramguard_model_unloads_total{model="enc",pool="cpu",reason="failed"} 0"#,
            r#"vramguard_model_unloads_total{model="enc",pool="cpu",reason="idle"} 0"#,
            r#"vramguard_cold_start_seconds_count{model="enc",pool="cpu"} 0"#,
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
