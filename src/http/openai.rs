//! OpenAI-compatible text generation: `GET /v1/models`, `POST /v1/completions` and
//! `POST /v1/chat/completions`, with errors in OpenAI's shape (`{"error": {"message", "type",
//! "param", "code"}}`), so clients built on the `openai` package work unchanged. Generation
//! itself is [`crate::serve::generate`]; chat templates and tool calls are [`crate::runtime::chat`].
//!
//! `stream: true` answers with server-sent events: one chunk per piece of text, the last with
//! `finish_reason` and `usage`, then `data: [DONE]`. The first chunk carries a `vramguard`
//! object naming the pool that serves the request and, while degraded, why, that pool's limits
//! and its estimated delay (the same facts a non-streamed answer has in `x-vramguard-*`
//! headers). An error before the first token is an ordinary error response; after it, a final
//! `error` event with the request id, the tokens already sent and how to resume, never a
//! silent replay. A chat request offering tools is never run twice once its first token is
//! picked, streamed or not: a tool call may already have acted on the client's side.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::time::Instant;

use futures_util::StreamExt;

use super::error::status_of;
use super::headers::{decode_headers, header_value, pool_facts, pool_headers, request_id, with_request_id};
use super::state::AppState;
use crate::pool::Pool;
use crate::protocol::headers::{ALLOW_SHRINK_HEADER, CONTEXT_CUT_HEADER, CONTEXT_HEADER, DECISION_HEADER};
use crate::serve::generate::{self, Params};
use crate::serve::lifecycle::RequestError;

/// An error as OpenAI's API writes it.
pub struct OpenAiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
    retry_after: Option<u64>,
    request_id: Option<String>,
}

impl OpenAiError {
    fn invalid(message: impl Into<String>, param: Option<&'static str>) -> OpenAiError {
        OpenAiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            retry_after: None,
            request_id: None,
        }
    }

    fn from_request(error: &RequestError, id: &str) -> OpenAiError {
        let status = status_of(error);
        OpenAiError {
            status,
            message: error.to_string(),
            kind: match status.as_u16() {
                404 => "not_found_error",
                429 => "rate_limit_error",
                400..=499 => "invalid_request_error",
                503 | 504 => "service_unavailable_error",
                _ => "server_error",
            },
            param: None,
            retry_after: error.retry_after_secs(),
            request_id: Some(id.to_string()),
        }
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let mut error = json!({"message": self.message, "type": self.kind, "param": self.param, "code": null});
        if let Some(id) = &self.request_id {
            error["request_id"] = json!(id);
        }
        let mut response = (self.status, axum::Json(json!({"error": error}))).into_response();
        if let Some(s) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}

/// `GET /v1/models`: the models that generate text (decoders with a tokenizer).
pub async fn models(State(state): State<Arc<AppState>>) -> axum::Json<Value> {
    let data: Vec<Value> = state
        .service
        .models
        .iter()
        .filter(|m| m.tokenizer.is_some())
        .map(|m| json!({"id": m.config.name, "object": "model", "created": 0, "owned_by": "vramguard"}))
        .collect();
    axum::Json(json!({"object": "list", "data": data}))
}

/// `stop`: one string or up to four.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

