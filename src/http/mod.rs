//! The HTTP API: Open Inference Protocol (KServe v2) endpoints, `/status` and `/metrics`.
//! [`app`] builds the router so tests can drive it without a socket; [`serve`] runs it with a
//! bounded graceful shutdown.

pub mod infer;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, JsonRejection};
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::{Json, Router};
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;

use crate::config::Keep;
use crate::engine::Engine;
use crate::metrics::{DecisionLabels, KindLabels, ModelPoolLabels, Outcome, RequestLabels};
use crate::onnx::BackendError;
use crate::pool::{Availability, InferJob, Pool, PoolError};
use crate::router::{self, Plan, PoolView};
use crate::snapshot::RequestInfo;

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
/// `FROM->TO` tokens when the context was shrunk.
pub const CONTEXT_HEADER: &str = "x-vramguard-context";
/// Binary extension header: length of the JSON part.
pub const HEADER_LENGTH: &str = "inference-header-content-length";

/// Shared state of the HTTP layer.
pub struct AppState {
    /// The running service.
    pub engine: Arc<Engine>,
    /// Set once shutdown starts: readiness turns false.
    pub shutting_down: AtomicBool,
    /// Wall-clock start, for `/status`.
    pub started: SystemTime,
    /// Bearer token for `/admin` (from the env var `server.admin_token_env` names).
    pub admin_token: Option<String>,
}

impl AppState {
    /// Wrap an engine. The admin token is read from the environment variable the config names;
    /// a named variable that is unset or empty is an error (the operator meant to set a token).
    pub fn new(engine: Arc<Engine>) -> Result<Arc<AppState>, String> {
        let admin_token = match &engine.config.server.admin_token_env {
            None => None,
            Some(var) => match std::env::var(var) {
                Ok(token) if !token.trim().is_empty() => Some(token),
                _ => {
                    return Err(format!(
                        "{}: server.admin_token_env names `{var}`, which is not set (or empty) in the environment",
                        engine.config.source
                    ));
                }
            },
        };
        Ok(Arc::new(AppState {
            engine,
            shutting_down: AtomicBool::new(false),
            started: SystemTime::now(),
            admin_token,
        }))
    }
}

/// An error answered as `{"error": "..."}` with a status and optional `Retry-After`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            retry_after: None,
        }
    }

    fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds.max(1));
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(json!({ "error": self.message }))).into_response();
        if let Some(s) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}

/// Build the router.
pub fn app(state: Arc<AppState>) -> Router {
    let body_limit = state.engine.config.server.body_limit;
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
        .route("/admin/sim/{device}", post(admin_sim))
        .route("/admin/policy/reload", post(admin_policy_reload))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// Serve until `shutdown` resolves, then stop accepting, answer queued work with 503, let running
/// work finish within the configured grace period, and return.
pub async fn serve(
    state: Arc<AppState>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let token = tokio_util::sync::CancellationToken::new();
    if let Some(sampler) = state.engine.take_sampler() {
        tokio::spawn(sampler.run(
            state.engine.config.exporter.sample_interval,
            token.clone(),
            Arc::clone(&state.engine.resample),
        ));
    }
    if let (crate::config::PolicySource::File(path), Some(interval)) = (
        &state.engine.config.policy.source,
        state.engine.config.policy.watch_interval,
    ) {
        tokio::spawn(watch_policy(
            Arc::clone(&state.engine),
            path.clone(),
            interval,
            token.clone(),
        ));
    }
    // Responses are small and latency matters: never let Nagle hold back the last segment.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
    });
    let server = axum::serve(
        listener,
        app(Arc::clone(&state)).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(token.clone().cancelled_owned());
    let mut server = tokio::spawn(async move { server.await });
    tokio::select! {
        result = &mut server => return result.map_err(std::io::Error::other)?,
        () = shutdown => {}
    }
    tracing::info!("shutting down: no new connections; queued requests are answered 503");
    state.shutting_down.store(true, Ordering::SeqCst);
    token.cancel();
    let grace = state.engine.config.server.shutdown_grace;
    let engine = Arc::clone(&state.engine);
    let _ = tokio::task::spawn_blocking(move || engine.shutdown(grace)).await;
    match tokio::time::timeout(grace, &mut server).await {
        Ok(result) => result.map_err(std::io::Error::other)?,
        Err(_) => {
            tracing::warn!("connections still open after the grace period; closing them");
            server.abort();
            Ok(())
        }
    }
}

