//! Reading a completion or chat request into a [`Job`]: the body decoded, every field checked,
//! the prompt tokenized. The fields OpenAI documents that would change the answer and that are
//! not supported are refused by name, never ignored.

use serde::Deserialize;
use serde_json::Value;

use super::error::OpenAiError;
use crate::http::state::AppState;
use crate::runtime::folder::SamplingDefaults;
use crate::runtime::grammar::Grammar;
use crate::serve::generation::{self, Params};
use crate::serve::lifecycle::RequestError;
use crate::serve::service::ModelEntry;

/// `stop`: one string or up to four.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
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

/// The body of `POST /v1/completions`.
#[derive(Debug, Deserialize)]
struct CompletionRequest {
    #[serde(flatten)]
    sampling: Sampling,
    prompt: Value,
    #[serde(default)]
    echo: Option<bool>,
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    best_of: Option<u32>,
    #[serde(default)]
    suffix: Option<String>,
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

/// A checked generation request: the model, its prompt's tokens and how to generate.
pub(super) struct Job {
    pub(super) model: String,
    pub(super) api: Api,
    pub(super) prompt: generation::Prompt,
    pub(super) params: Params,
    pub(super) stream: bool,
}

/// What a completion or a chat request contributes to its [`Job`] before the checks they share.
pub(super) struct Draft {
    pub(super) sampling: Sampling,
    /// The prompt's text (a chat's, rendered by its template).
    pub(super) text: String,
    pub(super) api: Api,
    pub(super) max_tokens: Option<u32>,
    /// How the prompt is cut when it does not fit: a chat by whole turns; a completion from its
    /// start (`None`, the prompt's default).
    pub(super) shorten: Option<generation::Shorten>,
    /// The grammar a chat's structured output follows.
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

/// Check a completion's or a chat's [`Draft`] into a [`Job`]: the sampling fields, and its
/// prompt tokenized by the model's tokenizer.
pub(super) fn checked(state: &AppState, draft: Draft, id: &str) -> Result<Job, OpenAiError> {
    let Draft {
        sampling,
        text,
        api,
        max_tokens,
        shorten,
        grammar,
        logprobs,
    } = draft;
    let stream = sampling.stream == Some(true);
    let chat = matches!(&api, Api::Chat { .. });
    let tools = matches!(&api, Api::Chat { tools } if !tools.is_empty());
    let entry = state.service.model(&sampling.model).expect("checked by text_model");
    let tokenizer = entry.tokenizer.as_ref().expect("checked by text_model");
    // The ids `logit_bias` may name: the model's logits, or where the graph leaves their
    // number open, its tokenizer's vocabulary.
    let vocab = entry
        .decoder
        .as_ref()
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
    // A completion's prompt gets what the tokenizer adds to any text (Llama's and Gemma's BOS),
    // as `transformers` and vLLM encode it; a chat's rendered template already holds it.
    let encoding = tokenizer
        .encode(text.as_str(), !chat)
        .map_err(|e| OpenAiError::invalid(format!("the prompt cannot be tokenized: {e}"), Some("prompt")))?;
    let tokens = encoding.get_ids().to_vec();
    if tokens.is_empty() {
        return Err(OpenAiError::invalid(
            "the prompt is empty",
            Some(if chat { "messages" } else { "prompt" }),
        ));
    }
    let mut prompt = generation::Prompt::from(tokens);
    if shorten.is_some() {
        prompt.shorten = shorten;
    }
    Ok(Job {
        model: sampling.model,
        api,
        prompt,
        params,
        stream,
    })
}

/// A `POST /v1/completions` body: one plain prompt.
pub(super) fn read_completion(state: &AppState, body: &[u8], id: &str) -> Result<Draft, OpenAiError> {
    let request: CompletionRequest = serde_json::from_slice(body)
        .map_err(|e| OpenAiError::invalid(format!("the body is not a completion request: {e}"), None))?;
    refuse_unsupported([
        (request.best_of.is_some_and(|n| n != 1), "best_of"),
        (request.echo == Some(true), "echo"),
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
    text_model(state, &request.sampling.model, id)?;
    let text = match &request.prompt {
        Value::String(text) => text.clone(),
        Value::Array(items) if items.len() == 1 && items[0].is_string() => {
            items[0].as_str().unwrap_or_default().to_string()
        }
        _ => return Err(OpenAiError::invalid("`prompt` must be one string", Some("prompt"))),
    };
    // Chat adds its end-of-turn string to `stop`; a completion's own stays within 4.
    if let Some(Stop::Many(v)) = &request.sampling.stop
        && v.len() > 4
    {
        return Err(OpenAiError::invalid("`stop` takes at most 4 strings", Some("stop")));
    }
    let max_tokens = request.sampling.max_tokens;
    Ok(Draft {
        sampling: request.sampling,
        text,
        api: Api::Completion,
        max_tokens,
        shorten: None,
        grammar: None,
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
    refuse_unsupported([(sampling.n.is_some_and(|n| n != 1), "n")])?;
    let max_tokens = max_tokens.unwrap_or(16);
    if max_tokens == 0 {
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

/// The model named, if it generates text.
pub(super) fn text_model<'a>(state: &'a AppState, model: &str, id: &str) -> Result<&'a ModelEntry, OpenAiError> {
    let service = &state.service;
    let entry = service.model(model).ok_or_else(|| {
        let error = RequestError::unknown_model(service, model);
        OpenAiError {
            param: Some("model"),
            ..OpenAiError::from_request(&error, id)
        }
    })?;
    if entry.decoder.is_none() || entry.tokenizer.is_none() {
        return Err(OpenAiError::invalid(
            format!(
                "model `{model}` does not generate text (it needs a decoder with past key values and `models[].tokenizer`)"
            ),
            Some("model"),
        ));
    }
    Ok(entry)
}
