//! A generation's prompt made a request and placed: its inputs, the tokens it may add, how to
//! shrink it when the client allowed that, and its run on the model asked for or, rebuilt, on
//! that model's fallback. What the steps after it decode with comes out of it.

use std::sync::Arc;

use crate::runtime::decoder::{DecoderLayout, step_inputs};
use crate::serve::lifecycle::{self, Placement, Refused, Request, RequestError, Served};
use crate::serve::service::{Api, ModelEntry, Service};

use super::{Params, Prompt, Source};

/// What a generation decodes with: its model's decoder and tokenizer, the tokens that end a
/// turn, how to pick tokens, and its prompt's length.
pub(super) struct Decoding<'a> {
    pub(super) entry: &'a ModelEntry,
    pub(super) layout: &'a DecoderLayout,
    pub(super) tokenizer: &'a Arc<tokenizers::Tokenizer>,
    pub(super) eos: Vec<u32>,
    pub(super) params: std::borrow::Cow<'a, Params>,
    pub(super) prompt_tokens: usize,
    /// The most tokens it adds: the request's `max_tokens`, or what its default came to.
    pub(super) max_tokens: u32,
    /// The prompt, to prefill it again (after a shrink, cut as the shrink cut it).
    pub(super) prompt: Prompt,
}

/// Make `request` `entry`'s generation of `prompt`: the prompt's run as its inputs, the tokens
/// it may add, and how to shrink it when the client allowed that.
pub(super) fn prepare<'a>(
    service: &Service,
    entry: &'a ModelEntry,
    prompt: Prompt,
    params: std::borrow::Cow<'a, Params>,
    request: &mut Request,
) -> Result<Decoding<'a>, RequestError> {
    let (Some(layout), Some(text)) = (entry.kind.decoder(), entry.kind.generator()) else {
        return Err(RequestError::BadInput(format!(
            "model `{}` does not {}",
            entry.config.name,
            Api::Generation.needs()
        )));
    };
    let tokenizer = &text.tokenizer;
    let prompt_tokens = prompt.tokens.len();
    let max_tokens = match params.max_tokens {
        Some(n) => n,
        None => super::new_tokens(service, entry, prompt_tokens as u64, request.generations),
    };
    if let Some(limit) = layout.context
        && (prompt_tokens as u64).saturating_add(u64::from(max_tokens)) > limit
    {
        return Err(RequestError::ContextTooLong {
            model: entry.config.name.clone(),
            limit,
            prompt: prompt_tokens as u64,
            whole: true,
            max_tokens: u64::from(max_tokens),
        });
    }
    request.shrinker = None;
    if request.meta.allow_shrink
        && let Some(shorten) = prompt.shorten.clone()
    {
        let layout = *layout;
        request.shrinker = Some(lifecycle::Shrinker(Arc::new(move |to| {
            let (tokens, cut) = shorten(to)?;
            if tokens.is_empty() {
                return Err("nothing of the prompt would be left".into());
            }
            Ok(lifecycle::Shrunk {
                inputs: step_inputs(&layout, &tokens, 0, Vec::new()),
                tokens: tokens.len() as u64,
                cut,
            })
        })));
    }
    request.model = entry.config.name.clone();
    request.inputs = step_inputs(layout, &prompt.tokens, 0, Vec::new());
    request.outputs = Vec::new();
    request.max_new_tokens = u64::from(max_tokens);
    request.sequence = Some(crate::pool::batch::next_sequence());
    Ok(Decoding {
        entry,
        layout,
        tokenizer,
        eos: entry.folder.end_tokens(tokenizer),
        params,
        prompt_tokens,
        max_tokens,
        prompt,
    })
}

/// The prompt as it ran (cut as a shrink cut it, to `shrunk.1` tokens) and `tokens` after it:
/// what a prefill after a failure runs.
pub(super) fn history(
    prompt: &Prompt,
    shrunk: Option<&(u64, u64, String)>,
    tokens: &[u32],
) -> Result<Vec<u32>, String> {
    let mut all = match (shrunk, &prompt.shorten) {
        (Some(s), Some(shorten)) => shorten(s.1)?.0,
        _ => prompt.tokens.clone(),
    };
    all.extend_from_slice(tokens);
    Ok(all)
}

/// A copy of `request` without its inputs (the prompt is not copied only to be dropped): the
/// request its steps run as, under its model and sequence.
fn without_prompt(request: &mut Request) -> Request {
    let prompt = std::mem::take(&mut request.inputs);
    let steps = request.clone();
    request.inputs = prompt;
    steps
}

