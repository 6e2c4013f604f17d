//! One request's life below any protocol: placement, admission, the run and its outcome.
//!
//! [`infer`] takes a decoded [`Request`] and returns what happened to it: the router's first
//! choice of pool, the policy's decision (or the configured fallback when the script fails or
//! asks for something that cannot be done), deferral bounded by the pool's `max_wait`, a shrunk
//! context, a redirect, the queue, the deadline, the one retry on the fallback pool, and the
//! request metrics. The HTTP handlers (and any other protocol) only decode, call [`infer`], and
//! encode. [`RequestError`] is the one place where a failure becomes a metric outcome and a
//! `Retry-After`; `http` gives each variant its status.
//!
//! The files follow the request: `admit.rs` (router and policy), `place.rs` (the checks before the
//! placed run), `fits.rs` (whether it could ever fit, or only not now), `room.rs` (making room for
//! it by unloading idle models of its device), `budget.rs` (the request's service's budgets),
//! `run.rs` (one run on a pool), `retry.rs` (the one retry, shared with a generation's steps),
//! `batch.rs` (a batch of requests placed and run as one, retried member by member),
//! `substitute.rs` (the model's `fallback_model` answering instead, with the client's leave),
//! `count.rs` (the request metrics) and `error.rs` (what a client is told).
//!
//! Nothing here calls back into a protocol: a protocol starts the count ([`Counted`]), places
//! the request ([`place_or_fallback`]), rebuilds it for the fallback when asked to, and
//! finishes the count with the answer it made.
//!
//! Time is tokio's, so tests run deferrals and deadlines with paused time.

mod admit;
mod batch;
mod budget;
mod count;
mod error;
mod fits;
mod place;
mod retry;
mod room;
mod run;
mod substitute;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::core::backend::RunMeta;
use crate::core::snapshot::Action;
use crate::core::tensor::Tensor;
use crate::pool::Pool;
use crate::pool::activity::Progress;
use crate::serve::metrics::FailoverReason;
use crate::serve::service::Service;

pub use batch::{BatchRan, place_batch};
pub use count::{Counted, answered, reject};
pub use error::{DeadlineMiss, NotRetried, Refused, RequestError};
pub use fits::{Ceiling, NeverFits, fits_now, longest_generation};
pub use place::place;
pub use substitute::{Answering, Fallback, Placement, Substitution, place_or_fallback, place_or_fallback_with};

/// A decoded inference request, whatever protocol it came in by.
#[derive(Debug, Clone)]
pub struct Request {
    /// Its identity and limits (id, deadline, priority, replayability, shrink permission,
    /// idempotency key): what every run of it carries to its pool's backend as it is.
    pub meta: RunMeta,
    /// Model name.
    pub model: String,
    /// Validated inputs.
    pub inputs: Vec<Tensor>,
    /// Outputs asked for (all when empty).
    pub outputs: Vec<String>,
    /// Tokens a generation may still add (0 for a single run): the estimate covers the KV
    /// cache they will take, and the policy sees it as `req.max_new_tokens`.
    pub max_new_tokens: u64,
    /// When it arrived (request duration is measured from here).
    pub received: Instant,
    /// How to shorten a generation's prompt when the policy shrinks its context and the
    /// client allowed it (models with a context axis are cut along it instead).
    pub shrinker: Option<Shrinker>,
    /// Its place in the service's waiting and running counts ([`infer`] and a generation
    /// accept it there; the default counts nothing).
    pub progress: Progress,
    /// The client allows its model's `fallback_model` to answer instead when the model cannot
    /// run ([`place_or_fallback`]). Not on [`RunMeta`], so a remote pool is never asked to
    /// swap models: the answer's model is decided here, where it is reported.
    pub allow_substitute: bool,
    /// A generation's sequence: on a pool whose backends keep caches, its prompt's run keeps
    /// its KV cache there under this number (a prefill), and only the last position's logits
    /// come back. Each prefill after a failed step takes a new one.
    pub sequence: Option<u64>,
    /// Generations that share a generation's prompt's run (OpenAI's `n`; 0 or 1: one), each
    /// going on from its own copy of the prompt's KV cache: the estimate covers that many
    /// caches, and the policy sees them as `req.batch`.
    pub generations: u64,
    /// Its inputs may be right-padded with zeros along every axis but the batch axis, to run
    /// in one batch with other requests' (`serve::batching`): an attention mask among them
    /// leaves the padding out, as an embeddings request's does. Without it, it shares a run
    /// only with requests of the same shapes.
    pub pads: bool,
}

