//! What a request that did not run is told: [`RequestError`], the one mapping of pool failures
//! to it, and what each variant means for the request metrics (`outcome`) and the client's
//! `Retry-After`. The HTTP status of each variant is decided in `http`, not here.

use std::sync::Arc;
use std::time::Duration;

use super::fits::NeverFits;
use crate::core::backend::{AllocFailureKind, BackendError, RemoteFailure};
use crate::core::snapshot::DeviceClass;
use crate::pool::{Pool, PoolError};
use crate::serve::metrics::Outcome;
use crate::serve::service::Service;

/// Why a request that hit an allocator failure was not retried on the fallback pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotRetried {
    /// The client sent `x-vramguard-replayable: false`.
    NotReplayable,
    /// The fallback pool could not take it; the reason says why.
    NoFallback(String),
    /// A generation offering tools had started: a tool call may already have acted.
    ToolsStarted,
}

impl std::fmt::Display for NotRetried {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotRetried::NotReplayable => f.write_str(
                "it was not retried because it is not replayable (x-vramguard-replayable: false); \
                 nothing of it ran to completion, so sending it again is safe",
            ),
            NotRetried::NoFallback(why) => write!(f, "it was not retried: {why}"),
            NotRetried::ToolsStarted => f.write_str(
                "it was not retried because it offers tools and its generation had started \
                 (a tool call may already have acted on the client's side); nothing was run twice",
            ),
        }
    }
}

/// A request that did not run, with the pool that refused or failed it when one was chosen.
#[derive(Debug, Clone)]
pub struct Refused {
    /// The pool involved, if the request got that far.
    pub pool: Option<Arc<Pool>>,
    /// What went wrong.
    pub error: RequestError,
}

impl Refused {
    /// `error`, met on `pool`.
    pub fn at(pool: &Arc<Pool>, error: RequestError) -> Refused {
        Refused {
            pool: Some(Arc::clone(pool)),
            error,
        }
    }
}

