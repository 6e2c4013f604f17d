//! What the connection layer answers itself, before any handler sees the request: the API's
//! error body (`{"error": "..."}`), written here because `net` sits below the HTTP API and
//! cannot use its error type.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::IntoResponse;

/// The message of a 413 for a body over `server.body_limit` of `limit` bytes, the same whether
/// the connection layer refused its declared length or the router found it too long.
pub fn body_too_large(limit: u64) -> String {
    format!("request body exceeds the {limit} byte limit (server.body_limit)")
}

/// A request the connection layer answers itself, before any handler sees it: the API's error
/// body (`{"error": "..."}`), with `Retry-After` when waiting helps.
#[derive(Debug)]
pub(super) struct Refusal {
    status: StatusCode,
    message: String,
    retry_after: Option<u64>,
}

impl Refusal {
    pub(super) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            retry_after: None,
        }
    }

    pub(super) fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds.max(1));
        self
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> axum::response::Response {
        let body = serde_json::json!({ "error": self.message });
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}
