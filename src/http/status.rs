//! `/status` (JSON for tools and the status page) and the status page itself. The report is the
//! service's ([`Service::status_report`](crate::serve::service::Service::status_report)).

use super::state::AppState;
use crate::protocol::status::StatusReport;
use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// `GET /`: a status page for people, served from the binary; it polls `/status`.
pub(super) async fn status_page() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        include_str!("status.html"),
    )
}

/// `GET /status`.
pub(super) async fn status(State(state): State<Arc<AppState>>) -> Json<StatusReport> {
    let shutting_down = state.shutting_down.load(Ordering::SeqCst);
    Json(state.service.status_report(state.started, shutting_down))
}
