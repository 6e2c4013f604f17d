//! Reading a completion or chat request into a [`Job`]: the body decoded, every field checked,
//! the prompt tokenized. The fields OpenAI documents that would change the answer and that are
//! not supported are refused by name, never ignored.

use serde::Deserialize;
use serde_json::Value;

use super::body;
use super::error::OpenAiError;
use super::format;
use crate::http::state::AppState;
use crate::runtime::folder::SamplingDefaults;
use crate::runtime::grammar::Grammar;
use crate::runtime::leading::{Bounded, encode_within};
use crate::serve::generation::{self, Params};
use crate::serve::service::{self, Generator, Kind, ModelEntry};

/// `stop`: one string or up to four.
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "expected a string or an array of strings")]
pub(super) enum Stop {
    One(String),
    Many(Vec<String>),
}

/// What completions and chat share: how to pick tokens and when to stop.
#[derive(Debug, Deserialize)]
pub(super) struct Sampling {
    pub(super) model: String,
    #[serde(default)]
    pub(super) max_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<u32>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    pub(super) stop: Option<Stop>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    presence_penalty: Option<f32>,
    #[serde(default)]
    frequency_penalty: Option<f32>,
    #[serde(default)]
    logit_bias: Option<serde_json::Map<String, Value>>,
    /// `transformers`' penalty, as vLLM takes it beside OpenAI's fields.
    #[serde(default)]
    repetition_penalty: Option<f32>,
    // Other fields (`user`, `stream_options`, `parallel_tool_calls`) do not change the answer
    // and are ignored.
}

/// The body of `POST /v1/completions` but for what it shares with chat ([`Sampling`]), read
/// from the body on its own.
#[derive(Debug, Deserialize)]
struct CompletionRequest {
    prompt: Value,
    #[serde(default)]
    echo: Option<bool>,
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    best_of: Option<u32>,
    #[serde(default)]
    suffix: Option<String>,
    /// Structured outputs, as chat takes them.
    #[serde(default)]
    response_format: Option<Value>,
}

/// Which API a generation answers.
#[derive(Debug, Clone)]
pub(super) enum Api {
    Completion,
    /// Chat, with the names of the tools offered (empty: none, or `tool_choice: "none"`).
    Chat {
        tools: Vec<String>,
    },
}

/// The most choices a request may ask for (`n` times its prompts): each is a generation with
/// a KV cache of its own.
pub(super) const MAX_CHOICES: usize = 128;

/// A checked generation request: the model, its prompts' tokens and how to generate. Its
/// choices are each prompt's `n` generations, in that order: choice `i` is prompt `i / n`'s.
pub(super) struct Job {
    pub(super) model: String,
    pub(super) api: Api,
    pub(super) prompts: Vec<generation::Prompt>,
    /// Generations of each prompt (OpenAI's `n`).
    pub(super) n: usize,
    /// With `echo`, each prompt's text, put before its choices' text.
    pub(super) echo: Option<Vec<String>>,
    pub(super) params: Params,
    pub(super) stream: bool,
}

impl Job {
    /// How many choices the answer has.
    pub(super) fn choices(&self) -> usize {
        self.prompts.len() * self.n
    }

    /// With `echo`, the text put before choice `index`'s: its prompt's.
    pub(super) fn echo_of(&self, index: usize) -> Option<&str> {
        self.echo.as_ref().map(|texts| texts[index / self.n].as_str())
    }
}

/// A prompt as the client sent it: text, or token ids (a completion's only).
pub(super) enum PromptIn {
    Text(String),
    Tokens(Vec<u32>),
}

/// What a completion or a chat request contributes to its [`Job`] before the checks they share.
pub(super) struct Draft {
    pub(super) sampling: Sampling,
    /// The prompts (a chat's one, its messages rendered by its template).
    pub(super) prompts: Vec<PromptIn>,
    /// `echo`: each prompt's text goes before its choices' text.
    pub(super) echo: bool,
    pub(super) api: Api,
    /// The most tokens to generate; `None`: as many as the model's context leaves after the
    /// prompt (chat's default, as OpenAI's and vLLM's).
    pub(super) max_tokens: Option<u32>,
    /// How the prompt is cut when it does not fit: a chat by whole turns; a completion from its
    /// start (`None`, the prompt's default).
    pub(super) shorten: Option<generation::Shorten>,
    /// The grammar a structured output follows (`response_format`, or a chat's forced tool call).
    pub(super) grammar: Option<Grammar>,
    /// How many of the most likely tokens' log-probabilities to give beside each token's
    /// (`None`: no log-probabilities).
    pub(super) logprobs: Option<u32>,
}

