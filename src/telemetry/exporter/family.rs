//! Encoding one family of constant metrics at scrape time, shared by every group the collector
//! encodes.

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::TypedMetric;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

/// Encode one family of constant metrics. A family with no series is still described (its
/// `# HELP` and `# TYPE`), from the first scrape: a dashboard panel or alert rule reading it sees
/// a known family with nothing in it (no service has a budget, no NVIDIA device), not a metric
/// that may be misspelt or from another version.
pub(in crate::telemetry) fn family<L: EncodeLabelSet, M: EncodeMetric + TypedMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    rows: impl IntoIterator<Item = (L, M)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, unit, M::TYPE)?;
    for (labels, metric) in rows {
        metric.encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// [`family`] of gauges.
pub(in crate::telemetry) fn gauge_family<L: EncodeLabelSet, V: prometheus_client::encoding::EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    rows: impl IntoIterator<Item = (L, V)>,
) -> Result<(), std::fmt::Error> {
    family(
        encoder,
        name,
        help,
        unit,
        rows.into_iter().map(|(l, v)| (l, ConstGauge::new(v))),
    )
}

/// The label set of a metric without labels.
pub(super) const NO_LABELS: [(&str, &str); 0] = [];

/// A byte count or counter as a gauge value, capped rather than wrapped.
pub(in crate::telemetry) fn saturating_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