/// Reload the policy when its file changes (checked every `interval`; editors that replace the
/// file count as a change too).
async fn watch_policy(
    engine: Arc<Engine>,
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
        let engine = Arc::clone(&engine);
        if let Ok(Err(e)) = tokio::task::spawn_blocking(move || engine.reload_policy()).await {
            tracing::warn!(error = %e, "policy file changed but the new script was refused");
        }
    }
}

async fn server_metadata(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "name": "vramguard",
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": ["binary_tensor_data"],
        "onnxruntime": state.engine.onnxruntime_version,
    }))
}

async fn live() -> StatusCode {
    StatusCode::OK
}

async fn ready(State(state): State<Arc<AppState>>) -> Result<StatusCode, ApiError> {
    if state.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting down"));
    }
    if state.engine.ready() {
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
            format!("unknown model version `{version}`; the only version is `1`"),
        ))
    }
}

fn unknown_model(state: &AppState, model: &str) -> ApiError {
    let names: Vec<&str> = state.engine.models.iter().map(|m| m.config.name.as_str()).collect();
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("unknown model `{model}`; models: {}", names.join(", ")),
    )
}

async fn model_metadata(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let entry = state
        .engine
        .model(&model)
        .ok_or_else(|| unknown_model(&state, &model))?;
    let tensors = |specs: &[crate::onnx::TensorSpec]| {
        specs
            .iter()
            .map(|s| json!({"name": s.name, "datatype": s.datatype.name(), "shape": s.shape}))
            .collect::<Vec<_>>()
    };
    let pools: Vec<Value> = state
        .engine
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
        .engine
        .model(&model)
        .ok_or_else(|| unknown_model(&state, &model))?;
    if state.engine.pools.iter().any(|p| p.serves(&model) && p.is_ready()) {
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

async fn infer(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let id = request_id(&headers);
    let started = Instant::now();
    let (pool, result) = match run_inference(&state, &model, &id, &headers, body, started).await {
        Ok((pool, response)) => (Some(pool), Ok(response)),
        Err((pool, outcome, error)) => (pool, Err((outcome, error))),
    };
    let pool_name = pool.as_ref().map(|p| p.name().to_string()).unwrap_or_default();
    let outcome = match &result {
        Ok(_) => Outcome::ok,
        Err((outcome, _)) => *outcome,
    };
    if state.engine.model(&model).is_some() {
        let metrics = &state.engine.metrics;
        metrics
            .requests
            .get_or_create(&RequestLabels {
                model: model.clone(),
                pool: pool_name.clone(),
                outcome,
            })
            .inc();
        if !pool_name.is_empty() {
            metrics
                .request_duration
                .get_or_create(&ModelPoolLabels {
                    model: model.clone(),
                    pool: pool_name.clone(),
                })
                .observe(started.elapsed().as_secs_f64());
        }
    }
    let mut response = match result {
        Ok(response) => response,
        Err((_, error)) => {
            tracing::debug!(request_id = %id, model = %model, pool = %pool_name, status = %error.status, error = %error.message, "request refused");
            error.into_response()
        }
    };
    if let Ok(v) = HeaderValue::from_str(&pool_name)
        && !pool_name.is_empty()
    {
        response.headers_mut().insert(HeaderName::from_static(POOL_HEADER), v);
    }
    with_request_id(response, &id)
}

type InferFailure = (Option<Arc<Pool>>, Outcome, ApiError);

async fn run_inference(
    state: &AppState,
    model: &str,
    id: &str,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    started: Instant,
) -> Result<(Arc<Pool>, Response), InferFailure> {
    let client_error =
        |status: StatusCode, message: String| (None, Outcome::client_error, ApiError::new(status, message));
    let engine = &state.engine;
    let entry = engine
        .model(model)
        .ok_or_else(|| (None, Outcome::client_error, unknown_model(state, model)))?;
    let body = body.map_err(|rejection| {
        let status = rejection.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            format!(
                "request body exceeds the {} byte limit (server.body_limit)",
                engine.config.server.body_limit
            )
        } else {
            format!("cannot read request body: {}", rejection.body_text())
        };
        client_error(status, message)
    })?;
    let header_len = match headers.get(HEADER_LENGTH) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .ok_or_else(|| {
                    client_error(
                        StatusCode::BAD_REQUEST,
                        "Inference-Header-Content-Length must be a number of bytes".into(),
                    )
                })?,
        ),
    };
    let deadline = match headers.get(DEADLINE_HEADER) {
        None => None,
        Some(v) => {
            let ms = v
                .to_str()
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    client_error(
                        StatusCode::BAD_REQUEST,
                        format!("{DEADLINE_HEADER} must be a number of milliseconds"),
                    )
                })?;
            Some(started + Duration::from_millis(ms))
        }
    };
    let mut request =
        infer::decode(&body, header_len, &entry.signature).map_err(|e| client_error(StatusCode::BAD_REQUEST, e))?;
    drop(body);

    let admitted = admit(state, entry, id, headers, &mut request, deadline).await?;
    let pool = admitted.pool;
    let job = InferJob {
        request_id: id.to_string(),
        model: model.to_string(),
        inputs: std::mem::take(&mut request.inputs),
        outputs: request.outputs.iter().map(|o| o.name.clone()).collect(),
        deadline,
        estimate_bytes: Some(admitted.estimate.context_bytes + admitted.estimate.workspace_bytes),
    };
    let fail = |pool: &Arc<Pool>, error: PoolError| {
        let (outcome, api) = pool_error(pool, error);
        (Some(Arc::clone(pool)), outcome, api)
    };
    let rx = pool.submit(job).map_err(|e| fail(&pool, e))?;
    let reply = match deadline {
        Some(d) => match tokio::time::timeout_at(d.into(), rx).await {
            Ok(reply) => reply,
            Err(_) => {
                return Err(fail(
                    &pool,
                    PoolError::DeadlineExceeded {
                        pool: pool.name().to_string(),
                    },
                ));
            }
        },
        None => rx.await,
    };
    let outputs = reply
        .unwrap_or_else(|_| {
            Err(PoolError::ShuttingDown {
                pool: pool.name().to_string(),
            })
        })
        .map_err(|e| fail(&pool, e))?;

    let mut parameters = Map::new();
    parameters.insert("pool".into(), json!(pool.name()));
    parameters.insert("provider".into(), json!(pool.provider().label()));
    parameters.insert("device".into(), json!(pool.config.device));
    parameters.insert("simulated".into(), json!(pool.device_kind == "simulated"));
    parameters.insert("decision".into(), json!(admitted.action));
    parameters.insert("request_id".into(), json!(id));
    let context = admitted.context.map(|(from, to)| format!("{from}->{to}"));
    if let Some(context) = &context {
        parameters.insert("context".into(), json!(context));
    }
    let encoded = infer::encode(model, request.id.as_deref(), &parameters, &outputs, &request);
    let mut response = encoded.body.into_response();
    let headers = response.headers_mut();
    headers.insert(
        HeaderName::from_static(DECISION_HEADER),
        HeaderValue::from_static(admitted.action),
    );
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
    Ok((pool, response))
}