/// Refuse the first field `given` that is not supported, by name.
pub(super) fn refuse_unsupported<const N: usize>(fields: [(bool, &'static str); N]) -> Result<(), OpenAiError> {
    match fields.into_iter().find(|(given, _)| *given) {
        Some((_, name)) => Err(OpenAiError::invalid(format!("`{name}` is not supported"), Some(name))),
        None => Ok(()),
    }
}

/// Check a completion's or a chat's [`Draft`] into a [`Job`]: the sampling fields, how many
/// choices, and its prompts tokenized by the model's tokenizer (token ids checked against it).
pub(super) fn checked(state: &AppState, draft: Draft, id: &str) -> Result<Job, OpenAiError> {
    let Draft {
        sampling,
        prompts,
        echo,
        api,
        max_tokens,
        shorten,
        grammar,
        logprobs,
    } = draft;
    let stream = sampling.stream == Some(true);
    let chat = matches!(&api, Api::Chat { .. });
    let tools = matches!(&api, Api::Chat { tools } if !tools.is_empty());
    let (entry, text) = text_model(state, &sampling.model, id)?;
    let tokenizer = &text.tokenizer;
    // The ids `logit_bias` may name: the model's logits, or where the graph leaves their
    // number open, its tokenizer's vocabulary.
    let vocab = entry
        .kind
        .decoder()
        .and_then(|layout| layout.vocab)
        .unwrap_or(tokenizer.get_vocab_size(true) as u64);
    let params = Params {
        grammar,
        ..params(
            &sampling,
            &entry.folder.sampling,
            (max_tokens, logprobs),
            tools,
            vocab,
            id,
        )?
    };
    let n = sampling.n.unwrap_or(1) as usize;
    if n == 0 {
        return Err(OpenAiError::invalid("`n` must be at least 1", Some("n")));
    }
    if n.saturating_mul(prompts.len()) > MAX_CHOICES {
        return Err(OpenAiError::invalid(
            format!(
                "`n` times the prompts is {} choices; at most {MAX_CHOICES} are served in one request",
                n.saturating_mul(prompts.len())
            ),
            Some("n"),
        ));
    }
    let field = if chat { "messages" } else { "prompt" };
    // The positions the model takes bound the prompt, with room for what it asks to generate
    // (at least one token): a longer one is refused before anything runs, found so from as
    // much of its text as that many tokens could cover.
    let context = entry.kind.decoder().and_then(|layout| layout.context);
    let generated = u64::from(params.max_tokens.unwrap_or(1));
    let too_long = |prompt: usize, whole: bool| {
        let limit = context.unwrap_or(u64::MAX);
        OpenAiError::context_too_long(&sampling.model, limit, (prompt as u64, whole), generated, field, id)
    };
    let limit = context.map(|c| c.saturating_sub(generated));
    if limit == Some(0) {
        return Err(too_long(1, false));
    }
    let limit = limit.map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(usize::MAX));
    let mut texts = Vec::with_capacity(prompts.len());
    let mut tokenized = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let (text, tokens) = match prompt {
            // A completion's prompt gets what the tokenizer adds to any text (Llama's and
            // Gemma's BOS), as `transformers` and vLLM encode it; a chat's rendered template
            // already holds it.
            PromptIn::Text(text) => match encode_within(tokenizer, &text, !chat, limit) {
                Ok(Bounded::Tokens(ids)) => (text, ids),
                Ok(Bounded::Over { at_least, whole }) => return Err(too_long(at_least, whole)),
                Err(e) => {
                    return Err(OpenAiError::invalid(
                        format!("the prompt cannot be tokenized: {e}"),
                        Some(field),
                    ));
                }
            },
            PromptIn::Tokens(ids) if ids.len() > limit => return Err(too_long(ids.len(), true)),
            // Token ids go to the model as they are: nothing is added.
            PromptIn::Tokens(ids) => {
                if let Some(id) = ids.iter().find(|&&id| tokenizer.id_to_token(id).is_none()) {
                    return Err(OpenAiError::invalid(
                        format!(
                            "token id {id} is not in the model's vocabulary ({} tokens)",
                            tokenizer.get_vocab_size(true)
                        ),
                        Some("prompt"),
                    ));
                }
                let text = match echo {
                    true => tokenizer.decode(&ids, false).map_err(|e| {
                        OpenAiError::invalid(format!("the prompt's tokens cannot be decoded: {e}"), Some("prompt"))
                    })?,
                    false => String::new(),
                };
                (text, ids)
            }
        };
        if tokens.is_empty() {
            return Err(OpenAiError::invalid("the prompt is empty", Some(field)));
        }
        let mut prompt = generation::Prompt::from(tokens);
        if shorten.is_some() {
            prompt.shorten = shorten.clone();
        }
        texts.push(text);
        tokenized.push(prompt);
    }
    Ok(Job {
        model: sampling.model,
        api,
        prompts: tokenized,
        n,
        echo: echo.then_some(texts),
        params,
        stream,
    })
}