/// What completions and chat share: how to pick tokens and when to stop. The fields OpenAI
/// documents that would change the answer and that are not supported are refused by name,
/// never ignored.
#[derive(Debug, Deserialize)]
struct Sampling {
    model: String,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<u32>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stop: Option<Stop>,
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

/// The body of `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
struct ChatRequest {
    #[serde(flatten)]
    sampling: Sampling,
    messages: Vec<Value>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    /// OpenAI's newer name for `max_tokens`.
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<u32>,
    #[serde(default)]
    response_format: Option<Value>,
}

/// Which API a generation answers.
#[derive(Debug, Clone)]
enum Api {
    Completion,
    /// Chat, with the names of the tools offered (empty: none, or `tool_choice: "none"`).
    Chat {
        tools: Vec<String>,
    },
}

/// A checked generation request: the model, its prompt's tokens and how to generate.
struct Job {
    model: String,
    api: Api,
    prompt: generate::Prompt,
    params: Params,
    stream: bool,
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(&state, &headers, body, false).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(&state, &headers, body, true).await
}

async fn serve(state: &AppState, headers: &HeaderMap, body: Result<Bytes, BytesRejection>, chat: bool) -> Response {
    let received = Instant::now();
    let id = request_id(headers);
    let result = match read_job(state, body, &id, chat) {
        Ok(job) => run(state, headers, job, &id, received).await,
        Err(error) => Err(error),
    };
    let response = match result {
        Ok(response) => response,
        Err(error) => error.into_response(),
    };
    with_request_id(response, &id)
}

/// Decode and check the body into a [`Job`].
fn read_job(state: &AppState, body: Result<Bytes, BytesRejection>, id: &str, chat: bool) -> Result<Job, OpenAiError> {
    let service = &state.service;
    let body = body.map_err(|e| OpenAiError {
        status: e.status(),
        message: e.body_text(),
        kind: "invalid_request_error",
        param: None,
        retry_after: None,
        request_id: Some(id.to_string()),
    })?;
    let (sampling, text, api, max_tokens, shorten) = if chat {
        let request: ChatRequest = serde_json::from_slice(&body)
            .map_err(|e| OpenAiError::invalid(format!("the body is not a chat completion request: {e}"), None))?;
        for (given, name) in [
            (request.logprobs == Some(true), "logprobs"),
            (request.top_logprobs.is_some(), "top_logprobs"),
            (
                request
                    .response_format
                    .as_ref()
                    .is_some_and(|f| !f.is_null() && f["type"] != "text"),
                "response_format",
            ),
        ] {
            if given {
                return Err(OpenAiError::invalid(format!("`{name}` is not supported"), Some(name)));
            }
        }
        let entry = text_model(state, &request.sampling.model, id)?;
        let template = entry.chat.clone().ok_or_else(|| {
            OpenAiError::invalid(
                format!(
                    "model `{}` has no chat template (set `models[].chat_template`, or put a tokenizer_config.json with `chat_template` beside its tokenizer); /v1/completions takes plain prompts",
                    request.sampling.model
                ),
                Some("model"),
            )
        })?;
        let messages = crate::runtime::chat::template_messages(&request.messages)
            .map_err(|e| OpenAiError::invalid(e, Some("messages")))?;
        let tools = request.tools.unwrap_or_default();
        crate::runtime::chat::check_tools(&tools).map_err(|e| OpenAiError::invalid(e, Some("tools")))?;
        // Without constrained decoding a call cannot be forced: `required` or a named function
        // is refused rather than answered with text the client did not ask for.
        let offered = match &request.tool_choice {
            None | Some(Value::Null) => !tools.is_empty(),
            Some(Value::String(c)) if c == "auto" => !tools.is_empty(),
            Some(Value::String(c)) if c == "none" => false,
            Some(_) => {
                return Err(OpenAiError::invalid(
                    "`tool_choice` may be \"auto\" or \"none\": forcing a call is not supported",
                    Some("tool_choice"),
                ));
            }
        };
        let offered_tools = offered.then_some(tools.as_slice());
        let prompt = template
            .render(&messages, offered_tools)
            .map_err(|e| OpenAiError::invalid(e, Some("messages")))?;
        let tokenizer = Arc::clone(entry.tokenizer.as_ref().expect("checked by text_model"));
        let shorten = shorten_chat(
            Arc::clone(&template),
            tokenizer,
            messages,
            offered_tools.map(<[Value]>::to_vec),
        );
        let names = if offered {
            tools
                .iter()
                .filter_map(|t| t["function"]["name"].as_str().map(str::to_string))
                .collect()
        } else {
            Vec::new()
        };
        let max_tokens = request.max_completion_tokens.or(request.sampling.max_tokens);
        let mut sampling = request.sampling;
        // The end of the assistant's turn ends the answer even where it is not a single token.
        let end = template.end_of_turn.clone();
        sampling.stop = Some(match sampling.stop.take() {
            None => Stop::Many(vec![end]),
            Some(Stop::One(s)) => Stop::Many(vec![s, end]),
            Some(Stop::Many(mut v)) => {
                if v.len() > 4 {
                    return Err(OpenAiError::invalid("`stop` takes at most 4 strings", Some("stop")));
                }
                v.push(end);
                Stop::Many(v)
            }
        });
        (sampling, prompt, Api::Chat { tools: names }, max_tokens, Some(shorten))
    } else {
        let request: CompletionRequest = serde_json::from_slice(&body)
            .map_err(|e| OpenAiError::invalid(format!("the body is not a completion request: {e}"), None))?;
        for (given, name) in [
            (request.best_of.is_some_and(|n| n != 1), "best_of"),
            (request.echo == Some(true), "echo"),
            (request.logprobs.as_ref().is_some_and(|v| !v.is_null()), "logprobs"),
            (request.suffix.is_some(), "suffix"),
        ] {
            if given {
                return Err(OpenAiError::invalid(format!("`{name}` is not supported"), Some(name)));
            }
        }
        text_model(state, &request.sampling.model, id)?;
        let prompt = match &request.prompt {
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
        (request.sampling, prompt, Api::Completion, max_tokens, None)
    };
    let stream = sampling.stream == Some(true);
    for (given, name) in [
        (sampling.n.is_some_and(|n| n != 1), "n"),
        (sampling.presence_penalty.is_some_and(|p| p != 0.0), "presence_penalty"),
        (
            sampling.frequency_penalty.is_some_and(|p| p != 0.0),
            "frequency_penalty",
        ),
        (
            sampling.logit_bias.as_ref().is_some_and(|b| !b.is_empty()),
            "logit_bias",
        ),
    ] {
        if given {
            return Err(OpenAiError::invalid(format!("`{name}` is not supported"), Some(name)));
        }
    }
    let max_tokens = max_tokens.unwrap_or(16);
    if max_tokens == 0 {
        return Err(OpenAiError::invalid(
            "`max_tokens` must be at least 1",
            Some("max_tokens"),
        ));
    }
    let temperature = sampling.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(OpenAiError::invalid(
            "`temperature` must be between 0 and 2",
            Some("temperature"),
        ));
    }
    let top_p = sampling.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(OpenAiError::invalid(
            "`top_p` must be greater than 0 and at most 1",
            Some("top_p"),
        ));
    }
    let stop = match sampling.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.iter().any(String::is_empty) {
        return Err(OpenAiError::invalid("`stop` strings must not be empty", Some("stop")));
    }
    let entry = service.model(&sampling.model).expect("checked by text_model");
    let tokenizer = entry.tokenizer.as_ref().expect("checked by text_model");
    let encoding = tokenizer
        .encode(text.as_str(), false)
        .map_err(|e| OpenAiError::invalid(format!("the prompt cannot be tokenized: {e}"), Some("prompt")))?;
    let tokens = encoding.get_ids().to_vec();
    if tokens.is_empty() {
        return Err(OpenAiError::invalid(
            "the prompt is empty",
            Some(if chat { "messages" } else { "prompt" }),
        ));
    }
    let params = Params {
        max_tokens,
        temperature,
        top_p,
        top_k: sampling.top_k.unwrap_or(0),
        // Without a seed, one from the request id: still the same tokens if it is retried.
        seed: sampling.seed.unwrap_or_else(|| {
            id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
            })
        }),
        stop,
        tools: matches!(&api, Api::Chat { tools } if !tools.is_empty()),
    };
    // A completion is cut from its start; a chat by whole turns.
    let mut prompt = generate::Prompt::from(tokens);
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

