//! The HTTP API: Open Inference Protocol (KServe v2) endpoints, `/status` and `/metrics`.
//! [`app`] builds the router so tests can drive it without a socket; [`serve`] runs it with a
//! bounded graceful shutdown.

pub mod admin;
pub mod conn;
pub mod infer;
pub mod openai;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::{Json, Router};
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;

use crate::idempotency::{Claim, StoredResponse};
use crate::lifecycle::{self, RequestError};
use crate::pool::{Availability, Pool};
use crate::service::Service;
use crate::snapshot::DeviceClass;

/// Request id header, kept end to end.
pub const REQUEST_ID: &str = "x-request-id";
/// Header naming the pool that served the request.
pub const POOL_HEADER: &str = "x-vramguard-pool";
/// Header naming the admission decision.
pub const DECISION_HEADER: &str = "x-vramguard-decision";
/// Client deadline in milliseconds from arrival.
pub const DEADLINE_HEADER: &str = "x-vramguard-deadline-ms";
/// Client priority (integer, higher is more important).
pub const PRIORITY_HEADER: &str = "x-vramguard-priority";
/// `false` when the request must never be retried automatically once started.
pub const REPLAYABLE_HEADER: &str = "x-vramguard-replayable";
/// A client's key for executing a request at most once.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Set on a response that is the stored answer of an earlier request with the same key.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// Why the service is degraded, on every response while it is.
pub const DEGRADED_HEADER: &str = "x-vramguard-degraded";
/// `true` when the client allows its context to be cut (overrides `parameters.allow_shrink`).
pub const ALLOW_SHRINK_HEADER: &str = "x-vramguard-allow-shrink";
/// While degraded: the serving pool's limits, `max_context=N; concurrency=N; queue_capacity=N`.
pub const POOL_LIMITS_HEADER: &str = "x-vramguard-pool-limits";
/// While degraded: the serving pool's current delay estimate for a new request, milliseconds.
pub const ESTIMATED_DELAY_HEADER: &str = "x-vramguard-estimated-delay-ms";
/// What a shrink of a generation's prompt left out (`x-vramguard-context` has the counts).
pub const CONTEXT_CUT_HEADER: &str = "x-vramguard-context-cut";
/// `FROM->TO` tokens when the context was shrunk.
pub const CONTEXT_HEADER: &str = "x-vramguard-context";
/// Binary extension header: length of the JSON part.
pub const HEADER_LENGTH: &str = "inference-header-content-length";

/// Shared state of the HTTP layer.
pub struct AppState {
    /// The running service.
    pub service: Arc<Service>,
    /// Set once shutdown starts: readiness turns false.
    pub shutting_down: AtomicBool,
    /// Wall-clock start, for `/status`.
    pub started: SystemTime,
    /// Bearer token for `/admin` (from the env var `server.admin_token_env` names).
    pub admin_token: Option<String>,
}

impl AppState {
    /// Wrap an service. The admin token is read from the environment variable the config names;
    /// a named variable that is unset or empty is an error (the operator meant to set a token).
    pub fn new(service: Arc<Service>) -> Result<Arc<AppState>, String> {
        let admin_token = match &service.config.server.admin_token_env {
            None => None,
            Some(var) => match std::env::var(var) {
                Ok(token) if !token.trim().is_empty() => Some(token),
                _ => {
                    return Err(format!(
                        "{}: server.admin_token_env names `{var}`, which is not set (or empty) in the environment",
                        service.config.source
                    ));
                }
            },
        };
        Ok(AppState::with_admin_token(service, admin_token))
    }

    /// Wrap a service with the admin token given (`None`: no admin over TCP).
    pub fn with_admin_token(service: Arc<Service>, admin_token: Option<String>) -> Arc<AppState> {
        Arc::new(AppState {
            service,
            shutting_down: AtomicBool::new(false),
            started: SystemTime::now(),
            admin_token,
        })
    }
}

