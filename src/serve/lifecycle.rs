//! One request's life below any protocol: placement, admission, the run and its outcome.
//!
//! [`infer`] takes a decoded [`Request`] and returns what happened to it: the router's first
//! choice of pool, the policy's decision (or the configured fallback when the script fails or
//! asks for something that cannot be done), deferral bounded by the pool's `max_wait`, a shrunk
//! context, a redirect, the queue, the deadline, and the request metrics. The HTTP handlers (and
//! any other protocol) only decode, call [`infer`], and encode. [`RequestError`] is the one place
//! where a failure becomes an HTTP status, a metric outcome and a `Retry-After`.
//!
//! Time is tokio's, so tests run deferrals and deadlines with paused time.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::Keep;
use crate::core::backend::{AllocFailureKind, BackendError, RemoteFailure, RunMeta};
use crate::core::snapshot::{Action, DeviceClass, Estimate, ProviderKind, RequestInfo};
use crate::core::tensor::Tensor;
use crate::policy::PolicyErrorKind;
use crate::pool::activity::Progress;
use crate::pool::sequences::Waiting;
use crate::pool::{InferJob, Pool, PoolError, RunCancel};
use crate::serve::router::{self, Plan, PoolView};
use crate::serve::service::{ModelEntry, Service};
use crate::telemetry::metrics::{
    DecisionLabels, FailoverReason, KindLabels, ModelPoolLabels, Outcome, RequestLabels, RetryLabels, RetryResult,
};

/// A decoded inference request, whatever protocol it came in by.
#[derive(Debug, Clone)]
pub struct Request {
    /// Request id, kept end to end (the caller generates one when the client sent none).
    pub id: String,
    /// Model name.
    pub model: String,
    /// Validated inputs.
    pub inputs: Vec<Tensor>,
    /// Outputs asked for (all when empty).
    pub outputs: Vec<String>,
    /// Client priority (higher is more important; 0 by default).
    pub priority: i64,
    /// False when the request must never be retried automatically once started.
    pub replayable: bool,
    /// True when the client allows its context to be cut (a shrink changes the answer).
    pub allow_shrink: bool,
    /// Tokens a generation may still add (0 for a single run): the estimate covers the KV
    /// cache they will take, and the policy sees it as `req.max_new_tokens`.
    pub max_new_tokens: u64,
    /// When the client stops caring.
    pub deadline: Option<Instant>,
    /// The client's `idempotency-key`: passed on when the request is forwarded to a remote
    /// pool, so the remote server executes it at most once too.
    pub idempotency_key: Option<String>,
    /// When it arrived (request duration is measured from here).
    pub received: Instant,
    /// How to shorten a generation's prompt when the policy shrinks its context and the
    /// client allowed it (models with a context axis are cut along it instead).
    pub shrinker: Option<Shrinker>,
    /// Its place in the service's waiting and running counts ([`infer`] and a generation
    /// accept it there; the default counts nothing).
    pub progress: Progress,
}

/// A generation's prompt, shortened: its new inputs, their length and what was cut.
#[derive(Debug)]
pub struct Shrunk {
    /// The inputs of the shorter prompt's run.
    pub inputs: Vec<Tensor>,
    /// Its tokens.
    pub tokens: u64,
    /// What was left out, for the client (`x-vramguard-context-cut`).
    pub cut: String,
}

/// Shortens a prompt to at most the given tokens, or says why it cannot.
#[derive(Clone)]
pub struct Shrinker(pub Arc<dyn Fn(u64) -> Result<Shrunk, String> + Send + Sync>);

impl std::fmt::Debug for Shrinker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Shrinker")
    }
}

