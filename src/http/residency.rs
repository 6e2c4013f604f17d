//! Loading and unloading a model on every pool serving it, as the admin API's
//! `POST /admin/models/{model}/load|unload` and Triton's
//! `POST /v2/repository/models/{model}/load|unload` both answer it (`admin.rs`,
//! `triton/repository.rs`), under the admin API's authorization. The work is the service's
//! ([`Service::change_residency`](crate::serve::service::Service::change_residency)).

use std::sync::Arc;

use axum::http::StatusCode;
use serde_json::{Value, json};

use super::error::ApiError;
use super::state::AppState;
use crate::serve::residency::Refusal;

/// What a load or unload did on the pools serving the model.
pub(super) struct Done {
    /// The answer: what happened on each pool and how long it took.
    pub(super) answer: Value,
    /// Why it failed on the pools where it did, and whether that pool is remote (its server
    /// loads its own models).
    pub(super) failures: Vec<(String, bool)>,
}

/// Load (`load`) or unload `model` on every pool serving it; answers what happened on each
/// pool and how long it took.
pub(super) async fn change(state: &Arc<AppState>, model: String, load: bool) -> Result<Done, ApiError> {
    let changes = state.service.change_residency(&model, load).await.map_err(|refusal| {
        let status = match refusal {
            Refusal::NoModel(_) => StatusCode::NOT_FOUND,
            Refusal::Pinned(_) => StatusCode::CONFLICT,
            Refusal::Unfinished(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, refusal.to_string())
    })?;
    let mut failures = Vec::new();
    let answers: Vec<Value> = changes
        .into_iter()
        .map(|change| {
            let took_ms = change.took.as_secs_f64() * 1000.0;
            match change.result {
                Ok(label) => json!({"pool": change.pool, "result": label, "took_ms": took_ms}),
                Err(failure) => {
                    let answer =
                        json!({"pool": change.pool, "result": "failed", "error": failure.message, "took_ms": took_ms});
                    failures.push((failure.message, failure.remote));
                    answer
                }
            }
        })
        .collect();
    Ok(Done {
        answer: json!({"model": model, "pools": answers}),
        failures,
    })
}
