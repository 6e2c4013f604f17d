//! OpenAI-compatible text generation: `GET /v1/models` and `POST /v1/completions`, with
//! errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`), so clients
//! built on the `openai` package work unchanged. Generation itself is [`crate::generate`].
//!
//! `stream: true` answers with server-sent events: one chunk per piece of text, the last with
//! `finish_reason` and `usage`, then `data: [DONE]`. An error before the first token is an
//! ordinary error response; after it, a final `error` event with the request id, the tokens
//! already sent and how to resume, never a silent replay. Not yet: `/v1/chat/completions`.

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

use super::{AppState, DECISION_HEADER, DEGRADED_HEADER, POOL_HEADER};
use crate::generate::{self, Params};
use crate::lifecycle::RequestError;

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
        let status = error.status();
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

/// The body of `POST /v1/completions`. The fields OpenAI documents that would change the
/// answer and that are not supported are refused by name, never ignored.
#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: String,
    prompt: Value,
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
    echo: Option<bool>,
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    best_of: Option<u32>,
    #[serde(default)]
    suffix: Option<String>,
    #[serde(default)]
    presence_penalty: Option<f32>,
    #[serde(default)]
    frequency_penalty: Option<f32>,
    #[serde(default)]
    logit_bias: Option<serde_json::Map<String, Value>>,
    // Other fields (`user`, `stream_options`) do not change the answer and are ignored.
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let received = Instant::now();
    let id = super::request_id(&headers);
    let response = match complete(&state, &headers, body, &id, received).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    };
    super::with_request_id(response, &id)
}

async fn complete(
    state: &AppState,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    id: &str,
    received: Instant,
) -> Result<Response, OpenAiError> {
    let service = &state.service;
    let body = body.map_err(|e| OpenAiError {
        status: e.status(),
        message: e.body_text(),
        kind: "invalid_request_error",
        param: None,
        retry_after: None,
        request_id: Some(id.to_string()),
    })?;
    let request: CompletionRequest = serde_json::from_slice(&body)
        .map_err(|e| OpenAiError::invalid(format!("the body is not a completion request: {e}"), None))?;
    let entry = service.model(&request.model).ok_or_else(|| {
        let error = RequestError::unknown_model(service, &request.model);
        OpenAiError {
            param: Some("model"),
            ..OpenAiError::from_request(&error, id)
        }
    })?;
    let (Some(_), Some(tokenizer)) = (entry.decoder, entry.tokenizer.clone()) else {
        return Err(OpenAiError::invalid(
            format!(
                "model `{}` does not generate text (it needs a decoder with past key values and `models[].tokenizer`)",
                request.model
            ),
            Some("model"),
        ));
    };
    let prompt = match &request.prompt {
        Value::String(text) => text.clone(),
        Value::Array(items) if items.len() == 1 && items[0].is_string() => {
            items[0].as_str().unwrap_or_default().to_string()
        }
        _ => return Err(OpenAiError::invalid("`prompt` must be one string", Some("prompt"))),
    };
    let stream = request.stream == Some(true);
    for (given, name) in [
        (request.n.is_some_and(|n| n != 1), "n"),
        (request.best_of.is_some_and(|n| n != 1), "best_of"),
        (request.echo == Some(true), "echo"),
        (request.logprobs.as_ref().is_some_and(|v| !v.is_null()), "logprobs"),
        (request.suffix.is_some(), "suffix"),
        (request.presence_penalty.is_some_and(|p| p != 0.0), "presence_penalty"),
        (request.frequency_penalty.is_some_and(|p| p != 0.0), "frequency_penalty"),
        (request.logit_bias.as_ref().is_some_and(|b| !b.is_empty()), "logit_bias"),
    ] {
        if given {
            return Err(OpenAiError::invalid(format!("`{name}` is not supported"), None));
        }
    }
    let max_tokens = request.max_tokens.unwrap_or(16);
    if max_tokens == 0 {
        return Err(OpenAiError::invalid(
            "`max_tokens` must be at least 1",
            Some("max_tokens"),
        ));
    }
    let temperature = request.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(OpenAiError::invalid(
            "`temperature` must be between 0 and 2",
            Some("temperature"),
        ));
    }
    let top_p = request.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(OpenAiError::invalid(
            "`top_p` must be greater than 0 and at most 1",
            Some("top_p"),
        ));
    }
    let stop = match request.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) if v.len() <= 4 => v,
        Some(Stop::Many(_)) => return Err(OpenAiError::invalid("`stop` takes at most 4 strings", Some("stop"))),
    };
    if stop.iter().any(String::is_empty) {
        return Err(OpenAiError::invalid("`stop` strings must not be empty", Some("stop")));
    }
    let encoding = tokenizer
        .encode(prompt.as_str(), false)
        .map_err(|e| OpenAiError::invalid(format!("the prompt cannot be tokenized: {e}"), Some("prompt")))?;
    let prompt_ids = encoding.get_ids().to_vec();
    if prompt_ids.is_empty() {
        return Err(OpenAiError::invalid("`prompt` is empty", Some("prompt")));
    }
    let params = Params {
        max_tokens,
        temperature,
        top_p,
        top_k: request.top_k.unwrap_or(0),
        // Without a seed, one from the request id: still the same tokens if it is retried.
        seed: request.seed.unwrap_or_else(|| {
            id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
            })
        }),
        stop,
    };
    let base = super::decode_headers(service, &request.model, id, headers, received)
        .map_err(|e| OpenAiError::from_request(&e, id))?;
    if stream {
        return streamed(state, &request.model, id, prompt_ids, params, base, tokenizer).await;
    }
    let generated = generate::generate(service, entry, prompt_ids, &params, base, None)
        .await
        .map_err(|refused| {
            let degraded = service.degraded.now();
            let mut error = OpenAiError::from_request(&refused.error, id);
            if let Some(d) = degraded {
                error.message = format!("{} (degraded: {})", error.message, d.reason);
            }
            error
        })?;
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let completion = generated.tokens.len();
    let mut response = axum::Json(json!({
        "id": format!("cmpl-{id}"),
        "object": "text_completion",
        "created": created,
        "model": request.model,
        "choices": [{"text": generated.text, "index": 0, "logprobs": null,
                     "finish_reason": generated.finish.label()}],
        "usage": {"prompt_tokens": generated.prompt_tokens, "completion_tokens": completion,
                  "total_tokens": generated.prompt_tokens + completion},
    }))
    .into_response();
    let out = response.headers_mut();
    out.insert(
        HeaderName::from_static(DECISION_HEADER),
        HeaderValue::from_static(generated.action.label()),
    );
    if let Ok(v) = HeaderValue::from_str(generated.pool.name()) {
        out.insert(HeaderName::from_static(POOL_HEADER), v);
    }
    if let Some(v) = service
        .degraded
        .now()
        .and_then(|d| HeaderValue::from_str(&d.reason).ok())
    {
        out.insert(HeaderName::from_static(DEGRADED_HEADER), v);
    }
    Ok(response)
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
    tokio::sync::mpsc::Receiver<u32>,
    tokio::task::JoinHandle<Result<generate::Generated, crate::lifecycle::Refused>>,
);

