//! Every metric vramguard exports, as one struct of cheap handles. Names follow
//! the documented conventions (docs/metrics.md): prefix `vramguard_`, base units, `_total` counters.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

pub use crate::telemetry::failover_labels::{
    FailoverLabels, FailoverReason, RetryLabels, RetryResult, SubstitutionLabels, SubstitutionReason,
};

/// Request outcomes, as the `outcome` label.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Outcome {
    /// Served.
    ok,
    /// The client's mistake (4xx other than 429).
    client_error,
    /// Refused: no pool could take it, queue full, allocator failure.
    rejected,
    /// Waited past the bound (queue max wait, deferral bound).
    deferred_timeout,
    /// Server-side failure.
    failed,
    /// The client went away or the deadline passed.
    cancelled,
}

impl Outcome {
    /// Every value, for creating each series at 0 before its first event.
    pub const ALL: [Self; 6] = [
        Self::ok,
        Self::client_error,
        Self::rejected,
        Self::deferred_timeout,
        Self::failed,
        Self::cancelled,
    ];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::ok => "ok",
            Self::client_error => "client_error",
            Self::rejected => "rejected",
            Self::deferred_timeout => "deferred_timeout",
            Self::failed => "failed",
            Self::cancelled => "cancelled",
        }
    }
}

/// `{version, onnxruntime}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    /// vramguard version.
    pub version: String,
    /// ONNX Runtime version.
    pub onnxruntime: String,
}

/// `{model, pool, outcome}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// Model name.
    pub model: String,
    /// Pool that handled (or refused) it; empty when none was chosen.
    pub pool: String,
    /// Outcome.
    pub outcome: Outcome,
}

/// `{model, pool}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelPoolLabels {
    /// Model name.
    pub model: String,
    /// Pool name.
    pub pool: String,
}

/// `{pool}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// Pool name.
    pub pool: String,
}

/// `{pool, direction}` of `vramguard_pool_transfer_bytes_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransferLabels {
    /// Pool name.
    pub pool: String,
    /// `to_pool` (inputs) or `from_pool` (outputs).
    pub direction: &'static str,
}

/// `{action, pool}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// The decision's kind.
    pub action: crate::core::snapshot::Action,
    /// The pool the decision sends the request to (the request's pool for defer/reject).
    pub pool: String,
}

/// `{kind}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// Kind of policy failure: `compile`, `runtime`, `limit` or `bad_return`.
    pub kind: crate::policy::PolicyErrorKind,
}

/// `{result}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `ok` or `error`.
    pub result: ReloadResult,
}

/// How a policy reload ended, as the `result` label.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum ReloadResult {
    /// The new script serves.
    ok,
    /// It was refused; the previous script keeps serving.
    error,
}

/// `{path, sha256}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyInfoLabels {
    /// Policy file.
    pub path: String,
    /// SHA-256 of the script serving now.
    pub sha256: String,
}

/// `{source}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    /// Memory source: `nvml`, `simulated` or `host`.
    pub source: String,
}

/// `{pool, device, kind}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AllocFailureLabels {
    /// Pool name.
    pub pool: String,
    /// Device name.
    pub device: String,
    /// `oom` or `driver`.
    pub kind: crate::core::backend::AllocFailureKind,
}

/// A limit the HTTP server enforced on a client, as the `limit` label.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum HttpLimit {
    /// Request headers not complete within `server.timeouts.header_read`; closed.
    header_timeout,
    /// A request body brought no byte for `server.timeouts.body_read`; 408 and closed.
    body_timeout,
    /// A keep-alive connection idle for `server.timeouts.idle`; closed.
    idle_timeout,
    /// A connection had to wait for a slot (`server.max_connections`).
    max_connections,
    /// Bodies being received were at `server.max_receiving_bytes`; 503.
    body_bytes,
    /// A body over `server.body_limit`; 413.
    body_limit,
}

impl HttpLimit {
    /// Every limit, for pre-creating their series.
    pub const ALL: [HttpLimit; 6] = [
        HttpLimit::header_timeout,
        HttpLimit::body_timeout,
        HttpLimit::idle_timeout,
        HttpLimit::max_connections,
        HttpLimit::body_bytes,
        HttpLimit::body_limit,
    ];
}

/// `{limit}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLimitLabels {
    /// Which limit.
    pub limit: HttpLimit,
}

