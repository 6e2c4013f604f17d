//! The API's error answer, `{"error": "..."}` with a status and `Retry-After` when waiting
//! helps. It lives in the connection layer, which answers some requests itself before any route
//! sees them (a body too large, too many bodies being received); the HTTP API above uses the
//! same type for everything else.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value};

/// The message of a 413 for a body over `server.body_limit` of `limit` bytes, the same whether
/// the connection layer refused its declared length or the router found it too long.
pub fn body_too_large(limit: u64) -> String {
    format!("request body exceeds the {limit} byte limit (server.body_limit)")
}

/// An error answered as `{"error": "..."}` with a status and optional `Retry-After`. Its parts
/// are open to the HTTP API, which writes them in OpenAI's shape for OpenAI's paths.
#[derive(Debug)]
pub struct ApiError {
    /// The answer's status.
    pub(crate) status: StatusCode,
    /// What went wrong, for the client.
    pub(crate) message: String,
    /// Seconds for `Retry-After`, when waiting helps.
    pub(crate) retry_after: Option<u64>,
    /// Fields beside `error` (the request id and reason of a resumable failure).
    pub(crate) extra: Map<String, Value>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            retry_after: None,
            extra: Map::new(),
        }
    }

    pub(crate) fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds.max(1));
        self
    }

    /// One more field beside `error` in the body.
    pub(crate) fn with(mut self, key: &str, value: Value) -> Self {
        self.extra.insert(key.into(), value);
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
