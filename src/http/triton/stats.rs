//! Triton's statistics extension: `GET /v2/models/stats` and `GET /v2/models/{model}/stats`,
//! each model's answered requests ([`crate::telemetry::inference_stats`]) in Triton's fields.
//!
//! What vramguard does not measure per model is 0, never estimated: the queue and compute
//! phases (vramguard times queue waits per pool, `vramguard_queue_wait_seconds`), a decoder's
//! runs (a generation is many runs, shared with other generations), cache hits (it has no
//! response cache) and per-batch-size figures.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde_json::{Value, json};

use crate::serve::service::ModelEntry;
use crate::telemetry::inference_stats::Totals;

use super::super::error::ApiError;
use super::super::oip::{ModelPath, configured};
use super::super::state::AppState;

/// `GET /v2/models/stats`: every configured model's statistics, in config order.
pub(super) async fn all_stats(State(state): State<Arc<AppState>>) -> Json<Value> {
    let models: Vec<Value> = state.service.models.iter().map(stats_of).collect();
    Json(json!({"model_stats": models}))
}

/// `GET /v2/models/{model}/stats`.
pub(super) async fn model_stats(
    State(state): State<Arc<AppState>>,
    ModelPath(model): ModelPath,
) -> Result<Json<Value>, ApiError> {
    let entry = configured(&state, &model)?;
    Ok(Json(json!({"model_stats": [stats_of(entry)]})))
}

/// One model's entry of `model_stats`.
///
/// Every answer counts once, as in `vramguard_requests_total`: `success` the `ok` ones, `fail`
/// every other outcome (refusals before any pool included), each with the time from its
/// arrival to its answer. Its configuration has `max_batch_size` 0, so each successful request
/// is one inference (`inference_count`). A request to a model that is not a decoder is one run
/// (vramguard never combines them), so `execution_count` is the same; a decoder's runs are not
/// counted per model: 0.
fn stats_of(entry: &ModelEntry) -> Value {
    let view = entry.stats.view();
    let totals = |t: Totals| json!({"count": t.count, "ns": t.ns});
    let none = totals(Totals::default());
    let executions = if entry.kind.decoder().is_some() {
        0
    } else {
        view.success.count
    };
    json!({
        "name": entry.config.name,
        "version": "1",
        "last_inference": view.last_answer_ms,
        "inference_count": view.success.count,
        "execution_count": executions,
        "inference_stats": {
            "success": totals(view.success),
            "fail": totals(view.fail),
            "queue": none,
            "compute_input": none,
            "compute_infer": none,
            "compute_output": none,
            "cache_hit": none,
            "cache_miss": none,
        },
        "response_stats": {},
        "batch_stats": [],
        "memory_usage": [],
    })
}