/// Where the policy sent a request.
struct Admitted {
    pool: Arc<Pool>,
    /// The decision that placed it: `admit`, `redirect` or `shrink_context`.
    action: &'static str,
    /// `(from, to)` tokens when the context was shrunk.
    context: Option<(u64, u64)>,
    /// The estimate for what actually runs (after any shrink).
    estimate: crate::snapshot::Estimate,
}

fn header_value<T: std::str::FromStr>(headers: &HeaderMap, name: &str, expected: &str) -> Result<Option<T>, String> {
    match headers.get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .map(Some)
            .ok_or_else(|| format!("{name} must be {expected}")),
    }
}

/// Ask the policy what to do with the request and carry it out until it is placed on a pool
/// (possibly after deferring, without holding a worker) or refused.
async fn admit(
    state: &AppState,
    entry: &crate::engine::ModelEntry,
    id: &str,
    headers: &HeaderMap,
    request: &mut infer::DecodedRequest,
    deadline: Option<Instant>,
) -> Result<Admitted, InferFailure> {
    let engine = &state.engine;
    let model = entry.config.name.as_str();
    let refuse = |outcome: Outcome, error: ApiError| (None, outcome, error);
    let client_error = |message: String| refuse(Outcome::client_error, ApiError::new(StatusCode::BAD_REQUEST, message));
    let priority = header_value::<i64>(headers, PRIORITY_HEADER, "an integer")
        .map_err(client_error)?
        .unwrap_or(0);
    let replayable = header_value::<bool>(headers, REPLAYABLE_HEADER, "`true` or `false`")
        .map_err(client_error)?
        .unwrap_or(true);
    // The router's choice: the first ready pool serving the model. The policy may move it.
    let routed = engine
        .pools
        .iter()
        .find(|p| p.serves(model) && p.is_ready())
        .cloned()
        .ok_or_else(|| {
            let reasons: Vec<String> = engine
                .pools
                .iter()
                .filter(|p| p.serves(model))
                .map(|p| match p.availability() {
                    Availability::Unavailable(reason) => format!("{}: {reason}", p.name()),
                    Availability::Ready => format!("{}: shutting down", p.name()),
                })
                .collect();
            refuse(
                Outcome::rejected,
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("no pool can take `{model}` ({})", reasons.join("; ")),
                )
                .retry_after(5),
            )
        })?;
    let (tokens, batch) = entry.shape_of(&request.inputs);
    let mut info = RequestInfo {
        id: id.to_string(),
        model: model.to_string(),
        pool: routed.name().to_string(),
        context_tokens: tokens,
        max_new_tokens: 0,
        batch,
        priority,
        replayable,
        deadline_ms: 0,
        estimate: entry.estimate(&request.inputs),
    };
    let has_context = entry.config.context.is_some();
    let max_defer = routed.config.max_wait;
    let mut deferred = Duration::ZERO;
    let metrics = &engine.metrics;
    loop {
        if let Some(deadline) = deadline {
            // The policy sees the time left, not the time the client first gave.
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(refuse(
                    Outcome::cancelled,
                    ApiError::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        "the deadline (x-vramguard-deadline-ms) passed while deferred",
                    ),
                ));
            }
            info.deadline_ms = (left.as_millis() as u64).max(1);
        }
        let views: Vec<PoolView<'_>> = engine
            .pools
            .iter()
            .map(|p| PoolView {
                name: p.name(),
                serves: p.serves(model),
                ready: match p.availability() {
                    Availability::Unavailable(reason) => Err(reason.clone()),
                    Availability::Ready if p.is_ready() => Ok(()),
                    Availability::Ready => Err("shutting down".into()),
                },
            })
            .collect();
        let eval_started = Instant::now();
        let view = engine.policy_view();
        let evaluation = engine.policy.decide_view(&info, &view);
        // Building the script's inputs counts: the view is part of what every request pays.
        let eval_time = eval_started.elapsed();
        metrics.policy_eval_duration.observe(eval_time.as_secs_f64());
        let mut decision = evaluation.decision;
        if let Some(error) = &evaluation.error {
            metrics
                .policy_errors
                .get_or_create(&KindLabels {
                    kind: error.kind.label().into(),
                })
                .inc();
            tracing::warn!(request_id = %id, %error, fallback = %decision, "policy failed; using the fallback decision");
        }
        let mut plan = router::plan(&decision, &info, has_context, &views, deferred, max_defer);
        if let Plan::Invalid(why) = &plan {
            metrics
                .policy_errors
                .get_or_create(&KindLabels {
                    kind: "bad_return".into(),
                })
                .inc();
            tracing::warn!(request_id = %id, decision = %decision, reason = %why, "policy decision cannot be carried out; using the fallback");
            decision = engine.policy.current().script.fallback().clone();
            plan = match router::plan(&decision, &info, has_context, &views, deferred, max_defer) {
                Plan::Invalid(why) => Plan::Refuse(format!(
                    "neither the policy's decision nor the fallback can be carried out: {why}"
                )),
                other => other,
            };
        }
        let target = match &plan {
            Plan::Run { pool, .. } => pool.as_str(),
            _ => info.pool.as_str(),
        };
        metrics
            .policy_decisions
            .get_or_create(&DecisionLabels {
                action: decision.action().into(),
                pool: target.into(),
            })
            .inc();
        tracing::debug!(
            request_id = %id,
            model,
            action = decision.action(),
            decision = %decision,
            pool = target,
            eval_us = eval_time.as_micros() as u64,
            estimate_bytes = info.estimate.total_bytes,
            "policy decision"
        );
        match plan {
            Plan::Run { pool, shrink_to } => {
                let pool = engine.pool(&pool).cloned().expect("plan only names existing pools");
                let mut context = None;
                let mut estimate = info.estimate;
                if let (Some(to), Some(axis)) = (shrink_to, &entry.config.context) {
                    if let Some(tensor) = request.inputs.iter_mut().find(|t| t.name == axis.input) {
                        tensor.truncate_axis(axis.axis, to as usize, axis.keep == Keep::End);
                    }
                    context = Some((info.context_tokens, to));
                    estimate = entry.estimate(&request.inputs);
                }
                return Ok(Admitted {
                    pool,
                    action: decision.action(),
                    context,
                    estimate,
                });
            }
            Plan::Wait(wait) => {
                if deadline.is_some_and(|d| Instant::now() + wait >= d) {
                    return Err(refuse(
                        Outcome::cancelled,
                        ApiError::new(
                            StatusCode::GATEWAY_TIMEOUT,
                            "the deadline (x-vramguard-deadline-ms) cannot be met: the policy defers this request",
                        ),
                    ));
                }
                tokio::time::sleep(wait).await;
                deferred += wait;
            }
            Plan::DeferredTooLong { total, bound } => {
                return Err(refuse(
                    Outcome::deferred_timeout,
                    ApiError::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        format!(
                            "deferred by the policy for {}ms; deferring again would pass pool `{}`'s max wait of {}ms",
                            deferred.as_millis(),
                            routed.name(),
                            bound.as_millis()
                        ),
                    )
                    .retry_after(total.as_secs().max(1)),
                ));
            }
            Plan::Refuse(reason) => {
                return Err(refuse(
                    Outcome::rejected,
                    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, reason)
                        .retry_after(routed.load().estimated_delay.as_secs().max(1)),
                ));
            }
            Plan::Invalid(_) => unreachable!("replaced by the fallback above"),
        }
    }
}