/// Why a request did not run. Each variant knows its metric outcome and `Retry-After`, and
/// `http::error` its status; nothing else maps failures.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// No such model.
    #[error("unknown model `{model}`; models: {known}")]
    UnknownModel {
        /// What was asked for.
        model: String,
        /// What exists, comma-separated.
        known: String,
    },
    /// The request is malformed; the message names the tensor or field and the reason.
    #[error("{0}")]
    BadInput(String),
    /// The body is larger than `server.body_limit`; the message says so (the connection
    /// layer words it, since it refuses such bodies too).
    #[error("{0}")]
    BodyTooLarge(String),
    /// The body did not fit in what the server may be receiving at once
    /// (`server.max_receiving_bytes`) when it arrived; the message says so. Not now, rather
    /// than not ever: the connection layer answers it 503 with `Retry-After`.
    #[error("{0}")]
    Receiving(String),
    /// No pool serving the model can take work.
    #[error("no pool can take `{model}` ({reasons})")]
    NoPool {
        /// The model.
        model: String,
        /// Each serving pool and why it cannot take work.
        reasons: String,
    },
    /// The policy rejected it, or its decision cannot be carried out.
    #[error("{reason}")]
    Refused {
        /// Why.
        reason: String,
        /// When to try again.
        retry_after: Duration,
    },
    /// The policy kept deferring it past the pool's `max_wait`.
    #[error(
        "deferred by the policy for {}ms; deferring again would pass pool `{pool}`'s max wait of {}ms",
        deferred.as_millis(),
        bound.as_millis()
    )]
    DeferredTooLong {
        /// The pool.
        pool: String,
        /// How long it was deferred.
        deferred: Duration,
        /// The pool's `max_wait`.
        bound: Duration,
        /// What the next deferral would have brought the total to.
        retry_after: Duration,
    },
    /// Its service stayed at a budget (`concurrency`, `device_memory`, a background service's
    /// turn) past the routed pool's `max_wait` (less the policy's deferrals); the reason names
    /// the service and the budget.
    #[error("{reason}; waited {}ms, to the end of its max wait, on pool `{pool}`", waited.as_millis())]
    OverBudget {
        /// Why it waited.
        reason: String,
        /// The pool it was placed on.
        pool: String,
        /// How long it waited.
        waited: Duration,
        /// When to try again.
        retry_after: Duration,
    },
    /// More than any pool serving the model could ever give it: the client's to make smaller,
    /// so no `Retry-After`.
    #[error("{0}")]
    NeverFits(Box<NeverFits>),
    /// A generation's prompt and `max_tokens` are more positions than its model takes (what
    /// its folder says: `genai_config.json`'s `context_length`, `config.json`'s
    /// `max_position_embeddings`): the client's to make shorter, as OpenAI words it.
    #[error(
        "`{model}`'s maximum context length is {limit} tokens; this request asks for {}{} ({}{prompt} in the prompt, {max_tokens} to generate): send a shorter prompt or a smaller max_tokens",
        if *whole { "" } else { "at least " },
        prompt + max_tokens,
        if *whole { "" } else { "at least " },
    )]
    ContextTooLong {
        /// The model.
        model: String,
        /// The most positions it takes.
        limit: u64,
        /// Tokens of the prompt: all of them, or with `whole` false those of the part of it
        /// that was tokenized (already too long: the prompt has more).
        prompt: u64,
        /// Whether `prompt` counts the whole prompt.
        whole: bool,
        /// Tokens it may generate.
        max_tokens: u64,
    },
    /// The pool's queue is at capacity.
    #[error("pool `{pool}` queue is full ({capacity} waiting)")]
    QueueFull {
        /// The pool.
        pool: String,
        /// Its queue capacity.
        capacity: usize,
        /// The pool's delay estimate.
        retry_after: Duration,
    },
    /// The request waited in the queue past the pool's `max_wait`.
    #[error("pool `{pool}` did not start the request within {}ms", waited.as_millis())]
    QueueTimeout {
        /// The pool.
        pool: String,
        /// How long it waited.
        waited: Duration,
        /// The pool's delay estimate.
        retry_after: Duration,
    },
    /// The pool is shutting down.
    #[error("pool `{pool}` is shutting down")]
    ShuttingDown {
        /// The pool.
        pool: String,
    },
    /// A host pool cannot take it without eating into the host's memory reserve.
    #[error("pool `{pool}` cannot take it now: {reason}")]
    HostMemory {
        /// The pool.
        pool: String,
        /// The numbers.
        reason: String,
        /// The pool's delay estimate (running work frees memory as it finishes).
        retry_after: Duration,
    },
    /// The pool's circuit breaker is open.
    #[error("pool `{pool}` is not taking work: its circuit breaker is open after {why}")]
    BreakerOpen {
        /// The pool.
        pool: String,
        /// Why it opened.
        why: String,
        /// Its cooldown.
        retry_after: Duration,
    },
    /// The pool could not start or lost every worker.
    #[error("pool `{pool}` is unavailable: {reason}")]
    Unavailable {
        /// The pool.
        pool: String,
        /// Why.
        reason: String,
    },
    /// The client's deadline cannot be met.
    #[error("the deadline (x-vramguard-deadline-ms) {0}")]
    Deadline(DeadlineMiss),
    /// The accelerator's allocator could not fit the run.
    #[error(
        "allocator failure ({kind}) on pool `{pool}`, device `{device}`{}: the request does not fit in accelerator memory; {message}{}",
        if *simulated { " (simulated)" } else { "" },
        not_retried.as_ref().map(|n| format!("; {n}")).unwrap_or_default()
    )]
    Allocation {
        /// `oom` or `driver`.
        kind: AllocFailureKind,
        /// The pool.
        pool: String,
        /// Its device.
        device: String,
        /// Whether the device is simulated.
        simulated: bool,
        /// ONNX Runtime's message, trimmed to the useful part.
        message: String,
        /// The pool's delay estimate.
        retry_after: Duration,
        /// Why it was not retried on the fallback pool, when one is configured.
        not_retried: Option<NotRetried>,
    },
    /// A remote pool's server failed to answer (unreachable, 5xx, timeout, overloaded, a
    /// broken answer).
    #[error(
        "remote pool `{pool}` got no answer from its server ({kind}): {message}{}",
        not_retried.as_ref().map(|n| format!("; {n}")).unwrap_or_default()
    )]
    Remote {
        /// The pool.
        pool: String,
        /// How its server failed.
        kind: RemoteFailure,
        /// What happened.
        message: String,
        /// The pool's breaker cooldown: the remote is unlikely to be back sooner.
        retry_after: Duration,
        /// Why it was not retried on the fallback pool, when one is configured.
        not_retried: Option<NotRetried>,
    },
    /// The pool's worker process was lost while it held the run (it may have run there).
    #[error(
        "pool `{pool}` lost its worker process while it held the request: {message}{}",
        not_retried.as_ref().map(|n| format!("; {n}")).unwrap_or_default()
    )]
    WorkerLost {
        /// The pool.
        pool: String,
        /// What happened.
        message: String,
        /// Until its replacement is likely to serve.
        retry_after: Duration,
        /// Why it was not retried on the fallback pool, when one is configured.
        not_retried: Option<NotRetried>,
    },
    /// A remote pool's server refused the request as the client's mistake: its status and
    /// message are passed on.
    #[error("remote pool `{pool}`: {message}")]
    RemoteRefused {
        /// The pool.
        pool: String,
        /// The remote's 4xx status.
        status: u16,
        /// The remote's message.
        message: String,
    },
    /// The client went away in the middle of work made of several runs (a streamed
    /// generation): the rest is not run. Nobody reads the answer; 499 as nginx logs it.
    #[error("the client went away")]
    ClientGone,
    /// The run failed on the server's side; the log has the details.
    #[error("inference failed on pool `{pool}`; the server log has the details")]
    Failed {
        /// The pool.
        pool: String,
    },
}

