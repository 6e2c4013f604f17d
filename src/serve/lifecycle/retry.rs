//! The one retry: a run that fails on an accelerator (or remote) pool in a way its fallback pool
//! would not (an allocator failure, a driver failure, the remote server failing) runs once more
//! there, when the request may be replayed and the fallback can take it. A request's placed run
//! and a generation's steps both go through [`run_with_retry`], so what is retried, what is
//! counted and what the client is told are decided in one place. (A breaker that opened before
//! anything ran is not a retry: `place` sends such a request to the fallback itself.)

use std::sync::Arc;

use crate::core::backend::{AllocFailureKind, BackendError};
use crate::core::breaker::Tripped;
use crate::core::tensor::Tensor;
use crate::pool::batch::sequences::Waiting;
use crate::pool::{Inputs, Pool, PoolError};
use crate::serve::metrics::{FailoverReason, RetryLabels, RetryResult};
use crate::serve::service::Service;

use super::run::{host_keeps_reserve, is_accelerator, run_on, run_permitted};
use super::{NotRetried, Ran, Refused, Request, RequestError};

/// Which of a request's runs is tried: they differ in what a failure may still do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Run {
    /// The run the policy placed: a single run, or a generation's prompt (counted as waiting
    /// on its pool while it runs). A request that may not be replayed is counted as such
    /// (`result="not_replayable"`) and told why it was not retried.
    Placed,
    /// A generation's next token. One that may not be replayed (the client said so, or it
    /// offers tools) does not consider the fallback and counts no retry decision; for tools,
    /// the generation tells the client why ([`NotRetried::ToolsStarted`]).
    Step,
}

/// Run `inputs` of `request` on `pool`, the breaker's permission already taken, and once more on the pool's fallback if that run fails in a way the
/// fallback would not. The failover is counted and marks degraded mode
/// ([`Service::failover`]); the retry's decision is counted for `pool`
/// (`vramguard_retries_total`); a failure that is not retried says why when that is news to
/// the client ([`NotRetried`]).
pub(super) async fn run_with_retry(
    service: &Service,
    pool: &Arc<Pool>,
    request: &Request,
    inputs: Vec<Tensor>,
    estimate_bytes: u64,
    run: Run,
) -> Result<Ran, Refused> {
    // A generation's prompt counts as waiting on its pool until its run is over.
    let waits = run == Run::Placed && request.max_new_tokens > 0;
    // Kept for the retry by reference, not copied: while the request holds them, the first run
    // reads them where they are (`Backend::run_borrowed`).
    let inputs = Inputs::from(inputs);
    let fallback = fallback_of(service, pool);
    let spare = (fallback.is_some() && request.meta.replayable).then(|| inputs.clone());
    let waiting = waits.then(|| waiting_on(pool, request, &inputs));
    let first = run_permitted(service, pool, request, inputs, estimate_bytes).await;
    drop(waiting);
    match first {
        Ok(outputs) => Ok(Ran {
            pool: Arc::clone(pool),
            retried: None,
            outputs,
        }),
        Err(error) => after_failure(service, pool, request, error, spare, estimate_bytes, run).await,
    }
}