/// A request that ran.
#[derive(Debug)]
pub struct Served {
    /// The pool that ran it.
    pub pool: Arc<Pool>,
    /// The decision that placed it: admit, redirect or shrink_context.
    pub action: Action,
    /// `(from, to)` context tokens when it was shrunk.
    pub context: Option<(u64, u64)>,
    /// What a shrink of a generation's prompt left out.
    pub context_cut: Option<String>,
    /// For the one retry: from the request's arrival to its run starting on the fallback.
    pub retry_started: Option<Duration>,
    /// Set when it ran here as the one retry after an allocator failure on its first pool.
    pub retried: Option<FailoverReason>,
    /// The outputs asked for.
    pub outputs: Vec<Tensor>,
}

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
#[derive(Debug)]
pub struct Refused {
    /// The pool involved, if the request got that far.
    pub pool: Option<Arc<Pool>>,
    /// What went wrong.
    pub error: RequestError,
}

/// Why a request did not run. Each variant knows its HTTP status, metric outcome and
/// `Retry-After`; nothing else maps failures.
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
            | RequestError::RemoteRefused { .. } => Outcome::client_error,
            // Refused or never received there: nothing ran, as with a full queue.
            RequestError::Remote { kind, .. } if kind.nothing_ran() => Outcome::rejected,
            RequestError::Remote { .. } => Outcome::failed,
            RequestError::DeferredTooLong { .. } | RequestError::QueueTimeout { .. } => Outcome::deferred_timeout,
            RequestError::Deadline(_) | RequestError::ClientGone => Outcome::cancelled,
            RequestError::Failed { .. } => Outcome::failed,
            RequestError::NoPool { .. }
            | RequestError::Refused { .. }
            | RequestError::QueueFull { .. }
            | RequestError::ShuttingDown { .. }
            | RequestError::Unavailable { .. }
            | RequestError::BreakerOpen { .. }
            | RequestError::HostMemory { .. }
            | RequestError::Allocation { .. } => Outcome::rejected,
        }
    }

    /// Seconds for `Retry-After` (at least 1), for the errors worth retrying.
    pub fn retry_after_secs(&self) -> Option<u64> {
        let after = match self {
            RequestError::NoPool { .. } | RequestError::Unavailable { .. } | RequestError::ShuttingDown { .. } => {
                Duration::from_secs(5)
            }
            RequestError::Refused { retry_after, .. }
            | RequestError::DeferredTooLong { retry_after, .. }
            | RequestError::QueueFull { retry_after, .. }
            | RequestError::QueueTimeout { retry_after, .. }
            | RequestError::BreakerOpen { retry_after, .. }
            | RequestError::HostMemory { retry_after, .. }
            | RequestError::Allocation { retry_after, .. }
            | RequestError::Remote { retry_after, .. } => *retry_after,
            RequestError::UnknownModel { .. }
            | RequestError::BadInput(_)
            | RequestError::BodyTooLarge(_)
            | RequestError::Deadline(_)
            | RequestError::ClientGone
            | RequestError::RemoteRefused { .. }
            | RequestError::Failed { .. } => return None,
        };
        Some(after.as_secs().max(1))
    }

    /// Say why a failure that could have moved to the fallback pool did not.
    fn not_retried(mut self, why: NotRetried) -> RequestError {
        if let RequestError::Allocation { not_retried, .. } | RequestError::Remote { not_retried, .. } = &mut self {
            *not_retried = Some(why);
        }
        self
    }

    /// `model` is not served here; the message lists what is.
    pub fn unknown_model(service: &Service, model: &str) -> RequestError {
        RequestError::UnknownModel {
            // The name comes from the client.
            model: crate::telemetry::logging::clipped(model, 64),
            known: service.model_names(),
        }
    }

    /// `pool`'s circuit breaker is open; come back after its cooldown.
    fn breaker_open(pool: &Pool) -> RequestError {
        RequestError::BreakerOpen {
            pool: pool.name().to_string(),
            why: pool.breaker_tripped().unwrap_or_default(),
            retry_after: pool.config.breaker.cooldown,
        }
    }

    /// What a pool's failure means for the client (the one place pool errors are mapped).
    fn from_pool(pool: &Pool, error: PoolError) -> RequestError {
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
            PoolError::Backend(BackendError::RemoteRefused { status, message }) => RequestError::RemoteRefused {
                pool: name,
                status,
                message,
            },
            PoolError::Backend(BackendError::Runtime(_) | BackendError::Panicked(_)) => {
                RequestError::Failed { pool: name }
            }
        }
    }
}

