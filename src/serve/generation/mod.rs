//! Text generation on a decoder with past key values (see [`crate::runtime::decoder`]), below any
//! protocol, from prompt to last token: this module owns a generation's whole life. The
//! prompt's run goes through the request lifecycle like any request (policy, breaker, one retry
//! on the fallback pool, deadline, cancellation), with the estimate covering the KV cache of the
//! prompt and every token it may add. On a pool whose backends keep caches the prompt's run
//! leaves its KV cache in the pool's runtime and brings back one row of logits; each following
//! token is then a row of the pool's batch for the model ([`crate::pool::batch`]), one run per
//! step for every generation there. A generation's cache is given back when it finishes or its
//! client goes away.
//!
//! A protocol runs a generation in two phases, so nothing here calls back into it: [`place`]
//! runs the prompt, or says that the model's fallback may take it ([`Placed::Fallback`]), and
//! the protocol, which holds what the client sent, makes the prompt again for that model and
//! hands it back ([`Rebuilding::place`]); then [`Prefilled::run`] generates. It gets finished
//! text: a streamed generation hands its sink one [`Delta`] per token, text that may be sent
//! now, and the end is the whole [`Generated`]. [`generate`] does it all for a caller that has
//! nothing to make a prompt again from.
//!
//! A protocol first makes its parsed request a [`Job`] for the model named ([`job()`]): `job.rs`
//! checks how to sample and tokenizes the prompts within the model's context, `chat.rs` renders
//! a chat by the model's template and compiles the grammar of a structured output, and reads
//! the tool calls back from the finished text ([`Generated::tool_calls`]); `text.rs` spells a
//! token's bytes for its log-probabilities ([`Spelling`]). The protocol only reads its wire
//! format and writes the answer.
//!
//! The files follow a generation: `prefill.rs` (the prompt made a request and placed, on its
//! model or its fallback), `decode.rs` (the token loop), `cache.rs` (where its KV cache is
//! between steps, and a step on it), `sample.rs` (picking a token), `constrain.rs` (the
//! grammar of a structured output) and `text.rs` (its text: decoded once, stop strings,
//! deltas).

mod cache;
mod chat;
mod constrain;
mod decode;
mod job;
mod prefill;
mod sample;
mod text;

pub use chat::{Call, Chat};
pub use job::{Asked, Job, PromptIn, Prompts, Sampling, job};
pub use sample::{Logprobs, Penalties, Rng};
pub use text::Spelling;

use std::sync::Arc;

use crate::core::snapshot::Action;
use crate::pool::Pool;
use crate::serve::lifecycle::{self, Refused, Request};
use crate::serve::metrics::FailoverReason;
use crate::serve::ran::RanOn;
use crate::serve::service::{ModelEntry, Service};

/// Why a request cannot be made a generation [`Job`] for its model: what the protocol's
/// client is told, naming the field at fault.
#[derive(Debug, Clone, PartialEq)]
pub enum Invalid {
    /// A field is wrong: what is wrong, and the field's path in the request (`messages[2].content`).
    Field {
        /// What is wrong.
        message: String,
        /// The field at fault.
        at: String,
    },
    /// A prompt leaves no room within the model's `limit` positions for the `generated`
    /// tokens asked for: `prompt` tokens of it were read (all of it when the flag is set).
    TooLong {
        /// The positions the model takes (`u64::MAX` where it does not say).
        limit: u64,
        /// Tokens read of the prompt, and whether that is all of it.
        prompt: (u64, bool),
        /// Tokens asked for (at least 1).
        generated: u64,
        /// The field holding the prompt (`prompt`, or a chat's `messages`).
        field: &'static str,
    },
}

impl Invalid {
    /// `message` about the field `at`.
    fn field(message: impl Into<String>, at: &str) -> Invalid {
        Invalid::Field {
            message: message.into(),
            at: at.to_string(),
        }
    }
}

/// Where a streamed generation sends its text as it comes: one [`Delta`] per token picked.
pub type Sink = tokio::sync::mpsc::Sender<Delta>;

/// What a streamed generation's token added: the text that may be sent now (empty while it
/// waits: an unfinished character, or what could still become a stop string or a tool call's
/// opening tag), and where it ran when that is news.
#[derive(Debug)]
pub struct Delta {
    /// Text not sent before that may be sent now.
    pub text: String,
    /// When the request asks for them, the log-probabilities of the tokens whose text became
    /// whole in what was sent with this delta and before (a token's whose text waits come with
    /// the delta that sends its end, or in [`Generated::logprobs`] at the end).
    pub logprobs: Vec<TokenLogprobs>,
    /// On the first delta, and again whenever the generation moved to another pool (a
    /// failover mid-stream): where its tokens come from.
    pub facts: Option<Facts>,
}