/// The metric handles vramguard updates as things happen; gauges read from live state are
/// encoded by [`crate::telemetry::exporter::LiveCollector`] at scrape time instead.
#[derive(Debug)]
pub struct Metrics {
    /// `vramguard_build_info`
    pub build_info: Family<BuildLabels, Gauge>,
    /// `vramguard_requests_total`
    pub requests: Family<RequestLabels, Counter>,
    /// `vramguard_request_duration_seconds`
    pub request_duration: Family<ModelPoolLabels, Histogram>,
    /// `vramguard_generated_tokens_total`
    pub generated_tokens: Family<ModelPoolLabels, Counter>,
    /// `vramguard_time_to_first_token_seconds`
    pub time_to_first_token: Family<ModelPoolLabels, Histogram>,
    /// `vramguard_inter_token_seconds`
    pub inter_token: Family<ModelPoolLabels, Histogram>,
    /// `vramguard_allocator_failures_total`
    pub allocator_failures: Family<AllocFailureLabels, Counter>,
    /// `vramguard_queue_wait_seconds`
    pub queue_wait: Family<PoolLabels, Histogram>,
    /// `vramguard_pool_transfer_bytes_total`
    pub pool_transfer: Family<TransferLabels, Counter>,
    /// `vramguard_exporter_sample_duration_seconds`
    pub exporter_sample_duration: Family<SourceLabels, Histogram>,
    /// `vramguard_exporter_errors_total`
    pub exporter_errors: Family<SourceLabels, Counter>,
    /// `vramguard_policy_decisions_total`
    pub policy_decisions: Family<DecisionLabels, Counter>,
    /// `vramguard_policy_eval_duration_seconds`
    pub policy_eval_duration: Histogram,
    /// `vramguard_policy_errors_total`
    pub policy_errors: Family<KindLabels, Counter>,
    /// `vramguard_policy_reloads_total`
    pub policy_reloads: Family<ResultLabels, Counter>,
    /// `vramguard_policy_info` (one series: the script serving now)
    pub policy_info: Family<PolicyInfoLabels, Gauge>,
    /// `vramguard_breaker_recovery_seconds{pool}`
    pub breaker_recovery: Family<PoolLabels, Histogram>,
    /// `vramguard_retries_total{pool, result}`
    pub retries: Family<RetryLabels, Counter>,
    /// `vramguard_failovers_total{from, to, reason}`
    pub failovers: Family<FailoverLabels, Counter>,
    /// `vramguard_substitutions_total{model, fallback_model, reason}`
    pub substitutions: Family<SubstitutionLabels, Counter>,
    /// `vramguard_http_limit_hits_total{limit}`
    pub http_limit_hits: Family<HttpLimitLabels, Counter>,
    /// `vramguard_http_connections`: connections being served now.
    pub http_connections: Gauge,
    /// Remote pools' failures and hops.
    pub remote: crate::pool::remote::RemoteFamily,
    /// The estimates' quality and what models hold.
    pub estimates: crate::telemetry::estimates::EstimateMetrics,
    /// The pools' health checks.
    pub health: crate::telemetry::health::HealthMetrics,
    /// Process-isolated pools' worker processes.
    pub workers: crate::telemetry::workers::WorkerMetrics,
    /// Which models each pool holds, their loads and unloads.
    pub residency: crate::telemetry::residency::ResidencyMetrics,
    /// Requests held back by their service's budgets.
    pub service_waits: crate::telemetry::waits::ServiceWaits,
}

