//! The generation family: tokens generated, the time to a generation's first token and between
//! its tokens, by model and pool. Its series appear with a model's first generation: which
//! models generate is known only once their sessions are read.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::core::metrics::{ModelPoolLabels, latency_histogram};

/// The generation family.
#[derive(Debug)]
pub struct GenerationMetrics {
    /// `vramguard_generated_tokens_total`
    pub generated_tokens: Family<ModelPoolLabels, Counter>,
    /// `vramguard_time_to_first_token_seconds`
    pub time_to_first_token: Family<ModelPoolLabels, Histogram>,
    /// `vramguard_inter_token_seconds`
    pub inter_token: Family<ModelPoolLabels, Histogram>,
}

impl Default for GenerationMetrics {
    fn default() -> Self {
        GenerationMetrics {
            generated_tokens: Family::default(),
            time_to_first_token: Family::new_with_constructor(latency_histogram),
            // 100µs .. ~6.5s: a token on a GPU takes milliseconds, on a CPU fallback much longer.
            inter_token: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.0001, 2.0, 17))),
        }
    }
}

impl GenerationMetrics {
    /// Register under `registry` (prefixed `vramguard`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "generated_tokens",
            "Tokens generated, by model and the pool that ran the last of a request's runs",
            self.generated_tokens.clone(),
        );
        registry.register_with_unit(
            "time_to_first_token",
            "Time from accepting a generation request to its first token",
            Unit::Seconds,
            self.time_to_first_token.clone(),
        );
        registry.register_with_unit(
            "inter_token",
            "Time between consecutive tokens of a generation",
            Unit::Seconds,
            self.inter_token.clone(),
        );
    }
}
