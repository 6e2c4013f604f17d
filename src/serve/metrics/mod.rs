//! Every metric family `vramguard serve` records into, registered together as [`Metrics`]: one
//! struct of cheap handles, one field per family. Each family is defined (struct, labels,
//! registration, the series it creates at 0) in one file of the layer that owns what it measures:
//! `telemetry::metrics` (the process: build, memory sampling, HTTP limits), `pool::metrics` (runs,
//! health checks, worker processes, residency), `pool::remote` (remote pools), and here
//! `requests.rs` (requests and their durations), `generation.rs` (tokens), `batching.rs`
//! (rows a batched run took), `speech.rs` (audio transcribed), `policy.rs` (admission
//! decisions, reloads), `failover.rs` (retries, failovers, substitutions), `estimates.rs` (memory
//! estimates' quality, what models hold) and `waits.rs` (requests held back by their service's
//! budgets). Gauges read from live state are encoded at scrape time by the collectors instead
//! ([`crate::telemetry::exporter::LiveCollector`]).

mod batching;
mod estimates;
mod failover;
mod generation;
mod policy;
mod requests;
mod speech;
mod waits;

use std::sync::Arc;

use prometheus_client::registry::Registry;

use crate::config::ModelConfig;
use crate::pool::metrics::{HealthMetrics, ResidencyMetrics, RunMetrics, WorkerMetrics};
use crate::pool::remote::RemoteFamily;
use crate::pool::{Pool, PoolMetrics};
use crate::telemetry::metrics::ProcessMetrics;

pub use batching::BatchingMetrics;
pub use estimates::{EstimateMetrics, MemoryKind, ModelMemoryLabels};
pub use failover::{
    FailoverLabels, FailoverMetrics, FailoverReason, RetryLabels, RetryResult, SubstitutionLabels, SubstitutionReason,
};
pub use generation::GenerationMetrics;
pub use policy::{DecisionLabels, KindLabels, PolicyInfoLabels, PolicyMetrics, ReloadResult, ResultLabels};
pub use requests::{Outcome, RequestLabels, RequestMetrics, UNKNOWN_MODEL};
pub use speech::{SpeechMetrics, SpeechTotals};
pub use waits::{ServiceWaits, WaitFor, WaitLabels};

/// The metric handles vramguard updates as things happen, one field per family.
#[derive(Debug)]
pub struct Metrics {
    /// Build, memory sampling, HTTP limits.
    pub process: ProcessMetrics,
    /// The estimates' quality and what models hold.
    pub estimates: EstimateMetrics,
    /// The pools' health checks.
    pub health: HealthMetrics,
    /// Process-isolated pools' worker processes.
    pub workers: WorkerMetrics,
    /// Which models each pool holds, their loads and unloads.
    pub residency: ResidencyMetrics,
    /// Requests held back by their service's budgets.
    pub service_waits: ServiceWaits,
    /// Requests by outcome, and their durations.
    pub requests: RequestMetrics,
    /// Tokens generated, and the time to each.
    pub generation: GenerationMetrics,
    /// Rows in each run of a model with dynamic batching.
    pub batching: BatchingMetrics,
    /// Audio transcribed, and how fast.
    pub speech: SpeechMetrics,
    /// The admission policy's decisions, failures and reloads.
    pub policy: PolicyMetrics,
    /// The pools' runs: allocator failures, queue waits, bytes crossing, breaker recoveries.
    pub runs: RunMetrics,
    /// Work that moved to another pool or model.
    pub failover: FailoverMetrics,
    /// Remote pools' failures and round trips.
    pub remote: RemoteFamily,
}

impl Metrics {
    /// Create the handles and register them in a fresh registry (`vramguard serve`).
    pub fn new(onnxruntime_version: &str) -> (Metrics, Registry) {
        let (process, mut registry) = ProcessMetrics::new(onnxruntime_version);
        let metrics = Metrics {
            process,
            estimates: EstimateMetrics::default(),
            health: HealthMetrics::default(),
            workers: WorkerMetrics::default(),
            residency: ResidencyMetrics::default(),
            service_waits: ServiceWaits::default(),
            requests: RequestMetrics::default(),
            generation: GenerationMetrics::default(),
            batching: BatchingMetrics::default(),
            speech: SpeechMetrics::default(),
            policy: PolicyMetrics::default(),
            runs: RunMetrics::default(),
            failover: FailoverMetrics::default(),
            remote: RemoteFamily::default(),
        };
        metrics.estimates.register(&mut registry);
        metrics.health.register(&mut registry);
        metrics.workers.register(&mut registry);
        metrics.residency.register(&mut registry);
        metrics.service_waits.register(&mut registry);
        metrics.requests.register(&mut registry);
        metrics.generation.register(&mut registry);
        metrics.batching.register(&mut registry);
        metrics.speech.register(&mut registry);
        metrics.policy.register(&mut registry);
        metrics.failover.register(&mut registry);
        metrics.remote.register(&mut registry);
        metrics.runs.register(&mut registry);
        (metrics, registry)
    }

