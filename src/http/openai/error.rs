//! Errors as OpenAI's API writes them (`{"error": {"message", "type", "param", "code"}}`), so
//! clients built on the `openai` package read them as they read OpenAI's own.

use std::borrow::Cow;

use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::http::error::{ApiError, status_of};
use crate::serve::lifecycle::RequestError;

/// An error as OpenAI's API writes it.
pub struct OpenAiError {
    pub(super) status: StatusCode,
    pub(super) message: String,
    /// OpenAI's `type`.
    pub(super) kind: &'static str,
    /// The request field at fault, when one is: its path in the body for a nested one
    /// (`messages[2].content`).
    pub(super) param: Option<Cow<'static, str>>,
    pub(super) retry_after: Option<u64>,
    pub(super) request_id: Option<String>,
    /// OpenAI's `code` (`context_length_exceeded`) when there is one, and fields of ours beside
    /// it, for the few errors that have them (boxed: every fallible reader returns this type).
    pub(super) extra: Option<Box<(Option<&'static str>, Fields)>>,
}

/// OpenAI's `code` for a model it does not have.
const MODEL_NOT_FOUND: &str = "model_not_found";

/// Fields of ours beside OpenAI's in an error.
type Fields = serde_json::Map<String, serde_json::Value>;

impl OpenAiError {
    /// The 404 for a `model` no configured model is (OpenAI's `model_not_found`), naming the
    /// models there are.
    pub(super) fn unknown_model(service: &crate::serve::service::Service, model: &str, id: &str) -> OpenAiError {
        let error = RequestError::unknown_model(service, model);
        OpenAiError {
            param: Some("model".into()),
            ..OpenAiError::from_request(&error, id)
        }
    }

    /// A 400 for what the request says, naming the field at fault when one is.
    pub(super) fn invalid(message: impl Into<String>, param: Option<&'static str>) -> OpenAiError {
        OpenAiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(Cow::Borrowed),
            retry_after: None,
            request_id: None,
            extra: None,
        }
    }

    /// The 400 for a prompt (`prompt`: its tokens, and whether they are all of it or only
    /// those of a prefix that was already too long) and `max_tokens` that are more positions
    /// than `model` takes (`limit`), found before anything runs: OpenAI's
    /// `context_length_exceeded` with `max_context`, `param` naming the prompt's field.
    pub(super) fn context_too_long(
        model: &str,
        limit: u64,
        (prompt, whole): (u64, bool),
        max_tokens: u64,
        param: &'static str,
        id: &str,
    ) -> OpenAiError {
        let error = RequestError::ContextTooLong {
            model: model.to_string(),
            limit,
            prompt,
            whole,
            max_tokens,
        };
        OpenAiError {
            param: Some(Cow::Borrowed(param)),
            ..OpenAiError::from_request(&error, id)
        }
    }

    /// A 400 for the field at `path` in the body (`messages[2].content`), which the message
    /// names.
    pub(super) fn invalid_at(message: impl Into<String>, path: String) -> OpenAiError {
        OpenAiError {
            param: Some(Cow::Owned(path)),
            ..OpenAiError::invalid(message, None)
        }
    }

    /// A body that could not be read (too large, or the connection failed), with the status the
    /// router gave it.
    pub(super) fn unreadable(rejection: &BytesRejection, id: &str) -> OpenAiError {
        OpenAiError {
            // A body a limit refused is answered by the connection with that limit's status in
            // place of this: it is counted by that status.
            status: crate::net::conn::refused_status(rejection).unwrap_or(rejection.status()),
            message: rejection.body_text(),
            kind: "invalid_request_error",
            param: None,
            retry_after: None,
            request_id: Some(id.to_string()),
            extra: None,
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
            extra: None,
        }
    }

    /// A 404 for a model that is not one of `GET /v1/models`, with OpenAI's code for it.
    pub(super) fn model_not_found(message: String, id: &str) -> OpenAiError {
        OpenAiError {
            status: StatusCode::NOT_FOUND,
            message,
            kind: kind_of(StatusCode::NOT_FOUND),
            param: Some("model".into()),
            retry_after: None,
            request_id: Some(id.to_string()),
            extra: Some(Box::new((Some(MODEL_NOT_FOUND), Fields::new()))),
        }
    }

