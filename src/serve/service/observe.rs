//! What runs were measured to take, fed back to the model's estimates and to the metrics that
//! show the estimates' quality.

use std::sync::Arc;

use crate::pool::Pool;
use crate::runtime::estimate::Dims;
use crate::runtime::estimate::learned::Observation;

use super::{ModelEntry, Service};

impl Service {
    /// A run of `entry`'s model on `pool`, of size `dims` and estimated at `estimated_bytes` of
    /// working memory, was measured: it raises later estimates where it took more, counts as an
    /// underrun when it needed more than its estimate, and refits the profile off the request
    /// path when enough runs came in.
    pub(crate) fn observe_run(
        &self,
        entry: &ModelEntry,
        pool: &Pool,
        dims: Dims,
        estimated_bytes: u64,
        observation: Observation,
    ) {
        let model = entry.config.name.as_str();
        let refit = entry.observe(dims, observation);
        let underrun = self
            .metrics
            .estimates
            .observed(model, pool.name(), estimated_bytes, observation);
        if underrun {
            tracing::info!(
                model,
                pool = pool.name(),
                size = %entry.profile.describe(&dims),
                estimate_bytes = estimated_bytes,
                measured = ?observation,
                "a run needed more than its estimate; later estimates for this size are raised"
            );
        }
        if refit {
            let learned = Arc::clone(&entry.learned);
            // A refit is a few milliseconds of arithmetic: not on a connection's task.
            match tokio::runtime::Handle::try_current() {
                Ok(handle) => drop(handle.spawn_blocking(move || learned.refit())),
                Err(_) => learned.refit(),
            }
        }
    }
}

/// The weights `pool` holds of `entry`'s model: every worker builds its own sessions.
pub(super) fn weights_on(pool: &Pool, entry: &ModelEntry) -> u64 {
    weights_for(&pool.config, entry)
}

/// [`weights_on`] for a pool not built yet, by its config.
pub(super) fn weights_for(pool: &crate::config::PoolConfig, entry: &ModelEntry) -> u64 {
    entry.profile.weights_bytes.saturating_mul(pool.workers.max(1) as u64)
}
