//! The metrics a pool's workers record into, registered together.

use prometheus_client::registry::{Registry, Unit};

use crate::telemetry::metrics::Metrics;

impl Metrics {
    /// What the pools' workers record: their allocators' failures, their queues' waits and
    /// the bytes crossing to and from their runtimes.
    pub(super) fn register_pools(&self, registry: &mut Registry) {
        let metrics = self;
        registry.register(
            "allocator_failures",
            "Allocation failures reported by ONNX Runtime, by kind (oom, driver)",
            metrics.allocator_failures.clone(),
        );
        registry.register_with_unit(
            "queue_wait",
            "Time requests waited in the pool's queue before a worker took them",
            Unit::Seconds,
            metrics.queue_wait.clone(),
        );
        registry.register_with_unit(
            "pool_transfer",
            "Tensor bytes crossing between vramguard and a pool's runtime (to_pool: inputs, from_pool: outputs); a generation's KV cache stays in the runtime and never crosses",
            Unit::Bytes,
            metrics.pool_transfer.clone(),
        );
    }
}
