//! Health checks of the pools, as the operator sees them: `vramguard_health_checks_total{pool,
//! result}`. A check is a probe inference at each model's smallest input on a local pool, or a
//! readiness question to a remote pool's server; it is never a request, so it is not in
//! `vramguard_requests_total`.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// How a health check went, as the `result` label.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum CheckResult {
    /// Every probe run (or the readiness check) succeeded.
    ok,
    /// One of them failed or did not answer in time.
    failed,
}

/// `{pool, result}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HealthCheckLabels {
    /// Pool name.
    pub pool: String,
    /// How it went.
    pub result: CheckResult,
}

/// The health-check metrics.
#[derive(Debug, Default)]
pub struct HealthMetrics {
    /// `vramguard_health_checks_total{pool, result}`
    pub checks: Family<HealthCheckLabels, Counter>,
}

impl HealthMetrics {
    /// Register under `registry` (prefixed `vramguard`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "health_checks",
            "Health checks of a pool (probe inferences, or a remote server's readiness), by result; not requests",
            self.checks.clone(),
        );
    }

    /// The `ok` and `failed` counters of `pool`: both series exist from the first scrape.
    pub fn of_pool(&self, pool: &str) -> (Counter, Counter) {
        let counter = |result| {
            self.checks.get_or_create_owned(&HealthCheckLabels {
                pool: pool.to_string(),
                result,
            })
        };
        (counter(CheckResult::ok), counter(CheckResult::failed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_results_exist_at_zero_and_count_apart() {
        let metrics = HealthMetrics::default();
        let mut registry = Registry::with_prefix("vramguard");
        metrics.register(&mut registry);
        let (ok, _failed) = metrics.of_pool("gpu");
        ok.inc();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for series in [
            "vramguard_health_checks_total{pool=\"gpu\",result=\"ok\"} 1\n",
            "vramguard_health_checks_total{pool=\"gpu\",result=\"failed\"} 0\n",
        ] {
            assert!(text.contains(series), "{series}: {text}");
        }
    }
}