/// How a chat is shortened: the system messages stay, and the oldest turns after them go,
/// whole (a turn starts at a user message), until the prompt fits; the latest turn always stays.
fn shorten_chat(
    template: Arc<crate::runtime::chat::ChatTemplate>,
    tokenizer: Arc<tokenizers::Tokenizer>,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
) -> generate::Shorten {
    Arc::new(move |to: u64| {
        let system = messages.iter().take_while(|m| m["role"] == "system").count();
        let starts: Vec<usize> = (system + 1..messages.len())
            .filter(|&i| messages[i]["role"] == "user")
            .collect();
        let mut shortest = None;
        for start in starts {
            let kept: Vec<Value> = messages[..system].iter().chain(&messages[start..]).cloned().collect();
            let text = template.render(&kept, tools.as_deref())?;
            let ids = tokenizer
                .encode(text.as_str(), false)
                .map_err(|e| format!("the shortened chat cannot be tokenized: {e}"))?
                .get_ids()
                .to_vec();
            if ids.len() as u64 <= to {
                let cut = format!(
                    "{} of {} messages: the oldest turns after the system prompt",
                    start - system,
                    messages.len()
                );
                return Ok((ids, cut));
            }
            shortest = Some(ids.len());
        }
        Err(match shortest {
            Some(n) => format!("the system prompt and the latest turn alone take {n} tokens"),
            None => "the chat has a single turn, and turns are cut whole".to_string(),
        })
    })
}

