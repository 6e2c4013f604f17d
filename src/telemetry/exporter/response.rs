//! The `/metrics` response: the exposition format the client accepts.

/// `/metrics`: OpenMetrics for clients that ask for it (Prometheus does), the Prometheus text
/// format 0.0.4 otherwise (curl, `promtool check metrics`).
pub fn metrics_response(
    registry: &prometheus_client::registry::Registry,
    headers: &axum::http::HeaderMap,
) -> axum::response::Response {
    use axum::http::header;
    use axum::response::IntoResponse;
    let wants_openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(accepts_openmetrics);
    if wants_openmetrics {
        (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            crate::telemetry::metrics::encode(registry),
        )
            .into_response()
    } else {
        (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
            crate::telemetry::metrics::encode_prometheus_text(registry),
        )
            .into_response()
    }
}

/// Whether one media range of an `Accept` header asks for OpenMetrics: the type matches and its
/// quality is not 0 (`q=0` means "not acceptable", RFC 9110 §12.4.2).
pub(super) fn accepts_openmetrics(range: &str) -> bool {
    let mut parts = range.split(';').map(str::trim);
    if !parts
        .next()
        .is_some_and(|t| t.eq_ignore_ascii_case("application/openmetrics-text"))
    {
        return false;
    }
    parts
        .filter_map(|p| p.split_once('='))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
        .is_none_or(|(_, q)| q.trim().parse::<f32>().is_ok_and(|q| q > 0.0))
}
