//! Counting a request once in the request metrics (`vramguard_requests_total`, its duration),
//! with the outcome it ends with, whether it ran, was refused before it reached a pool, or
//! lost its client on the way.

use std::sync::Arc;

use tokio::time::Instant;

use crate::core::metrics::ModelPoolLabels;
use crate::pool::Pool;
use crate::serve::metrics::{Outcome, RequestLabels};
use crate::serve::service::Service;
use crate::serve::service::UNKNOWN_MODEL;

use super::substitute::Answering;
use super::{Refused, RequestError};

/// Do `work` as request `request_id`, counted once in the request metrics with the outcome it
/// ends with (on the pool it ended on), or `cancelled` when its client goes away first, under
/// the model [`Answering`] names then: a request its model's fallback answered is counted
/// once, as the fallback's. Its policy decision, on the status page, says the same.
pub async fn counted_as<T>(
    service: &Service,
    answering: &Answering,
    request_id: &str,
    received: Instant,
    work: impl std::future::Future<Output = Result<(T, Arc<Pool>), Refused>>,
) -> Result<T, Refused> {
    // A client that goes away drops this future: the guard counts that as `cancelled` (a job
    // still queued is then skipped by the pool, one already running is stopped).
    let mut gone = ClientGone {
        service,
        answering,
        request_id,
        received,
        armed: true,
    };
    let result = work.await;
    gone.armed = false;
    let model = answering.model();
    let (pool, outcome) = match &result {
        Ok((_, pool)) => (Some(pool), Outcome::ok),
        Err(refused) => (refused.pool.as_ref(), refused.error.outcome()),
    };
    record(service, model, pool.map(|p| p.name()), outcome, received);
    // The pool that answered: a refusal's pool is where it was refused, which ran nothing.
    let ran = result.as_ref().ok().map(|(_, pool)| pool.name());
    service.decisions.answered(request_id, outcome.label(), ran);
    if let Err(refused) = &result {
        tracing::debug!(model = %model, pool = pool.map(|p| p.name()), outcome = ?refused.error.outcome(), error = %refused.error, "request refused");
    }
    result.map(|(value, _)| value)
}

/// Counts a request whose client went away before it was answered.
struct ClientGone<'a> {
    service: &'a Service,
    answering: &'a Answering,
    request_id: &'a str,
    received: Instant,
    armed: bool,
}

impl Drop for ClientGone<'_> {
    fn drop(&mut self) {
        if self.armed {
            let model = self.answering.model();
            tracing::debug!(model, "the client went away before the answer");
            record(self.service, model, None, Outcome::cancelled, self.received);
            let cancelled = Outcome::cancelled.label();
            self.service.decisions.answered(self.request_id, cancelled, None);
        }
    }
}

/// Refuse a request before it reaches [`infer`](super::infer) (it could not be decoded, say),
/// counting it like any other outcome.
pub fn reject(service: &Service, model: &str, error: RequestError, received: Instant) -> Refused {
    record(service, model, None, error.outcome(), received);
    Refused { pool: None, error }
}

/// Count a refusal the protocol layer answered itself, with no [`RequestError`] behind it (an
/// `idempotency-key` reused with another request, a generation request refused while it was
/// read): refused before any pool was chosen.
pub fn answered(service: &Service, model: &str, outcome: Outcome, received: Instant) {
    record(service, model, None, outcome, received);
}

/// Count a request's outcome: once in `vramguard_requests_total`, in its duration when it
/// reached a pool, and in its model's statistics (Triton's statistics extension).
fn record(service: &Service, model: &str, pool: Option<&str>, outcome: Outcome, received: Instant) {
    let took = received.elapsed();
    let model = match service.model(model) {
        Some(entry) => {
            entry
                .stats
                .record(outcome == Outcome::ok, took, std::time::SystemTime::now());
            model
        }
        None => UNKNOWN_MODEL,
    };
    let metrics = &service.metrics;
    metrics
        .requests
        .total
        .get_or_create(&RequestLabels {
            model: model.to_string(),
            pool: pool.unwrap_or_default().to_string(),
            outcome,
        })
        .inc();
    if let Some(pool) = pool
        && model != UNKNOWN_MODEL
    {
        metrics
            .requests
            .duration
            .get_or_create(&ModelPoolLabels {
                model: model.to_string(),
                pool: pool.to_string(),
            })
            .observe(took.as_secs_f64());
    }
}