/// Run `request` to its end: place it, ask the policy, carry the decision out, run it, and
/// count the outcome.
pub async fn infer(service: &Service, mut request: Request) -> Result<Served, Refused> {
    request.progress = service.activity.accept();
    let model = request.model.clone();
    let received = request.received;
    counted(service, &model, received, async move {
        let served = place(service, request).await?;
        let pool = Arc::clone(&served.pool);
        Ok((served, pool))
    })
    .await
}

/// Do `work` as one request for `model`: counted once in the request metrics with the outcome
/// it ends with (on the pool it ended on), or `cancelled` when its client goes away first.
pub async fn counted<T>(
    service: &Service,
    model: &str,
    received: Instant,
    work: impl std::future::Future<Output = Result<(T, Arc<Pool>), Refused>>,
) -> Result<T, Refused> {
    // A client that goes away drops this future: the guard counts that as `cancelled` (a job
    // still queued is then skipped by the pool, one already running is stopped).
    let mut gone = ClientGone {
        service,
        model,
        received,
        armed: true,
    };
    let result = work.await;
    gone.armed = false;
    let (pool, outcome) = match &result {
        Ok((_, pool)) => (Some(pool), Outcome::ok),
        Err(refused) => (refused.pool.as_ref(), refused.error.outcome()),
    };
    record(service, model, pool.map(|p| p.name()), outcome, received);
    if let Err(refused) = &result {
        tracing::debug!(model = %model, pool = pool.map(|p| p.name()), outcome = ?refused.error.outcome(), error = %refused.error, "request refused");
    }
    result.map(|(value, _)| value)
}

/// Counts a request whose client went away before it was answered.
struct ClientGone<'a> {
    service: &'a Service,
    model: &'a str,
    received: Instant,
    armed: bool,
}

impl Drop for ClientGone<'_> {
    fn drop(&mut self) {
        if self.armed {
            tracing::debug!(model = self.model, "the client went away before the answer");
            record(self.service, self.model, None, Outcome::cancelled, self.received);
        }
    }
}

/// Refuse a request before it reaches [`infer`] (it could not be decoded, say), counting it
/// like any other outcome.
pub fn reject(service: &Service, model: &str, error: RequestError, received: Instant) -> Refused {
    record(service, model, None, error.outcome(), received);
    Refused { pool: None, error }
}

/// Count a request's outcome. Requests for unknown models are not counted: their names would
/// be unbounded label values.
fn record(service: &Service, model: &str, pool: Option<&str>, outcome: Outcome, received: Instant) {
    if service.model(model).is_none() {
        return;
    }
    let metrics = &service.metrics;
    metrics
        .requests
        .get_or_create(&RequestLabels {
            model: model.to_string(),
            pool: pool.unwrap_or_default().to_string(),
            outcome,
        })
        .inc();
    if let Some(pool) = pool {
        metrics
            .request_duration
            .get_or_create(&ModelPoolLabels {
                model: model.to_string(),
                pool: pool.to_string(),
            })
            .observe(received.elapsed().as_secs_f64());
    }
}