    /// A request the lifecycle refused or that failed, with the status the HTTP layer gives it.
    pub(super) fn from_request(error: &RequestError, id: &str) -> OpenAiError {
        let status = status_of(error);
        let extra = match error {
            // What OpenAI says of a prompt too long (its clients read `code`), and the numbers a
            // client needs to send less, as a tensor client gets them.
            RequestError::NeverFits(never) => {
                let code = if never.tokens > 0 {
                    "context_length_exceeded"
                } else {
                    "never_fits"
                };
                let mut details = Fields::new();
                details.insert("needed_bytes".into(), json!(never.need_bytes));
                details.insert("max_bytes".into(), json!(never.largest.as_ref().map(|c| c.bytes)));
                details.insert("max_tokens".into(), json!(never.max_tokens));
                Some(Box::new((Some(code), details)))
            }
            // OpenAI's code for a model it does not have, which clients match on.
            RequestError::UnknownModel { .. } => Some(Box::new((Some(MODEL_NOT_FOUND), Fields::new()))),
            RequestError::ContextTooLong { limit, .. } => {
                let mut details = Fields::new();
                details.insert("max_context".into(), json!(limit));
                Some(Box::new((Some("context_length_exceeded"), details)))
            }
            _ => None,
        };
        OpenAiError {
            extra,
            status,
            message: error.to_string(),
            kind: kind_of(status),
            param: None,
            retry_after: error.retry_after_secs(),
            request_id: Some(id.to_string()),
        }
    }

    /// An error the server wrote as `{"error": "..."}` (a path no route serves, a body the
    /// connection layer refused), in OpenAI's shape: the same status, message, `Retry-After`
    /// and fields.
    pub fn from_api(error: ApiError) -> OpenAiError {
        OpenAiError {
            status: error.status,
            message: error.message,
            kind: kind_of(error.status),
            param: None,
            retry_after: error.retry_after,
            request_id: None,
            extra: (!error.extra.is_empty()).then(|| Box::new((None, error.extra))),
        }
    }
}

/// OpenAI's error `type` for an answer with `status`.
fn kind_of(status: StatusCode) -> &'static str {
    match status.as_u16() {
        404 => "not_found_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        503 | 504 => "service_unavailable_error",
        _ => "server_error",
    }
}

impl OpenAiError {
    /// The `error` object as OpenAI writes it: in an error response, or in a stream's `error`
    /// event once the stream has started.
    pub(super) fn body(&self) -> serde_json::Value {
        let code = self.extra.as_ref().and_then(|e| e.0);
        let mut error = json!({"message": self.message, "type": self.kind, "param": self.param, "code": code});
        if let Some(id) = &self.request_id {
            error["request_id"] = json!(id);
        }
        for (key, value) in self.extra.iter().flat_map(|e| e.1.iter()) {
            error[key] = value.clone();
        }
        error
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let error = self.body();
        let mut response = (self.status, axum::Json(json!({"error": error}))).into_response();
        if let Some(s) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::lifecycle::{Ceiling, NeverFits};

    /// A prompt that can never fit reads as OpenAI's own "context too long", with the numbers
    /// a tensor client gets, and no Retry-After.
    #[tokio::test]
    async fn a_prompt_that_never_fits_is_context_length_exceeded() {
        let never = NeverFits {
            model: "tiny".into(),
            need_bytes: 3 << 30,
            tokens: 9000,
            largest: Some(Ceiling {
                pool: "cpu".into(),
                bytes: 1 << 30,
                what: "host memory".into(),
                max_context: None,
            }),
            max_tokens: Some(3000),
            axis: Some("the prompt and max_tokens together".into()),
            dims: vec![("batch".into(), 1), ("context".into(), 9000)],
            substitute: None,
        };
        let response = OpenAiError::from_request(&RequestError::NeverFits(Box::new(never)), "req-1").into_response();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        assert!(response.headers().get(header::RETRY_AFTER).is_none());
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let error = &body["error"];
        assert_eq!(error["type"], "invalid_request_error", "{body}");
        assert_eq!(error["code"], "context_length_exceeded", "{body}");
        assert_eq!(
            (error["needed_bytes"].as_u64(), error["max_bytes"].as_u64()),
            (Some(3 << 30), Some(1 << 30))
        );
        assert_eq!(error["max_tokens"], 3000, "{body}");
        assert!(
            error["message"].as_str().unwrap().contains("send at most 3000 tokens"),
            "{body}"
        );
    }

    /// More positions than the model takes is OpenAI's "context too long" with the model's
    /// limit beside it, and no Retry-After.
    #[tokio::test]
    async fn more_positions_than_the_model_takes_is_context_length_exceeded() {
        let error = RequestError::ContextTooLong {
            model: "llama".into(),
            limit: 256,
            prompt: 250,
            whole: true,
            max_tokens: 16,
        };
        let response = OpenAiError::from_request(&error, "req-1").into_response();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        assert!(response.headers().get(header::RETRY_AFTER).is_none());
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let error = &body["error"];
        assert_eq!(
            (error["code"].as_str(), error["max_context"].as_u64()),
            (Some("context_length_exceeded"), Some(256))
        );
        assert_eq!(
            error["message"],
            "`llama`'s maximum context length is 256 tokens; this request asks for 266 (250 in the prompt, 16 to generate): send a shorter prompt or a smaller max_tokens"
        );
    }
}
