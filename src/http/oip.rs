//! The Open Inference Protocol (KServe v2) endpoints: server and model metadata, readiness,
//! and `infer` (decode with [`crate::protocol::oip`], hand the request down to
//! [`crate::serve::tensors`], encode what comes back; an `idempotency-key` answers a duplicate
//! with the first answer).

use super::error::{ApiError, status_of};
use super::headers::*;
use super::state::AppState;
use crate::net::conn;
use crate::protocol::headers::*;
use crate::protocol::oip as infer;
use crate::serve::idempotency::{Claim, StoredResponse};
use crate::serve::lifecycle::{self, RequestError};
use crate::serve::metrics::Outcome;
use crate::serve::ran::RanOn;
use crate::serve::service::{ModelEntry, Service};
use crate::serve::tensors;
use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// The protocol extensions served, as Triton names them: binary tensor data (here), and the
/// model repository, model configuration and statistics (`super::triton`).
const EXTENSIONS: [&str; 4] = [
    "binary_tensor_data",
    "model_repository",
    "model_configuration",
    "statistics",
];

/// `GET /v2`: the server's name, version and extensions.
pub(super) async fn server_metadata(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "name": "vramguard",
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": EXTENSIONS,
        "onnxruntime": state.service.runtime_version,
    }))
}

/// `GET /v2/health/live`: the process answers.
pub(super) async fn live() -> StatusCode {
    StatusCode::OK
}

/// `GET /v2/health/ready`: not shutting down, and some pool can take work.
pub(super) async fn ready(State(state): State<Arc<AppState>>) -> Result<StatusCode, ApiError> {
    if state.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting down"));
    }
    if state.service.ready() {
        Ok(StatusCode::OK)
    } else {
        Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no pool can take work"))
    }
}

/// The model a `/v2/models/{model}` or `/v2/models/{model}/versions/{version}` route names,
/// its version checked: each model route serves both forms with one handler.
pub(super) struct ModelPath(pub(super) String);

impl<S: Send + Sync> FromRequestParts<S> for ModelPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path(params) = Path::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::new(e.status(), e.body_text()))?;
        if let Some(version) = params.get("version") {
            check_version(version)?;
        }
        params
            .get("model")
            .cloned()
            .map(ModelPath)
            .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "no model named in the path"))
    }
}

/// Models have one version, `1`; any other is a 404.
fn check_version(version: &str) -> Result<(), ApiError> {
    if version == "1" {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "unknown model version `{}`; the only version is `1`",
                crate::core::human::clipped(version, 64)
            ),
        ))
    }
}

/// The configured model named `model`, or the 404 a lifecycle refusal of it would get.
pub(super) fn configured<'a>(state: &'a AppState, model: &str) -> Result<&'a ModelEntry, ApiError> {
    state.service.model(model).ok_or_else(|| {
        let error = RequestError::unknown_model(&state.service, model);
        ApiError::new(status_of(&error), error.to_string())
    })
}

/// `GET /v2/models/{model}`: its tensors, the pools serving it and its memory profile.
pub(super) async fn model_metadata(
    State(state): State<Arc<AppState>>,
    ModelPath(model): ModelPath,
) -> Result<Json<Value>, ApiError> {
    let entry = configured(&state, &model)?;
    let tensors = |specs: &[crate::core::signature::TensorSpec]| {
        specs
            .iter()
            .map(|s| json!({"name": s.name, "datatype": s.datatype.name(), "shape": s.shape}))
            .collect::<Vec<_>>()
    };
    let pools: Vec<Value> = state
        .service
        .pools
        .iter()
        .filter(|p| p.serves(&model))
        .map(|p| {
            let (weights, peak) = state.service.metrics.estimates.held(&model, p.name());
            json!({"name": p.name(), "provider": p.provider().label(), "device": p.config.device, "ready": p.is_ready(),
                   "resident": p.residency().is_resident(&model),
                   "memory": {"weights_bytes": weights, "workspace_peak_bytes": peak}})
        })
        .collect();
    let context = entry
        .config
        .context
        .as_ref()
        .map(|c| json!({"input": c.input, "axis": c.axis, "keep": c.keep}));
    Ok(Json(json!({
        "name": entry.config.name,
        "versions": ["1"],
        "platform": "onnxruntime_onnx",
        "inputs": tensors(&entry.signature.inputs),
        "outputs": tensors(&entry.signature.outputs),
        "parameters": {"source": entry.config.source.to_string(), "context": context, "pools": pools,
                       "residency": entry.config.residency.label(),
                       "memory_profile": entry.profile, "memory_learned": entry.learned.view()},
    })))
}

