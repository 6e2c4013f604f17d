//! What a pool needs from its surroundings besides its config and backends: a clock, metric
//! handles, and a factory for replacement backends.

use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;

use crate::core::backend::Backend;
use crate::core::clock::{Clock, SystemClock};
use crate::pool::models::ModelSetup;

/// Metric handles a pool records into from its worker threads.
#[derive(Debug, Clone)]
pub struct PoolMetrics {
    /// `vramguard_queue_wait_seconds{pool}`
    pub queue_wait: Histogram,
    /// `vramguard_allocator_failures_total{pool, device, kind="oom"}`
    pub oom_failures: Counter,
    /// `vramguard_allocator_failures_total{pool, device, kind="driver"}`
    pub driver_failures: Counter,
    /// `vramguard_breaker_recovery_seconds{pool}`: from the breaker opening to closing again.
    pub breaker_recovery: Histogram,
    /// `vramguard_health_checks_total{pool, result="ok"}`
    pub health_ok: Counter,
    /// `vramguard_health_checks_total{pool, result="failed"}`
    pub health_failed: Counter,
    /// `vramguard_pool_transfer_bytes_total{pool, direction="to_pool"}`: tensor bytes of the
    /// runs' inputs (a decode step's rows count [`DecodeStep::ROW_BYTES`] each).
    ///
    /// [`DecodeStep::ROW_BYTES`]: crate::core::backend::DecodeStep::ROW_BYTES
    pub to_pool: Counter,
    /// `…{direction="from_pool"}`: tensor bytes of the answers.
    pub from_pool: Counter,
    /// Its worker process's, when it is process-isolated.
    pub worker: Option<WorkerHandles>,
}

/// A process-isolated pool's worker metrics: `vramguard_worker_up{pool}` and
/// `vramguard_worker_restarts_total{pool, reason}` by reason.
#[derive(Debug, Clone, Default)]
pub struct WorkerHandles {
    /// `vramguard_worker_up{pool}`
    pub up: prometheus_client::metrics::gauge::Gauge,
    /// `…{reason="exited"}`: it died.
    pub exited: Counter,
    /// `…{reason="hung"}`: it stopped answering its heartbeat.
    pub hung: Counter,
    /// `…{reason="restore"}`: an operator's restore replaced it.
    pub restore: Counter,
}

impl PoolMetrics {
    /// Handles registered nowhere (tests, benches).
    pub fn detached() -> Self {
        Self {
            queue_wait: Histogram::new([0.001, 0.01, 0.1, 1.0, 10.0]),
            oom_failures: Counter::default(),
            driver_failures: Counter::default(),
            breaker_recovery: Histogram::new([1.0, 10.0, 60.0, 600.0]),
            health_ok: Counter::default(),
            health_failed: Counter::default(),
            to_pool: Counter::default(),
            from_pool: Counter::default(),
            worker: None,
        }
    }
}

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
}

impl Default for PoolContext {
    fn default() -> Self {
        Self {
            clock: Arc::new(SystemClock),
            metrics: PoolMetrics::detached(),
            models: Vec::new(),
        }
    }
}

/// Builds a fresh backend for a worker whose backend panicked (its state cannot be trusted).
pub type Respawn = Arc<dyn Fn() -> Result<Box<dyn Backend>, String> + Send + Sync>;