/// What follows a run of `request` that failed on `pool` with `error`: once more on the pool's
/// fallback with `spare` (the run's inputs, kept when the request may be replayed) when the
/// fallback would not fail the same way, else the error, with why it was not retried when
/// that is news to the client.
pub(super) async fn after_failure(
    service: &Service,
    pool: &Arc<Pool>,
    request: &Request,
    error: PoolError,
    spare: Option<Inputs>,
    estimate_bytes: u64,
    run: Run,
) -> Result<Ran, Refused> {
    let waits = run == Run::Placed && request.max_new_tokens > 0;
    let refuse = Refused::at;
    let fallback = fallback_of(service, pool);
    let reason = retry_reason(&error).or_else(|| moved_step_reason(&error, run));
    let (Some(reason), Some(fallback)) = (reason, fallback) else {
        return Err(refuse(pool, RequestError::from_pool(pool, error)));
    };
    let retries = |result: RetryResult| count_retry(service, pool, result);
    let inputs = match (spare, run) {
        (Some(inputs), _) => inputs,
        (None, Run::Step) => return Err(refuse(pool, RequestError::from_pool(pool, error))),
        (None, Run::Placed) => {
            // Never replayed behind the client's back: it gets a resumable error with its id.
            retries(RetryResult::not_replayable);
            let refused = RequestError::from_pool(pool, error).not_retried(NotRetried::NotReplayable);
            return Err(refuse(pool, refused));
        }
    };
    if let Err(why) = can_take_retry(service, &fallback, estimate_bytes) {
        retries(RetryResult::no_fallback);
        let refused = RequestError::from_pool(pool, error).not_retried(NotRetried::NoFallback(why));
        return Err(refuse(pool, refused));
    }
    service.failover(pool, &fallback, reason);
    let moving = match run {
        Run::Placed => "retrying once on the fallback pool",
        Run::Step => "the step and the rest move to the fallback pool",
    };
    tracing::info!(request_id = %request.meta.request_id, from = pool.name(), to = fallback.name(), reason = ?reason, "{moving}");
    let _waiting = waits.then(|| waiting_on(&fallback, request, &inputs));
    match run_on(service, &fallback, request, inputs, estimate_bytes).await {
        Ok(outputs) => {
            retries(RetryResult::ok);
            Ok(Ran {
                pool: fallback,
                retried: Some(reason),
                outputs,
            })
        }
        Err(error) => {
            retries(RetryResult::failed);
            Err(refuse(&fallback, RequestError::from_pool(&fallback, error)))
        }
    }
}

/// A generation's prompt waiting for its run on `pool` (its `inputs`): when the pool keeps its
/// cache, on its way to join the model's batch there, so admission counts the padding it
/// brings ([`crate::pool::batch::sequences::Sequences::join_padding`]).
fn waiting_on(pool: &Arc<Pool>, request: &Request, inputs: &[Tensor]) -> Waiting {
    let prompt = inputs
        .iter()
        .find(|t| t.name == "input_ids")
        .and_then(|t| t.shape.last())
        .map(|&n| n.max(0) as u64);
    match (request.sequence, prompt) {
        (Some(_), Some(prompt)) if pool.keeps_caches() => Waiting::joining(&pool.sequences, &request.model, prompt),
        _ => Waiting::on(&pool.sequences),
    }
}

/// Where a run that fails on `pool` with an allocator failure (or its remote server failing)
/// may go once: its configured fallback, for pools off the host.
pub(super) fn fallback_of(service: &Service, pool: &Pool) -> Option<Arc<Pool>> {
    pool.config
        .fallback
        .as_deref()
        .filter(|_| is_accelerator(pool))
        .and_then(|name| service.pool(name))
        .cloned()
}

/// Count one retry decision for a failure on `pool`.
fn count_retry(service: &Service, pool: &Pool, result: RetryResult) {
    service
        .metrics
        .failover
        .retries
        .get_or_create(&RetryLabels {
            pool: pool.name().to_string(),
            result,
        })
        .inc();
}

/// Whether a run that failed with `error` may be retried once on the fallback pool, and the
/// failover reason if so: an allocator failure, or a remote pool's server failing. Anything
/// else (the client's mistake, its deadline, a model error) would fail the same way there.
fn retry_reason(error: &PoolError) -> Option<FailoverReason> {
    match error {
        PoolError::Backend(BackendError::Allocation {
            kind: AllocFailureKind::Oom,
            ..
        }) => Some(FailoverReason::oom_retry),
        PoolError::Backend(BackendError::Allocation {
            kind: AllocFailureKind::Driver,
            ..
        }) => Some(FailoverReason::driver_retry),
        PoolError::Backend(BackendError::Remote { .. }) => Some(FailoverReason::remote_retry),
        PoolError::Backend(BackendError::WorkerLost(_)) => Some(FailoverReason::worker_lost),
        _ => None,
    }
}

