//! Text generation on a decoder with past key values (see [`crate::runtime::decoder`]), below any
//! protocol. The prompt's run goes through the request lifecycle like any request (policy,
//! breaker, one retry on the fallback pool, deadline, cancellation), with the estimate covering
//! the KV cache of the prompt and every token it may add. On a pool whose backends keep caches
//! the prompt's run leaves its KV cache in the pool's runtime and brings back one row of
//! logits; each following token is then a row of the pool's batch for the model
//! ([`crate::serve::steps`]), one run per step for every generation there. A generation's
//! cache is given back when it finishes or its client goes away.

use std::sync::Arc;

use crate::core::snapshot::Action;
use crate::pool::Pool;
use crate::pool::batch::sequences::Running;
use crate::runtime::decoder::{DecoderLayout, step_inputs};
use crate::runtime::text::{Detokenizer, first_at, tail_start};
use crate::serve::lifecycle::{self, NotRetried, Refused, Request, RequestError, Served};
use crate::serve::service::{ModelEntry, Service};
use crate::serve::steps::{Failed, Place, read_outputs};
use crate::telemetry::metrics::FailoverReason;

/// Where a streamed generation sends each token as it is picked.
pub type Sink = tokio::sync::mpsc::Sender<Token>;

/// A token as it is picked, with the pool whose run produced it (it changes after a failover).
#[derive(Debug, Clone)]
pub struct Token {
    /// The token id.
    pub id: u32,
    /// The pool that ran it.
    pub pool: Arc<Pool>,
    /// `(from, to)` prompt tokens and what was left out, when the context was shrunk.
    pub shrunk: Option<Arc<(u64, u64, String)>>,
    /// The model it comes from.
    pub source: Arc<Source>,
}

/// The model a generation's tokens come from (its model's fallback, when that stood in), and
/// the strings that end its text there.
#[derive(Debug)]
pub struct Source {
    /// The model that answers.
    pub model: String,
    /// Strings that end its text (a chat's include its template's end of turn).
    pub stop: Vec<String>,
    /// Set when it answers for the model asked for.
    pub substitution: Option<lifecycle::Substitution<()>>,
}

/// Tokens that end a turn, by the names model families give them.
const END_TOKENS: [&str; 7] = [
    "<|endoftext|>",
    "</s>",
    "<eos>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|end|>",
];

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
    /// Most tokens to add.
    pub max_tokens: u32,
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
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The end-of-text token or a stop string.
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
    /// Their text, cut before a stop string.
    pub text: String,
    /// Why it ended.
    pub finish: Finish,
}

/// A deterministic random source (SplitMix64): the same seed gives the same tokens anywhere.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next value in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Pick the next token from `logits` under `params`.
pub fn pick(logits: &[f32], params: &Params, rng: &mut Rng) -> u32 {
    let greedy = || {
        logits
            .iter()
            .enumerate()
            .fold(
                (0usize, f32::NEG_INFINITY),
                |best, (i, &l)| if l > best.1 { (i, l) } else { best },
            )
            .0 as u32
    };
    if params.temperature <= 0.0 {
        return greedy();
    }
    // Candidates by descending logit (ties by id, so the order is the same everywhere).
    let mut order: Vec<usize> = (0..logits.len()).filter(|&i| logits[i].is_finite()).collect();
    if order.is_empty() {
        return greedy();
    }
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if params.top_k > 0 {
        order.truncate(params.top_k as usize);
    }
    let max = logits[order[0]] as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / params.temperature as f64).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    // Nucleus: keep the most likely tokens until their share reaches top_p.
    let mut kept = 0;
    let mut share = 0.0;
    while kept < weights.len() {
        share += weights[kept] / total;
        kept += 1;
        if share >= params.top_p as f64 {
            break;
        }
    }
    let kept_total: f64 = weights[..kept].iter().sum();
    let mut target = rng.next_f64() * kept_total;
    for (i, w) in weights[..kept].iter().enumerate() {
        if target < *w {
            return order[i] as u32;
        }
        target -= w;
    }
    order[kept - 1] as u32
}