/// An error answered as `{"error": "..."}` with a status and optional `Retry-After`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    retry_after: Option<u64>,
    /// Fields beside `error` (the request id and reason of a resumable failure).
    extra: Map<String, Value>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            retry_after: None,
            extra: Map::new(),
        }
    }

    fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds.max(1));
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = self.extra;
        body.insert("error".into(), Value::String(self.message));
        let mut response = (self.status, Json(Value::Object(body))).into_response();
        if let Some(s) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}

/// Build the router.
pub fn app(state: Arc<AppState>) -> Router {
    let body_limit = state.service.config.server.body_limit;
    Router::new()
        .route("/v2", get(server_metadata))
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .route("/v2/models/{model}", get(model_metadata))
        .route("/v2/models/{model}/versions/{version}", get(model_metadata_versioned))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route(
            "/v2/models/{model}/versions/{version}/ready",
            get(model_ready_versioned),
        )
        .route("/v2/models/{model}/infer", post(infer))
        .route("/v2/models/{model}/versions/{version}/infer", post(infer_versioned))
        .route("/status", get(status))
        .route("/", get(status_page))
        .route("/v1/models", get(openai::models))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .merge(admin::tcp_routes(&state))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .method_not_allowed_fallback(|method: axum::http::Method| async move {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("method {method} is not allowed on this endpoint"),
            )
        })
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// Serve until `shutdown` resolves, then stop accepting, answer queued work with 503, and let
/// running work and open connections finish until one deadline, `server.shutdown_grace` after
/// the signal, for everything. Background tasks (sampler, policy watcher) are tracked and
/// awaited before returning.
pub async fn serve(
    state: Arc<AppState>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let token = tokio_util::sync::CancellationToken::new();
    let tasks = tokio_util::task::TaskTracker::new();
    if let Some(sampler) = state.service.take_sampler() {
        tasks.spawn(sampler.run(
            state.service.config.exporter.sample_interval,
            token.clone(),
            Arc::clone(&state.service.resample),
        ));
    }
    if let (crate::config::PolicySource::File(path), Some(interval)) = (
        &state.service.config.policy.source,
        state.service.config.policy.watch_interval,
    ) {
        tasks.spawn(watch_policy(
            Arc::clone(&state.service),
            path.clone(),
            interval,
            token.clone(),
        ));
    }
    for pool in &state.service.pools {
        if let crate::config::Provider::Remote(options) = pool.provider() {
            tasks.spawn(crate::remote::watch_health(
                Arc::clone(pool),
                options.clone(),
                state.service.metrics.remote_metrics(pool.name()),
                token.clone(),
            ));
        }
    }
    tasks.close();
    // Responses are small and latency matters: never let Nagle hold back the last segment.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
    });
    let limits = conn::Limits::new(&state.service.config.server, &state.service.metrics);
    let mut server = tokio::spawn(conn::serve(listener, app(Arc::clone(&state)), limits, token.clone()));
    tokio::select! {
        result = &mut server => {
            token.cancel();
            tasks.wait().await;
            return result.map_err(std::io::Error::other);
        }
        () = shutdown => {}
    }
    let deadline = tokio::time::Instant::now() + state.service.config.server.shutdown_grace;
    tracing::info!("shutting down: no new connections; queued requests are answered 503");
    state.shutting_down.store(true, Ordering::SeqCst);
    token.cancel();
    let service = Arc::clone(&state.service);
    let pools_deadline = deadline.into_std();
    let _ = tokio::task::spawn_blocking(move || service.shutdown(pools_deadline)).await;
    let result = match tokio::time::timeout_at(deadline, &mut server).await {
        Ok(result) => result.map_err(std::io::Error::other),
        Err(_) => {
            tracing::warn!("connections still open at the shutdown deadline; closing them");
            server.abort();
            Ok(())
        }
    };
    tasks.wait().await;
    result
}

