//! The API's error body (`{"error": "..."}`), and the HTTP status of each way a request can
//! fail: the lifecycle says what went wrong and whether waiting helps, this says how HTTP says it.

use crate::serve::lifecycle::RequestError;
use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value};

/// An error answered as `{"error": "..."}` with a status and optional `Retry-After`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    retry_after: Option<u64>,
    /// Fields beside `error` (the request id and reason of a resumable failure).
    extra: Map<String, Value>,
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

/// The HTTP status a request that failed with `error` is answered with. 503 means "not now"
/// (retrying may help, `Retry-After` says when); a 4xx is the request's own problem.
pub fn status_of(error: &RequestError) -> StatusCode {
    match error {
        RequestError::UnknownModel { .. } => StatusCode::NOT_FOUND,
        RequestError::BadInput(_) | RequestError::NeverFits(_) => StatusCode::BAD_REQUEST,
        RequestError::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
        RequestError::DeferredTooLong { .. } => StatusCode::TOO_MANY_REQUESTS,
        RequestError::Deadline(_) => StatusCode::GATEWAY_TIMEOUT,
        RequestError::ClientGone => StatusCode::from_u16(499).expect("499 is a valid status code"),
        RequestError::RemoteRefused { status, .. } => StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_REQUEST),
        RequestError::Failed { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        RequestError::NoPool { .. }
        | RequestError::Refused { .. }
        | RequestError::QueueFull { .. }
        | RequestError::QueueTimeout { .. }
        | RequestError::ShuttingDown { .. }
        | RequestError::Unavailable { .. }
        | RequestError::BreakerOpen { .. }
        | RequestError::HostMemory { .. }
        | RequestError::Allocation { .. }
        | RequestError::Remote { .. } => StatusCode::SERVICE_UNAVAILABLE,
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