/// Place and run a request like [`infer`], without counting it: for work made of several runs
/// (a generation), counted once around all of them by [`counted`].
pub async fn place(service: &Service, mut request: Request) -> Result<Served, Refused> {
    let refuse = |pool: Option<&Arc<Pool>>, error: RequestError| Refused {
        pool: pool.cloned(),
        error,
    };
    let entry = service
        .model(&request.model)
        .ok_or_else(|| refuse(None, RequestError::unknown_model(service, &request.model)))?;
    let mut admitted = admit(service, entry, &mut request).await?;
    let estimate_bytes = admitted
        .estimate
        .context_bytes
        .saturating_add(admitted.estimate.workspace_bytes);
    // The breaker's permission for the run, taken once here. It may have opened since the
    // request was routed (a concurrent run met a driver failure while the policy decided):
    // nothing of it has run, so the fallback takes it, as it would a request routed a moment
    // later, instead of refusing it.
    let probe = match admitted.pool.breaker_permit() {
        Ok(probe) => probe,
        Err(closed) => {
            let from = Arc::clone(&admitted.pool);
            let Some(fallback) =
                fallback_of(service, &from).filter(|f| can_take_retry(service, f, estimate_bytes).is_ok())
            else {
                return Err(refuse(Some(&from), RequestError::from_pool(&from, closed)));
            };
            let probe = fallback
                .breaker_permit()
                .map_err(|e| refuse(Some(&fallback), RequestError::from_pool(&fallback, e)))?;
            service.failover(&from, &fallback, FailoverReason::breaker_open);
            admitted.pool = fallback;
            admitted.action = Action::Redirect;
            probe
        }
    };
    let pool = Arc::clone(&admitted.pool);
    // Refused before its run: a probe it took goes to the next request.
    let refuse_unrun = |error: RequestError| {
        if probe {
            pool.probe_unused();
        }
        refuse(Some(&pool), error)
    };
    // A replayable request on an accelerator pool with a fallback may be retried once after an
    // allocator failure: keep a copy of its inputs for that (ONNX Runtime consumes the first).
    let fallback = fallback_of(service, &pool);
    let spare = (fallback.is_some() && request.replayable).then(|| request.inputs.clone());
    if !deadline_reachable(&pool, &request) {
        return Err(refuse_unrun(RequestError::Deadline(DeadlineMiss::Estimated)));
    }
    if let Err(reason) = host_keeps_reserve(service, &pool, estimate_bytes) {
        return Err(refuse_unrun(RequestError::HostMemory {
            pool: pool.name().to_string(),
            reason,
            retry_after: pool.load().estimated_delay,
        }));
    }
    let inputs = std::mem::take(&mut request.inputs);
    // A generation's prompt counts as waiting on its pool until its run is over.
    let generation = request.max_new_tokens > 0;
    let waiting = generation.then(|| Waiting::on(&pool.sequences));
    let first = run_permitted(service, &pool, &request, inputs, estimate_bytes, probe).await;
    drop(waiting);
    let error = match first {
        Ok(outputs) => {
            return Ok(Served {
                pool,
                action: admitted.action,
                context: admitted.context,
                context_cut: admitted.context_cut.clone(),
                retry_started: None,
                retried: None,
                outputs,
            });
        }
        Err(error) => error,
    };
    let Some(reason) = retry_reason(&error) else {
        return Err(refuse(Some(&pool), RequestError::from_pool(&pool, error)));
    };
    let Some(fallback) = fallback else {
        return Err(refuse(Some(&pool), RequestError::from_pool(&pool, error)));
    };
    let retries = |result: RetryResult| count_retry(service, &pool, result);
    let Some(inputs) = spare else {
        // Never replayed behind the client's back: it gets a resumable error with its id.
        retries(RetryResult::not_replayable);
        let refused = RequestError::from_pool(&pool, error).not_retried(NotRetried::NotReplayable);
        return Err(refuse(Some(&pool), refused));
    };
    if let Err(why) = can_take_retry(service, &fallback, estimate_bytes) {
        retries(RetryResult::no_fallback);
        let refused = RequestError::from_pool(&pool, error).not_retried(NotRetried::NoFallback(why));
        return Err(refuse(Some(&pool), refused));
    }
    service.failover(&pool, &fallback, reason);
    tracing::info!(request_id = %request.id, from = pool.name(), to = fallback.name(), reason = ?reason, "retrying once on the fallback pool");
    let _waiting = generation.then(|| Waiting::on(&fallback.sequences));
    match run_on(service, &fallback, &request, inputs, estimate_bytes).await {
        Ok(outputs) => {
            retries(RetryResult::ok);
            let retry_started = request
                .progress
                .last_started()
                .map(|at| at.saturating_duration_since(request.received.into_std()));
            Ok(Served {
                pool: fallback,
                action: Action::Redirect,
                context: admitted.context,
                context_cut: admitted.context_cut,
                retry_started,
                retried: Some(reason),
                outputs,
            })
        }
        Err(error) => {
            retries(RetryResult::failed);
            Err(refuse(Some(&fallback), RequestError::from_pool(&fallback, error)))
        }
    }
}

