//! What every metric family shares, below all of them: the label sets several families use
//! (`{pool}`, `{model, pool}`) and the latency buckets. Each family lives in the layer that owns
//! what it measures (`telemetry::metrics`, `pool::metrics`, `serve::metrics`); this module lets
//! them agree on these without one of them importing another.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

/// `{pool}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// Pool name.
    pub pool: String,
}

impl PoolLabels {
    /// The labels of `pool`.
    pub fn of(pool: &str) -> Self {
        PoolLabels { pool: pool.to_string() }
    }
}

/// `{model, pool}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelPoolLabels {
    /// Model name.
    pub model: String,
    /// Pool name.
    pub pool: String,
}

/// A latency histogram from 1ms to ~65s: covers a GPU request and a slow CPU fallback (a
/// request's duration, its first token, a queue's wait).
pub fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}