fn latency_histogram() -> Histogram {
    // 1ms .. ~65s: covers a GPU request and a slow CPU fallback.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

fn sample_histogram() -> Histogram {
    // 10µs .. ~1.3s: procfs reads take microseconds, a struggling driver call can take a second.
    Histogram::new(exponential_buckets(0.00001, 4.0, 10))
}

impl Metrics {
    /// Create the handles and register them in a fresh registry (`vramguard serve`).
    pub fn new(onnxruntime_version: &str) -> (Metrics, Registry) {
        let (metrics, mut registry) = Self::sampling(onnxruntime_version);
        metrics.register_serving(&mut registry);
        metrics.register_pools(&mut registry);
        (metrics, registry)
    }

    /// Only what the sampler measures registered (`vramguard exporter`: no requests, no
    /// policy, no pools, so none of their series that could never move).
    pub fn exporter() -> (Metrics, Registry) {
        Self::sampling("none")
    }

    fn sampling(onnxruntime_version: &str) -> (Metrics, Registry) {
        let mut registry = Registry::with_prefix("vramguard");
        let metrics = Metrics {
            build_info: Family::default(),
            requests: Family::default(),
            request_duration: Family::new_with_constructor(latency_histogram),
            generated_tokens: Family::default(),
            time_to_first_token: Family::new_with_constructor(latency_histogram),
            // 100µs .. ~6.5s: a token on a GPU takes milliseconds, on a CPU fallback much longer.
            inter_token: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.0001, 2.0, 17))),
            allocator_failures: Family::default(),
            queue_wait: Family::new_with_constructor(latency_histogram),
            pool_transfer: Family::default(),
            exporter_sample_duration: Family::new_with_constructor(sample_histogram),
            exporter_errors: Family::default(),
            policy_decisions: Family::default(),
            // 0.5µs .. ~2ms: a healthy policy takes microseconds; the tail shows a slow script.
            policy_eval_duration: Histogram::new(exponential_buckets(0.0000005, 2.0, 13)),
            policy_errors: Family::default(),
            policy_reloads: Family::default(),
            policy_info: Family::default(),
            breaker_recovery: Family::new_with_constructor(|| {
                // 1 s .. ~17 min: a restore takes seconds, a cooldown tens of seconds.
                Histogram::new(exponential_buckets(1.0, 2.0, 11))
            }),
            retries: Family::default(),
            failovers: Family::default(),
            substitutions: Family::default(),
            http_limit_hits: Family::default(),
            http_connections: Gauge::default(),
            remote: Default::default(),
            estimates: Default::default(),
            health: Default::default(),
            workers: Default::default(),
            residency: Default::default(),
            service_waits: Default::default(),
        };
        metrics
            .build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION").to_string(),
                onnxruntime: onnxruntime_version.to_string(),
            })
            .set(1);
        registry.register(
            "build_info",
            "vramguard and ONNX Runtime versions (always 1)",
            metrics.build_info.clone(),
        );
        registry.register_with_unit(
            "exporter_sample_duration",
            "Time one memory source took to sample",
            Unit::Seconds,
            metrics.exporter_sample_duration.clone(),
        );
        registry.register(
            "exporter_errors",
            "Failed samples by memory source",
            metrics.exporter_errors.clone(),
        );
        // Both `serve` and `exporter` answer HTTP behind the same connection limits.
        registry.register(
            "http_limit_hits",
            "Times a client met an HTTP server limit (timeouts, connection cap, body size and bytes)",
            metrics.http_limit_hits.clone(),
        );
        registry.register(
            "http_connections",
            "HTTP connections being served now",
            metrics.http_connections.clone(),
        );
        // Every limit has its series from the start, so alerts and dashboards can rely on it.
        for limit in HttpLimit::ALL {
            metrics.http_limit_hits.get_or_create_owned(&HttpLimitLabels { limit });
        }
        (metrics, registry)
    }

    fn register_serving(&self, registry: &mut Registry) {
        let metrics = self;
        metrics.estimates.register(registry);
        metrics.health.register(registry);
        metrics.workers.register(registry);
        metrics.residency.register(registry);
        metrics.service_waits.register(registry);
        registry.register(
            "requests",
            "Inference requests by model, pool and outcome",
            metrics.requests.clone(),
        );
        registry.register_with_unit(
            "request_duration",
            "Time from accepting an inference request to its response",
            Unit::Seconds,
            metrics.request_duration.clone(),
        );
        registry.register(
            "generated_tokens",
            "Tokens generated, by model and the pool that ran the last of a request's runs",
            metrics.generated_tokens.clone(),
        );
        registry.register_with_unit(
            "time_to_first_token",
            "Time from accepting a generation request to its first token",
            Unit::Seconds,
            metrics.time_to_first_token.clone(),
        );
        registry.register_with_unit(
            "inter_token",
            "Time between consecutive tokens of a generation",
            Unit::Seconds,
            metrics.inter_token.clone(),
        );
        registry.register(
            "policy_decisions",
            "Admission decisions by action and target pool",
            metrics.policy_decisions.clone(),
        );
        registry.register_with_unit(
            "policy_eval_duration",
            "Time to evaluate the policy for one request, building its inputs included",
            Unit::Seconds,
            metrics.policy_eval_duration.clone(),
        );
        registry.register(
            "policy_errors",
            "Policy evaluations that fell back (compile, runtime, limit, bad_return)",
            metrics.policy_errors.clone(),
        );
        registry.register(
            "policy_reloads",
            "Policy reloads by result (ok, error)",
            metrics.policy_reloads.clone(),
        );
        registry.register(
            "policy_info",
            "The policy script serving now (always 1)",
            metrics.policy_info.clone(),
        );
        registry.register_with_unit(
            "breaker_recovery",
            "Time from a pool's circuit breaker opening to closing again",
            Unit::Seconds,
            metrics.breaker_recovery.clone(),
        );
        registry.register(
            "retries",
            "Retries after an allocator failure, by the failing pool and how the retry went",
            metrics.retries.clone(),
        );
        registry.register(
            "failovers",
            "Requests moved from one pool to another, by reason",
            metrics.failovers.clone(),
        );
        registry.register(
            "substitutions",
            "Requests answered by their model's fallback_model, with the client's leave, by why the model asked for could not",
            metrics.substitutions.clone(),
        );
        metrics.remote.register(registry);
        use crate::policy::PolicyErrorKind;
        for kind in [
            PolicyErrorKind::Compile,
            PolicyErrorKind::Runtime,
            PolicyErrorKind::Limit,
            PolicyErrorKind::BadReturn,
        ] {
            metrics.policy_errors.get_or_create_owned(&KindLabels { kind });
        }
        for result in [ReloadResult::ok, ReloadResult::error] {
            metrics.policy_reloads.get_or_create_owned(&ResultLabels { result });
        }
    }
}

