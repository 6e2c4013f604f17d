//! Loading and unloading a model on every pool serving it: what the admin API's
//! `POST /admin/models/{model}/load|unload` and Triton's
//! `POST /v2/repository/models/{model}/load|unload` both do (`admin.rs`,
//! `triton/repository.rs`), under the admin API's authorization.

use std::sync::Arc;

use axum::http::StatusCode;
use serde_json::{Value, json};

use super::error::ApiError;
use super::state::AppState;

/// What a load or unload did on the pools serving the model.
pub(super) struct Done {
    /// The answer: what happened on each pool and how long it took.
    pub(super) answer: Value,
    /// Why it failed on the pools where it did.
    pub(super) failures: Vec<crate::pool::ResidencyError>,
}

/// Load (`load`) or unload `model` on every pool serving it, off the async runtime; answers
/// what happened on each pool and how long it took.
pub(super) async fn change(state: &Arc<AppState>, model: String, load: bool) -> Result<Done, ApiError> {
    let service = &state.service;
    let config = service
        .model(&model)
        .map(|m| m.config.residency)
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("no model `{model}`")))?;
    if !load && config == crate::config::Residency::Pinned {
        let refusal = crate::pool::ResidencyError::Pinned { model: model.clone() };
        return Err(ApiError::new(StatusCode::CONFLICT, refusal.to_string()));
    }
    let pools: Vec<Arc<crate::pool::Pool>> = service.pools.iter().filter(|p| p.serves(&model)).cloned().collect();
    let name = model.clone();
    let (answers, failures) = tokio::task::spawn_blocking(move || {
        let (mut answers, mut failures) = (Vec::new(), Vec::new());
        for pool in &pools {
            let started = std::time::Instant::now();
            let result = if load {
                pool.load_model(&name)
            } else {
                pool.unload_model(&name)
            };
            let took_ms = started.elapsed().as_secs_f64() * 1000.0;
            answers.push(match result {
                Ok(outcome) => json!({"pool": pool.name(), "result": outcome.label(), "took_ms": took_ms}),
                Err(e) => {
                    let answer =
                        json!({"pool": pool.name(), "result": "failed", "error": e.to_string(), "took_ms": took_ms});
                    failures.push(e);
                    answer
                }
            });
        }
        (answers, failures)
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    service.resample_now().await;
    Ok(Done {
        answer: json!({"model": model, "pools": answers}),
        failures,
    })
}