/// A completion's `prompt` as OpenAI takes it: a string, strings, token ids, or arrays of
/// token ids; each one its own prompt.
fn prompts_of(prompt: &Value) -> Result<Vec<PromptIn>, OpenAiError> {
    let wrong = || {
        OpenAiError::invalid(
            "`prompt` must be a string, an array of strings, an array of token ids or an array of arrays of token ids",
            Some("prompt"),
        )
    };
    let ids = |items: &[Value]| -> Result<Vec<u32>, OpenAiError> {
        items
            .iter()
            .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(wrong))
            .collect()
    };
    match prompt {
        Value::String(text) => Ok(vec![PromptIn::Text(text.clone())]),
        Value::Array(items) if items.is_empty() => Err(OpenAiError::invalid("`prompt` is empty", Some("prompt"))),
        Value::Array(items) if items.iter().all(Value::is_string) => Ok(items
            .iter()
            .map(|t| PromptIn::Text(t.as_str().unwrap_or_default().to_string()))
            .collect()),
        Value::Array(items) if items.iter().all(Value::is_number) => Ok(vec![PromptIn::Tokens(ids(items)?)]),
        Value::Array(items) if items.iter().all(Value::is_array) => items
            .iter()
            .map(|p| Ok(PromptIn::Tokens(ids(p.as_array().map_or(&[][..], Vec::as_slice))?)))
            .collect(),
        _ => Err(wrong()),
    }
}

/// A `POST /v1/completions` body: its prompts.
pub(super) fn read_completion(state: &AppState, body: &[u8], id: &str) -> Result<Draft, OpenAiError> {
    let value = body::parse(body)?;
    let sampling: Sampling = body::fields(&value)?;
    let request: CompletionRequest = body::fields(value)?;
    let echo = request.echo == Some(true);
    let logprobs = request.logprobs.as_ref().is_some_and(|v| !v.is_null());
    if echo && logprobs {
        // The prompt's run computes the last position's logits only (the graph is rewritten
        // so at load): the prompt's own tokens have none to give.
        return Err(OpenAiError::invalid(
            "`echo` with `logprobs` is not supported: it asks for the prompt tokens' logprobs, and the prompt's run computes the logits of its last position only",
            Some("echo"),
        ));
    }
    let n = sampling.n.unwrap_or(1);
    refuse_unsupported([
        // `best_of` equal to `n` picks all of them: the same answer.
        (request.best_of.is_some_and(|b| b != n), "best_of"),
        (request.suffix.is_some(), "suffix"),
    ])?;
    // OpenAI's completions give at most 5 alternatives a token.
    let logprobs = match &request.logprobs {
        None | Some(Value::Null) => None,
        Some(n) => Some(
            n.as_u64()
                .filter(|n| *n <= 5)
                .ok_or_else(|| OpenAiError::invalid("`logprobs` must be an integer from 0 to 5", Some("logprobs")))?
                as u32,
        ),
    };
    let (_, text) = text_model(state, &sampling.model, id)?;
    let prompts = prompts_of(&request.prompt)?;
    let format = format::schema(request.response_format.as_ref())?;
    let grammar = format.map(|format| format::compiled(text, &format)).transpose()?;
    // Chat adds its end-of-turn string to `stop`; a completion's own stays within 4.
    if let Some(Stop::Many(v)) = &sampling.stop
        && v.len() > 4
    {
        return Err(OpenAiError::invalid("`stop` takes at most 4 strings", Some("stop")));
    }
    // OpenAI's legacy default for completions (chat's is the rest of the context).
    let max_tokens = Some(sampling.max_tokens.unwrap_or(16));
    Ok(Draft {
        sampling,
        prompts,
        echo,
        api: Api::Completion,
        max_tokens,
        shorten: None,
        grammar,
        logprobs,
    })
}