/// When a deadline was found to be out of reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadlineMiss {
    /// It had passed before the policy was asked (a deadline of 0, or one shorter than reading
    /// the request took).
    OnArrival,
    /// It passed while the policy deferred the request.
    WhileDeferred,
    /// The policy's next deferral would pass it.
    ByDeferral,
    /// It passed while the request waited for its service's budgets.
    WhileBudgeted,
    /// It passed while the request was queued or running.
    InPool,
    /// The pool's queue and recent run times would finish it after the deadline: answered at
    /// once instead of after waiting.
    Estimated,
}

impl std::fmt::Display for DeadlineMiss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeadlineMiss::OnArrival => "had passed before the request could be admitted",
            DeadlineMiss::WhileDeferred => "passed while the policy deferred the request",
            DeadlineMiss::ByDeferral => "cannot be met: the policy defers this request past it",
            DeadlineMiss::WhileBudgeted => "passed while the request waited for its service's budgets",
            DeadlineMiss::InPool => "cannot be met: it passed before the run finished",
            DeadlineMiss::Estimated => {
                "cannot be met: the pool's queue and recent run times would finish it after the deadline"
            }
        })
    }
}

impl RequestError {
    /// The `outcome` label of `vramguard_requests_total`.
    pub fn outcome(&self) -> Outcome {
        match self {
            RequestError::UnknownModel { .. }
            | RequestError::BadInput(_)
            | RequestError::BodyTooLarge(_)
            | RequestError::NeverFits(_)
            | RequestError::ContextTooLong { .. }
            | RequestError::RemoteRefused { .. } => Outcome::client_error,
            // Refused or never received there: nothing ran, as with a full queue.
            RequestError::Remote { kind, .. } if kind.nothing_ran() => Outcome::rejected,
            RequestError::Remote { .. } | RequestError::WorkerLost { .. } => Outcome::failed,
            RequestError::DeferredTooLong { .. }
            | RequestError::OverBudget { .. }
            | RequestError::QueueTimeout { .. } => Outcome::deferred_timeout,
            RequestError::Deadline(_) | RequestError::ClientGone => Outcome::cancelled,
            RequestError::Failed { .. } => Outcome::failed,
            RequestError::NoPool { .. }
            | RequestError::Refused { .. }
            | RequestError::QueueFull { .. }
            | RequestError::ShuttingDown { .. }
            | RequestError::Unavailable { .. }
            | RequestError::BreakerOpen { .. }
            | RequestError::HostMemory { .. }
            | RequestError::Receiving(_)
            | RequestError::Allocation { .. } => Outcome::rejected,
        }
    }

