//! Which error body an answer gets, by its path: under `/v1/` OpenAI's
//! (`{"error": {"message", "type", "param", "code"}}`, what every OpenAI client parses),
//! elsewhere the API's own `{"error": "..."}`. The OpenAI handlers write their errors in
//! OpenAI's shape themselves; the answers no handler writes are written here: a path no route
//! serves (404), a method its route does not take (405), and a body the connection layer
//! refused (413 over `server.body_limit`, 503 over `server.max_receiving_bytes`, 408 stalled).

use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::openai::OpenAiError;

/// Whether `path` is OpenAI's API (`/v1` and everything under it).
fn is_openai(path: &str) -> bool {
    path.strip_prefix("/v1")
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// The answer `error` to a request for `path`, in the error body of the path's API.
pub(super) fn answer(path: &str, error: ApiError) -> Response {
    if is_openai(path) {
        OpenAiError::from_api(error).into_response()
    } else {
        error.into_response()
    }
}

/// 404 for a path no route serves; under `/v1/` in OpenAI's own words for an unknown URL.
pub(super) async fn no_route(method: Method, uri: Uri) -> Response {
    let path = uri.path();
    let message = if is_openai(path) {
        format!("Invalid URL ({method} {path})")
    } else {
        "no such endpoint".to_string()
    };
    answer(path, ApiError::new(StatusCode::NOT_FOUND, message))
}

/// 405 for a method the path's route does not take (the router adds `Allow` with those it
/// does); under `/v1/` in OpenAI's own words.
pub(super) async fn wrong_method(method: Method, uri: Uri) -> Response {
    let path = uri.path();
    let message = if is_openai(path) {
        format!("Invalid method for URL ({method} {path})")
    } else {
        format!("method {method} is not allowed on this endpoint")
    };
    answer(path, ApiError::new(StatusCode::METHOD_NOT_ALLOWED, message))
}

#[cfg(test)]
mod tests {
    use super::is_openai;

    #[test]
    fn openai_paths_are_v1_and_below_only() {
        for path in ["/v1", "/v1/", "/v1/embeddings", "/v1/chat/completions"] {
            assert!(is_openai(path), "{path}");
        }
        for path in ["/v10/models", "/v1x", "/v2/models/x/infer", "/metrics", "/", "/status"] {
            assert!(!is_openai(path), "{path}");
        }
    }
}
