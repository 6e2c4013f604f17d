//! Errors as OpenAI's API writes them (`{"error": {"message", "type", "param", "code"}}`), so
//! clients built on the `openai` package read them as they read OpenAI's own.

use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::http::error::status_of;
use crate::serve::lifecycle::RequestError;

/// An error as OpenAI's API writes it.
pub struct OpenAiError {
    pub(super) status: StatusCode,
    pub(super) message: String,
    /// OpenAI's `type`.
    pub(super) kind: &'static str,
    /// The request field at fault, when one is.
    pub(super) param: Option<&'static str>,
    pub(super) retry_after: Option<u64>,
    pub(super) request_id: Option<String>,
}

impl OpenAiError {
    /// A 400 for what the request says, naming the field at fault when one is.
    pub(super) fn invalid(message: impl Into<String>, param: Option<&'static str>) -> OpenAiError {
        OpenAiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            retry_after: None,
            request_id: None,
        }
    }

    /// A body that could not be read (too large, or the connection failed), with the status the
    /// router gave it.
    pub(super) fn unreadable(rejection: &BytesRejection, id: &str) -> OpenAiError {
        OpenAiError {
            status: rejection.status(),
            message: rejection.body_text(),
            kind: "invalid_request_error",
            param: None,
            retry_after: None,
            request_id: Some(id.to_string()),
        }
    }

    /// A 500 for a failure of the server's own, not the request's.
    pub(super) fn internal(message: String, id: &str) -> OpenAiError {
        OpenAiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message,
            kind: "server_error",
            param: None,
            retry_after: None,
            request_id: Some(id.to_string()),
        }
    }

    /// A request the lifecycle refused or that failed, with the status the HTTP layer gives it.
    pub(super) fn from_request(error: &RequestError, id: &str) -> OpenAiError {
        let status = status_of(error);
        OpenAiError {
            status,
            message: error.to_string(),
            kind: match status.as_u16() {
                404 => "not_found_error",
                429 => "rate_limit_error",
                400..=499 => "invalid_request_error",
                503 | 504 => "service_unavailable_error",
                _ => "server_error",
            },
            param: None,
            retry_after: error.retry_after_secs(),
            request_id: Some(id.to_string()),
        }
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let mut error = json!({"message": self.message, "type": self.kind, "param": self.param, "code": null});
        if let Some(id) = &self.request_id {
            error["request_id"] = json!(id);
        }
        let mut response = (self.status, axum::Json(json!({"error": error}))).into_response();
        if let Some(s) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}