/// Where a generation's tokens come from, as a stream states it.
#[derive(Debug, Clone)]
pub struct Facts {
    /// The pool that ran the token.
    pub pool: Arc<Pool>,
    /// The model that answers.
    pub source: Arc<Source>,
    /// `(from, to)` prompt tokens and what was left out, when the context was shrunk.
    pub shrunk: Option<(u64, u64, String)>,
}

/// The model a generation's tokens come from: the model asked for, or its fallback when that
/// stood in.
#[derive(Debug)]
pub struct Source {
    /// The model that answers.
    pub model: String,
    /// Set when it answers for the model asked for.
    pub substitution: Option<lifecycle::Substitution>,
}

impl Source {
    /// The model the client asked for: the one that answers, unless its fallback stood in.
    pub fn requested(&self) -> &str {
        self.substitution.as_ref().map_or(&self.model, |s| &s.requested)
    }
}

impl Facts {
    /// Where the token ran, as its answer tells its client (degraded mode included, for the
    /// model asked for).
    pub fn ran_on(&self, service: &Service) -> RanOn {
        service.ran_on(&self.pool, self.source.requested())
    }
}

/// Shortens a prompt to at most the given tokens: the new token ids and what was left out.
pub type Shorten = Arc<dyn Fn(u64) -> Result<(Vec<u32>, String), String> + Send + Sync>;

/// A prompt's tokens, and how to shorten it when the policy shrinks the context (used only when
/// the client allowed it).
#[derive(Clone)]
pub struct Prompt {
    /// Token ids.
    pub tokens: Vec<u32>,
    /// How to cut it.
    pub shorten: Option<Shorten>,
}

impl From<Vec<u32>> for Prompt {
    /// A prompt that is cut, if at all, from its start: its most recent tokens are kept.
    fn from(tokens: Vec<u32>) -> Prompt {
        let all = tokens.clone();
        let shorten: Shorten = Arc::new(move |to: u64| {
            let keep = (to as usize).min(all.len());
            let cut = all.len() - keep;
            Ok((
                all[cut..].to_vec(),
                format!("the first {cut} of the prompt's {} tokens", all.len()),
            ))
        });
        Prompt {
            tokens,
            shorten: Some(shorten),
        }
    }
}

/// How to pick tokens and when to stop.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// Most tokens to add; `None`: as many as the model's context leaves after the prompt,
    /// capped at what a pool serving it could ever hold ([`new_tokens`]).
    pub max_tokens: Option<u32>,
    /// Softmax temperature; 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches this.
    pub top_p: f32,
    /// Only the `top_k` most likely tokens (0: all).
    pub top_k: u32,
    /// Seed of the sampler: the same seed and request give the same tokens, on any pool.
    pub seed: u64,
    /// Strings that end the text (not included).
    pub stop: Vec<String>,
    /// The request offers tools: once its first token is picked it is never run again, on
    /// any pool, since a tool call it makes may already have acted on the client's side.
    pub tools: bool,
    /// The grammar its text follows (structured outputs), compiled for its model: only tokens
    /// it allows are picked, and the generation ends when it is finished.
    pub grammar: Option<crate::runtime::grammar::Grammar>,
    /// What bends the logits before each pick.
    pub penalties: Penalties,
    /// Each token's log-probability and, of this many most likely tokens at its step, theirs
    /// ([`Generated::logprobs`]); `None`: none.
    pub logprobs: Option<u32>,
}

