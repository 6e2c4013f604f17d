//! The admin API: policy reload, pool restore, loading and unloading models (also as Triton's
//! `/v2/repository/models/{model}/load|unload`), and fault injection on simulated devices.
//!
//! It is reachable two ways (docs/http-api.md, Admin access):
//! - on a Unix socket with owner-only permissions (`server.admin_socket`, on by default), where
//!   the file's permissions are the authorization, as for container runtimes' sockets and
//!   HAProxy's runtime API;
//! - over TCP only with `Authorization: Bearer <token>`, the token read from the environment
//!   variable `server.admin_token_env` names. Without a token, TCP admin is refused, loopback
//!   included: any reverse proxy on the same host would otherwise expose it.
//!
//! Authorization is checked before the body is read, and the token is compared in constant time.

use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::net::UnixListener;

use super::error::ApiError;
use super::residency;
use super::state::AppState;

/// How an admin request was let in, shown by `GET /admin`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The owner-only Unix socket.
    Socket,
    /// TCP with the bearer token.
    Bearer,
}

impl Via {
    fn label(self) -> &'static str {
        match self {
            Via::Socket => "socket",
            Via::Bearer => "bearer",
        }
    }
}

/// The admin routes, without any guard.
fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/admin", get(admin_index))
        .route("/admin/sim/{device}", post(admin_sim))
        .route("/admin/policy/reload", post(admin_policy_reload))
        .route("/admin/pools/{pool}/restore", post(admin_pool_restore))
        .route("/admin/models/{model}/load", post(admin_model_load))
        .route("/admin/models/{model}/unload", post(admin_model_unload))
        .merge(super::triton::repository::control_routes())
}

/// The admin routes for the TCP listener: each request must carry the bearer token, checked
/// before anything of it is read.
pub fn tcp_routes(state: &Arc<AppState>) -> Router<Arc<AppState>> {
    routes().route_layer(axum::middleware::from_fn_with_state(Arc::clone(state), require_token))
}

/// The router served on the admin socket.
pub fn socket_app(state: Arc<AppState>) -> Router {
    routes()
        .layer(Extension(Via::Socket))
        .fallback(|| async {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "the admin socket serves /admin and /v2/repository/models/{model}/load|unload only",
            )
        })
        .with_state(state)
}

async fn require_token(State(state): State<Arc<AppState>>, mut request: Request, next: Next) -> Response {
    let Some(token) = &state.admin_token else {
        let socket = match state.service.config.server.admin_socket.path() {
            Some(path) => format!(
                "locally, use the admin socket: `curl --unix-socket {} http://localhost/admin`",
                path.display()
            ),
            None => "the admin socket is off (server.admin_socket)".to_string(),
        };
        return ApiError::new(
            StatusCode::FORBIDDEN,
            format!("admin over TCP needs a token (server.admin_token_env); {socket}"),
        )
        .into_response();
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer);
    if !given.is_some_and(|given| same_secret(given, token)) {
        let mut response = ApiError::new(
            StatusCode::UNAUTHORIZED,
            "admin endpoints need `Authorization: Bearer <token>`",
        )
        .into_response();
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, axum::http::HeaderValue::from_static("Bearer"));
        return response;
    }
    request.extensions_mut().insert(Via::Bearer);
    next.run(request).await
}

/// The token of an `Authorization` value using the Bearer scheme, whose name is
/// case-insensitive (RFC 7235 §2.1).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Compare two secrets in time independent of where they differ (and of their lengths):
/// their SHA-256 digests are compared byte by byte without stopping early.
fn same_secret(given: &str, expected: &str) -> bool {
    let (a, b) = (Sha256::digest(given.as_bytes()), Sha256::digest(expected.as_bytes()));
    a.iter().zip(b.iter()).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

/// Bind the admin socket at `path` with owner-only permissions. Its folder is created (owner
/// only) when missing; a stale socket left by a crash is replaced, but one another process
/// still answers on is an error.
pub fn bind(path: &FsPath) -> Result<UnixListener, String> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let shown = path.display();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| format!("server.admin_socket: cannot create {}: {e}", dir.display()))?;
        }
        // A folder someone else owns or may write to (a shared /tmp) could swap the socket.
        use std::os::unix::fs::MetadataExt;
        let folder = std::fs::metadata(dir).map_err(|e| format!("server.admin_socket: {}: {e}", dir.display()))?;
        // Unknown: no folder matches, so the socket is refused rather than trusted.
        let me = crate::config::current_uid().unwrap_or(u32::MAX);
        if folder.uid() != me || folder.mode() & 0o022 != 0 {
            return Err(format!(
                "server.admin_socket: {} must be owned by this user (uid {me}) and writable by no one else (it is uid {}, mode {:o})",
                dir.display(),
                folder.uid(),
                folder.mode() & 0o777
            ));
        }
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(format!(
                "server.admin_socket: another process is serving on {shown} (another vramguard?)"
            ));
        }
        std::fs::remove_file(path).map_err(|e| format!("server.admin_socket: cannot replace stale {shown}: {e}"))?;
    }
    let listener = UnixListener::bind(path).map_err(|e| format!("server.admin_socket: cannot bind {shown}: {e}"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("server.admin_socket: cannot make {shown} owner-only: {e}"))?;
    Ok(listener)
}