/// A step that ran: where, whether it moved there after a failure, and its outputs.
#[derive(Debug)]
pub struct Stepped {
    /// The pool that ran it (the next steps go there too).
    pub pool: Arc<Pool>,
    /// Set when it moved to the fallback pool after an allocator failure.
    pub moved: Option<FailoverReason>,
    /// Its outputs.
    pub outputs: Vec<Tensor>,
}

/// One more run of a request already admitted to `pool`: a generation's next step. It is not
/// asked of the policy again and not counted as a request of its own. An allocator failure on
/// an accelerator pool moves it, and the runs after it, to the pool's fallback when the request
/// is replayable: a step is a pure function of its inputs (the KV cache travels with them), so
/// the tokens are the ones it would have had.
pub async fn step(
    service: &Service,
    pool: &Arc<Pool>,
    request: &Request,
    inputs: Vec<Tensor>,
    estimate_bytes: u64,
) -> Result<Stepped, RequestError> {
    let fallback = fallback_of(service, pool).filter(|_| request.replayable);
    let spare = fallback.as_ref().map(|_| inputs.clone());
    let error = match run_on(service, pool, request, inputs, estimate_bytes).await {
        Ok(outputs) => {
            return Ok(Stepped {
                pool: Arc::clone(pool),
                moved: None,
                outputs,
            });
        }
        Err(error) => error,
    };
    let Some(reason) = retry_reason(&error) else {
        return Err(RequestError::from_pool(pool, error));
    };
    let (Some(fallback), Some(inputs)) = (fallback, spare) else {
        return Err(RequestError::from_pool(pool, error));
    };
    let retries = |pool: &Pool, result: RetryResult| count_retry(service, pool, result);
    if let Err(why) = can_take_retry(service, &fallback, estimate_bytes) {
        retries(pool, RetryResult::no_fallback);
        return Err(RequestError::from_pool(pool, error).not_retried(NotRetried::NoFallback(why)));
    }
    service.failover(pool, &fallback, reason);
    tracing::info!(request_id = %request.id, from = pool.name(), to = fallback.name(), reason = ?reason, "the step and the rest move to the fallback pool");
    match run_on(service, &fallback, request, inputs, estimate_bytes).await {
        Ok(outputs) => {
            retries(pool, RetryResult::ok);
            Ok(Stepped {
                pool: fallback,
                moved: Some(reason),
                outputs,
            })
        }
        Err(error) => {
            retries(pool, RetryResult::failed);
            Err(RequestError::from_pool(&fallback, error))
        }
    }
}

/// Where a run that fails on `pool` with an allocator failure (or its remote server failing)
/// may go once: its configured fallback, for pools off the host.
fn fallback_of(service: &Service, pool: &Pool) -> Option<Arc<Pool>> {
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
        _ => None,
    }
}

/// Whether `pool` can finish the request before its deadline, going by its queue and recent
/// run times (no estimate yet: assume it can).
fn deadline_reachable(pool: &Pool, request: &Request) -> bool {
    let Some(deadline) = request.deadline else {
        return true;
    };
    let estimate = pool.load().estimated_delay;
    estimate.is_zero() || Instant::now() + estimate <= deadline
}

/// Whether a pool runs off the host: on an accelerator (CUDA, the simulated device) or on a
/// remote server. Such a pool may have a fallback, and its runs take no host memory.
fn is_accelerator(pool: &Pool) -> bool {
    pool.provider().kind() != ProviderKind::Cpu
}