/// Reload the policy when its file changes (checked every `interval`; editors that replace the
/// file count as a change too).
async fn watch_policy(
    service: Arc<Service>,
    path: std::path::PathBuf,
    interval: Duration,
    cancel: tokio_util::sync::CancellationToken,
) {
    let stamp = |path: &std::path::Path| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let mut seen = stamp(&path);
    let mut ticker = tokio::time::interval(interval);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let now = stamp(&path);
        if now.is_none() || now == seen {
            continue;
        }
        seen = now;
        let service = Arc::clone(&service);
        if let Ok(Err(e)) = tokio::task::spawn_blocking(move || service.reload_policy()).await {
            tracing::warn!(error = %e, "policy file changed but the new script was refused");
        }
    }
}

async fn server_metadata(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "name": "vramguard",
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": ["binary_tensor_data"],
        "onnxruntime": state.service.runtime_version,
    }))
}

async fn live() -> StatusCode {
    StatusCode::OK
}

async fn ready(State(state): State<Arc<AppState>>) -> Result<StatusCode, ApiError> {
    if state.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting down"));
    }
    if state.service.ready() {
        Ok(StatusCode::OK)
    } else {
        Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no pool can take work"))
    }
}

fn check_version(version: &str) -> Result<(), ApiError> {
    if version == "1" {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "unknown model version `{}`; the only version is `1`",
                crate::logging::clipped(version, 64)
            ),
        ))
    }
}

fn unknown_model(state: &AppState, model: &str) -> ApiError {
    let error = RequestError::unknown_model(&state.service, model);
    ApiError::new(error.status(), error.to_string())
}

async fn model_metadata(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let entry = state
        .service
        .model(&model)
        .ok_or_else(|| unknown_model(&state, &model))?;
    let tensors = |specs: &[crate::onnx::TensorSpec]| {
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
        .map(|p| json!({"name": p.name(), "provider": p.provider().label(), "device": p.config.device, "ready": p.is_ready()}))
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
                       "memory_profile": entry.profile},
    })))
}

async fn model_metadata_versioned(
    state: State<Arc<AppState>>,
    Path((model, version)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    check_version(&version)?;
    model_metadata(state, Path(model)).await
}

async fn model_ready(State(state): State<Arc<AppState>>, Path(model): Path<String>) -> Result<StatusCode, ApiError> {
    state
        .service
        .model(&model)
        .ok_or_else(|| unknown_model(&state, &model))?;
    if state.service.pools.iter().any(|p| p.serves(&model) && p.is_ready()) {
        Ok(StatusCode::OK)
    } else {
        Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("no ready pool serves `{model}`"),
        ))
    }
}

async fn model_ready_versioned(
    state: State<Arc<AppState>>,
    Path((model, version)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    check_version(&version)?;
    model_ready(state, Path(model)).await
}

async fn infer_versioned(
    state: State<Arc<AppState>>,
    Path((model, version)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    if let Err(e) = check_version(&version) {
        return with_request_id(e.into_response(), &request_id(&headers));
    }
    infer(state, Path(model), headers, body).await
}

fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 256)
        .map(str::to_string)
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string())
}

fn with_request_id(mut response: Response, id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(id) {
        response.headers_mut().insert(HeaderName::from_static(REQUEST_ID), v);
    }
    response
}

/// `POST /v2/models/{model}/infer`: decode, hand the request to the lifecycle, encode what
/// came back.
async fn infer(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let id = request_id(&headers);
    let key = headers.get(IDEMPOTENCY_KEY).cloned();
    let response = match (key, body) {
        (Some(key), Ok(body)) if state.service.model(&model).is_some() => {
            idempotent(state, model, id.clone(), headers, body, key).await
        }
        (_, body) => respond(&state, &model, &id, &headers, body).await.0,
    };
    with_request_id(response, &id)
}