/// Why a generation's step refused by a breaker that opened since its prompt ran moves to the
/// fallback (its cache was on this pool, and the fallback rebuilds it): the breaker's own cause
/// when that is a lost worker, so a step that meets the dead worker and one that meets the
/// breaker its supervisor opened first are counted alike, else `breaker_open`.
fn moved_step_reason(error: &PoolError, run: Run) -> Option<FailoverReason> {
    match (error, run) {
        (
            PoolError::BreakerOpen {
                why: Tripped::WorkerLost(_),
                ..
            },
            Run::Step,
        ) => Some(FailoverReason::worker_lost),
        (PoolError::BreakerOpen { .. }, Run::Step) => Some(FailoverReason::breaker_open),
        _ => None,
    }
}

/// Whether the fallback pool can take a retry now: it runs, its breaker lets work through, and
/// when it is on the host, the host keeps its reserve after the request (the CPU path must
/// not take the machine down).
pub(super) fn can_take_retry(service: &Service, fallback: &Pool, need_bytes: u64) -> Result<(), String> {
    if let Some(why) = fallback.refusal() {
        return Err(format!("fallback pool `{}` cannot take work: {why}", fallback.name()));
    }
    host_keeps_reserve(service, fallback, need_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::backend::RemoteFailure;

    fn backend(error: BackendError) -> PoolError {
        PoolError::Backend(error)
    }

    #[test]
    fn only_failures_the_fallback_would_not_share_are_retried() {
        let allocation = |kind| {
            backend(BackendError::Allocation {
                kind,
                message: "no memory".into(),
            })
        };
        assert_eq!(
            retry_reason(&allocation(AllocFailureKind::Oom)),
            Some(FailoverReason::oom_retry)
        );
        assert_eq!(
            retry_reason(&allocation(AllocFailureKind::Driver)),
            Some(FailoverReason::driver_retry)
        );
        let remote = backend(BackendError::Remote {
            kind: RemoteFailure::ServerError,
            message: "502".into(),
        });
        assert_eq!(retry_reason(&remote), Some(FailoverReason::remote_retry));
        // The client's mistake, its deadline, a full queue or an open breaker would be the same
        // on the fallback, or are not failures of the run at all.
        for error in [
            backend(BackendError::InvalidInput("bad shape".into())),
            backend(BackendError::DeadlineExceeded),
            PoolError::QueueFull {
                pool: "gpu".into(),
                capacity: 1,
            },
            PoolError::BreakerOpen {
                pool: "gpu".into(),
                why: Tripped::Driver,
            },
        ] {
            assert_eq!(retry_reason(&error), None, "{error}");
        }
    }

    /// A step meets either the dead worker or the breaker its supervisor opened first, as the
    /// two threads race: the failover is counted as the lost worker's either way.
    #[test]
    fn a_step_moved_by_a_breaker_a_lost_worker_opened_counts_as_worker_lost() {
        let open = |why| PoolError::BreakerOpen {
            pool: "gpu".into(),
            why,
        };
        let lost = open(Tripped::WorkerLost("killed by signal 9".into()));
        assert_eq!(moved_step_reason(&lost, Run::Step), Some(FailoverReason::worker_lost));
        let met = backend(BackendError::WorkerLost("connection closed".into()));
        assert_eq!(retry_reason(&met), Some(FailoverReason::worker_lost));
        assert_eq!(
            moved_step_reason(&open(Tripped::Driver), Run::Step),
            Some(FailoverReason::breaker_open)
        );
        assert_eq!(
            moved_step_reason(&open(Tripped::Failures(3)), Run::Step),
            Some(FailoverReason::breaker_open)
        );
        // A placed run refused by an open breaker never ran: `place` moves it, not a retry.
        assert_eq!(moved_step_reason(&lost, Run::Placed), None);
    }
}