/// A generated token's log-probabilities: of the logits its step picked from, after
/// [`Penalties`] and before temperature, `top_k` and `top_p`.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The token.
    pub token: u32,
    /// Where its text starts in the generation's text, in characters.
    pub text_offset: usize,
    /// Its log-probability and the most likely tokens' at its step.
    pub logprobs: Logprobs,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The end-of-text token, a stop string, or the end of its grammar.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl Finish {
    /// OpenAI's `finish_reason`.
    pub fn label(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// A finished generation.
#[derive(Debug)]
pub struct Generated {
    /// The pool that ran the last token (after a failover, the fallback).
    pub pool: Arc<Pool>,
    /// The decision that placed the prompt's run.
    pub action: Action,
    /// Set when a run moved to the fallback pool after an allocator failure.
    pub retried: Option<FailoverReason>,
    /// The model that answered.
    pub source: Arc<Source>,
    /// Tokens of the prompt (after any shrink).
    pub prompt_tokens: usize,
    /// `(from, to)` prompt tokens and what was left out, when the context was shrunk.
    pub shrunk: Option<(u64, u64, String)>,
    /// Tokens generated.
    pub tokens: Vec<u32>,
    /// Each token's log-probabilities, when the request asks for them: as many as `tokens`
    /// (a stop string's too, though its text is cut).
    pub logprobs: Option<Vec<TokenLogprobs>>,
    /// Their text, cut before a stop string.
    pub text: String,
    /// Why it ended.
    pub finish: Finish,
}

impl Generated {
    /// Where its last token ran, as its answer tells its client (degraded mode included, for
    /// the model asked for).
    pub fn ran_on(&self, service: &Service) -> RanOn {
        service.ran_on(&self.pool, self.source.requested())
    }
}

/// Where a generation's prompt went: it ran, or its model's fallback may take it once the
/// caller, which holds what the client sent, makes the prompt again for that model.
pub enum Placed<'a> {
    /// The prompt ran: its tokens come next ([`Prefilled::run`]).
    Prefilled(Prefilled<'a>),
    /// Its model could not take it and the fallback may: the caller makes the prompt and
    /// parameters again for [`Rebuilding::model`] (its tokenizer and template) and hands them
    /// to [`Rebuilding::place`].
    Fallback(Rebuilding<'a>),
}

/// A generation whose prompt ran, its tokens to come.
pub struct Prefilled<'a> {
    service: &'a Service,
    counted: lifecycle::Counted<'a>,
    prefill: prefill::Prefill<'a>,
}

/// A generation its model's fallback may take, waiting for its prompt made again for it.
pub struct Rebuilding<'a> {
    service: &'a Service,
    counted: lifecycle::Counted<'a>,
    fallback: lifecycle::Fallback,
    steps: Request,
}

/// Start `entry`'s generation of `prompt` (token ids) under `params`, counted from here as one
/// request, and run its prompt on that model; or say that the model's fallback may take it.
/// `request` carries the id, deadline, priority, replayability and leave to substitute; its
/// inputs are built here.
pub async fn place<'a>(
    service: &'a Service,
    entry: &'a ModelEntry,
    prompt: Prompt,
    params: &'a Params,
    mut request: Request,
) -> Result<Placed<'a>, Refused> {
    let decoding = match prefill::prepare(service, entry, prompt, std::borrow::Cow::Borrowed(params), &mut request) {
        Ok(decoding) => decoding,
        Err(error) => return Err(lifecycle::reject(service, &entry.config.name, error, request.received)),
    };
    let counted = lifecycle::Counted::start(service, &mut request);
    match prefill::place_prompt(service, decoding, request).await {
        Ok(prefill::Placed::Ran(prefill)) => Ok(Placed::Prefilled(Prefilled {
            service,
            counted,
            prefill,
        })),
        Ok(prefill::Placed::Fallback(fallback, steps)) => Ok(Placed::Fallback(Rebuilding {
            service,
            counted,
            fallback,
            steps,
        })),
        Err(refused) => Err(counted_refusal(counted, refused)),
    }
}

impl<'a> Rebuilding<'a> {
    /// The model that may answer instead.
    pub fn model(&self) -> &str {
        self.fallback.model()
    }

    /// Run the prompt made again for the fallback (`rebuilt`: its prompt and parameters from
    /// what the client sent, or why they cannot be made). When the fallback cannot take it,
    /// the client gets its model's refusal, saying why.
    pub async fn place(self, rebuilt: Result<(Prompt, Params), String>) -> Result<Prefilled<'a>, Refused> {
        let Rebuilding {
            service,
            counted,
            fallback,
            steps,
        } = self;
        match prefill::place_rebuilt(service, counted.answering(), fallback, steps, rebuilt).await {
            Ok(prefill) => Ok(Prefilled {
                service,
                counted,
                prefill,
            }),
            Err(refused) => Err(counted_refusal(counted, refused)),
        }
    }
}

impl Prefilled<'_> {
    /// Its tokens, to `sink` as they come when it is streamed; counted once it ends.
    pub async fn run(self, sink: Option<Sink>) -> Result<Generated, Refused> {
        let generated = decode::run(self.service, self.prefill, sink).await;
        self.counted
            .finish(generated.as_ref().map(|generated| generated.pool.as_ref()));
        generated
    }
}