/// Decode, run and encode one request; also says whether it executed (its response is then
/// what a duplicate with the same idempotency key must get).
async fn respond(
    state: &AppState,
    model: &str,
    id: &str,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> (Response, bool) {
    let received = tokio::time::Instant::now();
    let service = &state.service;
    let (request, decoded) = match decode(service, model, id, headers, body, received) {
        Ok(decoded) => decoded,
        Err(error) => {
            let refused = lifecycle::reject(service, model, error, received);
            return (refused_response(refused, id, None), true);
        }
    };
    let result = lifecycle::infer(service, request).await;
    // Degraded mode as it is when the answer goes out, on every response served meanwhile.
    let degraded = service.degraded.now();
    match result {
        Ok(served) => {
            let max_bytes = service.config.server.max_response_bytes;
            (
                served_response(model, id, &served, &decoded, degraded.as_ref(), max_bytes),
                true,
            )
        }
        Err(refused) => {
            // Refused before anything ran (queue full, breaker, deadline…): a retry with the
            // same key must be allowed to run.
            let executed =
                refused.error.retry_after_secs().is_none() && !matches!(refused.error, RequestError::Deadline(_));
            (refused_response(refused, id, degraded.as_ref()), executed)
        }
    }
}

/// An `idempotency-key` request executes at most once: the first runs, duplicates in flight
/// wait for it, later ones get its stored response, and the same key with another request is
/// refused with 422 (IETF Idempotency-Key draft).
async fn idempotent(
    state: Arc<AppState>,
    model: String,
    id: String,
    headers: HeaderMap,
    body: Bytes,
    key: HeaderValue,
) -> Response {
    let Some(key) = key
        .to_str()
        .ok()
        .filter(|k| !k.is_empty() && k.len() <= 255)
        .map(str::to_string)
    else {
        return ApiError::new(
            StatusCode::BAD_REQUEST,
            "idempotency-key must be 1 to 255 visible ASCII characters",
        )
        .into_response();
    };
    let header = |name: &str| headers.get(name).map_or(&[][..], |v| v.as_bytes());
    // What changes the request's meaning; the request id and the deadline may differ on a retry.
    let fingerprint = crate::idempotency::fingerprint(&[
        model.as_bytes(),
        &body,
        header(HEADER_LENGTH),
        header(PRIORITY_HEADER),
        header(REPLAYABLE_HEADER),
        header(ALLOW_SHRINK_HEADER),
    ]);
    let cache = state.service.idempotency.clone();
    match cache.claim(&model, &key, fingerprint).await {
        Claim::Done(stored) => {
            // Stripe's header name: the client can tell an answer it got again from a new run.
            let mut response = stored_response(&stored);
            response.headers_mut().insert(
                HeaderName::from_static(IDEMPOTENT_REPLAYED),
                HeaderValue::from_static("true"),
            );
            response
        }
        Claim::Conflict => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("idempotency-key `{key}` was already used for a different request to model `{model}`"),
        )
        .into_response(),
        Claim::Busy => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many idempotent requests are running (server.idempotency.max_entries)",
        )
        .retry_after(1)
        .into_response(),
        Claim::Run(ticket) => {
            // The run owns the ticket, not the connection: a client that disconnects must not
            // release the key while its request still executes.
            let run = tokio::spawn(async move {
                let (response, executed) = respond(&state, &model, &id, &headers, Ok(body)).await;
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
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            RequestError::BodyTooLarge {
                limit: service.config.server.body_limit,
            }
        } else {
            RequestError::BadInput(format!("cannot read request body: {}", rejection.body_text()))
        }
    })?;
    let header_len = header_value::<usize>(headers, HEADER_LENGTH, "a number of bytes")?;
    let allow_shrink_header = header_value::<bool>(headers, ALLOW_SHRINK_HEADER, "`true` or `false`")?;
    let mut decoded = infer::decode(&body, header_len, &entry.signature).map_err(RequestError::BadInput)?;
    drop(body);
    // The header wins over the request's parameter, which wins over the model's default.
    request.allow_shrink = allow_shrink_header
        .or(decoded.allow_shrink)
        .unwrap_or(entry.config.allow_shrink);
    request.inputs = std::mem::take(&mut decoded.inputs);
    request.outputs = decoded.outputs.iter().map(|o| o.name.clone()).collect();
    Ok((request, decoded))
}