    /// The handles a pool's workers record into: its runs' and its health checks'.
    pub fn pool_metrics(&self, pool: &str, device: &str) -> PoolMetrics {
        self.runs.of_pool(pool, device, &self.health)
    }

    /// Create at 0 every series whose label values the configuration fixes, once `models` and
    /// `pools` are known: requests for each model on each pool serving it (and on no pool, for
    /// refusals before one was chosen) with every outcome, and their durations; residency per
    /// model and pool; the budgets' waits of each model's service; substitutions of each model
    /// with a `fallback_model` by it; decisions per action and pool; failovers and retries from
    /// each pool with a fallback to that fallback, with every reason and result.
    pub fn zero_known<'a>(&self, models: impl IntoIterator<Item = &'a ModelConfig>, pools: &[Arc<Pool>]) {
        for model in models {
            let name = model.name.as_str();
            for pool in pools.iter().filter(|p| p.serves(name)).map(|p| p.name()) {
                self.requests.serving(name, pool);
                // The pool holds these handles already; asking again changes nothing.
                self.residency.handles(name, pool);
                if model.batching.is_some() {
                    self.batching.serving(name, pool);
                }
            }
            self.requests.configured(name);
            // Every service vramguard runs may have its requests held back by its budgets.
            self.service_waits.zero(&model.service);
            if let Some(fallback) = &model.fallback_model {
                self.failover.substitute(name, fallback);
            }
        }
        for pool in pools {
            self.policy.pool(pool.name());
            if let Some(fallback) = pool.config.fallback.as_deref() {
                self.failover.fallback(pool.name(), fallback);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_uses_contract_names_and_units() {
        let (metrics, registry) = Metrics::new("1.31.1");
        metrics
            .requests
            .total
            .get_or_create(&RequestLabels {
                model: "encoder".into(),
                pool: "cpu".into(),
                outcome: Outcome::ok,
            })
            .inc();
        metrics
            .runs
            .allocator_failures
            .get_or_create(&crate::pool::metrics::AllocFailureLabels {
                pool: "gpu".into(),
                device: "gpu0".into(),
                kind: crate::core::backend::AllocFailureKind::Oom,
            })
            .inc();
        metrics
            .requests
            .duration
            .get_or_create(&crate::core::metrics::ModelPoolLabels {
                model: "encoder".into(),
                pool: "cpu".into(),
            })
            .observe(0.003);
        let text = crate::telemetry::metrics::encode(&registry);
        assert!(
            text.contains(&format!(
                "vramguard_build_info{{version=\"{}\",onnxruntime=\"1.31.1\"}} 1\n",
                env!("CARGO_PKG_VERSION")
            )),
            "{text}"
        );
        assert!(
            text.contains("vramguard_requests_total{model=\"encoder\",pool=\"cpu\",outcome=\"ok\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("vramguard_allocator_failures_total{pool=\"gpu\",device=\"gpu0\",kind=\"oom\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE vramguard_request_duration_seconds histogram\n"),
            "{text}"
        );
        assert!(
            text.contains("vramguard_request_duration_seconds_bucket{le=\"0.004\",model=\"encoder\",pool=\"cpu\"} 1\n"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn every_http_limit_and_the_connection_gauge_are_exported_from_the_start() {
        for registry in [Metrics::new("1.31.1").1, ProcessMetrics::new("none").1] {
            let text = crate::telemetry::metrics::encode(&registry);
            for limit in [
                "header_timeout",
                "body_timeout",
                "idle_timeout",
                "max_connections",
                "body_bytes",
                "body_limit",
            ] {
                assert!(
                    text.contains(&format!("vramguard_http_limit_hits_total{{limit=\"{limit}\"}} 0\n")),
                    "{limit}: {text}"
                );
            }
            assert!(
                text.contains("# TYPE vramguard_http_connections gauge\nvramguard_http_connections 0\n"),
                "{text}"
            );
        }
    }
}