/// A generation's tokens and text, with what still waited (an unfinished character at the end)
/// and cut before the first stop string: the one found at `stop_at`, which ended it, or one that
/// what waited completed.
fn final_text(text: Detokenizer, stop_at: Option<usize>, stop: &[String]) -> Result<(Vec<u32>, String), String> {
    let searched = text.text().len();
    let (tokens, mut text) = text.finish()?;
    if let Some(cut) = stop_at.or_else(|| first_at(&text, tail_start(&text, searched, stop), stop)) {
        text.truncate(cut);
    }
    Ok((tokens, text))
}

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

/// Makes a generation's prompt and parameters again for another model (its model's
/// `fallback_model`, named), from what the client sent: that model's tokenizer and template,
/// or why it cannot take the request.
pub type Rebuild = Box<dyn FnOnce(&str) -> Result<(Prompt, Params), String> + Send>;

/// What a generation decodes with: its model's decoder and tokenizer, the tokens that end a
/// turn, how to pick tokens, and its prompt's length.
struct Decoding<'a> {
    entry: &'a ModelEntry,
    layout: &'a DecoderLayout,
    tokenizer: &'a Arc<tokenizers::Tokenizer>,
    eos: Vec<u32>,
    params: std::borrow::Cow<'a, Params>,
    prompt_tokens: usize,
    /// The prompt, to prefill it again (after a shrink, cut as the shrink cut it).
    prompt: Prompt,
}

/// Make `request` `entry`'s generation of `prompt`: the prompt's run as its inputs, the tokens
/// it may add, and how to shrink it when the client allowed that.
fn prepare<'a>(
    entry: &'a ModelEntry,
    prompt: Prompt,
    params: std::borrow::Cow<'a, Params>,
    request: &mut Request,
) -> Result<Decoding<'a>, RequestError> {
    let (Some(layout), Some(tokenizer)) = (&entry.decoder, &entry.tokenizer) else {
        return Err(RequestError::BadInput(format!(
            "model `{}` does not generate text (it needs a decoder with past key values and `models[].tokenizer`)",
            entry.config.name
        )));
    };
    let prompt_tokens = prompt.tokens.len();
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
    request.max_new_tokens = u64::from(params.max_tokens);
    request.sequence = Some(crate::pool::batch::next_sequence());
    Ok(Decoding {
        entry,
        layout,
        tokenizer,
        eos: END_TOKENS.iter().filter_map(|t| tokenizer.token_to_id(t)).collect(),
        params,
        prompt_tokens,
        prompt,
    })
}

/// Generate from `prompt` (token ids) under `params`. `request` carries the id, deadline,
/// priority, replayability and leave to substitute; its inputs are built here. `rebuild` makes
/// the prompt again for the model's fallback, when one may answer instead.
pub async fn generate(
    service: &Service,
    entry: &ModelEntry,
    prompt: Prompt,
    params: &Params,
    mut request: Request,
    sink: Option<Sink>,
    rebuild: Option<Rebuild>,
) -> Result<Generated, Refused> {
    let decoding = match prepare(entry, prompt, std::borrow::Cow::Borrowed(params), &mut request) {
        Ok(decoding) => decoding,
        Err(error) => return Err(lifecycle::reject(service, &entry.config.name, error, request.received)),
    };
    request.progress = service.accept(&request.model);
    let answering = lifecycle::Answering::new(&request.model);
    let received = request.received;
    let id = request.meta.request_id.clone();
    lifecycle::counted_as(service, &answering, &id, received, async {
        let generated = run(service, &answering, decoding, request, rebuild, sink).await?;
        let pool = Arc::clone(&generated.pool);
        Ok((generated, pool))
    })
    .await
}

