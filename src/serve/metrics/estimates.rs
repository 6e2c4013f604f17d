//! How good the memory estimates are, as the operator sees it: runs that needed more than their
//! estimate, the relative error of every measured run, and what each model holds on each pool.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::core::metrics::ModelPoolLabels;
use crate::runtime::estimate::learned::Observation;

/// What a `vramguard_model_memory_bytes` series counts.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum MemoryKind {
    /// The model's weights, as loaded on the pool (every worker's sessions).
    weights,
    /// The largest working memory a measured run of the model took on the pool.
    workspace_peak,
}

/// `{model, pool, kind}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelMemoryLabels {
    /// Model name.
    pub model: String,
    /// Pool name.
    pub pool: String,
    /// What is counted.
    pub kind: MemoryKind,
}

/// `{model, pool, component}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ComponentLabels {
    /// Model name.
    pub model: String,
    /// Pool name.
    pub pool: String,
    /// The component: `model` for a model of one graph, `encoder` and `decoder` for a Whisper.
    pub component: String,
}

/// Relative error buckets: from estimates four times too high to four times too low.
const ERROR_BUCKETS: [f64; 10] = [-0.75, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 1.0, 3.0];

/// The estimate metrics.
#[derive(Debug)]
pub struct EstimateMetrics {
    /// `vramguard_estimate_underruns_total{model,pool}`
    pub underruns: Family<ModelPoolLabels, Counter>,
    /// `vramguard_estimate_relative_error{model,pool}`
    pub relative_error: Family<ModelPoolLabels, Histogram>,
    /// `vramguard_model_memory_bytes{model,pool,kind}`
    pub model_memory: Family<ModelMemoryLabels, Gauge>,
    /// `vramguard_model_component_weights_bytes{model,pool,component}`: each component's
    /// share of the `kind="weights"` series above, which is their sum (a family of its own, so
    /// that the series of `vramguard_model_memory_bytes` stay as they were).
    pub component_weights: Family<ComponentLabels, Gauge>,
}

impl Default for EstimateMetrics {
    fn default() -> Self {
        EstimateMetrics {
            underruns: Family::default(),
            relative_error: Family::new_with_constructor(|| Histogram::new(ERROR_BUCKETS)),
            model_memory: Family::default(),
            component_weights: Family::default(),
        }
    }
}