/// A request with no inputs yet, from the headers every protocol shares: request id,
/// deadline, priority and replayability. [`decode`] adds the tensors; a generation endpoint
/// builds its inputs itself.
fn decode_headers(
    service: &Service,
    model: &str,
    id: &str,
    headers: &HeaderMap,
    received: tokio::time::Instant,
) -> Result<lifecycle::Request, RequestError> {
    service
        .model(model)
        .ok_or_else(|| RequestError::unknown_model(service, model))?;
    let deadline = header_value::<u64>(headers, DEADLINE_HEADER, "a number of milliseconds")?
        .map(|ms| received + Duration::from_millis(ms));
    let priority = header_value::<i64>(headers, PRIORITY_HEADER, "an integer")?.unwrap_or(0);
    let replayable = header_value::<bool>(headers, REPLAYABLE_HEADER, "`true` or `false`")?.unwrap_or(true);
    Ok(lifecycle::Request {
        id: id.to_string(),
        model: model.to_string(),
        inputs: Vec::new(),
        outputs: Vec::new(),
        priority,
        replayable,
        allow_shrink: false,
        max_new_tokens: 0,
        deadline,
        // Checked by `idempotent` before the request runs; kept to pass on to remote pools.
        idempotency_key: headers
            .get(IDEMPOTENCY_KEY)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        received,
        shrinker: None,
        progress: Default::default(),
    })
}

