//! The metric families every vramguard process exports, `vramguard serve` and `vramguard
//! exporter` alike: its build, its memory sources' sampling and its HTTP server's limits
//! ([`ProcessMetrics`]), and the encoding of a registry in either text format. Names follow the documented conventions (docs/metrics.md):
//! prefix `vramguard_`, base units, `_total` counters.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

/// `{version, onnxruntime}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    /// vramguard version.
    pub version: String,
    /// ONNX Runtime version.
    pub onnxruntime: String,
}

/// `{source}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    /// Memory source: `nvml`, `simulated` or `host`.
    pub source: String,
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

/// What every vramguard process exports of itself: its versions, its memory sources' samples,
/// and the limits its HTTP server enforced.
#[derive(Debug, Clone)]
pub struct ProcessMetrics {
    /// `vramguard_build_info`
    pub build_info: Family<BuildLabels, Gauge>,
    /// `vramguard_exporter_sample_duration_seconds`
    pub exporter_sample_duration: Family<SourceLabels, Histogram>,
    /// `vramguard_exporter_errors_total`
    pub exporter_errors: Family<SourceLabels, Counter>,
    /// `vramguard_http_limit_hits_total{limit}`
    pub http_limit_hits: Family<HttpLimitLabels, Counter>,
    /// `vramguard_http_connections`: connections being served now.
    pub http_connections: Gauge,
}

fn sample_histogram() -> Histogram {
    // 10µs .. ~1.3s: procfs reads take microseconds, a struggling driver call can take a second.
    Histogram::new(exponential_buckets(0.00001, 4.0, 10))
}

impl ProcessMetrics {
    /// Create the handles and register them in a fresh registry (prefixed `vramguard`): all
    /// that `vramguard exporter` registers besides its collectors, and what `vramguard serve`
    /// registers first.
    pub fn new(onnxruntime_version: &str) -> (ProcessMetrics, Registry) {
        let mut registry = Registry::with_prefix("vramguard");
        let metrics = ProcessMetrics {
            build_info: Family::default(),
            exporter_sample_duration: Family::new_with_constructor(sample_histogram),
            exporter_errors: Family::default(),
            http_limit_hits: Family::default(),
            http_connections: Gauge::default(),
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

    /// `source` is sampled: its error counter exists from now on, at 0, so a rate over it
    /// means something before the first failure.
    pub fn sampling(&self, source: &str) {
        self.exporter_errors.get_or_create_owned(&SourceLabels {
            source: source.to_string(),
        });
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