/// Serve the admin API on `listener` until `stop` is cancelled, then remove the socket file,
/// and its folder when that is one of ours (`vramguard-$UID`, `$XDG_RUNTIME_DIR/vramguard`)
/// and nothing else is left in it. Its connections live under the same timeouts and caps as
/// the TCP listener's.
pub async fn serve_socket(
    state: Arc<AppState>,
    listener: UnixListener,
    path: PathBuf,
    stop: tokio_util::sync::CancellationToken,
) -> std::io::Result<()> {
    let limits = crate::net::conn::Limits::new(&state.service.config.server, &state.service.metrics.process);
    crate::net::conn::serve(listener, socket_app(state), limits, stop).await;
    let _ = std::fs::remove_file(&path);
    let ours = |name: &str| name == "vramguard" || name.starts_with("vramguard-");
    if let Some(dir) = path
        .parent()
        .filter(|d| d.file_name().and_then(|n| n.to_str()).is_some_and(ours))
    {
        // Fails, as it should, while the folder holds anything else.
        let _ = std::fs::remove_dir(dir);
    }
    Ok(())
}

async fn admin_policy_reload(State(state): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let service = Arc::clone(&state.service);
    let result = tokio::task::spawn_blocking(move || service.reload_policy())
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    match result {
        Ok(_) => Ok(Json(
            json!({"reloaded": true, "policy": state.service.serving_policy()}),
        )),
        Err(e) => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("reload refused; the previous policy keeps serving: {e}"),
        )),
    }
}

/// Body of `POST /admin/sim/{device}`: one or more faults to set.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SimCommand {
    /// External pressure to hold on the device: bytes or a size like `300MiB` (0 releases).
    pressure: Option<crate::config::ByteSize>,
    /// The next N runs on the device fail with an allocator failure (0 clears).
    fail_next: Option<u64>,
    /// With `fail_next`: let this many runs pass first (a failure in the middle of a
    /// generation).
    pass_first: Option<u64>,
    /// Runs fail with a driver-class error until `false` or a restore of the pool; on a
    /// process-isolated pool, until its worker is replaced (a restore), as a sticky CUDA error.
    driver_reset: Option<bool>,
    /// The device's pool's worker process dies at once (SIGKILL), mid-run if it has work.
    kill_worker: Option<bool>,
    /// The device's pool's worker process stops answering (its heartbeat and its runs).
    hang_worker: Option<bool>,
}

/// `GET /admin`: whether this client may use the admin endpoints, and which there are. It
/// changes nothing, so `vramguard doctor` asks it to check the token without side effects.
async fn admin_index(
    State(state): State<Arc<AppState>>,
    Extension(via): Extension<Via>,
) -> Result<Json<Value>, ApiError> {
    let simulated: Vec<&str> = state.service.simulated.iter().map(|d| d.name.as_str()).collect();
    Ok(Json(json!({
        "authorized": true,
        "auth": via.label(),
        "endpoints": [
            "POST /admin/policy/reload",
            "POST /admin/pools/{pool}/restore",
            "POST /admin/models/{model}/load",
            "POST /admin/models/{model}/unload",
            "POST /admin/sim/{device}",
            "POST /v2/repository/models/{model}/load",
            "POST /v2/repository/models/{model}/unload",
        ],
        "simulated_devices": simulated,
    })))
}

async fn admin_sim(
    State(state): State<Arc<AppState>>,
    Path(device): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let service = &state.service;
    let sim = service.simulated_device(&device).cloned().ok_or_else(|| {
        let simulated: Vec<&str> = service.simulated.iter().map(|d| d.name.as_str()).collect();
        ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "`{device}` is not a simulated device (simulated devices: {})",
                simulated.join(", ")
            ),
        )
    })?;
    // JSON whatever the Content-Type says, as `/infer` reads it: `curl -d` sends
    // application/x-www-form-urlencoded, and refusing that helps nobody.
    let body = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    let command: SimCommand = serde_json::from_slice(&body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "the body must be a JSON object with `pressure` (\"300MiB\"), `fail_next` (N) and/or `driver_reset` (true|false): {e}"
            ),
        )
    })?;
    let (kill, hang) = check_sim(&command, service, &device)?;
    let change = crate::device::simulated::DeviceChange {
        pressure: command.pressure.map(|p| p.bytes()),
        fail_next: command.fail_next,
        pass_first: command.pass_first,
        driver_reset: command.driver_reset,
        hang,
    };
    let held = Arc::clone(&sim);
    tokio::task::spawn_blocking(move || held.apply(change))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| ApiError::new(StatusCode::CONFLICT, e))?;
    if let Some(bytes) = change.pressure {
        tracing::info!(device = %device, pressure_bytes = bytes, "simulated external pressure set");
    }
    if let Some(n) = command.fail_next {
        tracing::warn!(device = %device, runs = n, "fault injection: the next runs fail with an allocator failure");
    }
    if let Some(reset) = command.driver_reset {
        tracing::warn!(device = %device, reset, "fault injection: simulated driver reset");
    }
    let mut killed = None;
    if kill {
        killed = Some(
            service
                .kill_worker_on(&device)
                .map_err(|e| ApiError::new(StatusCode::CONFLICT, e))?,
        );
    }
    if hang {
        tracing::warn!(device = %device, "fault injection: the worker process stops answering");
    }
    service.resample_now().await;
    let snapshot = service.store.latest().snapshot;
    let state = if kill || hang {
        crate::device::simulated::DeviceState {
            pressure: sim.pressure(),
            ..Default::default()
        }
    } else {
        let held = Arc::clone(&sim);
        tokio::task::spawn_blocking(move || held.state())
            .await
            .unwrap_or_default()
    };
    Ok(Json(json!({
        "device": device,
        "simulated": true,
        "pressure_bytes": state.pressure,
        "fail_next": state.fail_next,
        "pass_first": state.pass_first,
        "driver_reset": state.driver_reset,
        "killed_worker_pid": killed,
        "hung_worker": hang,
        "memory": snapshot.devices.get(&device),
    })))
}

