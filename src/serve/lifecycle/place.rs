//! A request's placed run: after the policy's decision, its service's budgets, the breaker's
//! permission (or the fallback, when the breaker opened since routing), the deadline and
//! host-memory checks, then the run with its one retry.

use std::sync::Arc;

use tokio::time::Instant;

use crate::core::snapshot::Action;
use crate::pool::{Pool, PoolError};
use crate::serve::metrics::FailoverReason;
use crate::serve::service::Service;

use super::admit::{Admitted, admit};
use super::retry::{Run, can_take_retry, fallback_of, run_with_retry};
use super::run::host_keeps_reserve;
use super::{DeadlineMiss, Refused, Request, RequestError, Served};

/// Place and run a request like [`infer`](super::infer), without counting it: for work made of
/// several runs (a generation), counted once around all of them by a
/// [`Counted`](super::Counted). It runs alone: a protocol that batches requests of a model with
/// `batching` places them through [`crate::serve::batching`] instead.
pub async fn place(service: &Service, mut request: Request) -> Result<Served, Refused> {
    let (mut admitted, estimate_bytes) = placed(service, &mut request).await?;
    let pool = Arc::clone(&admitted.pool);
    let inputs = std::mem::take(&mut request.inputs);
    let ran = run_with_retry(service, &pool, &request, inputs, estimate_bytes, Run::Placed).await;
    release_hold(service, &mut admitted);
    let ran = ran?;
    // For the one retry: the run that answered is the request's last one started.
    let retry_started = ran
        .retried
        .and(request.progress.last_started())
        .map(|at| at.saturating_duration_since(request.received.into_std()));
    Ok(Served {
        pool: ran.pool,
        action: if ran.retried.is_some() {
            Action::Redirect
        } else {
            admitted.action
        },
        context: admitted.context,
        context_cut: admitted.context_cut,
        retry_started,
        retried: ran.retried,
        outputs: ran.outputs,
    })
}

/// Everything before a placed request's run: the policy's decision, its service's budgets, the
/// breaker's permission (taken), the deadline and host-memory checks. Gives where it runs and
/// the bytes its run is estimated to take beyond the weights.
pub(super) async fn placed(service: &Service, request: &mut Request) -> Result<(Admitted, u64), Refused> {
    let entry = service.model(&request.model).ok_or_else(|| Refused {
        pool: None,
        error: RequestError::unknown_model(service, &request.model),
    })?;
    let mut admitted = admit(service, entry, request).await?;
    let estimate_bytes = admitted
        .estimate
        .context_bytes
        .saturating_add(admitted.estimate.workspace_bytes);
    // Before the breaker's permission: waiting here must not hold a half-open pool's trial.
    super::budget::enter(service, entry, &mut admitted, request, estimate_bytes).await?;
    permit_or_fallback(service, &mut admitted, estimate_bytes).map_err(|(pool, error)| Refused {
        error: RequestError::from_pool(&pool, error),
        pool: Some(pool),
    })?;
    let pool = Arc::clone(&admitted.pool);
    if !deadline_reachable(&pool, request) {
        return Err(Refused::at(&pool, RequestError::Deadline(DeadlineMiss::Estimated)));
    }
    if let Err(reason) = host_keeps_reserve(service, &pool, estimate_bytes) {
        return Err(Refused::at(
            &pool,
            RequestError::HostMemory {
                pool: pool.name().to_string(),
                reason,
                retry_after: pool.load().estimated_delay,
            },
        ));
    }
    Ok((admitted, estimate_bytes))
}

/// After the placed run: what its load took shows in the next sample, which the device's next
/// cold start waits for; the answer does not.
pub(super) fn release_hold(service: &Service, admitted: &mut Admitted) {
    if let Some(hold) = admitted.hold.take() {
        let resample = service.resampler().now();
        tokio::spawn(async move {
            resample.await;
            drop(hold);
        });
    }
}

/// The breaker's permission for the run, taken once here. The breaker may not be closed (it
/// opened since the request was routed, as when a concurrent run met a driver failure while the
/// policy decided, or it is half-open and waits for its health check): nothing of the request
/// has run, so the fallback takes it, as it would a request routed a moment later, instead of
/// refusing it. A refusal names the pool that refused.
fn permit_or_fallback(
    service: &Service,
    admitted: &mut Admitted,
    estimate_bytes: u64,
) -> Result<(), (Arc<Pool>, PoolError)> {
    let from = Arc::clone(&admitted.pool);
    let closed = match from.health().breaker_permit() {
        Ok(()) => return Ok(()),
        Err(closed) => closed,
    };
    let Some(fallback) = fallback_of(service, &from).filter(|f| can_take_retry(service, f, estimate_bytes).is_ok())
    else {
        return Err((from, closed));
    };
    fallback
        .health()
        .breaker_permit()
        .map_err(|e| (Arc::clone(&fallback), e))?;
    service.failover(&from, &fallback, FailoverReason::breaker_open);
    admitted.pool = fallback;
    admitted.action = Action::Redirect;
    Ok(())
}

/// Whether `pool` can finish the request before its deadline, going by its queue and recent
/// run times (no estimate yet: assume it can).
fn deadline_reachable(pool: &Pool, request: &Request) -> bool {
    let Some(deadline) = request.deadline() else {
        return true;
    };
    let estimate = pool.load().estimated_delay;
    estimate.is_zero() || Instant::now() + estimate <= deadline
}