fn header_value<T: std::str::FromStr>(
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
fn pool_facts(pool: &Pool, degraded: Option<&crate::degraded::Now>) -> Value {
    let mut facts = json!({
        "pool": pool.name(),
        "provider": pool.provider().label(),
        "simulated": pool.device_kind == DeviceClass::Simulated,
    });
    if let Some(degraded) = degraded {
        facts["degraded"] = json!(degraded.reason);
        facts["limits"] = json!({"max_context": pool.config.max_context,
                                 "concurrency": pool.config.workers,
                                 "queue_capacity": pool.config.queue_capacity});
        facts["estimated_delay_ms"] = json!(pool.load().estimated_delay.as_millis() as u64);
    }
    facts
}

/// The same facts as [`pool_facts`], as response headers.
fn pool_headers(headers: &mut HeaderMap, pool: &Pool, degraded: Option<&crate::degraded::Now>) {
    if let Ok(v) = HeaderValue::from_str(pool.name()) {
        headers.insert(HeaderName::from_static(POOL_HEADER), v);
    }
    let Some(degraded) = degraded else {
        return;
    };
    if let Ok(v) = HeaderValue::from_str(&degraded.reason) {
        headers.insert(HeaderName::from_static(DEGRADED_HEADER), v);
    }
    let max_context = pool
        .config
        .max_context
        .map_or_else(|| "none".to_string(), |n| n.to_string());
    let limits = format!(
        "max_context={max_context}; concurrency={}; queue_capacity={}",
        pool.config.workers, pool.config.queue_capacity
    );
    if let Ok(v) = HeaderValue::from_str(&limits) {
        headers.insert(HeaderName::from_static(POOL_LIMITS_HEADER), v);
    }
    headers.insert(
        HeaderName::from_static(ESTIMATED_DELAY_HEADER),
        HeaderValue::from(pool.load().estimated_delay.as_millis() as u64),
    );
}

fn served_response(
    model: &str,
    id: &str,
    served: &lifecycle::Served,
    decoded: &infer::DecodedRequest,
    degraded: Option<&crate::degraded::Now>,
    max_bytes: usize,
) -> Response {
    let pool = &served.pool;
    let mut parameters = Map::new();
    if let Some(reason) = served.retried {
        parameters.insert("reason".into(), json!(format!("{reason:?}")));
    }
    if let Some(started) = served.retry_started {
        // When the retry's run started on the fallback, from the request's arrival.
        parameters.insert("retry_started_ms".into(), json!(started.as_secs_f64() * 1000.0));
    }
    if let Some(degraded) = degraded {
        parameters.insert("degraded".into(), json!(degraded.reason));
    }
    parameters.insert("pool".into(), json!(pool.name()));
    parameters.insert("provider".into(), json!(pool.provider().label()));
    parameters.insert("device".into(), json!(pool.config.device));
    parameters.insert("simulated".into(), json!(pool.device_kind == DeviceClass::Simulated));
    parameters.insert("decision".into(), json!(served.action));
    parameters.insert("request_id".into(), json!(id));
    let context = served.context.map(|(from, to)| format!("{from}->{to}"));
    if let Some(context) = &context {
        parameters.insert("context".into(), json!(context));
    }
    let encoded = match infer::encode(
        model,
        decoded.id.as_deref(),
        &parameters,
        &served.outputs,
        decoded,
        max_bytes,
    ) {
        Ok(encoded) => encoded,
        Err(message) => {
            let mut api = ApiError::new(StatusCode::BAD_REQUEST, message);
            api.extra.insert("request_id".into(), json!(id));
            return api.into_response();
        }
    };
    let mut response = encoded.body.into_response();
    let headers = response.headers_mut();
    headers.insert(
        HeaderName::from_static(DECISION_HEADER),
        HeaderValue::from_static(served.action.label()),
    );
    pool_headers(headers, pool, degraded);
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
    response
}

fn refused_response(refused: lifecycle::Refused, id: &str, degraded: Option<&crate::degraded::Now>) -> Response {
    let error = &refused.error;
    if error.status().is_server_error() && error.outcome() == crate::metrics::Outcome::failed {
        tracing::error!(pool = refused.pool.as_ref().map(|p| p.name()), error = %error, "request failed");
    }
    let mut api = ApiError::new(error.status(), error.to_string());
    if let Some(seconds) = error.retry_after_secs() {
        api = api.retry_after(seconds);
    }
    // Every error names its request, so a client can match a resumable failure to what it sent.
    api.extra.insert("request_id".into(), json!(id));
    let movable = match error {
        RequestError::Allocation { kind, not_retried, .. } => Some((format!("allocator_failure_{kind}"), not_retried)),
        RequestError::Remote { kind, not_retried, .. } => Some((format!("remote_{kind}"), not_retried)),
        _ => None,
    };
    if let Some((reason, not_retried)) = movable {
        api.extra.insert("reason".into(), json!(reason));
        api.extra.insert("retried".into(), json!(false));
        if let Some(why) = not_retried {
            api.extra.insert("not_retried".into(), json!(why.to_string()));
        }
    }
    if let Some(degraded) = degraded {
        api.extra.insert("degraded".into(), json!(degraded.reason));
    }
    let mut response = api.into_response();
    if let Some(pool) = refused.pool.as_ref().and_then(|p| HeaderValue::from_str(p.name()).ok()) {
        response
            .headers_mut()
            .insert(HeaderName::from_static(POOL_HEADER), pool);
    }
    if let Some(v) = degraded.and_then(|d| HeaderValue::from_str(&d.reason).ok()) {
        response
            .headers_mut()
            .insert(HeaderName::from_static(DEGRADED_HEADER), v);
    }
    response
}

/// `GET /`: a status page for people, served from the binary; it polls `/status`.
async fn status_page() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        include_str!("status.html"),
    )
}