/// `GET /v2/models/{model}/ready`: some ready pool serves it.
pub(super) async fn model_ready(
    State(state): State<Arc<AppState>>,
    ModelPath(model): ModelPath,
) -> Result<StatusCode, ApiError> {
    configured(&state, &model)?;
    if state.service.pools.iter().any(|p| p.serves(&model) && p.is_ready()) {
        Ok(StatusCode::OK)
    } else {
        Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("no ready pool serves `{model}`"),
        ))
    }
}

/// `POST /v2/models/{model}/versions/{version}/infer`.
pub(super) async fn infer_versioned(
    state: State<Arc<AppState>>,
    Path((model, version)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    if let Err(e) = check_version(&version) {
        let received = tokio::time::Instant::now();
        lifecycle::answered(&state.service, &model, Outcome::client_error, received);
        return with_request_id(e.into_response(), &request_id(&headers));
    }
    infer(state, Path(model), headers, body).await
}

/// `POST /v2/models/{model}/infer`: decode, hand the request to the lifecycle, encode what
/// came back.
pub(super) async fn infer(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let received = tokio::time::Instant::now();
    let id = request_id(&headers);
    let key = headers.get(IDEMPOTENCY_KEY).cloned();
    let response = match (key, body) {
        (Some(key), Ok(body)) if state.service.model(&model).is_some() => {
            idempotent(state, model, id.clone(), headers, body, key, received).await
        }
        (_, body) => respond(&state, &model, &id, &headers, body, received).await.0,
    };
    with_request_id(response, &id)
}

/// Decode, run and encode one request, counted once; also says whether it executed (its
/// response is then what a duplicate with the same idempotency key must get).
async fn respond(
    state: &AppState,
    model: &str,
    id: &str,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    received: tokio::time::Instant,
) -> (Response, bool) {
    let service = &state.service;
    // A cheap handle on the body, for decoding it again for the model's fallback.
    let kept = body.as_ref().ok().cloned();
    let (request, decoded) = match decode(service, model, id, headers, body, received) {
        Ok(decoded) => decoded,
        Err(error) => {
            let refused = lifecycle::reject(service, model, error, received);
            return (refused_response(refused, id, None), true);
        }
    };
    // Kept only when a substitute may be asked: otherwise its memory goes now, as it would.
    let has_fallback = service.model(model).is_some_and(|m| m.config.fallback_model.is_some());
    let kept = kept.filter(|_| request.allow_substitute && has_fallback);
    // The fallback takes what the client sent only if it decodes for the fallback's signature.
    let decode_for = |fallback: &str| match kept {
        Some(body) => decode(service, fallback, id, headers, Ok(body), received).map_err(|e| e.to_string()),
        None => Err("the request's body is gone".to_string()),
    };
    let max_bytes = service.config.server.max_response_bytes;
    let result = match tensors::run(service, &state.batching, request, decode_for).await {
        Ok(ran) => {
            let answered = Answered {
                model,
                decoded: &decoded,
                substitution: ran.substitution.as_ref().map(|(s, decoded)| (s, decoded)),
            };
            // An answer that cannot be made (over its limit) is counted with the error the
            // client gets, not as served.
            let made = served_response(&answered, id, &ran.served, &ran.at, max_bytes);
            ran.finish(made).map_err(|refused| *refused)
        }
        Err(refused) => Err(refused),
    };
    match result {
        Ok(response) => (response, true),
        Err(refused) => {
            let degraded = service.degraded_reason();
            // Refused before anything ran (queue full, breaker, deadline…): a retry with the
            // same key must be allowed to run.
            let executed =
                refused.error.retry_after_secs().is_none() && !matches!(refused.error, RequestError::Deadline(_));
            (refused_response(refused, id, degraded.as_deref()), executed)
        }
    }
}

/// An `idempotency-key` request executes at most once: the first runs, duplicates in flight
/// wait for it, later ones get its stored response, and the same key with another request is
/// refused with 422 (IETF Idempotency-Key draft). Each request is counted once in the request
/// metrics, a refusal here included.
async fn idempotent(
    state: Arc<AppState>,
    model: String,
    id: String,
    headers: HeaderMap,
    body: Bytes,
    key: HeaderValue,
    received: tokio::time::Instant,
) -> Response {
    let refuse = |outcome: Outcome, error: ApiError| {
        lifecycle::answered(&state.service, &model, outcome, received);
        error.into_response()
    };
    let Some(key) = key
        .to_str()
        .ok()
        .filter(|k| !k.is_empty() && k.len() <= 255)
        .map(str::to_string)
    else {
        return refuse(
            Outcome::client_error,
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "idempotency-key must be 1 to 255 visible ASCII characters",
            ),
        );
    };
    let header = |name: &str| headers.get(name).map_or(&[][..], |v| v.as_bytes());
    // What changes the request's meaning; the request id and the deadline may differ on a retry.
    let fingerprint = crate::serve::idempotency::fingerprint(&[
        model.as_bytes(),
        &body,
        header(HEADER_LENGTH),
        header(PRIORITY_HEADER),
        header(REPLAYABLE_HEADER),
        header(ALLOW_SHRINK_HEADER),
        header(ALLOW_SUBSTITUTE_HEADER),
    ]);
    let cache = state.service.idempotency.clone();
    match cache.claim(&model, &key, fingerprint).await {
        Claim::Done(stored) => {
            // Not counted again in the request metrics: the request was, when its first answer
            // went out; this one is counted in `vramguard_idempotency_hits_total`.
            // Stripe's header name: the client can tell an answer it got again from a new run.
            let mut response = stored_response(&stored);
            response.headers_mut().insert(
                HeaderName::from_static(IDEMPOTENT_REPLAYED),
                HeaderValue::from_static("true"),
            );
            response
        }
        Claim::Conflict => refuse(
            Outcome::client_error,
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("idempotency-key `{key}` was already used for a different request to model `{model}`"),
            ),
        ),
        Claim::Busy => refuse(
            Outcome::rejected,
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "too many idempotent requests are running (server.idempotency.max_entries)",
            )
            .retry_after(1),
        ),
        Claim::Run(ticket) => {
            // The run owns the ticket, not the connection: a client that disconnects must not
            // release the key while its request still executes.
            let run = tokio::spawn(async move {
                let (response, executed) = respond(&state, &model, &id, &headers, Ok(body), received).await;
                let stored = store(response).await;
                if executed {
                    ticket.complete(stored.clone());
                } else {
                    ticket.abandon();
                }
                stored
            });
            match run.await {
                Ok(stored) => stored_response(&stored),
                Err(e) => ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("the request task failed: {e}"),
                )
                .into_response(),
            }
        }
    }
}