/// Map a pool failure to an outcome and a client-facing error (the one place this happens).
fn pool_error(pool: &Pool, error: PoolError) -> (Outcome, ApiError) {
    let retry = pool.load().estimated_delay.as_secs().max(1);
    match error {
        PoolError::QueueFull { .. } | PoolError::ShuttingDown { .. } | PoolError::Unavailable { .. } => (
            Outcome::rejected,
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, error.to_string()).retry_after(retry),
        ),
        PoolError::QueueTimeout { .. } => (
            Outcome::deferred_timeout,
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, error.to_string()).retry_after(retry),
        ),
        PoolError::DeadlineExceeded { .. } => (
            Outcome::cancelled,
            ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "the deadline (x-vramguard-deadline-ms) cannot be met",
            ),
        ),
        PoolError::Backend(BackendError::Allocation { kind, message }) => {
            // Counted by the pool's worker (vramguard_allocator_failures_total), not here.
            let simulated = if pool.device_kind == "simulated" {
                " (simulated)"
            } else {
                ""
            };
            (
                Outcome::rejected,
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "allocator failure ({kind}) on pool `{}`, device `{}`{simulated}: the request does not fit in accelerator memory; {}",
                        pool.name(),
                        pool.config.device,
                        crate::onnx::concise(&message)
                    ),
                )
                .retry_after(retry),
            )
        }
        PoolError::Backend(BackendError::InvalidInput(message)) => (
            Outcome::client_error,
            ApiError::new(StatusCode::BAD_REQUEST, crate::onnx::concise(&message)),
        ),
        PoolError::Backend(BackendError::Runtime(message)) => {
            tracing::error!(pool = pool.name(), error = %message, "inference failed");
            (
                Outcome::failed,
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!(
                        "inference failed on pool `{}`; the server log has the details",
                        pool.name()
                    ),
                ),
            )
        }
    }
}