/// A generation's prompt, run: what ran, what the steps decode with (the model that
/// answered), the request the steps run as (the request without its prompt, for that model and
/// the sequence its prompt ran under), and where the tokens come from.
pub(super) struct Prefill<'a> {
    pub(super) served: Served,
    pub(super) decoding: Decoding<'a>,
    pub(super) steps: Request,
    pub(super) source: Arc<Source>,
}

impl<'a> Prefill<'a> {
    /// Generation `i` of this prompt beside this one (OpenAI's `n`), from the same run: its own
    /// sequence, its own seed (the request's plus `i`), the run's outputs copied. Its cache is
    /// copied by [`super::cache::fork`].
    pub(super) fn copy(&self, i: u64) -> Prefill<'a> {
        let served = &self.served;
        let mut steps = self.steps.clone();
        steps.sequence = steps.sequence.map(|_| crate::pool::batch::next_sequence());
        let mut params = self.decoding.params.clone().into_owned();
        params.seed = params.seed.wrapping_add(i);
        Prefill {
            served: Served {
                pool: Arc::clone(&served.pool),
                action: served.action,
                context: served.context,
                context_cut: served.context_cut.clone(),
                retry_started: served.retry_started,
                retried: served.retried,
                outputs: served.outputs.clone(),
            },
            decoding: Decoding {
                eos: self.decoding.eos.clone(),
                params: std::borrow::Cow::Owned(params),
                prompt: self.decoding.prompt.clone(),
                ..self.decoding
            },
            steps,
            source: Arc::clone(&self.source),
        }
    }
}

/// A prompt's run placed on the model asked for, or refused where the model's fallback may take
/// it (with the request the steps run as, to make the fallback's from).
pub(super) enum Placed<'a> {
    /// It ran.
    Ran(Prefill<'a>),
    /// The fallback may take it, once its prompt is made again.
    Fallback(lifecycle::Fallback, Request),
}

/// Place the prompt's run on the model asked for.
pub(super) async fn place_prompt<'a>(
    service: &'a Service,
    decoding: Decoding<'a>,
    mut request: Request,
) -> Result<Placed<'a>, Refused> {
    let steps = without_prompt(&mut request);
    Ok(match lifecycle::place_or_fallback(service, request).await? {
        Placement::Served(served) => Placed::Ran(prefilled(served, decoding, steps, None)),
        Placement::Fallback(fallback) => Placed::Fallback(fallback, steps),
    })
}

/// Place the prompt made again for `fallback` (`rebuilt`: its prompt and parameters, or why
/// they could not be made) as the request `answering` counts; `substitute` is the request the
/// original's steps would have run as, made the fallback's here.
pub(super) async fn place_rebuilt<'a>(
    service: &'a Service,
    answering: &lifecycle::Answering,
    fallback: lifecycle::Fallback,
    mut substitute: Request,
    rebuilt: Result<(Prompt, Params), String>,
) -> Result<Prefill<'a>, Refused> {
    let decoding = rebuilt.and_then(|(prompt, params)| {
        let entry = service.model(fallback.model()).ok_or("it is not configured")?;
        prepare(service, entry, prompt, std::borrow::Cow::Owned(params), &mut substitute).map_err(|e| e.to_string())
    });
    let decoding = match decoding {
        Ok(decoding) => decoding,
        Err(why) => return Err(fallback.cannot(&why)),
    };
    // The substitute's own steps go with its decoding: its prompt is prefilled under the
    // substitute's sequence, and the steps must join the batch under that one, not the
    // original's (whose cache does not exist, which would cost a prefill again and leave the
    // substitute's cache unclaimed in the runtime).
    let its_steps = without_prompt(&mut substitute);
    let (served, substitution) = fallback.place(service, answering, substitute).await?;
    Ok(prefilled(served, decoding, its_steps, Some(substitution)))
}

/// The prompt's run on the model that answers, and the request its steps run as.
fn prefilled<'a>(
    served: Served,
    decoding: Decoding<'a>,
    mut steps: Request,
    substitution: Option<lifecycle::Substitution>,
) -> Prefill<'a> {
    // Once its first token is picked, a generation offering tools is never run again.
    steps.meta.replayable &= !decoding.params.tools;
    let source = Arc::new(Source {
        model: decoding.entry.config.name.clone(),
        substitution,
    });
    Prefill {
        served,
        decoding,
        steps,
        source,
    }
}