impl Request {
    /// When the client stops caring, on tokio's clock: the lifecycle waits and compares on it,
    /// so paused time in tests moves deadlines too.
    fn deadline(&self) -> Option<Instant> {
        self.meta.deadline.map(Instant::from_std)
    }
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

/// A run that answered, after the one retry if it needed it.
#[derive(Debug)]
pub struct Ran {
    /// The pool that ran it (a generation's next steps go there too).
    pub pool: Arc<Pool>,
    /// Set when it ran there as the one retry, after a failure on the pool it was sent to.
    pub retried: Option<FailoverReason>,
    /// Its outputs.
    pub outputs: Vec<Tensor>,
}

/// Run `request` to its end: place it, ask the policy, carry the decision out, run it, and
/// count the outcome. It has nothing to rebuild a request for another model from, so its
/// model's fallback never answers it. A protocol that answers from what was served does these
/// steps itself: [`Counted::start`], [`place_or_fallback`], [`Counted::finish`] with its answer.
pub async fn infer(service: &Service, request: Request) -> Result<Served, Refused> {
    infer_with(service, request, |request| place_or_fallback(service, request)).await
}

/// [`infer`], placing the request with `place` (a batcher's, `serve::batching`).
pub async fn infer_with<'a, F, P>(service: &'a Service, mut request: Request, place: P) -> Result<Served, Refused>
where
    P: FnOnce(Request) -> F,
    F: Future<Output = Result<Placement, Refused>> + 'a,
{
    let counted = Counted::start(service, &mut request);
    let served = match place(request).await {
        Ok(Placement::Served(served)) => Ok(served),
        Ok(Placement::Fallback(fallback)) => {
            Err(fallback.cannot("it was not received by a protocol that can ask another model"))
        }
        Err(refused) => Err(refused),
    };
    counted.finish(served.as_ref().map(|served| served.pool.as_ref()));
    served
}

/// One more run of a request already admitted to `pool`: a generation's step on a pool that
/// keeps no caches (the cache travels in `inputs`), or its prompt prefilled again after a step
/// failed. It is not asked of the policy again and not counted as a request of its own. An
/// allocator failure on an accelerator pool moves it, and the runs after it, to the pool's
/// fallback when the request is replayable: a run depends only on the tokens in it, so the
/// tokens are the ones it would have had.
pub async fn step(
    service: &Service,
    pool: &Arc<Pool>,
    request: &Request,
    inputs: Vec<Tensor>,
    estimate_bytes: u64,
) -> Result<Ran, RequestError> {
    pool.health()
        .breaker_permit()
        .map_err(|e| RequestError::from_pool(pool, e))?;
    retry::run_with_retry(service, pool, request, inputs, estimate_bytes, retry::Run::Step)
        .await
        .map_err(|refused| refused.error)
}

/// A generation's batched step failed on `pool` with `error` (its KV cache was kept there):
/// its prompt and the tokens so far (`inputs`, a first pass) are prefilled again, on `pool`
/// when only the cache was missing there (its backend was replaced), else on the pool's
/// fallback as a failed step moves (only when the request may be replayed). The cache is
/// rebuilt, never carried: it was on the device, or in a worker process that died.
pub async fn recompute(
    service: &Service,
    pool: &Arc<Pool>,
    request: &Request,
    error: crate::pool::PoolError,
    inputs: Vec<Tensor>,
    estimate_bytes: u64,
) -> Result<Ran, RequestError> {
    if let crate::pool::PoolError::Backend(crate::core::backend::BackendError::CacheMissing(_)) = error {
        return step(service, pool, request, inputs, estimate_bytes).await;
    }
    let spare = (request.meta.replayable).then(|| inputs.into());
    retry::after_failure(service, pool, request, error, spare, estimate_bytes, retry::Run::Step)
        .await
        .map_err(|refused| refused.error)
}
