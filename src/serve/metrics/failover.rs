//! The family of work that moved: a retry after an allocator failure, a request that went to
//! another pool, and one another model answered; their labels with every value each can take
//! (so their series exist at 0 from the start).

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// `{pool, result}`: a retry after an allocator failure on `pool`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetryLabels {
    /// The pool whose run failed.
    pub pool: String,
    /// How the retry went.
    pub result: RetryResult,
}

/// How a retry after an allocator failure went, as the `result` label.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum RetryResult {
    /// The retry was served.
    ok,
    /// The retry ran or was queued and failed too.
    failed,
    /// Not retried: the client marked the request non-replayable; it got a resumable 503.
    not_replayable,
    /// Not retried: the fallback pool could not take it (unavailable, breaker, host memory).
    no_fallback,
}

impl RetryResult {
    /// Every value, for creating each series at 0 before its first event.
    pub const ALL: [Self; 4] = [Self::ok, Self::failed, Self::not_replayable, Self::no_fallback];
}

/// `{from, to, reason}`: work moved from one pool to another.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailoverLabels {
    /// The pool the request was meant for.
    pub from: String,
    /// The pool that took it.
    pub to: String,
    /// Why it moved.
    pub reason: FailoverReason,
}

/// Why work moved to another pool, as the `reason` label.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum FailoverReason {
    /// Retried after an out-of-memory allocator failure.
    oom_retry,
    /// Retried after a driver-class failure.
    driver_retry,
    /// The first pool's circuit breaker was open.
    breaker_open,
    /// The policy redirected it before it ran.
    policy_redirect,
    /// Retried after a remote pool's server failed (unreachable, 5xx, timeout, overloaded).
    remote_retry,
    /// Retried after the pool's worker process died or hung while it held the run.
    worker_lost,
}

/// `{model, fallback_model, reason}`: a request for `model` answered by its `fallback_model`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SubstitutionLabels {
    /// The model asked for.
    pub model: String,
    /// The model that answered instead.
    pub fallback_model: String,
    /// Why the model asked for could not.
    pub reason: SubstitutionReason,
}

/// Why a model's `fallback_model` answered instead of it, as the `reason` label.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum SubstitutionReason {
    /// The circuit breaker of every pool serving it was open.
    breaker_open,
    /// It did not fit: the policy refused it, the host's memory reserve, or no pool could ever
    /// give it enough.
    no_fit,
    /// No pool serving it could take work (not ready, lost its workers).
    unavailable,
}

impl SubstitutionReason {
    /// Every value, for creating each series at 0 before its first event.
    pub const ALL: [Self; 3] = [Self::breaker_open, Self::no_fit, Self::unavailable];
}

impl FailoverReason {
    /// Every value, for creating each series at 0 before its first event.
    pub const ALL: [Self; 6] = [
        Self::oom_retry,
        Self::driver_retry,
        Self::breaker_open,
        Self::policy_redirect,
        Self::remote_retry,
        Self::worker_lost,
    ];

    /// Whether work moved because it did not fit in accelerator memory, which starts degraded
    /// mode's memory-redirect window: an out-of-memory retry, or a policy redirect (the shipped
    /// policies redirect for memory). A driver retry or an open breaker is not (the breaker
    /// says why while it lasts), nor is a remote server failing.
    pub fn moves_for_memory(self) -> bool {
        match self {
            Self::oom_retry | Self::policy_redirect => true,
            Self::driver_retry | Self::breaker_open | Self::remote_retry | Self::worker_lost => false,
        }
    }
}

/// The failover family.
#[derive(Debug, Default)]
pub struct FailoverMetrics {
    /// `vramguard_retries_total{pool, result}`
    pub retries: Family<RetryLabels, Counter>,
    /// `vramguard_failovers_total{from, to, reason}`
    pub failovers: Family<FailoverLabels, Counter>,
    /// `vramguard_substitutions_total{model, fallback_model, reason}`
    pub substitutions: Family<SubstitutionLabels, Counter>,
}

impl FailoverMetrics {
    /// Register under `registry` (prefixed `vramguard`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "retries",
            "Retries after an allocator failure, by the failing pool and how the retry went",
            self.retries.clone(),
        );
        registry.register(
            "failovers",
            "Requests moved from one pool to another, by reason",
            self.failovers.clone(),
        );
        registry.register(
            "substitutions",
            "Requests answered by their model's fallback_model, with the client's leave, by why the model asked for could not",
            self.substitutions.clone(),
        );
    }

    /// Pool `from` falls back to `to`: the failovers between them with every reason, and the
    /// retries after a failure on `from` with every result, exist from the first scrape.
    pub fn fallback(&self, from: &str, to: &str) {
        for reason in FailoverReason::ALL {
            self.failovers.get_or_create_owned(&FailoverLabels {
                from: from.to_string(),
                to: to.to_string(),
                reason,
            });
        }
        for result in RetryResult::ALL {
            self.retries.get_or_create_owned(&RetryLabels {
                pool: from.to_string(),
                result,
            });
        }
    }

    /// Model `model` may be answered by `fallback_model`: its substitutions with every reason
    /// exist from the first scrape.
    pub fn substitute(&self, model: &str, fallback_model: &str) {
        for reason in SubstitutionReason::ALL {
            self.substitutions.get_or_create_owned(&SubstitutionLabels {
                model: model.to_string(),
                fallback_model: fallback_model.to_string(),
                reason,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::FailoverReason;

    #[test]
    fn only_memory_moves_count_as_memory_redirects() {
        let moved: Vec<FailoverReason> = FailoverReason::ALL
            .into_iter()
            .filter(|r| r.moves_for_memory())
            .collect();
        assert_eq!(moved, [FailoverReason::oom_retry, FailoverReason::policy_redirect]);
    }
}