/// The prompt as it ran (cut as a shrink cut it, to `shrunk.1` tokens) and `tokens` after it:
/// what a prefill after a failure runs.
fn history(prompt: &Prompt, shrunk: Option<&(u64, u64, String)>, tokens: &[u32]) -> Result<Vec<u32>, String> {
    let mut all = match (shrunk, &prompt.shorten) {
        (Some(s), Some(shorten)) => shorten(s.1)?.0,
        _ => prompt.tokens.clone(),
    };
    all.extend_from_slice(tokens);
    Ok(all)
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

/// A copy of `request` without its inputs (the prompt is not copied only to be dropped): the
/// template of its steps, which run under its model and sequence.
fn without_prompt(request: &mut Request) -> Request {
    let prompt = std::mem::take(&mut request.inputs);
    let template = request.clone();
    request.inputs = prompt;
    template
}

/// The prompt's run placed: on the model asked for, or rebuilt for its fallback when that may
/// answer instead. What ran, what the steps decode with (the model that answered), the steps'
/// template (the request without its prompt, for that model and the sequence its prompt ran
/// under), and where the tokens come from.
async fn place_prompt<'a>(
    service: &'a Service,
    answering: &lifecycle::Answering,
    decoding: Decoding<'a>,
    mut request: Request,
    rebuild: Option<Rebuild>,
) -> Result<(Served, Decoding<'a>, Request, Arc<Source>), Refused> {
    let mut template = without_prompt(&mut request);
    // The substitute's own template goes with its decoding: its prompt is prefilled under the
    // substitute's sequence, and the steps must join the batch under that one, not the
    // original's (whose cache does not exist, which would cost a prefill again and leave the
    // substitute's cache unclaimed in the runtime).
    let substitute = |fallback: &str| {
        let entry = service.model(fallback).ok_or("it is not configured")?;
        let (prompt, params) = rebuild.ok_or("nothing can make its prompt again")?(fallback)?;
        let mut substitute = template.clone();
        let decoding =
            prepare(entry, prompt, std::borrow::Cow::Owned(params), &mut substitute).map_err(|e| e.to_string())?;
        let steps = without_prompt(&mut substitute);
        Ok((substitute, (decoding, steps)))
    };
    let (served, substitution) = lifecycle::place_or_substitute(service, answering, request, substitute).await?;
    let (decoding, substitution) = match substitution {
        Some(s) => {
            let (decoding, steps) = s.rebuilt;
            template = steps;
            (
                decoding,
                Some(lifecycle::Substitution {
                    requested: s.requested,
                    model: s.model,
                    reason: s.reason,
                    rebuilt: (),
                }),
            )
        }
        None => (decoding, None),
    };
    // Once its first token is picked, a generation offering tools is never run again.
    template.meta.replayable &= !decoding.params.tools;
    let source = Arc::new(Source {
        model: decoding.entry.config.name.clone(),
        stop: decoding.params.stop.clone(),
        substitution,
    });
    Ok((served, decoding, template, source))
}

