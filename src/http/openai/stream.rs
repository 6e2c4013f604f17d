//! `stream: true`: the answer as server-sent events, one chunk per piece of text, the last with
//! `finish_reason` and `usage`, then `data: [DONE]`. The first chunk names the serving pool; an
//! error after it is a final `error` event saying what was sent and how to resume. The text
//! comes finished from the generation ([`generation::Delta`]): this file only formats it.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{Value, json};

use super::chat::tool_calls_json;
use super::error::OpenAiError;
use super::job::{Api, Job};
use super::logprobs;
use super::run::{Resend, generate};
use crate::http::headers::{model_header, pool_facts, pool_headers, shrink_headers};
use crate::http::state::AppState;
use crate::pool::Pool;
use crate::serve::generation;
use crate::serve::lifecycle::RequestError;

/// Seconds since the epoch, for a completion's `created`.
pub(super) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// One server-sent event carrying `value` as JSON.
fn event(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// A generation running in its own task: its deltas as they come, and its end.
type Running = (
    tokio::sync::mpsc::Receiver<generation::Delta>,
    tokio::task::JoinHandle<Result<generation::Generated, crate::serve::lifecycle::Refused>>,
);

/// `stream: true`: run the prompt first, so a refusal before the first token is an ordinary
/// error response; then stream each piece of text as it is generated. A reader that goes away
/// drops the stream and with it the channel: the generation stops at its next token and is
/// counted `cancelled`. The first delta names the model that answers (its fallback, when that
/// stood in).
pub(super) async fn streamed(
    state: &AppState,
    job: Job,
    id: &str,
    base: crate::serve::lifecycle::Request,
    resend: Option<Resend>,
) -> Result<Response, OpenAiError> {
    let service = Arc::clone(&state.service);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<generation::Delta>(64);
    let task = tokio::spawn({
        let service = Arc::clone(&service);
        let model = job.model.clone();
        let params = job.params.clone();
        let prompt = job.prompt;
        let id = id.to_string();
        async move { generate(&service, (&model, prompt, &params), base, &id, Some(tx), resend).await }
    });
    let asked = job.params.logprobs.is_some();
    let stream = |source: &Arc<generation::Source>| Stream::new(service, job.api, id, Arc::clone(source), asked);
    // Until the first delta, a failure is an ordinary error response. The channel closes
    // without one only when the generation ended before picking a token it sends.
    match rx.recv().await {
        Some(mut first) => {
            let facts = first.facts.take().expect("the first delta says where it ran");
            let mut stream = Stream {
                running: Some((rx, task)),
                ..stream(&facts.source)
            };
            stream.take(first);
            let opening = stream.opening(&facts.pool, facts.shrunk.as_ref());
            Ok(sse(stream, opening, &facts.pool, facts.shrunk.as_ref()))
        }
        None => match task.await {
            Ok(Err(refused)) => Err(OpenAiError::from_request(&refused.error, id)),
            // Ended before any token (the end-of-text token came first): only the last chunk.
            Ok(Ok(generated)) => {
                let pool = Arc::clone(&generated.pool);
                let shrunk = generated.shrunk.clone();
                let source = Arc::clone(&generated.source);
                let stream = Stream {
                    finished: Some(Ok(generated)),
                    ..stream(&source)
                };
                let opening = stream.opening(&pool, shrunk.as_ref());
                Ok(sse(stream, opening, &pool, shrunk.as_ref()))
            }
            Err(e) => Err(OpenAiError::internal(format!("the generation task failed: {e}"), id)),
        },
    }
}

/// The state of a streamed completion.
struct Stream {
    /// Text received and not sent yet.
    unsent: String,
    /// Bytes of text already sent.
    sent: usize,
    /// Deltas received: one per token.
    tokens: usize,
    /// When the request asks for log-probabilities, how its model's tokens read as bytes.
    bytes: Option<crate::runtime::text::TokenBytes>,
    /// Log-probabilities received and not sent yet: of the tokens whose text is all in what
    /// was received.
    logprobs: Vec<generation::TokenLogprobs>,
    /// Log-probabilities already sent.
    logprobs_sent: usize,
    running: Option<Running>,
    finished: Option<Result<generation::Generated, crate::serve::lifecycle::Refused>>,
    done: bool,
    api: Api,
    id: String,
    /// The model that answers.
    source: Arc<generation::Source>,
    created: u64,
    service: Arc<crate::serve::service::Service>,
}

impl Stream {
    /// A stream of `source`'s text, nothing sent yet, with the tokens' log-probabilities when
    /// `logprobs` asks for them.
    fn new(
        service: Arc<crate::serve::service::Service>,
        api: Api,
        id: &str,
        source: Arc<generation::Source>,
        logprobs: bool,
    ) -> Stream {
        Stream {
            unsent: String::new(),
            sent: 0,
            tokens: 0,
            bytes: logprobs
                .then(|| logprobs::token_bytes(&service, &source.model))
                .flatten(),
            logprobs: Vec::new(),
            logprobs_sent: 0,
            running: None,
            finished: None,
            done: false,
            api,
            id: id.to_string(),
            source,
            created: unix_now(),
            service,
        }
    }

    /// Take a delta: one more token, its text and the log-probabilities it completes to send.
    fn take(&mut self, delta: generation::Delta) {
        self.tokens += 1;
        self.unsent.push_str(&delta.text);
        self.logprobs.extend(delta.logprobs);
    }

    /// The text not sent yet, now counted as sent.
    fn piece(&mut self) -> String {
        self.sent += self.unsent.len();
        std::mem::take(&mut self.unsent)
    }

    /// A chunk carrying the text `piece` (see [`Stream::chunk`]) and, when they are asked for,
    /// the log-probabilities of `tokens`, now counted as sent.
    fn carrying(
        &mut self,
        piece: Value,
        tokens: &[generation::TokenLogprobs],
        finish: Option<&str>,
        usage: Option<Value>,
    ) -> Value {
        let mut value = self.chunk(piece, finish, usage);
        if let Some(bytes) = &self.bytes {
            value["choices"][0]["logprobs"] = match self.api {
                Api::Completion => logprobs::completion(bytes, tokens),
                Api::Chat { .. } => logprobs::chat(bytes, tokens),
            };
            self.logprobs_sent += tokens.len();
        }
        value
    }

    /// The text and log-probabilities received and not sent yet, as a chunk.
    fn pending(&mut self) -> Value {
        let piece = self.piece();
        let tokens = std::mem::take(&mut self.logprobs);
        self.carrying(json!(piece), &tokens, None, None)
    }

    /// One chunk: `text` (chat: the delta's `content`), and at the end why and the usage.
    fn chunk(&self, delta: Value, finish: Option<&str>, usage: Option<Value>) -> Value {
        let mut value = match &self.api {
            Api::Completion => json!({
                "id": format!("cmpl-{}", self.id), "object": "text_completion", "created": self.created,
                "model": self.source.model,
                "choices": [{"text": delta, "index": 0, "logprobs": null, "finish_reason": finish}],
            }),
            Api::Chat { .. } => json!({
                "id": format!("chatcmpl-{}", self.id), "object": "chat.completion.chunk",
                "created": self.created, "model": self.source.model,
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
    fn opening(&self, pool: &Arc<Pool>, shrunk: Option<&(u64, u64, String)>) -> Bytes {
        let delta = match self.api {
            Api::Completion => json!(""),
            Api::Chat { .. } => json!({"role": "assistant", "content": ""}),
        };
        let mut value = self.chunk(delta, None, None);
        value["vramguard"] = self.facts(pool);
        value["vramguard"]["model"] = json!(self.source.model);
        if let Some(s) = &self.source.substitution {
            value["vramguard"]["requested_model"] = json!(s.requested);
            value["vramguard"]["substituted"] = json!(format!("{:?}", s.reason));
        }
        if let Some((from, to, cut)) = shrunk {
            value["vramguard"]["context"] = json!({"from": from, "to": to, "cut": cut});
        }
        event(&value)
    }

    /// Which pool serves the stream and, while degraded mode reduces it, why, its limits and
    /// expected delay.
    fn facts(&self, pool: &Arc<Pool>) -> Value {
        pool_facts(pool, self.degraded_on(pool).as_ref())
    }

    /// Degraded mode as the stream's answer from `pool` carries it (for the model asked for).
    fn degraded_on(&self, pool: &Pool) -> Option<crate::pool::degraded::Now> {
        let requested = self
            .source
            .substitution
            .as_ref()
            .map_or(&self.source.model, |s| &s.requested);
        self.service.degraded.for_answer(pool, requested)
    }

    /// The next bytes to send, or `None` when the stream is over.
    async fn next(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        loop {
            if self.finished.is_none() && !self.unsent.is_empty() {
                return Some(event(&self.pending()));
            }
            if let Some(result) = self.finished.take() {
                self.done = true;
                let mut out = match result {
                    Ok(generated) => self.last(&generated),
                    Err(refused) => {
                        let error = OpenAiError::from_request(&refused.error, &self.id);
                        event(&json!({"error": {
                            "message": format!("{}; {} tokens had been sent, and nothing was replayed", error.message, self.tokens),
                            "type": error.kind, "param": null, "code": null,
                            "request_id": self.id,
                            "tokens_sent": self.tokens,
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
                Some(mut delta) => {
                    let moved = delta.facts.take();
                    self.take(delta);
                    // Moved to another pool (a failover mid-stream): say so in the next chunk.
                    if let Some(facts) = moved {
                        let mut value = self.pending();
                        value["vramguard"] = self.facts(&facts.pool);
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

    /// The rest of the text, chat's tool calls, why it ended and the usage, the rest of the
    /// log-probabilities with the last chunk (a stop string's tokens', whose text is cut, too).
    fn last(&mut self, generated: &generation::Generated) -> Vec<u8> {
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
        let tokens = generated
            .logprobs
            .as_deref()
            .and_then(|all| all.get(self.logprobs_sent..))
            .unwrap_or_default();
        if calls.is_empty() {
            let last = self.carrying(json!(rest), tokens, Some(generated.finish.label()), Some(usage));
            return event(&last).to_vec();
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
        let last = self.carrying(json!({}), tokens, Some("tool_calls"), Some(usage));
        out.extend_from_slice(&event(&last));
        out
    }
}

fn sse(stream: Stream, opening: Bytes, pool: &Pool, shrunk: Option<&(u64, u64, String)>) -> Response {
    let degraded = stream.degraded_on(pool);
    let model = stream.source.model.clone();
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
    model_header(headers, &model);
    if let Some((from, to, cut)) = shrunk {
        shrink_headers(headers, *from, *to, cut);
    }
    response
}
