//! The HTTP API: Open Inference Protocol (KServe v2) endpoints, the OpenAI endpoints, `/status`,
//! `/metrics` and admin. [`app`] builds the router so tests can drive it without a socket;
//! [`serve`] runs it with a bounded graceful shutdown.

pub mod admin;
mod dialect;
mod error;
mod headers;
mod oip;
pub mod openai;
mod residency;
mod state;
mod status;
mod triton;

pub use error::{ApiError, status_of};
pub use state::AppState;

use crate::net::conn;
use crate::serve::service::Service;
use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use oip::*;
use status::{status, status_page};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::net::TcpListener;

/// Build the router.
pub fn app(state: Arc<AppState>) -> Router {
    let body_limit = state.service.config.server.body_limit;
    Router::new()
        .route("/v2", get(server_metadata))
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .route("/v2/models/{model}", get(model_metadata))
        .route("/v2/models/{model}/versions/{version}", get(model_metadata))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route("/v2/models/{model}/versions/{version}/ready", get(model_ready))
        .route("/v2/models/{model}/infer", post(infer))
        .route("/v2/models/{model}/versions/{version}/infer", post(infer_versioned))
        .route("/status", get(status))
        .route("/", get(status_page))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{*id}", get(openai::model))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/rerank", post(openai::rerank))
        .route("/v1/audio/transcriptions", post(openai::transcriptions))
        .route("/v1/audio/translations", post(openai::translations))
        .merge(triton::routes())
        .merge(admin::tcp_routes(&state))
        .route("/metrics", get(metrics))
        .fallback(dialect::no_route)
        .method_not_allowed_fallback(dialect::wrong_method)
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
    crate::serve::health::watch_pools(&state.service, &tasks, &token);
    tasks.close();
    // Responses are small and latency matters: never let Nagle hold back the last segment.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
    });
    let limits = conn::Limits::new(&state.service.config.server, &state.service.metrics.process);
    limits.tell_refusals(Arc::new(CountedRefusals(Arc::clone(&state.service))));
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

async fn metrics(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    crate::telemetry::exporter::metrics_response(&state.service.registry, &headers)
}

/// Counts the connection layer's answers to inference and generation requests whose bodies it
/// refused before any route saw them, in `vramguard_requests_total` as the routes count theirs:
/// every answer to such a request is counted once. An OpenAI request's model is in its body,
/// which was not read: it is counted under the label of requests naming no configured model.
/// Its refusals are written in the error body of their path's API (OpenAI's under `/v1/`).
#[derive(Debug)]
struct CountedRefusals(Arc<Service>);

impl conn::Refusals for CountedRefusals {
    fn refused(&self, path: &str, status: StatusCode) {
        if let Some(model) = inference_model(path) {
            let outcome = error::outcome_of_status(status);
            crate::serve::lifecycle::answered(&self.0, model, outcome, tokio::time::Instant::now());
        }
    }

    fn write(&self, path: &str, error: ApiError) -> Response {
        dialect::answer(path, error)
    }
}

/// The model an inference or generation request for `path` names (`""` for OpenAI's
/// endpoints, whose model is in the body), or `None` for any other path.
fn inference_model(path: &str) -> Option<&str> {
    if matches!(
        path,
        "/v1/completions"
            | "/v1/chat/completions"
            | "/v1/embeddings"
            | "/v1/rerank"
            | "/v1/audio/transcriptions"
            | "/v1/audio/translations"
    ) {
        return Some(crate::serve::service::UNKNOWN_MODEL);
    }
    let rest = path.strip_prefix("/v2/models/")?;
    match rest.split('/').collect::<Vec<_>>().as_slice() {
        [model, "infer"] | [model, "versions", _, "infer"] => Some(model),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::inference_model;

    #[test]
    fn the_connection_layer_names_the_model_of_an_inference_path_only() {
        assert_eq!(inference_model("/v2/models/encoder/infer"), Some("encoder"));
        assert_eq!(inference_model("/v2/models/encoder/versions/1/infer"), Some("encoder"));
        assert_eq!(inference_model("/v1/chat/completions"), Some(""));
        assert_eq!(inference_model("/v1/completions"), Some(""));
        assert_eq!(inference_model("/v1/embeddings"), Some(""));
        assert_eq!(inference_model("/v1/rerank"), Some(""));
        for other in [
            "/v2/models/encoder",
            "/v2/models/encoder/ready",
            "/admin/policy/reload",
            "/metrics",
            "/v2/models//x/infer",
        ] {
            assert_eq!(inference_model(other), None, "{other}");
        }
    }
}
