//! The HTTP status of each way a request can fail: the lifecycle says what went wrong and
//! whether waiting helps, this says how HTTP says it. The error body itself ([`ApiError`]) is
//! the connection layer's, which answers some requests before any route sees them.

use axum::http::StatusCode;

pub use crate::net::ApiError;
use crate::serve::lifecycle::RequestError;

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