/// Whether the fallback pool can take a retry now: it runs, its breaker lets work through, and
/// when it is on the host, the host keeps its reserve after the request (the CPU path must
/// not take the machine down).
fn can_take_retry(service: &Service, fallback: &Pool, need_bytes: u64) -> Result<(), String> {
    if let Some(why) = fallback.refusal() {
        return Err(format!("fallback pool `{}` cannot take work: {why}", fallback.name()));
    }
    host_keeps_reserve(service, fallback, need_bytes)
}

/// The host-RAM guard: a run on a host (CPU) pool is admitted only if available host memory,
/// less what runs already admitted to host pools are expected to need, less this run's
/// estimate, stays above `host.reserve`, so CPU work cannot take the machine down.
fn host_keeps_reserve(service: &Service, pool: &Pool, need_bytes: u64) -> Result<(), String> {
    if is_accelerator(pool) {
        return Ok(());
    }
    let host = service.store.latest().snapshot.host.clone();
    if host.mem_total_bytes == 0 {
        return Ok(()); // no host reading (no procfs): nothing to judge by
    }
    let committed = service.host_committed();
    let left = host
        .mem_available_bytes
        .saturating_sub(committed)
        .saturating_sub(need_bytes);
    if left < host.reserve_bytes {
        return Err(format!(
            "the host would drop below its memory reserve ({} available, {} promised to running CPU work, {} needed, {} reserved)",
            crate::telemetry::logging::human_bytes(host.mem_available_bytes),
            crate::telemetry::logging::human_bytes(committed),
            crate::telemetry::logging::human_bytes(need_bytes),
            crate::telemetry::logging::human_bytes(host.reserve_bytes)
        ));
    }
    Ok(())
}

/// Queue one run of `request` with `inputs` on `pool` and wait for it (or the deadline). Takes
/// the breaker's permission first; a half-open breaker's probe is settled by its outcome.
async fn run_on(
    service: &Service,
    pool: &Arc<Pool>,
    request: &Request,
    inputs: Vec<Tensor>,
    estimate_bytes: u64,
) -> Result<Vec<Tensor>, PoolError> {
    let probe = pool.breaker_permit()?;
    run_permitted(service, pool, request, inputs, estimate_bytes, probe).await
}

/// [`run_on`] with the breaker's permission already taken (`probe`: it is the half-open probe).
async fn run_permitted(
    service: &Service,
    pool: &Arc<Pool>,
    request: &Request,
    inputs: Vec<Tensor>,
    estimate_bytes: u64,
    probe: bool,
) -> Result<Vec<Tensor>, PoolError> {
    // What a host pool's run is expected to take stays promised until it ends (or the client
    // goes away), so concurrent admissions see each other before the next memory sample does.
    let _promised = (!is_accelerator(pool)).then(|| service.promise_host_memory(estimate_bytes));
    let cancel = RunCancel::for_request(request.progress.clone());
    let job = InferJob {
        meta: RunMeta {
            request_id: request.id.clone(),
            deadline: request.deadline.map(Instant::into_std),
            idempotency_key: request.idempotency_key.clone(),
            priority: request.priority,
            replayable: request.replayable,
            allow_shrink: request.allow_shrink,
        },
        model: request.model.clone(),
        inputs,
        outputs: request.outputs.clone(),
        estimate_bytes: Some(estimate_bytes),
        probe,
        cancel: cancel.clone(),
    };
    // Until the answer is in: a client that goes away (this future dropped) or a deadline that
    // passes stops the job, queued or running, so the device is not spent on it.
    let mut stop = StopOnDrop(Some(cancel));
    let reply = pool.submit(job).inspect_err(|_| {
        if probe {
            pool.probe_unused();
        }
    })?;
    let reply = match request.deadline {
        Some(deadline) => match tokio::time::timeout_at(deadline, reply).await {
            Ok(reply) => reply,
            // The worker sees the closed reply and skips the job if it has not started.
            Err(_) => {
                return Err(PoolError::DeadlineExceeded {
                    pool: pool.name().to_string(),
                });
            }
        },
        None => reply.await,
    };
    stop.0 = None;
    reply.unwrap_or_else(|_| {
        Err(PoolError::ShuttingDown {
            pool: pool.name().to_string(),
        })
    })
}

