//! Reading a completion or chat request into a [`Job`]: the body decoded, every field that
//! needs no model checked, and the rest handed to the generation, which makes it a job for the
//! model named ([`generation::job()`]: the prompt tokenized, the sampling checked against the
//! model's defaults). The fields OpenAI documents that would change the answer and that are
//! not supported are refused by name, never ignored.

use serde::Deserialize;
use serde_json::Value;

use super::body;
use super::error::OpenAiError;
use super::format;
use crate::http::state::AppState;
use crate::serve::generation::{self, Params, PromptIn, Prompts};
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

/// What a completion or a chat request contributes to its [`Job`] before the checks they share.
pub(super) struct Draft<'a> {
    /// The model named, found as it was read.
    pub(super) model: (&'a ModelEntry, &'a Generator),
    pub(super) sampling: Sampling,
    /// The prompts: a completion's, or a chat's messages and tools.
    pub(super) prompts: Prompts,
    /// `echo`: each prompt's text goes before its choices' text.
    pub(super) echo: bool,
    /// The most tokens to generate; `None`: as many as the model's context leaves after the
    /// prompt (chat's default, as OpenAI's and vLLM's).
    pub(super) max_tokens: Option<u32>,
    /// The JSON schema a structured output follows, and whether strictly (`response_format`).
    pub(super) format: Option<(Value, bool)>,
    /// How many of the most likely tokens' log-probabilities to give beside each token's
    /// (`None`: no log-probabilities).
    pub(super) logprobs: Option<u32>,
}

impl Sampling {
    /// The sampling fields as the generation takes them, `stop` as a list.
    fn asked(self) -> generation::Sampling {
        generation::Sampling {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            stop: match self.stop {
                None => Vec::new(),
                Some(Stop::One(s)) => vec![s],
                Some(Stop::Many(v)) => v,
            },
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: self.logit_bias,
            repetition_penalty: self.repetition_penalty,
        }
    }
}

/// Refuse the first field `given` that is not supported, by name.
pub(super) fn refuse_unsupported<const N: usize>(fields: [(bool, &'static str); N]) -> Result<(), OpenAiError> {
    match fields.into_iter().find(|(given, _)| *given) {
        Some((_, name)) => Err(OpenAiError::invalid(format!("`{name}` is not supported"), Some(name))),
        None => Ok(()),
    }
}

/// Check a completion's or a chat's [`Draft`] into a [`Job`]: how many choices, then the
/// generation's job for the model named (its prompts tokenized, its sampling checked).
pub(super) fn checked(draft: Draft<'_>, id: &str) -> Result<Job, OpenAiError> {
    let Draft {
        model: (entry, text),
        sampling,
        prompts,
        echo,
        max_tokens,
        format,
        logprobs,
    } = draft;
    let stream = sampling.stream == Some(true);
    // Chat adds its end-of-turn string to `stop`; the client's own stay within 4.
    if let Some(Stop::Many(v)) = &sampling.stop
        && v.len() > 4
    {
        return Err(OpenAiError::invalid("`stop` takes at most 4 strings", Some("stop")));
    }
    let n = sampling.n.unwrap_or(1) as usize;
    if n == 0 {
        return Err(OpenAiError::invalid("`n` must be at least 1", Some("n")));
    }
    let count = match &prompts {
        Prompts::Completion(prompts) => prompts.len(),
        Prompts::Chat(_) => 1,
    };
    if n.saturating_mul(count) > MAX_CHOICES {
        return Err(OpenAiError::invalid(
            format!(
                "`n` times the prompts is {} choices; at most {MAX_CHOICES} are served in one request",
                n.saturating_mul(count)
            ),
            Some("n"),
        ));
    }
    let chat = matches!(&prompts, Prompts::Chat(_));
    let model = sampling.model.clone();
    let asked = generation::Asked {
        prompts,
        sampling: sampling.asked(),
        max_tokens,
        logprobs,
        echo,
        format,
    };
    let job = generation::job(entry, text, asked, id).map_err(|e| refused(e, &model, id))?;
    Ok(Job {
        model,
        api: match chat {
            true => Api::Chat { tools: job.tools },
            false => Api::Completion,
        },
        prompts: job.prompts,
        n,
        echo: job.echo,
        params: job.params,
        stream,
    })
}

/// What the generation found wrong with a request for `model`, in OpenAI's shape.
fn refused(invalid: generation::Invalid, model: &str, id: &str) -> OpenAiError {
    match invalid {
        generation::Invalid::Field { message, at } => OpenAiError::invalid_at(message, at),
        generation::Invalid::TooLong {
            limit,
            prompt,
            generated,
            field,
        } => OpenAiError::context_too_long(model, limit, prompt, generated, field, id),
    }
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
pub(super) fn read_completion<'a>(state: &'a AppState, body: &[u8], id: &str) -> Result<Draft<'a>, OpenAiError> {
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
    let model = text_model(state, &sampling.model, id)?;
    let prompts = prompts_of(&request.prompt)?;
    let format = format::schema(request.response_format.as_ref())?;
    // OpenAI's legacy default for completions (chat's is the rest of the context).
    let max_tokens = Some(sampling.max_tokens.unwrap_or(16));
    Ok(Draft {
        model,
        sampling,
        prompts: Prompts::Completion(prompts),
        echo,
        max_tokens,
        format,
        logprobs,
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