/// `POST /admin/pools/{pool}/restore`: rebuild the pool's backends in the background of the
/// request path (other pools keep serving), clearing a simulated driver reset on its device.
async fn admin_pool_restore(
    State(state): State<Arc<AppState>>,
    Path(pool): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let service = &state.service;
    let target = service.pool(&pool).cloned().ok_or_else(|| {
        let names: Vec<&str> = service.pools.iter().map(|p| p.name()).collect();
        ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no pool `{pool}` (pools: {})", names.join(", ")),
        )
    })?;
    if let Some(sim) = service.simulated_device(&target.config.device) {
        sim.set_driver_reset(false);
    }
    let started = std::time::Instant::now();
    let rebuilding = Arc::clone(&target);
    let built = tokio::task::spawn_blocking(move || rebuilding.restore())
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("restore failed: {e}")))?;
    service.resample_now().await;
    Ok(Json(json!({
        "pool": pool,
        "rebuilt_backends": built,
        "took_ms": started.elapsed().as_millis() as u64,
        "breaker": target.health().breaker_state().label(),
        "state": if target.is_ready() { "ready" } else { "unavailable" },
    })))
}

/// `POST /admin/models/{model}/load`: every pool serving it builds its sessions.
async fn admin_model_load(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
) -> Result<Json<Value>, ApiError> {
    residency::change(&state, model, true)
        .await
        .map(|done| Json(done.answer))
}

/// `POST /admin/models/{model}/unload`: every pool serving it drops its sessions, once its
/// requests there have finished. A pinned model is refused (409).
async fn admin_model_unload(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
) -> Result<Json<Value>, ApiError> {
    residency::change(&state, model, false)
        .await
        .map(|done| Json(done.answer))
}

/// What a `POST /admin/sim/{device}` asks that can be done: the worker knobs (`kill_worker`,
/// `hang_worker`), or why not.
fn check_sim(
    command: &SimCommand,
    service: &crate::serve::service::Service,
    device: &str,
) -> Result<(bool, bool), ApiError> {
    if command.pass_first.is_some() && command.fail_next.is_none() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "`pass_first` goes with `fail_next`: it says how many runs pass before those fail",
        ));
    }
    let kill = command.kill_worker == Some(true);
    let hang = command.hang_worker == Some(true);
    if command.pressure.is_none() && command.fail_next.is_none() && command.driver_reset.is_none() && !kill && !hang {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "nothing to do: give `pressure`, `fail_next`, `driver_reset`, `kill_worker` or `hang_worker`",
        ));
    }
    if (kill || hang) && !service.has_worker_on(device) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!(
                "no pool on `{device}` runs in a worker process (`isolation: process`): there is no worker to kill or hang"
            ),
        ));
    }
    Ok((kill, hang))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer abc"), Some("abc"));
        assert_eq!(bearer("BEARER  abc "), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearerabc"), None);
    }

    #[test]
    fn secrets_compare_equal_only_when_equal() {
        assert!(same_secret("s3cret", "s3cret"));
        assert!(!same_secret("s3cret", "s3creT"));
        assert!(!same_secret("s3cre", "s3cret"));
        assert!(!same_secret("", "s3cret"));
    }

    #[test]
    fn the_socket_is_owner_only_and_a_live_one_is_not_stolen() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("vramguard-admin-{}", std::process::id()));
        let path = dir.join("sub/admin.sock");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let listener = bind(&path).unwrap();
            let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
            let dir_mode = std::fs::metadata(path.parent().unwrap()).unwrap().permissions().mode() & 0o777;
            assert_eq!(dir_mode, 0o700);
            let again = bind(&path).unwrap_err();
            assert!(again.contains("another process is serving"), "{again}");
            drop(listener);
            // The file left behind by a listener that is gone is stale: replaced.
            bind(&path).unwrap();
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
}