/// Cancels its job when dropped while still armed.
struct StopOnDrop(Option<RunCancel>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Some(cancel) = self.0.take() {
            cancel.cancel();
        }
    }
}

/// Where the policy sent a request.
struct Admitted {
    pool: Arc<Pool>,
    action: Action,
    context: Option<(u64, u64)>,
    context_cut: Option<String>,
    /// The estimate for what actually runs (after any shrink).
    estimate: Estimate,
}

/// The router's choice: the first ready pool serving the model (config order). The policy may
/// move the request elsewhere.
fn routed_pool(service: &Service, model: &str) -> Result<Arc<Pool>, RequestError> {
    let mut skipped: Option<&Arc<Pool>> = None;
    for pool in service.pools.iter().filter(|p| p.serves(model) && p.is_ready()) {
        if !pool.breaker_allows() {
            // Its breaker is open: the next pool takes new work, and says where it came from.
            skipped.get_or_insert(pool);
            continue;
        }
        if let Some(from) = skipped {
            service.failover(from, pool, FailoverReason::breaker_open);
        }
        return Ok(Arc::clone(pool));
    }
    if let Some(pool) = skipped {
        return Err(RequestError::breaker_open(pool));
    }
    let reasons: Vec<String> = service
        .pools
        .iter()
        .filter(|p| p.serves(model))
        .map(|p| {
            format!(
                "{}: {}",
                p.name(),
                p.unready_reason().unwrap_or_else(|| "not ready".into())
            )
        })
        .collect();
    Err(RequestError::NoPool {
        model: model.to_string(),
        reasons: reasons.join("; "),
    })
}

