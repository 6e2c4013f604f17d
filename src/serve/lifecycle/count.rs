//! Counting a request once in the request metrics (`vramguard_requests_total`, its duration),
//! with the outcome it ends with, whether it ran, was refused before it reached a pool, or
//! lost its client on the way. The protocol finishes a [`Counted`] with its answer, so an
//! answer that cannot be made is counted with the error the client gets.

use tokio::time::Instant;

use crate::core::metrics::ModelPoolLabels;
use crate::pool::Pool;
use crate::serve::metrics::{Outcome, RequestLabels};
use crate::serve::service::Service;
use crate::serve::service::UNKNOWN_MODEL;

use super::substitute::Answering;
use super::{Refused, Request, RequestError};

/// A request on its way to its answer, counted once in the request metrics. [`Counted::finish`]
/// counts it with the outcome it ends with (on the pool it ended on); dropped unfinished (its
/// client went away, which drops the future holding it), it is counted `cancelled`. Either way
/// it is counted under the model [`Answering`] names then: a request its model's fallback
/// answered is counted once, as the fallback's. Its policy decision, on the status page, says
/// the same.
pub struct Counted<'a> {
    service: &'a Service,
    answering: Answering,
    request_id: String,
    received: Instant,
    /// Set until it is finished.
    armed: bool,
}

impl<'a> Counted<'a> {
    /// Start counting `request`: it takes its place in the service's waiting and running
    /// counts, as a request for its model.
    pub fn start(service: &'a Service, request: &mut Request) -> Counted<'a> {
        request.progress = service.accept(&request.model);
        Counted {
            service,
            answering: Answering::new(&request.model),
            request_id: request.meta.request_id.clone(),
            received: request.received,
            armed: true,
        }
    }

    /// The model answering it now.
    pub fn answering(&self) -> &Answering {
        &self.answering
    }

    /// Count the request with the outcome it ends with: served by the pool that answered, or
    /// refused.
    pub fn finish(mut self, answered: Result<&Pool, &Refused>) {
        self.armed = false;
        let service = self.service;
        let model = self.answering.model();
        let (pool, outcome) = match answered {
            Ok(pool) => (Some(pool.name()), Outcome::ok),
            Err(refused) => (refused.pool.as_ref().map(|p| p.name()), refused.error.outcome()),
        };
        record(service, model, pool, outcome, self.received);
        // The pool that answered: a refusal's pool is where it was refused, which ran nothing.
        let ran = answered.ok().map(Pool::name);
        service.decisions.answered(&self.request_id, outcome.label(), ran);
        if let Err(refused) = answered {
            tracing::debug!(model = %model, pool, outcome = ?refused.error.outcome(), error = %refused.error, "request refused");
        }
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        // A job still queued is then skipped by the pool, one already running is stopped.
        if self.armed {
            let model = self.answering.model();
            tracing::debug!(model, "the client went away before the answer");
            record(self.service, model, None, Outcome::cancelled, self.received);
            let cancelled = Outcome::cancelled.label();
            self.service.decisions.answered(&self.request_id, cancelled, None);
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