/// The model named, if it generates text.
fn text_model<'a>(
    state: &'a AppState,
    model: &str,
    id: &str,
) -> Result<&'a crate::serve::service::ModelEntry, OpenAiError> {
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

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Run a checked job and answer it, streamed or whole.
async fn run(
    state: &AppState,
    headers: &HeaderMap,
    job: Job,
    id: &str,
    received: Instant,
) -> Result<Response, OpenAiError> {
    let service = &state.service;
    let mut base =
        decode_headers(service, &job.model, id, headers, received).map_err(|e| OpenAiError::from_request(&e, id))?;
    let entry = service.model(&job.model).expect("checked by text_model");
    // Cutting a prompt changes the answer: only when the client (or the model's config) allows.
    base.meta.allow_shrink = header_value::<bool>(headers, ALLOW_SHRINK_HEADER, "`true` or `false`")
        .map_err(|e| OpenAiError::from_request(&e, id))?
        .unwrap_or(entry.config.allow_shrink);
    let tokenizer = Arc::clone(entry.tokenizer.as_ref().expect("checked by text_model"));
    if job.stream {
        return streamed(state, job, id, base, tokenizer).await;
    }
    let generated = generate::generate(service, entry, job.prompt, &job.params, base, None)
        .await
        .map_err(|refused| {
            let degraded = service.degraded.now();
            let mut error = OpenAiError::from_request(&refused.error, id);
            if let Some(d) = degraded {
                error.message = format!("{} (degraded: {})", error.message, d.reason);
            }
            error
        })?;
    let completion = generated.tokens.len();
    let usage = json!({"prompt_tokens": generated.prompt_tokens, "completion_tokens": completion,
                       "total_tokens": generated.prompt_tokens + completion});
    let body = match &job.api {
        Api::Completion => json!({
            "id": format!("cmpl-{id}"),
            "object": "text_completion",
            "created": unix_now(),
            "model": job.model,
            "choices": [{"text": generated.text, "index": 0, "logprobs": null,
                         "finish_reason": generated.finish.label()}],
            "usage": usage,
        }),
        Api::Chat { tools } => {
            let offered: Vec<&str> = tools.iter().map(String::as_str).collect();
            let (prose, calls) = crate::runtime::chat::split_tool_calls(&generated.text, &offered);
            let mut message = json!({"role": "assistant", "content": prose});
            let finish = if calls.is_empty() {
                generated.finish.label()
            } else {
                let prose = prose.trim();
                message["content"] = if prose.is_empty() { Value::Null } else { json!(prose) };
                message["tool_calls"] = tool_calls_json(&calls, id);
                "tool_calls"
            };
            json!({
                "id": format!("chatcmpl-{id}"),
                "object": "chat.completion",
                "created": unix_now(),
                "model": job.model,
                "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}],
                "usage": usage,
            })
        }
    };
    let mut response = axum::Json(body).into_response();
    let out = response.headers_mut();
    out.insert(
        HeaderName::from_static(DECISION_HEADER),
        HeaderValue::from_static(generated.action.label()),
    );
    pool_headers(out, &generated.pool, service.degraded.now().as_ref());
    if let Some((from, to, cut)) = &generated.shrunk {
        shrink_headers(out, *from, *to, cut);
    }
    Ok(response)
}

