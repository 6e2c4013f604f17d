//! A generation's token loop after its prompt's run: pick a token (among those its grammar
//! allows, when it has one), add it to the text, hand a streamed generation's delta to its
//! sink, and step on the cache until the end-of-text token, a stop string, the end of its
//! grammar or `max_tokens`.

use std::sync::Arc;

use crate::core::snapshot::Action;
use crate::pool::Pool;
use crate::pool::batch::sequences::Running;
use crate::serve::lifecycle::{NotRetried, Refused, RequestError, Served};
use crate::serve::service::{ModelEntry, Service};

use super::cache::{CacheSite, Failed, read_outputs};
use super::constrain::{self, Constraint};
use super::prefill::{Decoding, Prefill, history};
use super::sample::{Picked, Sampler};
use super::text::Text;
use super::{Delta, Facts, Finish, Generated, Sink, TokenLogprobs};

/// A step of a generation offering tools failed on an allocator: it was not retried since a
/// tool call may already have acted, and the client is told so (unless the error already says
/// why it was not retried).
fn tools_not_retried(mut error: RequestError, tools: bool) -> RequestError {
    if tools
        && let RequestError::Allocation { not_retried, .. } = &mut error
        && not_retried.is_none()
    {
        *not_retried = Some(NotRetried::ToolsStarted);
    }
    error
}

/// A generation that failed on the server's side (its model's outputs are not what a decoder
/// gives): logged with the detail, the client told only where.
fn internal(model: &str, pool: &Arc<Pool>, error: String) -> Refused {
    tracing::warn!(model = %model, %error, "generation failed");
    Refused::at(
        pool,
        RequestError::Failed {
            pool: pool.name().to_string(),
        },
    )
}

/// A generation's tokens after its prompt's run (`prefill`), uncounted: one step per token on
/// the pool that ran it.
pub(super) async fn run<'a>(
    service: &'a Service,
    prefill: Prefill<'a>,
    sink: Option<Sink>,
) -> Result<Generated, Refused> {
    let Prefill {
        served,
        decoding,
        mut steps,
        source,
    } = prefill;
    let Decoding {
        entry,
        layout,
        tokenizer,
        eos,
        params,
        prompt_tokens,
        max_tokens,
        prompt,
    } = decoding;
    let Served {
        pool,
        action,
        retried,
        outputs,
        context,
        context_cut,
        ..
    } = served;
    // A shrink shortened the prompt: positions count from its new length.
    let shrunk = context.map(|(from, to)| (from, to, context_cut.unwrap_or_default()));
    let prompt_tokens = shrunk.as_ref().map_or(prompt_tokens, |s| s.1 as usize);
    let broken = |pool: &Arc<Pool>, e: String| internal(&entry.config.name, pool, e);
    let (mut logits, cache) = read_outputs(outputs).map_err(|e| broken(&pool, e))?;
    // The cache this generation holds between runs (a windowed layer's: its window), on the
    // pool that holds it; given back when this function returns or its future is dropped.
    let kv_bytes = |tokens: usize| layout.kv_bytes_per_token() * tokens as u64 + layout.kv_window_bytes();
    let mut held = Running::on(&pool.sequences, kv_bytes(prompt_tokens));
    let mut site = CacheSite::new(pool, &steps, cache, retried);
    let labels = |pool: &Pool| crate::core::metrics::ModelPoolLabels {
        model: entry.config.name.clone(),
        pool: pool.name().to_string(),
    };
    let metrics = &service.metrics.generation;
    metrics
        .time_to_first_token
        .get_or_create(&labels(&site.pool))
        .observe(steps.received.elapsed().as_secs_f64());
    let mut last_token = tokio::time::Instant::now();
    let mut sampler =
        Sampler::new(&params, || history(&prompt, shrunk.as_ref(), &[])).map_err(|e| broken(&site.pool, e))?;
    let mut text = Text::new(Arc::clone(tokenizer), &params.stop, sink.is_some(), params.tools);
    let mut scores = Scores::new(params.logprobs.is_some());
    // The pool the sink was last told of: a delta names it again when it changes.
    let mut told = None;
    let estimate_bytes = step_bytes(entry, prompt_tokens, max_tokens);
    let mut constraint = Constraint::new(&params);
    let finish = loop {
        let (picked, finished) =
            constrain::pick(&mut constraint, &mut sampler, &mut logits, &eos).map_err(|e| broken(&site.pool, e))?;
        let next = picked.token;
        if eos.contains(&next) {
            break Finish::Stop;
        }
        let sent = scores.push(&mut text, picked).map_err(|e| broken(&site.pool, e))?;
        if let (Some(sink), Some(sent)) = (&sink, sent) {
            let facts = || Facts {
                pool: Arc::clone(&site.pool),
                source: Arc::clone(&source),
                shrunk: shrunk.clone(),
            };
            if !tell(sink, &mut told, sent, &site.pool, facts).await {
                // The stream's reader is gone: stop here; the KV cache goes with this future.
                return Err(Refused::at(&site.pool, RequestError::ClientGone));
            }
        }
        if text.stopped() || finished {
            break Finish::Stop;
        }
        let produced = text.tokens().len();
        if produced >= max_tokens as usize {
            break Finish::Length;
        }
        let past = prompt_tokens + produced - 1;
        let history = || history(&prompt, shrunk.as_ref(), text.tokens());
        let step = site.step(service, &mut steps, layout, (next, past), history, estimate_bytes);
        let (stepped, masked) = constrain::alongside(constraint.as_mut(), step).await;
        logits = match stepped {
            Ok(logits) => logits,
            Err(Failed::Request(e)) => return Err(Refused::at(&site.pool, tools_not_retried(e, params.tools))),
            Err(Failed::Broken(e)) => return Err(broken(&site.pool, e)),
        };
        masked.map_err(|e| broken(&site.pool, e))?;
        held.update(&site.pool.sequences, kv_bytes(past + 1));
        metrics
            .inter_token
            .get_or_create(&labels(&site.pool))
            .observe(last_token.elapsed().as_secs_f64());
        last_token = tokio::time::Instant::now();
    };
    let CacheSite { pool, retried, .. } = site;
    let (tokens, text) = text.finish().map_err(|e| broken(&pool, e))?;
    metrics
        .generated_tokens
        .get_or_create(&labels(&pool))
        .inc_by(tokens.len() as u64);
    Ok(Generated {
        pool,
        action: if retried.is_some() { Action::Redirect } else { action },
        retried,
        source,
        prompt_tokens,
        shrunk,
        tokens,
        logprobs: scores.all,
        text,
        finish,
    })
}

