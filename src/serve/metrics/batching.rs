//! The batching family: how many rows each run of a batched model took (`models[].batching`),
//! by model and the pool that ran it: how well requests that arrive together share runs.

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::core::metrics::ModelPoolLabels;

/// The batching family.
#[derive(Debug)]
pub struct BatchingMetrics {
    /// `vramguard_batch_rows`
    pub rows: Family<ModelPoolLabels, Histogram>,
}

impl Default for BatchingMetrics {
    fn default() -> Self {
        BatchingMetrics {
            // 1 .. 1024 rows, doubling: `max_batch` is rarely more.
            rows: Family::new_with_constructor(|| Histogram::new(exponential_buckets(1.0, 2.0, 11))),
        }
    }
}

impl BatchingMetrics {
    /// Register under `registry` (prefixed `vramguard`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "batch_rows",
            "Rows (items along the batch axis) in each run of a model with dynamic batching, by model and the pool that ran it",
            self.rows.clone(),
        );
    }

    /// The series of `model` batched on `pool`, at 0 from the first scrape.
    pub fn serving(&self, model: &str, pool: &str) {
        let _ = self.rows.get_or_create(&ModelPoolLabels {
            model: model.to_string(),
            pool: pool.to_string(),
        });
    }
}