/// Says that the prompt was cut from `from` to `to` tokens, and what went.
fn shrink_headers(headers: &mut HeaderMap, from: u64, to: u64, cut: &str) {
    if let Ok(v) = HeaderValue::from_str(&format!("{from}->{to}")) {
        headers.insert(HeaderName::from_static(CONTEXT_HEADER), v);
    }
    if let Ok(v) = HeaderValue::from_str(cut) {
        headers.insert(HeaderName::from_static(CONTEXT_CUT_HEADER), v);
    }
}

/// OpenAI's `tool_calls`, each with an id unique to the request.
fn tool_calls_json(calls: &[crate::runtime::chat::ToolCall], id: &str) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"id": format!("call_{i}_{id}"), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}})
            })
            .collect(),
    )
}

/// One server-sent event carrying `value` as JSON.
fn event(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// Text that can be sent now: all of `text` but an unfinished UTF-8 sequence at its end and
/// any tail that could still become one of the stop strings.
fn sendable<'a>(text: &'a str, stop: &[String]) -> &'a str {
    let mut end = text.trim_end_matches('\u{FFFD}').len();
    // Nothing from a stop string on: the text ends before it.
    if let Some(at) = stop.iter().filter_map(|s| text.find(s.as_str())).min() {
        end = end.min(at);
    }
    for s in stop {
        // The longest end of the text that is a beginning of the stop string waits.
        for k in (1..s.len().min(end + 1)).rev() {
            if text.is_char_boundary(end - k) && s.starts_with(&text[end - k..end]) {
                end -= k;
                break;
            }
        }
    }
    &text[..end]
}

/// A generation running in its own task: its tokens as they come, and its end.
type Running = (
    tokio::sync::mpsc::Receiver<generate::Token>,
    tokio::task::JoinHandle<Result<generate::Generated, crate::serve::lifecycle::Refused>>,
);

/// `stream: true`: run the prompt first, so a refusal before the first token is an ordinary
/// error response; then stream each piece of text as it is generated. A reader that goes away
/// drops the stream and with it the channel: the generation stops at its next token and is
/// counted `cancelled`.
async fn streamed(
    state: &AppState,
    job: Job,
    id: &str,
    base: crate::serve::lifecycle::Request,
    tokenizer: Arc<tokenizers::Tokenizer>,
) -> Result<Response, OpenAiError> {
    let service = Arc::clone(&state.service);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<generate::Token>(64);
    let task = tokio::spawn({
        let service = Arc::clone(&service);
        let model = job.model.clone();
        let params = job.params.clone();
        let prompt = job.prompt;
        async move {
            let entry = service.model(&model).expect("checked before");
            generate::generate(&service, entry, prompt, &params, base, Some(tx)).await
        }
    });
    // Text from a tool call's start on waits for the end, when the calls are read back.
    let mut held = job.params.stop.clone();
    if matches!(&job.api, Api::Chat { tools } if !tools.is_empty()) {
        held.push(crate::runtime::chat::TOOL_CALL_OPEN.to_string());
    }
    let stream = Stream {
        tokens: Vec::new(),
        sent: 0,
        running: None,
        finished: None,
        done: false,
        pool: None,
        held,
        api: job.api,
        id: id.to_string(),
        model: job.model,
        created: unix_now(),
        tokenizer,
        service,
    };
    // Until the first token, a failure is an ordinary error response. The channel closes
    // without a token only when the generation ended before sending one.
    match rx.recv().await {
        Some(first) => {
            let pool = Arc::clone(&first.pool);
            let mut stream = Stream {
                tokens: vec![first.id],
                running: Some((rx, task)),
                ..stream
            };
            let opening = stream.opening(&pool, first.shrunk.as_deref());
            Ok(sse(stream, opening, &pool, first.shrunk.as_deref()))
        }
        None => match task.await {
            Ok(Err(refused)) => Err(OpenAiError::from_request(&refused.error, id)),
            // Ended before any token (the end-of-text token came first): only the last chunk.
            Ok(Ok(generated)) => {
                let pool = Arc::clone(&generated.pool);
                let shrunk = generated.shrunk.clone();
                let mut stream = Stream {
                    finished: Some(Ok(generated)),
                    ..stream
                };
                let opening = stream.opening(&pool, shrunk.as_ref());
                Ok(sse(stream, opening, &pool, shrunk.as_ref()))
            }
            Err(e) => Err(OpenAiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: format!("the generation task failed: {e}"),
                kind: "server_error",
                param: None,
                retry_after: None,
                request_id: Some(id.to_string()),
            }),
        },
    }
}