/// [`generate`]'s runs, uncounted: the prompt's run ([`place_prompt`]), then one step per
/// token on the pool that ran it.
async fn run<'a>(
    service: &'a Service,
    answering: &lifecycle::Answering,
    decoding: Decoding<'a>,
    request: Request,
    rebuild: Option<Rebuild>,
    sink: Option<Sink>,
) -> Result<Generated, Refused> {
    let (served, decoding, mut template, source) = place_prompt(service, answering, decoding, request, rebuild).await?;
    let Decoding {
        entry,
        layout,
        tokenizer,
        eos,
        params,
        prompt_tokens,
        prompt,
    } = decoding;
    let params = params.as_ref();
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
    let shrunk_shared = shrunk.clone().map(Arc::new);
    let failed = Refused::at;
    let broken = |pool: &Arc<Pool>, e: String| internal(&entry.config.name, pool, e);
    let (mut logits, cache) = read_outputs(outputs).map_err(|e| broken(&pool, e))?;
    // The cache this generation holds between runs, on the pool that holds it; given back when
    // this function returns or its future is dropped (a reader gone, a deadline).
    let kv_per_token = layout.kv_bytes_per_token();
    let mut held = Running::on(&pool.sequences, kv_per_token.saturating_mul(prompt_tokens as u64));
    let mut place = Place::new(pool, &template, cache, retried);
    let labels = |pool: &Pool| crate::telemetry::metrics::ModelPoolLabels {
        model: entry.config.name.clone(),
        pool: pool.name().to_string(),
    };
    let metrics = &service.metrics;
    metrics
        .time_to_first_token
        .get_or_create(&labels(&place.pool))
        .observe(template.received.elapsed().as_secs_f64());
    let mut last_token = tokio::time::Instant::now();
    let mut rng = Rng::new(params.seed);
    // The text as it comes, decoded a token at a time; a stop string is looked for only where
    // the new text could have completed one.
    let mut text = Detokenizer::new(Arc::clone(tokenizer));
    let mut stop_at = None;
    let estimate = entry.estimate_tokens((prompt_tokens as u64).saturating_add(u64::from(params.max_tokens)), 1);
    let estimate_bytes = estimate.context_bytes.saturating_add(estimate.workspace_bytes);
    let finish = loop {
        let next = pick(&logits, params, &mut rng);
        if eos.contains(&next) {
            break Finish::Stop;
        }
        let searched = text.text().len();
        text.push(next).map_err(|e| broken(&place.pool, e))?;
        let token = || Token {
            id: next,
            pool: Arc::clone(&place.pool),
            shrunk: shrunk_shared.clone(),
            source: Arc::clone(&source),
        };
        if let Some(sink) = &sink
            && sink.send(token()).await.is_err()
        {
            // The stream's reader is gone: stop here; the KV cache goes with this future.
            return Err(failed(&place.pool, RequestError::ClientGone));
        }
        let grown = text.text();
        stop_at = first_at(grown, tail_start(grown, searched, &params.stop), &params.stop);
        if stop_at.is_some() {
            break Finish::Stop;
        }
        let produced = text.tokens().len();
        if produced >= params.max_tokens as usize {
            break Finish::Length;
        }
        let past = prompt_tokens + produced - 1;
        let history = || history(&prompt, shrunk.as_ref(), text.tokens());
        logits = match place
            .step(service, &mut template, layout, (next, past), history, estimate_bytes)
            .await
        {
            Ok(logits) => logits,
            Err(Failed::Request(e)) => return Err(failed(&place.pool, tools_not_retried(e, params.tools))),
            Err(Failed::Broken(e)) => return Err(broken(&place.pool, e)),
        };
        held.update(&place.pool.sequences, kv_per_token.saturating_mul((past + 1) as u64));
        metrics
            .inter_token
            .get_or_create(&labels(&place.pool))
            .observe(last_token.elapsed().as_secs_f64());
        last_token = tokio::time::Instant::now();
    };
    let Place { pool, retried, .. } = place;
    let (tokens, text) = final_text(text, stop_at, &params.stop).map_err(|e| broken(&pool, e))?;
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
        text,
        finish,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, top_k: u32) -> Params {
        Params {
            max_tokens: 8,
            temperature,
            top_p,
            top_k,
            seed: 7,
            stop: vec![],
            tools: false,
        }
    }

    #[test]
    fn greedy_takes_the_most_likely_token() {
        let mut rng = Rng::new(1);
        assert_eq!(pick(&[0.1, 3.0, -1.0, 2.9], &params(0.0, 1.0, 0), &mut rng), 1);
    }

    #[test]
    fn sampling_is_seeded_and_respects_top_k_and_top_p() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let run = |p: &Params| {
            let mut rng = Rng::new(p.seed);
            (0..200).map(|_| pick(&logits, p, &mut rng)).collect::<Vec<u32>>()
        };
        let p = params(1.0, 1.0, 0);
        assert_eq!(run(&p), run(&p), "same seed, same tokens");
        assert_ne!(run(&p), run(&Params { seed: 8, ..p.clone() }));
        // top_k = 3: only the three largest logits are ever picked.
        let mut best: Vec<usize> = (0..50).collect();
        best.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let top3: Vec<u32> = best[..3].iter().map(|&i| i as u32).collect();
        assert!(run(&params(1.0, 1.0, 3)).iter().all(|t| top3.contains(t)));
        // A tiny top_p keeps only the most likely token.
        assert!(run(&params(1.0, 1e-6, 0)).iter().all(|&t| t == top3[0]));
    }

    #[test]
    fn the_rng_is_uniform_enough() {
        let mut rng = Rng::new(42);
        let mean = (0..10_000).map(|_| rng.next_f64()).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }
}
