//! A process-isolated pool's worker process, as the operator sees it: `vramguard_worker_up{pool}`
//! (1 while it runs and answers its heartbeat) and `vramguard_worker_restarts_total{pool,
//! reason}` (each reason at 0 from the first scrape), and the handles a pool's worker records into.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::core::metrics::PoolLabels;

/// Why a worker process was replaced, as the `reason` label.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum RestartReason {
    /// It died: crashed, killed, or exited.
    exited,
    /// It stopped answering its heartbeat within `health.timeout` and was killed.
    hung,
    /// An operator's restore replaced it.
    restore,
}

impl RestartReason {
    /// Every value, for creating each series at 0.
    pub const ALL: [Self; 3] = [Self::exited, Self::hung, Self::restore];
}

/// `{pool, reason}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RestartLabels {
    /// Pool name.
    pub pool: String,
    /// Why.
    pub reason: RestartReason,
}

/// The worker-process metrics.
#[derive(Debug, Default)]
pub struct WorkerMetrics {
    /// `vramguard_worker_up{pool}`
    pub up: Family<PoolLabels, Gauge>,
    /// `vramguard_worker_restarts_total{pool, reason}`
    pub restarts: Family<RestartLabels, Counter>,
}

impl WorkerMetrics {
    /// Register under `registry` (prefixed `vramguard`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "worker_up",
            "1 while a process-isolated pool's worker process runs and answers its heartbeat",
            self.up.clone(),
        );
        registry.register(
            "worker_restarts",
            "Worker processes of a pool replaced, by reason (exited, hung, restore)",
            self.restarts.clone(),
        );
    }

    /// `pool`'s worker-process handles (only process-isolated pools have them), every series
    /// created at 0.
    pub fn of_pool(&self, pool: &str) -> WorkerHandles {
        let counter = |reason| {
            self.restarts.get_or_create_owned(&RestartLabels {
                pool: pool.to_string(),
                reason,
            })
        };
        let [exited, hung, restore] = RestartReason::ALL.map(counter);
        WorkerHandles {
            up: self.up.get_or_create_owned(&PoolLabels::of(pool)),
            exited,
            hung,
            restore,
        }
    }
}

/// A process-isolated pool's worker metrics: `vramguard_worker_up{pool}` and
/// `vramguard_worker_restarts_total{pool, reason}` by reason.
#[derive(Debug, Clone, Default)]
pub struct WorkerHandles {
    /// `vramguard_worker_up{pool}`
    pub up: Gauge,
    /// `…{reason="exited"}`: it died.
    pub exited: Counter,
    /// `…{reason="hung"}`: it stopped answering its heartbeat.
    pub hung: Counter,
    /// `…{reason="restore"}`: an operator's restore replaced it.
    pub restore: Counter,
}
