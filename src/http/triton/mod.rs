//! Triton's extensions of the Open Inference Protocol, which its own client (`tritonclient`)
//! and the tools built on it use: the model repository (`repository.rs`: the index, and load
//! and unload, which are the admin API's), model configuration (`config.rs`) and statistics
//! (`stats.rs`).

mod config;
pub(super) mod repository;
mod stats;

use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};

use super::state::AppState;

/// The routes anyone may use: the repository index, configurations and statistics. Load and
/// unload change what the server holds: they are admin routes ([`repository::control_routes`]).
pub(super) fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v2/repository/index", post(repository::index))
        .route("/v2/models/{model}/config", get(config::model_config))
        .route(
            "/v2/models/{model}/versions/{version}/config",
            get(config::model_config),
        )
        .route("/v2/models/stats", get(stats::all_stats))
        .route("/v2/models/{model}/stats", get(stats::model_stats))
        .route("/v2/models/{model}/versions/{version}/stats", get(stats::model_stats))
}