impl Metrics {
    /// `pool`'s worker-process handles (only process-isolated pools have them).
    pub fn worker_metrics(&self, pool: &str) -> crate::pool::WorkerHandles {
        let (up, [exited, hung, restore]) = self.workers.of_pool(pool);
        crate::pool::WorkerHandles {
            up,
            exited,
            hung,
            restore,
        }
    }

    /// The handles a pool's workers record into.
    pub fn pool_metrics(&self, pool: &str, device: &str) -> crate::pool::PoolMetrics {
        let failures = |kind| {
            self.allocator_failures.get_or_create_owned(&AllocFailureLabels {
                pool: pool.to_string(),
                device: device.to_string(),
                kind,
            })
        };
        let (health_ok, health_failed) = self.health.of_pool(pool);
        let transfer = |direction| {
            self.pool_transfer.get_or_create_owned(&TransferLabels {
                pool: pool.to_string(),
                direction,
            })
        };
        crate::pool::PoolMetrics {
            to_pool: transfer("to_pool"),
            from_pool: transfer("from_pool"),
            health_ok,
            health_failed,
            worker: None,
            breaker_recovery: self
                .breaker_recovery
                .get_or_create_owned(&PoolLabels { pool: pool.to_string() }),
            queue_wait: self
                .queue_wait
                .get_or_create_owned(&PoolLabels { pool: pool.to_string() }),
            oom_failures: failures(crate::core::backend::AllocFailureKind::Oom),
            driver_failures: failures(crate::core::backend::AllocFailureKind::Driver),
        }
    }
}

/// Encode a registry as OpenMetrics text.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::with_capacity(8 * 1024);
    prometheus_client::encoding::text::encode(&mut out, registry).expect("writing to a String cannot fail");
    out
}

/// Encode a registry in the Prometheus text format 0.0.4 (what `promtool check metrics` and
/// clients that do not ask for OpenMetrics read).
pub fn encode_prometheus_text(registry: &Registry) -> String {
    let mut out = String::with_capacity(8 * 1024);
    prometheus_client::encoding::prometheus_text::encode(&mut out, registry).expect("writing to a String cannot fail");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_uses_contract_names_and_units() {
        let (metrics, registry) = Metrics::new("1.31.1");
        metrics
            .requests
            .get_or_create(&RequestLabels {
                model: "encoder".into(),
                pool: "cpu".into(),
                outcome: Outcome::ok,
            })
            .inc();
        metrics
            .allocator_failures
            .get_or_create(&AllocFailureLabels {
                pool: "gpu".into(),
                device: "gpu0".into(),
                kind: crate::core::backend::AllocFailureKind::Oom,
            })
            .inc();
        metrics
            .request_duration
            .get_or_create(&ModelPoolLabels {
                model: "encoder".into(),
                pool: "cpu".into(),
            })
            .observe(0.003);
        let text = encode(&registry);
        assert!(
            text.contains("vramguard_build_info{version=\"0.1.0\",onnxruntime=\"1.31.1\"} 1\n"),
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
        for (_, registry) in [Metrics::new("1.31.1"), Metrics::exporter()] {
            let text = encode(&registry);
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
