//! What a pool's runs meet: their allocators' failures, their queues' waits, the bytes crossing
//! to and from their runtimes, and their breakers' recoveries; and the handles one pool records
//! into ([`PoolMetrics`]), these and its health checks' and worker process's.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::core::backend::AllocFailureKind;
use crate::core::metrics::{PoolLabels, latency_histogram};
use crate::pool::metrics::{HealthMetrics, WorkerHandles};

/// `{pool, device, kind}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AllocFailureLabels {
    /// Pool name.
    pub pool: String,
    /// Device name.
    pub device: String,
    /// `oom` or `driver`.
    pub kind: AllocFailureKind,
}

/// `{pool, direction}` of `vramguard_pool_transfer_bytes_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransferLabels {
    /// Pool name.
    pub pool: String,
    /// `to_pool` (inputs) or `from_pool` (outputs).
    pub direction: &'static str,
}

/// The run metrics of every pool.
#[derive(Debug)]
pub struct RunMetrics {
    /// `vramguard_allocator_failures_total{pool, device, kind}`
    pub allocator_failures: Family<AllocFailureLabels, Counter>,
    /// `vramguard_queue_wait_seconds{pool}`
    pub queue_wait: Family<PoolLabels, Histogram>,
    /// `vramguard_pool_transfer_bytes_total{pool, direction}`
    pub pool_transfer: Family<TransferLabels, Counter>,
    /// `vramguard_breaker_recovery_seconds{pool}`
    pub breaker_recovery: Family<PoolLabels, Histogram>,
}

impl Default for RunMetrics {
    fn default() -> Self {
        RunMetrics {
            allocator_failures: Family::default(),
            queue_wait: Family::new_with_constructor(latency_histogram),
            pool_transfer: Family::default(),
            breaker_recovery: Family::new_with_constructor(|| {
                // 1 s .. ~17 min: a restore takes seconds, a cooldown tens of seconds.
                Histogram::new(exponential_buckets(1.0, 2.0, 11))
            }),
        }
    }
}

impl RunMetrics {
    /// Register under `registry` (prefixed `vramguard`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "allocator_failures",
            "Allocation failures reported by ONNX Runtime, by kind (oom, driver)",
            self.allocator_failures.clone(),
        );
        registry.register_with_unit(
            "queue_wait",
            "Time requests waited in the pool's queue before a worker took them",
            Unit::Seconds,
            self.queue_wait.clone(),
        );
        registry.register_with_unit(
            "pool_transfer",
            "Tensor bytes crossing between vramguard and a pool's runtime (to_pool: inputs, from_pool: outputs); a generation's KV cache stays in the runtime and never crosses",
            Unit::Bytes,
            self.pool_transfer.clone(),
        );
        registry.register_with_unit(
            "breaker_recovery",
            "Time from a pool's circuit breaker opening to closing again",
            Unit::Seconds,
            self.breaker_recovery.clone(),
        );
    }

    /// The handles pool `pool` on `device` records into, its health checks' from `health`
    /// (every series created at 0); no worker process's yet.
    pub fn of_pool(&self, pool: &str, device: &str, health: &HealthMetrics) -> PoolMetrics {
        let failures = |kind| {
            self.allocator_failures.get_or_create_owned(&AllocFailureLabels {
                pool: pool.to_string(),
                device: device.to_string(),
                kind,
            })
        };
        let (health_ok, health_failed) = health.of_pool(pool);
        let transfer = |direction| {
            self.pool_transfer.get_or_create_owned(&TransferLabels {
                pool: pool.to_string(),
                direction,
            })
        };
        PoolMetrics {
            to_pool: transfer("to_pool"),
            from_pool: transfer("from_pool"),
            health_ok,
            health_failed,
            worker: None,
            breaker_recovery: self.breaker_recovery.get_or_create_owned(&PoolLabels::of(pool)),
            queue_wait: self.queue_wait.get_or_create_owned(&PoolLabels::of(pool)),
            oom_failures: failures(AllocFailureKind::Oom),
            driver_failures: failures(AllocFailureKind::Driver),
        }
    }
}

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