/// A generation's tokens' log-probabilities, when the request asks for them, and how many of
/// them went to its sink.
struct Scores {
    all: Option<Vec<TokenLogprobs>>,
    handed: usize,
}

impl Scores {
    /// None yet; kept only when `asked` for.
    fn new(asked: bool) -> Scores {
        Scores {
            all: asked.then(Vec::new),
            handed: 0,
        }
    }

    /// Add the `picked` token to `text`, keeping its log-probabilities: for a streamed
    /// generation, the text that may be sent now and the log-probabilities of the tokens whose
    /// text it completes.
    fn push(&mut self, text: &mut Text, picked: Picked) -> Result<Option<(String, Vec<TokenLogprobs>)>, String> {
        let text_offset = text.chars();
        let sent = text.push(picked.token)?;
        if let (Some(all), Some(logprobs)) = (&mut self.all, picked.logprobs) {
            all.push(TokenLogprobs {
                token: picked.token,
                text_offset,
                logprobs,
            });
        }
        Ok(sent.map(|sent| (sent.text, self.hand(sent.tokens))))
    }

    /// The next `whole` tokens' (their text now all sent), for a delta.
    fn hand(&mut self, whole: usize) -> Vec<TokenLogprobs> {
        let Some(all) = &self.all else {
            return Vec::new();
        };
        let handed = all[self.handed..self.handed + whole].to_vec();
        self.handed += whole;
        handed
    }
}

/// What a step of `entry`'s generation is admitted with, the cache of its prompt
/// (`prompt_tokens`) and every token it may add (`max_tokens`) with the run's workspace.
fn step_bytes(entry: &ModelEntry, prompt_tokens: usize, max_tokens: u32) -> u64 {
    let estimate = entry.estimate_tokens((prompt_tokens as u64).saturating_add(u64::from(max_tokens)), 1);
    estimate.context_bytes.saturating_add(estimate.workspace_bytes)
}

/// Hand a streamed generation's text and log-probabilities, run on `pool`, to its sink as a
/// [`Delta`], with the [`Facts`] when `pool` is not the one `told` names (the first delta, or
/// after a move); false once the reader is gone.
async fn tell(
    sink: &Sink,
    told: &mut Option<String>,
    (text, logprobs): (String, Vec<TokenLogprobs>),
    pool: &Arc<Pool>,
    facts: impl FnOnce() -> Facts,
) -> bool {
    let moved = told.as_deref() != Some(pool.name());
    if moved {
        *told = Some(pool.name().to_string());
    }
    let delta = Delta {
        text,
        logprobs,
        facts: moved.then(facts),
    };
    sink.send(delta).await.is_ok()
}