/// `stream: true`: run the prompt first, so a refusal before the first token is an ordinary
/// error response; then stream each piece of text as it is generated. A reader that goes away
/// drops the stream and with it the channel: the generation stops at its next token and is
/// counted `cancelled`.
async fn streamed(
    state: &AppState,
    model: &str,
    id: &str,
    prompt: Vec<u32>,
    params: Params,
    base: crate::lifecycle::Request,
    tokenizer: Arc<tokenizers::Tokenizer>,
) -> Result<Response, OpenAiError> {
    let service = Arc::clone(&state.service);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<u32>(64);
    let task = tokio::spawn({
        let service = Arc::clone(&service);
        let model = model.to_string();
        let params = params.clone();
        async move {
            let entry = service.model(&model).expect("checked before");
            generate::generate(&service, entry, prompt, &params, base, Some(tx)).await
        }
    });
    let stream = Stream {
        tokens: Vec::new(),
        sent: 0,
        running: None,
        finished: None,
        done: false,
        params,
        id: id.to_string(),
        model: model.to_string(),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        tokenizer,
    };
    // Until the first token, a failure is an ordinary error response. The channel closes
    // without a token only when the generation ended before sending one.
    match rx.recv().await {
        Some(first) => Ok(sse(Stream {
            tokens: vec![first],
            running: Some((rx, task)),
            ..stream
        })),
        None => match task.await {
            Ok(Err(refused)) => Err(OpenAiError::from_request(&refused.error, id)),
            // Ended before any token (the end-of-text token came first): only the last chunk.
            Ok(Ok(generated)) => Ok(sse(Stream {
                finished: Some(Ok(generated)),
                ..stream
            })),
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
    finished: Option<Result<generate::Generated, crate::lifecycle::Refused>>,
    done: bool,
    params: Params,
    id: String,
    model: String,
    created: u64,
    tokenizer: Arc<tokenizers::Tokenizer>,
}

impl Stream {
    fn chunk(&self, text: &str, finish: Option<&str>, usage: Option<Value>) -> Bytes {
        let mut value = json!({
            "id": format!("cmpl-{}", self.id), "object": "text_completion", "created": self.created,
            "model": self.model,
            "choices": [{"text": text, "index": 0, "logprobs": null, "finish_reason": finish}],
        });
        if let Some(usage) = usage {
            value["usage"] = usage;
        }
        event(&value)
    }

    /// The next bytes to send, or `None` when the stream is over.
    async fn next(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        loop {
            if self.finished.is_none() {
                let text = self.tokenizer.decode(&self.tokens, true).unwrap_or_default();
                let ready = sendable(&text, &self.params.stop);
                if ready.len() > self.sent {
                    let piece = ready[self.sent..].to_string();
                    self.sent = ready.len();
                    return Some(self.chunk(&piece, None, None));
                }
            }
            if let Some(result) = self.finished.take() {
                self.done = true;
                let mut out = match result {
                    Ok(generated) => {
                        let rest = generated.text.get(self.sent..).unwrap_or_default().to_string();
                        let usage = json!({"prompt_tokens": generated.prompt_tokens,
                                           "completion_tokens": generated.tokens.len(),
                                           "total_tokens": generated.prompt_tokens + generated.tokens.len()});
                        self.chunk(&rest, Some(generated.finish.label()), Some(usage)).to_vec()
                    }
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
                Some(token) => self.tokens.push(token),
                None => {
                    let result = match task.await {
                        Ok(result) => result,
                        Err(e) => {
                            tracing::warn!(request_id = %self.id, error = %e, "the generation task failed");
                            Err(crate::lifecycle::Refused {
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
}

fn sse(stream: Stream) -> Response {
    let body = futures_util::stream::unfold(stream, |mut stream| async move {
        let bytes = stream.next().await?;
        Some((Ok::<_, std::convert::Infallible>(bytes), stream))
    });
    let mut response = axum::body::Body::from_stream(body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
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
}
