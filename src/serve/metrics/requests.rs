//! The requests family: `vramguard_requests_total{model, pool, outcome}` and
//! `vramguard_request_duration_seconds{model, pool}`, the outcome label, and the series created
//! at 0 when the service is assembled, so that the first scrape has them: dashboards show 0
//! instead of "No data" and `rate()` in the alert rules has a start to measure from
//! (Prometheus's instrumentation guidance: initialise the label values you know).

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::core::metrics::{ModelPoolLabels, latency_histogram};

/// The `model` label of a request that names no configured model (an unknown model, a body
/// that cannot be read far enough to name one): one fixed value, so a client cannot create
/// series by sending names, and one no configured model can have (names are never empty).
pub const UNKNOWN_MODEL: &str = "";

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

/// The requests family.
#[derive(Debug)]
pub struct RequestMetrics {
    /// `vramguard_requests_total{model, pool, outcome}`
    pub total: Family<RequestLabels, Counter>,
    /// `vramguard_request_duration_seconds{model, pool}`
    pub duration: Family<ModelPoolLabels, Histogram>,
}

impl Default for RequestMetrics {
    fn default() -> Self {
        RequestMetrics {
            total: Family::default(),
            duration: Family::new_with_constructor(latency_histogram),
        }
    }
}

impl RequestMetrics {
    /// Register under `registry` (prefixed `vramguard`), with the refusals of requests naming
    /// no configured model at 0.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "requests",
            "Inference requests by model, pool and outcome",
            self.total.clone(),
        );
        registry.register_with_unit(
            "request_duration",
            "Time from accepting an inference request to its response",
            Unit::Seconds,
            self.duration.clone(),
        );
        self.zero(UNKNOWN_MODEL, "", Outcome::client_error);
    }

    /// `model` is served on `pool`: its requests there with every outcome, and their
    /// durations, exist from the first scrape.
    pub fn serving(&self, model: &str, pool: &str) {
        for outcome in Outcome::ALL {
            self.zero(model, pool, outcome);
        }
        self.duration.get_or_create_owned(&ModelPoolLabels {
            model: model.to_string(),
            pool: pool.to_string(),
        });
    }

    /// `model` is configured: its refusals before any pool was chosen (never served there)
    /// exist from the first scrape.
    pub fn configured(&self, model: &str) {
        for outcome in Outcome::ALL.into_iter().filter(|o| *o != Outcome::ok) {
            self.zero(model, "", outcome);
        }
    }

    /// The series of `model` on `pool` ending with `outcome`, created if it is not yet.
    fn zero(&self, model: &str, pool: &str, outcome: Outcome) {
        self.total.get_or_create_owned(&RequestLabels {
            model: model.to_string(),
            pool: pool.to_string(),
            outcome,
        });
    }
}