/// The state of a streamed completion.
struct Stream {
    tokens: Vec<u32>,
    /// Bytes of text already sent.
    sent: usize,
    running: Option<Running>,
    finished: Option<Result<generate::Generated, crate::serve::lifecycle::Refused>>,
    done: bool,
    /// The pool the last token came from, once the first chunk has named it.
    pool: Option<String>,
    /// Strings whose text waits: the stop strings, and a tool call's opening tag.
    held: Vec<String>,
    api: Api,
    id: String,
    model: String,
    created: u64,
    tokenizer: Arc<tokenizers::Tokenizer>,
    service: Arc<crate::serve::service::Service>,
}

impl Stream {
    /// One chunk: `text` (chat: the delta's `content`), and at the end why and the usage.
    fn chunk(&self, delta: Value, finish: Option<&str>, usage: Option<Value>) -> Value {
        let mut value = match &self.api {
            Api::Completion => json!({
                "id": format!("cmpl-{}", self.id), "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"text": delta, "index": 0, "logprobs": null, "finish_reason": finish}],
            }),
            Api::Chat { .. } => json!({
                "id": format!("chatcmpl-{}", self.id), "object": "chat.completion.chunk",
                "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": if delta.is_object() { delta } else { json!({"content": delta}) },
                             "logprobs": null, "finish_reason": finish}],
            }),
        };
        if let Some(usage) = usage {
            value["usage"] = usage;
        }
        value
    }

    /// The first chunk: chat's assistant role (completions: empty text), with the serving
    /// pool's facts.
    fn opening(&mut self, pool: &Arc<Pool>, shrunk: Option<&(u64, u64, String)>) -> Bytes {
        let delta = match self.api {
            Api::Completion => json!(""),
            Api::Chat { .. } => json!({"role": "assistant", "content": ""}),
        };
        let mut value = self.chunk(delta, None, None);
        value["vramguard"] = self.facts(pool);
        if let Some((from, to, cut)) = shrunk {
            value["vramguard"]["context"] = json!({"from": from, "to": to, "cut": cut});
        }
        event(&value)
    }

    /// Which pool serves the stream and, while degraded, why, its limits and expected delay.
    fn facts(&mut self, pool: &Arc<Pool>) -> Value {
        self.pool = Some(pool.name().to_string());
        pool_facts(pool, self.service.degraded.now().as_ref())
    }

    /// The next bytes to send, or `None` when the stream is over.
    async fn next(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        loop {
            if self.finished.is_none() {
                let text = self.tokenizer.decode(&self.tokens, true).unwrap_or_default();
                let ready = sendable(&text, &self.held);
                if ready.len() > self.sent {
                    let piece = ready[self.sent..].to_string();
                    self.sent = ready.len();
                    return Some(event(&self.chunk(json!(piece), None, None)));
                }
            }
            if let Some(result) = self.finished.take() {
                self.done = true;
                let mut out = match result {
                    Ok(generated) => self.last(&generated),
                    Err(refused) => {
                        let error = OpenAiError::from_request(&refused.error, &self.id);
                        event(&json!({"error": {
                            "message": format!("{}; {} tokens had been sent, and nothing was replayed", error.message, self.tokens.len()),
                            "type": error.kind, "param": null, "code": null,
                            "request_id": self.id,
                            "tokens_sent": self.tokens.len(),
                            "resume": "send the prompt followed by the text received so far, with max_tokens reduced by tokens_sent",
                        }}))
                        .to_vec()
                    }
                };
                out.extend_from_slice(b"data: [DONE]\n\n");
                return Some(Bytes::from(out));
            }
            let (rx, task) = self.running.as_mut()?;
            match rx.recv().await {
                Some(token) => {
                    self.tokens.push(token.id);
                    // Moved to another pool (a failover mid-stream): say so in the next chunk.
                    if self.pool.as_deref() != Some(token.pool.name()) {
                        let text = self.tokenizer.decode(&self.tokens, true).unwrap_or_default();
                        let ready = sendable(&text, &self.held);
                        let piece = ready.get(self.sent..).unwrap_or_default().to_string();
                        self.sent = self.sent.max(ready.len());
                        let mut value = self.chunk(json!(piece), None, None);
                        value["vramguard"] = self.facts(&token.pool);
                        return Some(event(&value));
                    }
                }
                None => {
                    let result = match task.await {
                        Ok(result) => result,
                        Err(e) => {
                            tracing::warn!(request_id = %self.id, error = %e, "the generation task failed");
                            Err(crate::serve::lifecycle::Refused {
                                pool: None,
                                error: RequestError::Failed { pool: String::new() },
                            })
                        }
                    };
                    self.finished = Some(result);
                    self.running = None;
                }
            }
        }
    }

    /// The rest of the text, chat's tool calls, why it ended and the usage.
    fn last(&self, generated: &generate::Generated) -> Vec<u8> {
        let usage = json!({"prompt_tokens": generated.prompt_tokens,
                           "completion_tokens": generated.tokens.len(),
                           "total_tokens": generated.prompt_tokens + generated.tokens.len()});
        let offered: Vec<&str> = match &self.api {
            Api::Chat { tools } => tools.iter().map(String::as_str).collect(),
            Api::Completion => Vec::new(),
        };
        let (prose, calls) = if offered.is_empty() {
            (generated.text.clone(), Vec::new())
        } else {
            crate::runtime::chat::split_tool_calls(&generated.text, &offered)
        };
        let rest = prose.get(self.sent..).unwrap_or_default();
        if calls.is_empty() {
            return event(&self.chunk(json!(rest), Some(generated.finish.label()), Some(usage))).to_vec();
        }
        let mut out = Vec::new();
        if !rest.trim().is_empty() {
            out.extend_from_slice(&event(&self.chunk(json!(rest.trim_end()), None, None)));
        }
        let mut calls = tool_calls_json(&calls, &self.id);
        for (i, call) in calls.as_array_mut().into_iter().flatten().enumerate() {
            call["index"] = json!(i);
        }
        out.extend_from_slice(&event(&self.chunk(json!({"tool_calls": calls}), None, None)));
        out.extend_from_slice(&event(&self.chunk(json!({}), Some("tool_calls"), Some(usage))));
        out
    }
}