async fn status(State(state): State<Arc<AppState>>) -> Json<Value> {
    let engine = &state.engine;
    let sample = engine.store.latest();
    let pools: Vec<Value> = engine
        .pools
        .iter()
        .map(|p| {
            let load = p.load();
            let (state_name, reason) = match p.availability() {
                Availability::Ready if p.is_ready() => ("ready", None),
                Availability::Ready => ("stopping", None),
                Availability::Unavailable(r) => ("unavailable", Some(r.clone())),
            };
            let arena = crate::exporter::pool_arena(p, &engine.simulated).map(|s| {
                json!({"reserved_bytes": s.reserved_bytes, "active_bytes": s.active_bytes,
                       "peak_active_bytes": s.peak_active_bytes, "limit_bytes": s.limit_bytes,
                       "extensions": s.extensions, "shrinkages": s.shrinkages})
            });
            json!({
                "name": p.name(),
                "provider": p.provider().label(),
                "device": p.config.device,
                "device_kind": p.device_kind,
                "simulated": p.device_kind == "simulated",
                "state": state_name,
                "reason": reason,
                "breaker": "closed",
                "models": p.config.models,
                "workers": p.config.workers,
                "queue_depth": load.queue_depth,
                "queue_capacity": p.config.queue_capacity,
                "queue_oldest_age_ms": load.oldest_age.as_millis() as u64,
                "inflight": load.inflight,
                "estimated_delay_ms": load.estimated_delay.as_millis() as u64,
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
            if let Some(sim) = engine.simulated_device(name) {
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
        "onnxruntime": engine.onnxruntime_version,
        "config": engine.config.source,
        "started_unix": started,
        "shutting_down": state.shutting_down.load(Ordering::SeqCst),
        "degraded": {"active": false, "reason": null, "since": null},
        "pools": pools,
        "devices": devices,
        "host": sample.snapshot.host,
        "processes": sample.snapshot.processes,
        "sample_age_ms": sample.taken_at.map(|t| t.elapsed().as_millis() as u64),
        "policy": policy_status(engine),
    }))
}

fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn policy_status(engine: &crate::engine::Engine) -> Value {
    let status = engine.policy.status();
    json!({
        "path": status.origin,
        "source": match &engine.config.policy.source {
            crate::config::PolicySource::File(_) => "file".to_string(),
            crate::config::PolicySource::Builtin(name) => format!("builtin:{name}"),
        },
        "sha256": status.sha256,
        "loaded_at_unix": unix_seconds(status.loaded_at),
        "cases": engine.policy.current().cases,
        "last_error": status.last_error,
        "fallback": engine.config.policy.fallback,
    })
}

async fn admin_policy_reload(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, peer, &headers)?;
    let engine = Arc::clone(&state.engine);
    let result = tokio::task::spawn_blocking(move || engine.reload_policy())
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    match result {
        Ok(_) => Ok(Json(json!({"reloaded": true, "policy": policy_status(&state.engine)}))),
        Err(e) => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("reload refused; the previous policy keeps serving: {e}"),
        )),
    }
}