async fn status(State(state): State<Arc<AppState>>) -> Json<Value> {
    let service = &state.service;
    let sample = service.store.latest();
    let pools: Vec<Value> = service
        .pools
        .iter()
        .map(|p| {
            let load = p.load();
            let (state_name, reason) = match p.availability() {
                Availability::Ready if p.is_ready() => ("ready", None),
                Availability::Ready => ("stopping", None),
                Availability::Unavailable(r) => ("unavailable", Some(r)),
            };
            let arena = crate::exporter::pool_arena(p, &service.simulated).map(|s| {
                json!({"reserved_bytes": s.reserved_bytes, "active_bytes": s.active_bytes,
                       "peak_active_bytes": s.peak_active_bytes, "limit_bytes": s.limit_bytes,
                       "extensions": s.extensions, "shrinkages": s.shrinkages})
            });
            json!({
                "name": p.name(),
                "provider": p.provider().label(),
                "device": p.config.device,
                "device_kind": p.device_kind,
                "simulated": p.device_kind == DeviceClass::Simulated,
                "state": state_name,
                "reason": reason,
                "models": p.config.models,
                "workers": p.config.workers,
                "queue_depth": load.queue_depth,
                "queue_capacity": p.config.queue_capacity,
                "queue_oldest_age_ms": load.oldest_age.as_millis() as u64,
                "inflight": load.inflight,
                "estimated_delay_ms": load.estimated_delay.as_millis() as u64,
                "breaker": p.breaker_state().label(),
                "breaker_reason": p.breaker_tripped(),
                "max_context": p.config.max_context,
                "fallback": p.config.fallback,
                "alloc_failures_recent": p.alloc_failures_recent(),
                "arena": arena,
            })
        })
        .collect();
    let devices: Map<String, Value> = sample
        .snapshot
        .devices
        .iter()
        .map(|(name, d)| {
            let mut value = json!(d);
            if let Some(sim) = service.simulated_device(name) {
                value["simulated"] = json!(true);
                value["pressure_bytes"] = json!(sim.pressure());
            }
            (name.clone(), value)
        })
        .collect();
    let started = state
        .started
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "onnxruntime": service.runtime_version,
        "config": service.config.source,
        "started_unix": started,
        "shutting_down": state.shutting_down.load(Ordering::SeqCst),
        "degraded": match service.degraded.now() {
            Some(now) => json!({"active": true, "reason": now.reason, "cause": now.cause.label(),
                                "since_unix": unix_seconds(now.since),
                                "fallbacks": fallbacks(service)}),
            None => json!({"active": false, "reason": null, "cause": null, "since_unix": null,
                           "fallbacks": []}),
        },
        "pools": pools,
        "devices": devices,
        "host": sample.snapshot.host,
        "processes": sample.snapshot.processes,
        "sample_age_ms": sample.taken_at.map(|t| t.elapsed().as_millis() as u64),
        "policy": policy_status(service),
        "recent_decisions": service.decisions.list(),
    }))
}

/// Where work goes while degraded: each configured `fallback`, with the limits a redirected
/// request meets there and the delay a new one should expect (queue position × recent run time).
fn fallbacks(service: &Service) -> Vec<Value> {
    service
        .pools
        .iter()
        .filter_map(|from| {
            let to = service.pool(from.config.fallback.as_deref()?)?;
            let load = to.load();
            Some(json!({
                "from": from.name(),
                "pool": to.name(),
                "max_context": to.config.max_context,
                "concurrency": to.config.workers,
                "queue_capacity": to.config.queue_capacity,
                "queue_position": load.queue_depth + load.inflight + 1,
                "estimated_delay_ms": load.estimated_delay.as_millis() as u64,
            }))
        })
        .collect()
}

fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn policy_status(service: &Service) -> Value {
    let status = service.policy.status();
    json!({
        "path": status.origin,
        "source": match &service.config.policy.source {
            crate::config::PolicySource::File(_) => "file".to_string(),
            crate::config::PolicySource::Builtin(name) => format!("builtin:{name}"),
        },
        "sha256": status.sha256,
        "loaded_at_unix": unix_seconds(status.loaded_at),
        "cases": service.policy.current().cases,
        "last_error": status.last_error,
        "fallback": service.config.policy.fallback,
    })
}

async fn metrics(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    crate::exporter::metrics_response(&state.service.registry, &headers)
}
