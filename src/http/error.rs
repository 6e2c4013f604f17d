//! The HTTP status of each way a request can fail: the lifecycle says what went wrong and
//! whether waiting helps, this says how HTTP says it. The error body itself ([`ApiError`]) is
//! the connection layer's, which answers some requests before any route sees them.

use axum::http::StatusCode;

pub use crate::net::ApiError;
use crate::serve::lifecycle::RequestError;
use crate::serve::metrics::Outcome;

/// The HTTP status a request that failed with `error` is answered with. 503 means "not now"
/// (retrying may help, `Retry-After` says when); a 4xx is the request's own problem.
pub fn status_of(error: &RequestError) -> StatusCode {
    match error {
        RequestError::UnknownModel { .. } => StatusCode::NOT_FOUND,
        RequestError::BadInput(_) | RequestError::NeverFits(_) | RequestError::ContextTooLong { .. } => {
            StatusCode::BAD_REQUEST
        }
        RequestError::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
        RequestError::DeferredTooLong { .. } | RequestError::OverBudget { .. } => StatusCode::TOO_MANY_REQUESTS,
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
        | RequestError::Receiving(_)
        | RequestError::Allocation { .. }
        | RequestError::Remote { .. }
        | RequestError::WorkerLost { .. } => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// The outcome an answer with `status` is counted with when no [`RequestError`] is at hand (a
/// generation request refused while it was read): the same as [`RequestError::outcome`] gives
/// the errors [`status_of`] answers so.
pub fn outcome_of_status(status: StatusCode) -> Outcome {
    match status.as_u16() {
        200..=399 => Outcome::ok,
        429 => Outcome::deferred_timeout,
        499 | 504 => Outcome::cancelled,
        400..=499 => Outcome::client_error,
        503 => Outcome::rejected,
        _ => Outcome::failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::lifecycle::DeadlineMiss;
    use std::time::Duration;

    #[test]
    fn a_status_is_counted_as_the_error_answered_with_it_is() {
        let errors = [
            RequestError::BadInput("x".into()),
            RequestError::ClientGone,
            RequestError::Failed { pool: "gpu".into() },
            RequestError::Deadline(DeadlineMiss::OnArrival),
            RequestError::QueueFull {
                pool: "gpu".into(),
                capacity: 1,
                retry_after: Duration::from_secs(1),
            },
            RequestError::Receiving("busy".into()),
        ];
        for error in errors {
            assert_eq!(outcome_of_status(status_of(&error)), error.outcome(), "{error:?}");
        }
    }
}
