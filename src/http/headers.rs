//! vramguard's request and response headers: the request id kept end to end, the request
//! headers a lifecycle request is built from, and the serving pool's facts on the answer.

use crate::core::backend::RunMeta;
use crate::protocol::headers::*;
use crate::serve::lifecycle::{self, RequestError};
use crate::serve::ran::RanOn;
use crate::serve::service::Service;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::Response;
use serde_json::{Value, json};
use std::time::Duration;

/// The client's `x-request-id` when it is usable (1 to 256 visible characters), else a new
/// one: every answer and log line names its request.
pub(super) fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 256)
        .map(str::to_string)
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string())
}

/// `response` with the request id header set.
pub(super) fn with_request_id(mut response: Response, id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(id) {
        response.headers_mut().insert(HeaderName::from_static(REQUEST_ID), v);
    }
    response
}

/// A request with no inputs yet, from the headers every protocol shares: request id,
/// deadline, priority, replayability and leave to substitute. The Open Inference Protocol adds
/// the tensors; a generation endpoint builds its inputs itself.
pub(super) fn decode_headers(
    service: &Service,
    model: &str,
    id: &str,
    headers: &HeaderMap,
    received: tokio::time::Instant,
) -> Result<lifecycle::Request, RequestError> {
    let entry = service
        .model(model)
        .ok_or_else(|| RequestError::unknown_model(service, model))?;
    let deadline = header_value::<u64>(headers, DEADLINE_HEADER, "a number of milliseconds")?
        .map(|ms| (received + Duration::from_millis(ms)).into_std());
    let priority = header_value::<i64>(headers, PRIORITY_HEADER, "an integer")?.unwrap_or(0);
    let replayable = header_value::<bool>(headers, REPLAYABLE_HEADER, "`true` or `false`")?.unwrap_or(true);
    // Another model changes the answer: only with the client's leave, or the model's config's
    // for a client that does not say (an explicit `false` wins).
    let allow_substitute = header_value::<bool>(headers, ALLOW_SUBSTITUTE_HEADER, "`true` or `false`")?
        .unwrap_or(entry.config.allow_substitute);
    Ok(lifecycle::Request {
        meta: RunMeta {
            request_id: id.to_string(),
            deadline,
            // Checked by `idempotent` before the request runs; kept to pass on to remote pools.
            idempotency_key: headers
                .get(IDEMPOTENCY_KEY)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
            priority,
            replayable,
            allow_shrink: false,
        },
        model: model.to_string(),
        inputs: Vec::new(),
        outputs: Vec::new(),
        max_new_tokens: 0,
        received,
        shrinker: None,
        progress: Default::default(),
        allow_substitute,
        sequence: None,
        generations: 0,
        pads: false,
    })
}

/// A header parsed as `T`: absent is `None`, given twice or unparsable is a 400 saying it must
/// be `expected`.
pub(super) fn header_value<T: std::str::FromStr>(
    headers: &HeaderMap,
    name: &str,
    expected: &str,
) -> Result<Option<T>, RequestError> {
    let mut values = headers.get_all(name).iter();
    match values.next() {
        None => Ok(None),
        Some(_) if values.next().is_some() => Err(RequestError::BadInput(format!(
            "{name} is given more than once; send it once"
        ))),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .map(Some)
            .ok_or_else(|| RequestError::BadInput(format!("{name} must be {expected}"))),
    }
}

/// What a client is told about the pool serving it: its name and, while degraded, why, its
/// limits and the delay a new request there should expect (a stream's first chunk).
pub(super) fn pool_facts(ran: &RanOn) -> Value {
    let mut facts = json!({
        "pool": ran.pool,
        "provider": ran.provider.label(),
        "simulated": ran.simulated,
    });
    if let Some(degraded) = &ran.degraded {
        facts["degraded"] = json!(degraded);
        facts["limits"] = json!({"max_context": ran.max_context,
                                 "concurrency": ran.concurrency,
                                 "queue_capacity": ran.queue_capacity});
        facts["estimated_delay_ms"] = json!(ran.estimated_delay.as_millis() as u64);
    }
    facts
}

/// What every answer carries: the pool it reached, when it reached one, and while degraded why.
pub(super) fn pool_and_degraded(headers: &mut HeaderMap, pool: Option<&str>, degraded: Option<&str>) {
    if let Some(v) = pool.and_then(|p| HeaderValue::from_str(p).ok()) {
        headers.insert(HeaderName::from_static(POOL_HEADER), v);
    }
    if let Some(v) = degraded.and_then(|d| HeaderValue::from_str(d).ok()) {
        headers.insert(HeaderName::from_static(DEGRADED_HEADER), v);
    }
}

/// The same facts as [`pool_facts`], as response headers.
pub(super) fn pool_headers(headers: &mut HeaderMap, ran: &RanOn) {
    pool_and_degraded(headers, Some(&ran.pool), ran.degraded.as_deref());
    if ran.degraded.is_none() {
        return;
    }
    let max_context = ran.max_context.map_or_else(|| "none".to_string(), |n| n.to_string());
    let limits = format!(
        "max_context={max_context}; concurrency={}; queue_capacity={}",
        ran.concurrency, ran.queue_capacity
    );
    if let Ok(v) = HeaderValue::from_str(&limits) {
        headers.insert(HeaderName::from_static(POOL_LIMITS_HEADER), v);
    }
    headers.insert(
        HeaderName::from_static(ESTIMATED_DELAY_HEADER),
        HeaderValue::from(ran.estimated_delay.as_millis() as u64),
    );
}

/// Names the model that answered (`x-vramguard-model`), on every answer: the one asked for, or
/// its `fallback_model` when that stood in.
pub(super) fn model_header(headers: &mut HeaderMap, model: &str) {
    if let Ok(v) = HeaderValue::from_str(model) {
        headers.insert(HeaderName::from_static(MODEL_HEADER), v);
    }
}

/// Says that the prompt was cut from `from` to `to` tokens, and what went.
pub(super) fn shrink_headers(headers: &mut HeaderMap, from: u64, to: u64, cut: &str) {
    if let Ok(v) = HeaderValue::from_str(&format!("{from}->{to}")) {
        headers.insert(HeaderName::from_static(CONTEXT_HEADER), v);
    }
    if let Ok(v) = HeaderValue::from_str(cut) {
        headers.insert(HeaderName::from_static(CONTEXT_CUT_HEADER), v);
    }
}