/// How to generate, from the sampling fields, `max_tokens` and `logprobs` (chat's and
/// completions' own): each checked; what the request leaves out, the model folder's `defaults`
/// (its `generation_config.json`), else OpenAI's. `tools` says whether the prompt offers tools;
/// `vocab` is how many token ids the model has.
fn params(
    sampling: &Sampling,
    defaults: &SamplingDefaults,
    (max_tokens, logprobs): (Option<u32>, Option<u32>),
    tools: bool,
    vocab: u64,
    id: &str,
) -> Result<Params, OpenAiError> {
    if max_tokens == Some(0) {
        return Err(OpenAiError::invalid(
            "`max_tokens` must be at least 1",
            Some("max_tokens"),
        ));
    }
    let temperature = sampling.temperature.or(defaults.temperature).unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(OpenAiError::invalid(
            "`temperature` must be between 0 and 2",
            Some("temperature"),
        ));
    }
    let top_p = sampling.top_p.or(defaults.top_p).unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(OpenAiError::invalid(
            "`top_p` must be greater than 0 and at most 1",
            Some("top_p"),
        ));
    }
    let stop = match &sampling.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.iter().any(String::is_empty) {
        return Err(OpenAiError::invalid("`stop` strings must not be empty", Some("stop")));
    }
    Ok(Params {
        max_tokens,
        temperature,
        top_p,
        top_k: sampling.top_k.or(defaults.top_k).unwrap_or(0),
        // Without a seed, one from the request id: still the same tokens if it is retried.
        seed: sampling.seed.unwrap_or_else(|| {
            id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
            })
        }),
        stop,
        tools,
        grammar: None,
        penalties: penalties(sampling, defaults, vocab)?,
        logprobs,
    })
}

/// The penalties and bias, each checked: OpenAI's `presence_penalty` and `frequency_penalty`
/// (-2 to 2) and `logit_bias` (token ids below `vocab`, as strings, to -100 to 100), and
/// `repetition_penalty` (above 0) from the request, else the model folder's `defaults`.
fn penalties(
    sampling: &Sampling,
    defaults: &SamplingDefaults,
    vocab: u64,
) -> Result<generation::Penalties, OpenAiError> {
    let openai = |value: Option<f32>, name: &'static str| match value.unwrap_or(0.0) {
        p if (-2.0..=2.0).contains(&p) => Ok(p),
        _ => Err(OpenAiError::invalid(
            format!("`{name}` must be between -2 and 2"),
            Some(name),
        )),
    };
    let repetition = sampling
        .repetition_penalty
        .or(defaults.repetition_penalty)
        .unwrap_or(1.0);
    if !(repetition > 0.0 && repetition.is_finite()) {
        return Err(OpenAiError::invalid(
            "`repetition_penalty` must be a number above 0",
            Some("repetition_penalty"),
        ));
    }
    let mut bias = Vec::new();
    for (key, value) in sampling.logit_bias.iter().flatten() {
        let id = key
            .parse::<u32>()
            .ok()
            .filter(|&id| u64::from(id) < vocab)
            .ok_or_else(|| {
                OpenAiError::invalid(
                    format!("`logit_bias` names `{key}`, not a token id below the model's {vocab}"),
                    Some("logit_bias"),
                )
            })?;
        let value = value.as_f64().filter(|v| (-100.0..=100.0).contains(v)).ok_or_else(|| {
            OpenAiError::invalid(
                format!("`logit_bias` of token {id} is {value}, not a number from -100 to 100"),
                Some("logit_bias"),
            )
        })?;
        bias.push((id, value as f32));
    }
    // Two keys may name one id (`"7"` and `"07"`).
    bias.sort_unstable_by_key(|&(id, _)| id);
    if let Some(twice) = bias.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(OpenAiError::invalid(
            format!("`logit_bias` names token {} twice", twice[0].0),
            Some("logit_bias"),
        ));
    }
    Ok(generation::Penalties {
        presence: openai(sampling.presence_penalty, "presence_penalty")?,
        frequency: openai(sampling.frequency_penalty, "frequency_penalty")?,
        repetition,
        bias,
    })
}

/// The model named, if it generates text, and what it generates text with.
pub(super) fn text_model<'a>(
    state: &'a AppState,
    model: &str,
    id: &str,
) -> Result<(&'a ModelEntry, &'a Generator), OpenAiError> {
    super::model_for(state, model, service::Api::Generation, id, Kind::generator)
}