/// Buffer a response so it can be kept and sent again.
async fn store(response: Response) -> StoredResponse {
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
    StoredResponse {
        status: parts.status.as_u16(),
        headers: parts
            .headers
            .iter()
            .map(|(name, value)| (name.as_str().to_string(), value.as_bytes().to_vec()))
            .collect(),
        body,
    }
}

/// A stored response, sent again.
fn stored_response(stored: &StoredResponse) -> Response {
    let mut response = Response::new(axum::body::Body::from(stored.body.clone()));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    for (name, value) in &stored.headers {
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_bytes(value)) {
            response.headers_mut().append(name, value);
        }
    }
    response
}

/// Decode the protocol's request and headers into a [`lifecycle::Request`]; the decoded form is
/// kept for encoding the response (which outputs, binary or JSON).
fn decode(
    service: &Service,
    model: &str,
    id: &str,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    received: tokio::time::Instant,
) -> Result<(lifecycle::Request, infer::DecodedRequest), RequestError> {
    let mut request = decode_headers(service, model, id, headers, received)?;
    let entry = service.model(model).expect("decode_headers checked the model");
    // A body a limit refused is answered by the connection with that limit's status in place
    // of this error: it is counted by that status.
    let body = body.map_err(
        |rejection| match conn::refused_status(&rejection).unwrap_or(rejection.status()) {
            StatusCode::PAYLOAD_TOO_LARGE => {
                RequestError::BodyTooLarge(conn::body_too_large(service.config.server.body_limit as u64))
            }
            StatusCode::SERVICE_UNAVAILABLE => RequestError::Receiving(format!(
                "request bodies being received are at server.max_receiving_bytes: {}",
                rejection.body_text()
            )),
            _ => RequestError::BadInput(format!("cannot read request body: {}", rejection.body_text())),
        },
    )?;
    let header_len = header_value::<usize>(headers, HEADER_LENGTH, "a number of bytes")?;
    let allow_shrink_header = header_value::<bool>(headers, ALLOW_SHRINK_HEADER, "`true` or `false`")?;
    let mut decoded = infer::decode(&body, header_len, &entry.signature).map_err(RequestError::BadInput)?;
    drop(body);
    // The header wins over the request's parameter, which wins over the model's default.
    request.meta.allow_shrink = allow_shrink_header
        .or(decoded.allow_shrink)
        .unwrap_or(entry.config.allow_shrink);
    request.allow_substitute = header_value::<bool>(headers, ALLOW_SUBSTITUTE_HEADER, "`true` or `false`")?
        .or(decoded.allow_substitute)
        .unwrap_or(entry.config.allow_substitute);
    request.inputs = std::mem::take(&mut decoded.inputs);
    request.outputs = decoded.outputs.iter().map(|o| o.name.clone()).collect();
    Ok((request, decoded))
}

