//! The remote pools' metric family, registered and zero-initialised here:
//! `vramguard_remote_errors_total{pool, kind}` (every kind at 0 from the first scrape, so a rate
//! over them is defined before the first failure) and
//! `vramguard_remote_request_duration_seconds{pool}`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::core::backend::RemoteFailure;
use crate::core::metrics::PoolLabels;

/// `{pool, kind}`: a remote pool's server failing.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RemoteErrorLabels {
    /// The remote pool.
    pub pool: String,
    /// How its server failed.
    pub kind: RemoteFailure,
}

/// Every remote pool's series: what `Metrics` holds and registers.
#[derive(Debug)]
pub struct RemoteFamily {
    /// `vramguard_remote_errors_total{pool, kind}`
    pub errors: Family<RemoteErrorLabels, Counter>,
    /// `vramguard_remote_request_duration_seconds{pool}`
    pub request_duration: Family<PoolLabels, Histogram>,
}

impl Default for RemoteFamily {
    fn default() -> Self {
        Self {
            errors: Family::default(),
            request_duration: Family::new_with_constructor(hop_histogram),
        }
    }
}

impl RemoteFamily {
    /// Register under `registry` (prefixed `vramguard`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "remote_errors",
            "Failures of a remote pool's server, by kind (connect, timeout, overloaded, server_error, protocol, health)",
            self.errors.clone(),
        );
        registry.register_with_unit(
            "remote_request_duration",
            "Time a request forwarded by a remote pool took there and back",
            Unit::Seconds,
            self.request_duration.clone(),
        );
    }

    /// The handles remote pool `pool` records into, its series created at 0.
    pub fn of_pool(&self, pool: &str) -> RemoteMetrics {
        let labels = |kind| RemoteErrorLabels {
            pool: pool.to_string(),
            kind,
        };
        for kind in [
            RemoteFailure::Connect,
            RemoteFailure::Timeout,
            RemoteFailure::Overloaded,
            RemoteFailure::ServerError,
            RemoteFailure::Protocol,
            RemoteFailure::Health,
        ] {
            self.errors.get_or_create_owned(&labels(kind));
        }
        RemoteMetrics {
            pool: pool.to_string(),
            errors: self.errors.clone(),
            duration: self
                .request_duration
                .get_or_create_owned(&PoolLabels { pool: pool.to_string() }),
        }
    }
}

/// The handles a remote pool records into: its server's failures and the time each forwarded
/// request took there and back.
#[derive(Debug, Clone)]
pub struct RemoteMetrics {
    pool: String,
    errors: Family<RemoteErrorLabels, Counter>,
    /// `vramguard_remote_request_duration_seconds{pool}`: one forwarded request, from sending
    /// it to its decoded answer (or failure).
    pub duration: Histogram,
}

impl RemoteMetrics {
    /// Count one failure of the remote server.
    pub fn failed(&self, kind: RemoteFailure) {
        self.errors
            .get_or_create(&RemoteErrorLabels {
                pool: self.pool.clone(),
                kind,
            })
            .inc();
    }
}

fn hop_histogram() -> Histogram {
    // 100µs .. ~52s: a loopback hop takes a fraction of a millisecond, a CPU remote seconds.
    Histogram::new(exponential_buckets(0.0001, 2.0, 20))
}