    /// Seconds for `Retry-After` (at least 1), for the errors worth retrying.
    pub fn retry_after_secs(&self) -> Option<u64> {
        let after = match self {
            RequestError::NoPool { .. } | RequestError::Unavailable { .. } | RequestError::ShuttingDown { .. } => {
                Duration::from_secs(5)
            }
            // As the connection layer's own refusal of such a body says.
            RequestError::Receiving(_) => Duration::from_secs(1),
            RequestError::Refused { retry_after, .. }
            | RequestError::DeferredTooLong { retry_after, .. }
            | RequestError::OverBudget { retry_after, .. }
            | RequestError::QueueFull { retry_after, .. }
            | RequestError::QueueTimeout { retry_after, .. }
            | RequestError::BreakerOpen { retry_after, .. }
            | RequestError::HostMemory { retry_after, .. }
            | RequestError::Allocation { retry_after, .. }
            | RequestError::Remote { retry_after, .. }
            | RequestError::WorkerLost { retry_after, .. } => *retry_after,
            RequestError::UnknownModel { .. }
            | RequestError::BadInput(_)
            | RequestError::BodyTooLarge(_)
            | RequestError::NeverFits(_)
            | RequestError::ContextTooLong { .. }
            | RequestError::Deadline(_)
            | RequestError::ClientGone
            | RequestError::RemoteRefused { .. }
            | RequestError::Failed { .. } => return None,
        };
        Some(after.as_secs().max(1))
    }

    /// Say why a failure that could have moved to the fallback pool did not.
    pub(super) fn not_retried(mut self, why: NotRetried) -> RequestError {
        if let RequestError::Allocation { not_retried, .. }
        | RequestError::Remote { not_retried, .. }
        | RequestError::WorkerLost { not_retried, .. } = &mut self
        {
            *not_retried = Some(why);
        }
        self
    }

    /// `model` is not served here; the message lists what is.
    pub fn unknown_model(service: &Service, model: &str) -> RequestError {
        RequestError::UnknownModel {
            // The name comes from the client.
            model: crate::core::human::clipped(model, 64),
            known: service.model_names(),
        }
    }

    /// `pool`'s circuit breaker is open; come back after its cooldown.
    pub(super) fn breaker_open(pool: &Pool) -> RequestError {
        RequestError::BreakerOpen {
            pool: pool.name().to_string(),
            why: pool.health().breaker_tripped().unwrap_or_default(),
            retry_after: pool.config.breaker.cooldown,
        }
    }

    /// What a pool's failure means for the client (the one place pool errors are mapped).
    pub(super) fn from_pool(pool: &Pool, error: PoolError) -> RequestError {
        let retry_after = pool.load().estimated_delay;
        let name = pool.name().to_string();
        match error {
            PoolError::QueueFull { capacity, .. } => RequestError::QueueFull {
                pool: name,
                capacity,
                retry_after,
            },
            PoolError::QueueTimeout { waited, .. } => RequestError::QueueTimeout {
                pool: name,
                waited,
                retry_after,
            },
            PoolError::ShuttingDown { .. } => RequestError::ShuttingDown { pool: name },
            PoolError::Unavailable { reason, .. } => RequestError::Unavailable { pool: name, reason },
            PoolError::BreakerOpen { .. } => RequestError::breaker_open(pool),
            PoolError::DeadlineExceeded { .. } => RequestError::Deadline(DeadlineMiss::InPool),
            // Counted by the pool's worker (vramguard_allocator_failures_total), not here.
            PoolError::Backend(BackendError::Allocation { kind, message }) => RequestError::Allocation {
                kind,
                pool: name,
                device: pool.config.device.clone(),
                simulated: pool.device_kind == DeviceClass::Simulated,
                message: crate::runtime::onnx::concise(&message),
                retry_after,
                not_retried: None,
            },
            PoolError::Backend(BackendError::InvalidInput(message)) => {
                RequestError::BadInput(crate::runtime::onnx::concise(&message))
            }
            // Only a caller that went away cancels, so no client reads this answer.
            PoolError::Backend(BackendError::Cancelled | BackendError::DeadlineExceeded) => {
                RequestError::Deadline(DeadlineMiss::InPool)
            }
            PoolError::Backend(BackendError::Remote { kind, message }) => RequestError::Remote {
                pool: name,
                kind,
                message,
                retry_after: pool.config.breaker.cooldown.min(Duration::from_secs(30)),
                not_retried: None,
            },
            PoolError::Backend(BackendError::WorkerLost(message)) => RequestError::WorkerLost {
                pool: name,
                message,
                retry_after: Duration::from_secs(2),
                not_retried: None,
            },
            PoolError::Backend(BackendError::RemoteRefused { status, message }) => RequestError::RemoteRefused {
                pool: name,
                status,
                message,
            },
            // A generation prefills again when its cache is missing: one that reaches a client
            // is the server's failure.
            PoolError::Backend(
                BackendError::Runtime(_) | BackendError::Panicked(_) | BackendError::CacheMissing(_),
            ) => RequestError::Failed { pool: name },
        }
    }
}
