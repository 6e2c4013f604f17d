//! Every request, decision, failover and retry series whose label values the configuration
//! fixes, created at 0 when the service is assembled: the first scrape has them, so dashboards
//! show 0 instead of "No data" and `rate()` in the alert rules has a start to measure from
//! (Prometheus's instrumentation guidance: initialise the label values you know).

use std::sync::Arc;

use crate::core::snapshot::Action;
use crate::pool::Pool;
use crate::telemetry::metrics::{
    DecisionLabels, FailoverLabels, FailoverReason, Metrics, ModelPoolLabels, Outcome, RequestLabels, RetryLabels,
    RetryResult, SubstitutionLabels, SubstitutionReason,
};

use super::ModelEntry;

/// The `model` label of a request that names no configured model (an unknown model, a body
/// that cannot be read far enough to name one): one fixed value, so a client cannot create
/// series by sending names, and one no configured model can have (names are never empty).
pub const UNKNOWN_MODEL: &str = "";

/// Create the series at 0: requests for each model on each pool serving it (and on no pool,
/// for refusals before one was chosen) with every outcome, and refusals of requests naming no
/// configured model; durations per model and pool; decisions per action and pool; failovers
/// and retries from each pool with a fallback to that fallback, with every reason and result;
/// substitutions of each model with a `fallback_model` by it, with every reason;
/// residency (resident, loads, unloads, load and cold-start times) per model and pool.
pub(super) fn zero_known_series(metrics: &Metrics, models: &[ModelEntry], pools: &[Arc<Pool>]) {
    for entry in models {
        let model = entry.config.name.as_str();
        let serving = pools.iter().filter(|p| p.serves(model)).map(|p| p.name());
        for pool in serving {
            for outcome in Outcome::ALL {
                request(metrics, model, pool, outcome);
            }
            metrics.request_duration.get_or_create_owned(&ModelPoolLabels {
                model: model.to_string(),
                pool: pool.to_string(),
            });
            // The pool holds these handles already; asking again changes nothing.
            metrics.residency.handles(model, pool);
        }
        // Refused before any pool was chosen: never served there.
        for outcome in Outcome::ALL.into_iter().filter(|o| *o != Outcome::ok) {
            request(metrics, model, "", outcome);
        }
        // Every service vramguard runs may have its requests held back by its budgets.
        metrics.service_waits.zero(&entry.config.service);
        if let Some(fallback) = &entry.config.fallback_model {
            for reason in SubstitutionReason::ALL {
                metrics.substitutions.get_or_create_owned(&SubstitutionLabels {
                    model: model.to_string(),
                    fallback_model: fallback.clone(),
                    reason,
                });
            }
        }
    }
    request(metrics, UNKNOWN_MODEL, "", Outcome::client_error);
    for pool in pools {
        for action in Action::ALL {
            metrics.policy_decisions.get_or_create_owned(&DecisionLabels {
                action,
                pool: pool.name().to_string(),
            });
        }
        let Some(fallback) = pool.config.fallback.as_deref() else {
            continue;
        };
        for reason in FailoverReason::ALL {
            metrics.failovers.get_or_create_owned(&FailoverLabels {
                from: pool.name().to_string(),
                to: fallback.to_string(),
                reason,
            });
        }
        for result in RetryResult::ALL {
            metrics.retries.get_or_create_owned(&RetryLabels {
                pool: pool.name().to_string(),
                result,
            });
        }
    }
}

/// The request series of `model` on `pool` ending with `outcome`, created if it is not yet.
fn request(metrics: &Metrics, model: &str, pool: &str, outcome: Outcome) {
    metrics.requests.get_or_create_owned(&RequestLabels {
        model: model.to_string(),
        pool: pool.to_string(),
        outcome,
    });
}
