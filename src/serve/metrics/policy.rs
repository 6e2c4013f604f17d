//! The admission policy's family: its decisions, how long each took, its failures and reloads,
//! and the script serving now. Every label value the configuration fixes exists from the first
//! scrape.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::core::snapshot::Action;
use crate::policy::{PolicyErrorKind, PolicyStatus};

/// `{action, pool}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// The decision's kind.
    pub action: Action,
    /// The pool the decision sends the request to (the request's pool for defer/reject).
    pub pool: String,
}

/// `{kind}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// Kind of policy failure: `compile`, `runtime`, `limit` or `bad_return`.
    pub kind: PolicyErrorKind,
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

/// The policy family.
#[derive(Debug)]
pub struct PolicyMetrics {
    /// `vramguard_policy_decisions_total{action, pool}`
    pub decisions: Family<DecisionLabels, Counter>,
    /// `vramguard_policy_eval_duration_seconds`
    pub eval_duration: Histogram,
    /// `vramguard_policy_errors_total{kind}`
    pub errors: Family<KindLabels, Counter>,
    /// `vramguard_policy_reloads_total{result}`
    pub reloads: Family<ResultLabels, Counter>,
    /// `vramguard_policy_info` (one series: the script serving now)
    pub info: Family<PolicyInfoLabels, Gauge>,
}

impl Default for PolicyMetrics {
    fn default() -> Self {
        PolicyMetrics {
            decisions: Family::default(),
            // 0.5µs .. ~2ms: a healthy policy takes microseconds; the tail shows a slow script.
            eval_duration: Histogram::new(exponential_buckets(0.0000005, 2.0, 13)),
            errors: Family::default(),
            reloads: Family::default(),
            info: Family::default(),
        }
    }
}

impl PolicyMetrics {
    /// Register under `registry` (prefixed `vramguard`), every kind of failure and every
    /// reload result at 0.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "policy_decisions",
            "Admission decisions by action and target pool",
            self.decisions.clone(),
        );
        registry.register_with_unit(
            "policy_eval_duration",
            "Time to evaluate the policy for one request, building its inputs included",
            Unit::Seconds,
            self.eval_duration.clone(),
        );
        registry.register(
            "policy_errors",
            "Policy evaluations that fell back (compile, runtime, limit, bad_return)",
            self.errors.clone(),
        );
        registry.register(
            "policy_reloads",
            "Policy reloads by result (ok, error)",
            self.reloads.clone(),
        );
        registry.register(
            "policy_info",
            "The policy script serving now (always 1)",
            self.info.clone(),
        );
        for kind in [
            PolicyErrorKind::Compile,
            PolicyErrorKind::Runtime,
            PolicyErrorKind::Limit,
            PolicyErrorKind::BadReturn,
        ] {
            self.errors.get_or_create_owned(&KindLabels { kind });
        }
        for result in [ReloadResult::ok, ReloadResult::error] {
            self.reloads.get_or_create_owned(&ResultLabels { result });
        }
    }

    /// Pool `pool` may be decided for: its decisions with every action exist from the first
    /// scrape.
    pub fn pool(&self, pool: &str) {
        for action in Action::ALL {
            self.decisions.get_or_create_owned(&DecisionLabels {
                action,
                pool: pool.to_string(),
            });
        }
    }

    /// Show the policy now serving, and only it, as `vramguard_policy_info{path,sha256} 1`.
    pub fn show(&self, status: &PolicyStatus) {
        self.info.clear();
        self.info
            .get_or_create(&PolicyInfoLabels {
                path: status.origin.clone(),
                sha256: status.sha256.clone(),
            })
            .set(1);
    }
}