fn sse(stream: Stream, opening: Bytes, pool: &Pool, shrunk: Option<&(u64, u64, String)>) -> Response {
    let degraded = stream.service.degraded.now();
    let rest = futures_util::stream::unfold(stream, |mut stream| async move {
        let bytes = stream.next().await?;
        Some((Ok::<_, std::convert::Infallible>(bytes), stream))
    });
    let first = futures_util::stream::once(async move { Ok::<_, std::convert::Infallible>(opening) });
    let mut response = axum::body::Body::from_stream(first.chain(rest)).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    pool_headers(headers, pool, degraded.as_ref());
    if let Some((from, to, cut)) = shrunk {
        shrink_headers(headers, *from, *to, cut);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_that_may_become_a_stop_string_or_is_an_unfinished_character_waits() {
        let stop = vec![" GPU".to_string()];
        assert_eq!(sendable("hello", &stop), "hello");
        assert_eq!(sendable("hello G", &stop), "hello");
        assert_eq!(sendable("hello GP", &stop), "hello");
        assert_eq!(sendable("hello Gx", &stop), "hello Gx");
        assert_eq!(sendable("hello GPUs", &stop), "hello");
        assert_eq!(sendable("caf\u{FFFD}", &[]), "caf");
    }

    #[test]
    fn a_tool_call_waits_from_its_opening_tag_on() {
        let held = vec![crate::runtime::chat::TOOL_CALL_OPEN.to_string()];
        assert_eq!(sendable("Let me check. <tool", &held), "Let me check. ");
        assert_eq!(sendable("Let me check. <tool_call>{\"name\"", &held), "Let me check. ");
        assert_eq!(sendable("a <b>", &held), "a <b>");
    }
}