/// Ask the policy what to do with the request and carry it out until it is placed on a pool
/// (possibly after deferring, without holding a worker) or refused.
async fn admit(service: &Service, entry: &ModelEntry, request: &mut Request) -> Result<Admitted, Refused> {
    let model = entry.config.name.as_str();
    let refuse = |error: RequestError| Refused { pool: None, error };
    let routed = routed_pool(service, model).map_err(refuse)?;
    let (tokens, batch) = entry.shape_of(&request.inputs);
    let mut info = RequestInfo {
        id: request.id.clone(),
        model: model.to_string(),
        pool: routed.name().to_string(),
        context_tokens: tokens,
        max_new_tokens: request.max_new_tokens,
        batch,
        priority: request.priority,
        replayable: request.replayable,
        allow_shrink: request.allow_shrink,
        deadline_ms: 0,
        estimate: entry
            .profile
            .estimate(tokens.saturating_add(request.max_new_tokens), batch),
    };
    let has_context = entry.config.context.is_some() || request.shrinker.is_some();
    let max_defer = routed.config.max_wait;
    let mut deferred = Duration::ZERO;
    let metrics = &service.metrics;
    loop {
        if let Some(deadline) = request.deadline {
            // The policy sees the time left, not the time the client first gave.
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let miss = if deferred.is_zero() {
                    DeadlineMiss::OnArrival
                } else {
                    DeadlineMiss::WhileDeferred
                };
                return Err(refuse(RequestError::Deadline(miss)));
            }
            info.deadline_ms = (left.as_millis() as u64).max(1);
        }
        let views: Vec<PoolView<'_>> = service
            .pools
            .iter()
            .map(|p| PoolView {
                name: p.name(),
                serves: p.serves(model),
                ready: p.refusal().map_or(Ok(()), Err),
                max_context: p.config.max_context,
            })
            .collect();
        let eval_started = std::time::Instant::now();
        let view = service.policy_view();
        let evaluation = service.policy.decide_view(&info, &view);
        // Building the script's inputs counts: the view is part of what every request pays.
        let eval_time = eval_started.elapsed();
        metrics.policy_eval_duration.observe(eval_time.as_secs_f64());
        let mut decision = evaluation.decision;
        let mut fell_back = evaluation.error.is_some();
        if let Some(error) = &evaluation.error {
            metrics
                .policy_errors
                .get_or_create(&KindLabels { kind: error.kind })
                .inc();
            tracing::warn!(request_id = %info.id, %error, fallback = %decision, "policy failed; using the fallback decision");
        }
        let mut plan = router::plan(&decision, &info, has_context, &views, deferred, max_defer);
        if let Plan::Invalid(why) = &plan {
            metrics
                .policy_errors
                .get_or_create(&KindLabels {
                    kind: PolicyErrorKind::BadReturn,
                })
                .inc();
            tracing::warn!(request_id = %info.id, decision = %decision, reason = %why, "policy decision cannot be carried out; using the fallback");
            decision = service.policy.current().script.fallback().clone();
            fell_back = true;
            plan = match router::plan(&decision, &info, has_context, &views, deferred, max_defer) {
                Plan::Invalid(why) => Plan::Refuse(format!(
                    "neither the policy's decision nor the fallback can be carried out: {why}"
                )),
                other => other,
            };
        }
        let target = match &plan {
            Plan::Run { pool, .. } => pool.as_str(),
            _ => info.pool.as_str(),
        };
        metrics
            .policy_decisions
            .get_or_create(&DecisionLabels {
                action: decision.action(),
                pool: target.into(),
            })
            .inc();
        service.decisions.record(&info.id, model, &decision, target, fell_back);
        tracing::debug!(
            request_id = %info.id,
            model,
            action = %decision.action(),
            decision = %decision,
            pool = target,
            eval_us = eval_time.as_micros() as u64,
            estimate_bytes = info.estimate.total_bytes,
            "policy decision"
        );
        match plan {
            Plan::Run { pool, shrink_to } => {
                let pool = service.pool(&pool).cloned().expect("plan only names existing pools");
                if pool.name() != routed.name() && is_accelerator(&routed) {
                    service.failover(&routed, &pool, FailoverReason::policy_redirect);
                }
                let mut context = None;
                let mut context_cut = None;
                let mut estimate = info.estimate;
                if let (Some(to), Some(axis)) = (shrink_to, &entry.config.context) {
                    if let Some(tensor) = request.inputs.iter_mut().find(|t| t.name == axis.input) {
                        tensor.truncate_axis(axis.axis, to as usize, axis.keep == Keep::End);
                    }
                    context = Some((info.context_tokens, to));
                    estimate = entry.estimate(&request.inputs);
                } else if let (Some(to), Some(shrinker)) = (shrink_to, &request.shrinker) {
                    let shrunk = (shrinker.0)(to).map_err(|why| {
                        refuse(RequestError::Refused {
                            reason: format!("the policy asked to shrink the context to {to} tokens, but {why}"),
                            retry_after: pool.load().estimated_delay,
                        })
                    })?;
                    context = Some((info.context_tokens, shrunk.tokens));
                    context_cut = Some(shrunk.cut);
                    request.inputs = shrunk.inputs;
                    estimate = entry
                        .profile
                        .estimate(shrunk.tokens.saturating_add(request.max_new_tokens), 1);
                }
                return Ok(Admitted {
                    pool,
                    action: decision.action(),
                    context,
                    context_cut,
                    estimate,
                });
            }
            Plan::Wait(wait) => {
                if request.deadline.is_some_and(|d| Instant::now() + wait >= d) {
                    return Err(refuse(RequestError::Deadline(DeadlineMiss::ByDeferral)));
                }
                tokio::time::sleep(wait).await;
                deferred += wait;
            }
            Plan::DeferredTooLong { total, bound } => {
                return Err(refuse(RequestError::DeferredTooLong {
                    pool: routed.name().to_string(),
                    deferred,
                    bound,
                    retry_after: total,
                }));
            }
            Plan::Refuse(reason) => {
                return Err(refuse(RequestError::Refused {
                    reason,
                    retry_after: routed.load().estimated_delay,
                }));
            }
            Plan::Invalid(_) => unreachable!("replaced by the fallback above"),
        }
    }
}
