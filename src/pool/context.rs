//! What a pool needs from its surroundings besides its config and backends: a clock, metric
//! handles, and a factory for replacement backends.

use std::sync::Arc;

use crate::core::backend::Backend;
use crate::core::clock::{Clock, SystemClock};
use crate::pool::metrics::PoolMetrics;
use crate::pool::residency::ModelSetup;

/// What a pool needs from its surroundings besides its config and backends.
#[derive(Debug, Clone)]
pub struct PoolContext {
    /// Time source for queue stamps and ages.
    pub clock: Arc<dyn Clock>,
    /// Metric handles.
    pub metrics: PoolMetrics,
    /// The models it serves, how each is held, and their bytes for loads after start (a
    /// model not listed is held as resident).
    pub models: Vec<ModelSetup>,
    /// The service's host tier, which loads after start take their bytes from when it can.
    pub tier: Option<Arc<crate::pool::tier::HostTier>>,
}

impl Default for PoolContext {
    fn default() -> Self {
        Self {
            clock: Arc::new(SystemClock),
            metrics: PoolMetrics::detached(),
            models: Vec::new(),
            tier: None,
        }
    }
}

/// Builds a fresh backend for a worker whose backend panicked (its state cannot be trusted).
pub type Respawn = Arc<dyn Fn() -> Result<Box<dyn Backend>, String> + Send + Sync>;