/// Who answered a request that ran: the model asked for, or its fallback with the request as
/// decoded for it.
struct Answered<'a> {
    /// The model asked for.
    model: &'a str,
    /// The request as decoded for it.
    decoded: &'a infer::DecodedRequest,
    /// Set when the model's fallback answered instead, with the request as decoded for it.
    substitution: Option<(&'a lifecycle::Substitution, &'a infer::DecodedRequest)>,
}

/// The answer to a request that ran: the encoded outputs, with the serving pool's facts (and
/// the model that answered) in `parameters` and in headers; or why they cannot be sent (the
/// client's to fix: over `server.max_response_bytes`, say).
fn served_response(
    answered: &Answered<'_>,
    id: &str,
    served: &lifecycle::Served,
    ran: &RanOn,
    max_bytes: usize,
) -> Result<Response, String> {
    let (model, decoded) = match answered.substitution {
        Some((s, decoded)) => (s.model.as_str(), decoded),
        None => (answered.model, answered.decoded),
    };
    let mut parameters = Map::new();
    // The protocol's `model_name` is the model used for inference; `parameters` says it too,
    // and what was asked for when another model stood in.
    parameters.insert("model".into(), json!(model));
    if let Some((s, _)) = answered.substitution {
        parameters.insert("requested_model".into(), json!(s.requested));
        parameters.insert("substituted".into(), json!(format!("{:?}", s.reason)));
    }
    if let Some(reason) = served.retried {
        parameters.insert("reason".into(), json!(format!("{reason:?}")));
    }
    if let Some(started) = served.retry_started {
        // When the retry's run started on the fallback, from the request's arrival.
        parameters.insert("retry_started_ms".into(), json!(started.as_secs_f64() * 1000.0));
    }
    if let Some(degraded) = &ran.degraded {
        parameters.insert("degraded".into(), json!(degraded));
    }
    parameters.insert("pool".into(), json!(ran.pool));
    parameters.insert("provider".into(), json!(ran.provider.label()));
    parameters.insert("device".into(), json!(ran.device));
    parameters.insert("simulated".into(), json!(ran.simulated));
    parameters.insert("decision".into(), json!(served.action));
    parameters.insert("request_id".into(), json!(id));
    let context = served.context.map(|(from, to)| format!("{from}->{to}"));
    if let Some(context) = &context {
        parameters.insert("context".into(), json!(context));
    }
    let encoded = infer::encode(
        model,
        decoded.id.as_deref(),
        &parameters,
        &served.outputs,
        decoded,
        max_bytes,
    )?;
    let mut response = encoded.body.into_response();
    let headers = response.headers_mut();
    headers.insert(
        HeaderName::from_static(DECISION_HEADER),
        HeaderValue::from_static(served.action.label()),
    );
    pool_headers(headers, ran);
    model_header(headers, model);
    if let Some(context) = context.and_then(|c| HeaderValue::from_str(&c).ok()) {
        headers.insert(HeaderName::from_static(CONTEXT_HEADER), context);
    }
    match encoded.header_len {
        Some(len) => {
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            headers.insert(HeaderName::from_static(HEADER_LENGTH), HeaderValue::from(len));
        }
        None => {
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
    }
    Ok(response)
}

/// The answer to a refused or failed request: its status, why, whether waiting helps, and
/// the pool and degraded mode it met.
fn refused_response(refused: lifecycle::Refused, id: &str, degraded: Option<&str>) -> Response {
    let error = &refused.error;
    if status_of(error).is_server_error() && error.outcome() == crate::serve::metrics::Outcome::failed {
        let pool = refused.pool.as_ref().map(|p| p.name());
        if matches!(error, RequestError::WorkerLost { .. }) {
            // The loss itself is logged once, as an error unless a fault knob caused it; each
            // request it took down is its consequence.
            tracing::warn!(pool, error = %error, "request failed");
        } else {
            tracing::error!(pool, error = %error, "request failed");
        }
    }
    let mut api = ApiError::new(status_of(error), error.to_string());
    if let Some(seconds) = error.retry_after_secs() {
        api = api.retry_after(seconds);
    }
    // Every error names its request, so a client can match a resumable failure to what it sent.
    api = api.with("request_id", json!(id));
    let movable = match error {
        RequestError::Allocation { kind, not_retried, .. } => Some((format!("allocator_failure_{kind}"), not_retried)),
        RequestError::Remote { kind, not_retried, .. } => Some((format!("remote_{kind}"), not_retried)),
        RequestError::WorkerLost { not_retried, .. } => Some(("worker_lost".to_string(), not_retried)),
        _ => None,
    };
    if let Some((reason, not_retried)) = movable {
        api = api.with("reason", json!(reason));
        api = api.with("retried", json!(false));
        if let Some(why) = not_retried {
            api = api.with("not_retried", json!(why.to_string()));
        }
    }
    if let RequestError::NeverFits(never) = error {
        // What a client needs to make the request smaller, without parsing the message.
        api = api.with("reason", json!("never_fits"));
        api = api.with("needed_bytes", json!(never.need_bytes));
        api = api.with("max_bytes", json!(never.largest.as_ref().map(|c| c.bytes)));
        api = api.with("max_tokens", json!(never.max_tokens));
        let dims: serde_json::Map<String, Value> = never.dims.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
        api = api.with("dims", Value::Object(dims));
    }
    if let Some(degraded) = degraded {
        api = api.with("degraded", json!(degraded));
    }
    let mut response = api.into_response();
    pool_and_degraded(
        response.headers_mut(),
        refused.pool.as_ref().map(|p| p.name()),
        degraded,
    );
    response
}