/// Body of `POST /admin/sim/{device}`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SimCommand {
    /// External pressure to hold on the device: bytes or a size like `300MiB` (0 releases).
    pressure: Option<crate::config::ByteSize>,
}

fn authorize(state: &AppState, peer: SocketAddr, headers: &HeaderMap) -> Result<(), ApiError> {
    match &state.admin_token {
        Some(token) => {
            let given = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            if given == Some(token.as_str()) {
                Ok(())
            } else {
                Err(ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "admin endpoints need `Authorization: Bearer <token>`",
                ))
            }
        }
        None if peer.ip().is_loopback() => Ok(()),
        None => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "admin endpoints are loopback-only unless server.admin_token_env names a token",
        )),
    }
}

async fn admin_sim(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    Path(device): Path<String>,
    headers: HeaderMap,
    body: Result<Json<SimCommand>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, peer, &headers)?;
    let engine = &state.engine;
    let sim = engine.simulated_device(&device).cloned().ok_or_else(|| {
        let simulated: Vec<&str> = engine.simulated.iter().map(|d| d.name.as_str()).collect();
        ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "`{device}` is not a simulated device (simulated devices: {})",
                simulated.join(", ")
            ),
        )
    })?;
    let Json(command) = body.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.body_text()))?;
    let Some(pressure) = command.pressure else {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "nothing to do: give `pressure`"));
    };
    let bytes = pressure.bytes();
    tokio::task::spawn_blocking(move || sim.set_pressure(bytes))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| ApiError::new(StatusCode::CONFLICT, e))?;
    tracing::info!(device = %device, pressure_bytes = bytes, "simulated external pressure set");
    engine.resample_now().await;
    let snapshot = engine.store.latest().snapshot;
    Ok(Json(json!({
        "device": device,
        "simulated": true,
        "pressure_bytes": bytes,
        "memory": snapshot.devices.get(&device),
    })))
}

async fn metrics(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    metrics_response(&state.engine.registry, &headers)
}

/// `/metrics`: OpenMetrics for clients that ask for it (Prometheus does), the Prometheus text
/// format 0.0.4 otherwise (curl, `promtool check metrics`).
pub fn metrics_response(registry: &prometheus_client::registry::Registry, headers: &HeaderMap) -> Response {
    let wants_openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    if wants_openmetrics {
        (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            crate::metrics::encode(registry),
        )
            .into_response()
    } else {
        (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
            crate::metrics::encode_prometheus_text(registry),
        )
            .into_response()
    }
}