impl<'a> Prefilled<'a> {
    /// This generation and `n - 1` more of its prompt from its one run (OpenAI's `n`): each goes
    /// on from its own copy of the prompt's KV cache, made where the pool keeps it (on its
    /// device; a cache carried as tensors, a remote pool's, is cloned), samples from its own
    /// seed (the request's, then +1, +2, …: at temperature 0 they are the same answer) and is
    /// counted as a request of its own. A copy whose cache is lost is prefilled again alone,
    /// as any generation's.
    pub fn fork(self, n: usize) -> Vec<Prefilled<'a>> {
        let Prefilled {
            service,
            counted,
            mut prefill,
        } = self;
        // Each goes on as one generation: a prefill again after a failed step is its own.
        prefill.steps.generations = 1;
        let mut copies: Vec<prefill::Prefill<'a>> = (1..n as u64).map(|i| prefill.copy(i)).collect();
        let steps: Vec<&Request> = copies.iter().map(|c| &c.steps).collect();
        cache::fork(&prefill.served.pool, &prefill.steps, &prefill.served.outputs, &steps);
        let mut all = Vec::with_capacity(n);
        all.push(Prefilled {
            service,
            counted,
            prefill,
        });
        for mut copy in copies.drain(..) {
            let counted = lifecycle::Counted::start(service, &mut copy.steps);
            // Its prompt ran with the first's: it is running from now on.
            copy.steps.progress.started();
            all.push(Prefilled {
                service,
                counted,
                prefill: copy,
            });
        }
        all
    }
}

/// The tokens a request that leaves `max_tokens` out gets to add to a prompt of `prompt`
/// tokens, `generations` of it (OpenAI's `n`): as many as `entry`'s model's context leaves
/// (OpenAI's and vLLM's chat default), [`UNKNOWN_CONTEXT_TOKENS`] where the model does not say
/// its context, and at most what a pool serving it could ever hold with its prompt, so that
/// the default never makes a request that could never run. Admission reserves the KV cache
/// for all of them, as for any `max_tokens`.
pub fn new_tokens(service: &Service, entry: &ModelEntry, prompt: u64, generations: u64) -> u32 {
    let rest = match entry.kind.decoder().and_then(|layout| layout.context) {
        Some(context) => context.saturating_sub(prompt).max(1),
        None => u64::from(UNKNOWN_CONTEXT_TOKENS),
    };
    let fits = lifecycle::longest_generation(service, entry, prompt, generations, rest);
    u32::try_from(fits.max(1)).unwrap_or(u32::MAX)
}

/// How many of one request's prompts are placed at once (a completion's `prompt` may hold up
/// to 128): one batch of prompts as a pool runs them together ([`crate::pool::MAX_PROMPTS`]),
/// and no more than the smallest queue of a pool serving `entry`'s model holds. The others
/// wait for those runs, so a request never fills a queue with its own prompts and is refused
/// as if by strangers ("queue is full") when it could never be queued whole; its generations
/// still all batch together once their prompts ran.
pub fn prompts_at_once(service: &Service, entry: &ModelEntry) -> usize {
    let model = entry.config.name.as_str();
    let queues = service.pools.iter().filter(|p| p.serves(model));
    let smallest = queues.map(|p| p.config.queue_capacity).min();
    smallest.unwrap_or(1).clamp(1, crate::pool::MAX_PROMPTS)
}

/// What a request that leaves `max_tokens` out may add on a model whose folder does not say
/// the positions it takes (a graph alone): a bound, since past its positions a model fails.
pub const UNKNOWN_CONTEXT_TOKENS: u32 = 4096;

/// `refused`, counted as the generation's outcome.
fn counted_refusal(counted: lifecycle::Counted<'_>, refused: Refused) -> Refused {
    counted.finish(Err(&refused));
    refused
}

/// Generate from `prompt` for a caller that cannot make the prompt again for the model's
/// fallback (its model's refusal then says so): [`place`], then [`Prefilled::run`].
pub async fn generate(
    service: &Service,
    entry: &ModelEntry,
    prompt: Prompt,
    params: &Params,
    request: Request,
    sink: Option<Sink>,
) -> Result<Generated, Refused> {
    let prefilled = match place(service, entry, prompt, params, request).await? {
        Placed::Prefilled(prefilled) => prefilled,
        Placed::Fallback(fallback) => {
            let cannot = Err("nothing can make its prompt again".to_string());
            fallback.place(cannot).await?
        }
    };
    prefilled.run(sink).await
}