impl EstimateMetrics {
    /// Register under `registry` (prefixed `vramguard`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "estimate_underruns",
            "Runs that needed more working memory than their admission estimate (or failed to allocate it)",
            self.underruns.clone(),
        );
        registry.register(
            "estimate_relative_error",
            "(measured - estimated) / estimated working memory of each measured run; above 0 the estimate was too low",
            self.relative_error.clone(),
        );
        registry.register_with_unit(
            "model_memory",
            "Memory a model holds on a pool: its weights, and the peak working memory of its measured runs",
            Unit::Bytes,
            self.model_memory.clone(),
        );
        registry.register_with_unit(
            "model_component_weights",
            "Weights of each component (graph) of a model on a pool; they add up to its vramguard_model_memory_bytes{kind=\"weights\"}",
            Unit::Bytes,
            self.component_weights.clone(),
        );
    }

    fn memory(&self, model: &str, pool: &str, kind: MemoryKind) -> Gauge {
        self.model_memory.get_or_create_owned(&ModelMemoryLabels {
            model: model.to_string(),
            pool: pool.to_string(),
            kind,
        })
    }

    /// What `model` holds on `pool`: its weights and the peak working memory of its measured
    /// runs, in bytes.
    pub fn held(&self, model: &str, pool: &str) -> (u64, u64) {
        let read = |kind| u64::try_from(self.memory(model, pool, kind).get()).unwrap_or(0);
        (read(MemoryKind::weights), read(MemoryKind::workspace_peak))
    }

    /// `model` is served on `pool` with `weights_bytes` of weights: every series exists from the
    /// first scrape.
    pub fn serving(&self, model: &str, pool: &str, weights_bytes: u64) {
        let labels = ModelPoolLabels {
            model: model.to_string(),
            pool: pool.to_string(),
        };
        self.underruns.get_or_create_owned(&labels);
        self.relative_error.get_or_create_owned(&labels);
        self.memory(model, pool, MemoryKind::weights)
            .set(i64::try_from(weights_bytes).unwrap_or(i64::MAX));
        self.memory(model, pool, MemoryKind::workspace_peak);
    }

    /// `component` of `model` holds `weights_bytes` of weights on `pool`.
    pub fn component(&self, model: &str, pool: &str, component: &str, weights_bytes: u64) {
        self.component_weights
            .get_or_create(&ComponentLabels {
                model: model.to_string(),
                pool: pool.to_string(),
                component: component.to_string(),
            })
            .set(i64::try_from(weights_bytes).unwrap_or(i64::MAX));
    }

    /// A run of `model` on `pool` estimated at `estimated_bytes` of working memory was measured.
    /// True when it was an underrun.
    pub fn observed(&self, model: &str, pool: &str, estimated_bytes: u64, observation: Observation) -> bool {
        let labels = ModelPoolLabels {
            model: model.to_string(),
            pool: pool.to_string(),
        };
        let underrun = match observation {
            Observation::Exactly(bytes) => {
                if estimated_bytes > 0 {
                    let error = (bytes as f64 - estimated_bytes as f64) / estimated_bytes as f64;
                    self.relative_error.get_or_create(&labels).observe(error);
                }
                let peak = self.memory(model, pool, MemoryKind::workspace_peak);
                let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
                if bytes > peak.get() {
                    peak.set(bytes);
                }
                bytes > i64::try_from(estimated_bytes).unwrap_or(i64::MAX)
            }
            // It needed more than this, so more than an estimate no larger.
            Observation::MoreThan(bytes) => bytes >= estimated_bytes,
            // Within the arena's earlier peak: whether it took more than its estimate is not
            // known, so it is not counted either way.
            Observation::AtMost(_) => false,
        };
        if underrun {
            self.underruns.get_or_create(&labels).inc();
        }
        underrun
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text
    }

    #[test]
    fn every_series_exists_at_zero_and_underruns_are_counted() {
        let metrics = EstimateMetrics::default();
        let mut registry = Registry::with_prefix("vramguard");
        metrics.register(&mut registry);
        metrics.serving("encoder", "gpu", 68_474);
        metrics.component("encoder", "gpu", "model", 68_474);
        let text = encode(&registry);
        for series in [
            "vramguard_estimate_underruns_total{model=\"encoder\",pool=\"gpu\"} 0\n",
            "vramguard_estimate_relative_error_count{model=\"encoder\",pool=\"gpu\"} 0\n",
            "vramguard_model_memory_bytes{model=\"encoder\",pool=\"gpu\",kind=\"weights\"} 68474\n",
            "vramguard_model_memory_bytes{model=\"encoder\",pool=\"gpu\",kind=\"workspace_peak\"} 0\n",
            "vramguard_model_component_weights_bytes{model=\"encoder\",pool=\"gpu\",component=\"model\"} 68474\n",
        ] {
            assert!(text.contains(series), "{series}: {text}");
        }
        assert!(!metrics.observed("encoder", "gpu", 1000, Observation::Exactly(900)));
        assert!(metrics.observed("encoder", "gpu", 1000, Observation::Exactly(1500)));
        assert!(metrics.observed("encoder", "gpu", 1000, Observation::MoreThan(4000)));
        let text = encode(&registry);
        assert!(
            text.contains("vramguard_estimate_underruns_total{model=\"encoder\",pool=\"gpu\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "vramguard_model_memory_bytes{model=\"encoder\",pool=\"gpu\",kind=\"workspace_peak\"} 1500\n"
            ),
            "{text}"
        );
        // -0.1 and +0.5: one in the bucket up to -0.1, both by 0.5.
        assert!(
            text.contains("vramguard_estimate_relative_error_bucket{le=\"-0.1\",model=\"encoder\",pool=\"gpu\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("vramguard_estimate_relative_error_bucket{le=\"0.5\",model=\"encoder\",pool=\"gpu\"} 2\n"),
            "{text}"
        );
    }
}
