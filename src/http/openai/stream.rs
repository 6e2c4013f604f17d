//! `stream: true`: the answer as server-sent events, one chunk per piece of a choice's text
//! (naming the choice's `index`), each choice's last with its `finish_reason`, the last of all
//! with the `usage` of all, then `data: [DONE]`. The first chunk names the serving pool; an
//! error after it is a final `error` event saying which choice failed, what was sent and how to
//! resume. The text comes finished from the generation ([`generation::Delta`]): this file only
//! formats it.

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
use super::run::{Out, Resend, Usage, generate_all};
use crate::http::headers::{model_header, pool_facts, pool_headers, shrink_headers};
use crate::http::state::AppState;
use crate::serve::generation::{self, Spelling};
use crate::serve::lifecycle::{Refused, RequestError};
use crate::serve::ran::RanOn;

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

/// What a choice's generation tells its stream: a delta, or its end.
enum Event {
    Delta(generation::Delta),
    End(Result<generation::Generated, Refused>),
}

/// `stream: true`: run the prompts first, so a refusal before the first token is an ordinary
/// error response; then stream each piece of each choice's text as it is generated, each chunk
/// naming its choice's `index`, and `[DONE]` once every choice finished. The first delta names
/// the model that answers (its fallback, when that stood in).
pub(super) async fn streamed(
    state: &AppState,
    job: Job,
    id: &str,
    base: crate::serve::lifecycle::Request,
    resend: Option<Resend>,
) -> Result<Response, OpenAiError> {
    let service = Arc::clone(&state.service);
    let count = job.choices();
    // Every choice's deltas and end, tagged with its index, on one channel.
    let (tagged, mut events) = tokio::sync::mpsc::channel::<(usize, Event)>(64);
    // A reader that goes away drops the stream and with it the channel: each forwarder then
    // drops its choice's sink, and its generation stops at its next token, counted `cancelled`
    // on its pool, its cache dropped with the pool's next step.
    let mut outs = Vec::with_capacity(count);
    for index in 0..count {
        let (sink, mut deltas) = tokio::sync::mpsc::channel(64);
        let (end, ended) = tokio::sync::oneshot::channel();
        outs.push(Out { sink: Some(sink), end });
        let tagged = tagged.clone();
        tokio::spawn(async move {
            while let Some(delta) = deltas.recv().await {
                if tagged.send((index, Event::Delta(delta))).await.is_err() {
                    return;
                }
            }
            // Its generation's task ended without saying how only if it panicked.
            let end = match ended.await {
                Ok(end) => end,
                Err(_) => Err(task_failed()),
            };
            let _ = tagged.send((index, Event::End(end))).await;
        });
    }
    drop(tagged);
    let job_logprobs = job.params.logprobs.is_some();
    let mut stream = Stream::new(Arc::clone(&service), &job, id);
    tokio::spawn({
        let id = id.to_string();
        let resend = resend.map(Arc::new);
        async move { generate_all(&service, &job, base, &id, outs, resend).await }
    });
    // Until the first delta, a failure is an ordinary error response. A choice ends without
    // one only when it ended before picking a token it sends.
    let (index, first) = events
        .recv()
        .await
        .unwrap_or_else(|| (0, Event::End(Err(task_failed()))));
    let (ran, source, shrunk) = match &first {
        Event::End(Err(refused)) => return Err(OpenAiError::from_request(&refused.error, id)),
        Event::Delta(delta) => {
            let facts = delta.facts.as_ref().expect("the first delta says where it ran");
            (
                facts.ran_on(&stream.service),
                Arc::clone(&facts.source),
                facts.shrunk.clone(),
            )
        }
        Event::End(Ok(generated)) => (
            generated.ran_on(&stream.service),
            Arc::clone(&generated.source),
            generated.shrunk.clone(),
        ),
    };
    if job_logprobs {
        stream.bytes = Spelling::of(&stream.service, &source.model);
    }
    stream.source = source;
    stream.events = Some(events);
    let mut opening = stream.opening(&ran, shrunk.as_ref()).to_vec();
    if let Some(bytes) = stream.on(index, first) {
        opening.extend_from_slice(&bytes);
    }
    Ok(sse(stream, Bytes::from(opening), &ran, shrunk.as_ref()))
}

/// The error a choice ends with when its task ended without saying how.
fn task_failed() -> Refused {
    Refused {
        pool: None,
        error: RequestError::Failed { pool: String::new() },
    }
}

/// One choice of a streamed answer.
#[derive(Default)]
struct Choice {
    /// Bytes of its text already sent.
    sent: usize,
    /// Deltas received: one per token.
    tokens: usize,
    /// Log-probabilities already sent: of the tokens whose text was sent.
    logprobs_sent: usize,
    /// Its last chunk was sent.
    ended: bool,
    /// The pool its tokens come from, as the stream last told it.
    pool: Option<String>,
}

/// The state of a streamed answer.
struct Stream {
    choices: Vec<Choice>,
    /// Every choice's events, once the stream started.
    events: Option<tokio::sync::mpsc::Receiver<(usize, Event)>>,
    /// The usage of the choices ended so far.
    usage: Usage,
    done: bool,
    api: Api,
    /// Generations of each prompt.
    n: usize,
    /// The text each choice's first chunk carries: with `echo`, its prompt's.
    openings: Vec<String>,
    id: String,
    /// The model that answers.
    source: Arc<generation::Source>,
    /// When the request asks for log-probabilities, how the answering model's tokens read as
    /// bytes.
    bytes: Option<Spelling>,
    created: u64,
    service: Arc<crate::serve::service::Service>,
}

impl Stream {
    /// A stream of `job`'s choices, nothing sent yet.
    fn new(service: Arc<crate::serve::service::Service>, job: &Job, id: &str) -> Stream {
        Stream {
            choices: (0..job.choices()).map(|_| Choice::default()).collect(),
            events: None,
            usage: Usage::default(),
            done: false,
            api: job.api.clone(),
            n: job.n,
            openings: (0..job.choices())
                .map(|i| job.echo_of(i).unwrap_or_default().to_string())
                .collect(),
            id: id.to_string(),
            source: Arc::new(generation::Source {
                model: job.model.clone(),
                substitution: None,
            }),
            bytes: None,
            created: unix_now(),
            service,
        }
    }

    /// One chunk of choice `index`: `text` (chat: the delta's `content`), and at its end why
    /// and, on the last chunk of all, the usage.
    fn chunk(&self, index: usize, delta: Value, finish: Option<&str>, usage: Option<Value>) -> Value {
        let mut value = match &self.api {
            Api::Completion => json!({
                "id": format!("cmpl-{}", self.id), "object": "text_completion", "created": self.created,
                "model": self.source.model,
                "choices": [{"text": delta, "index": index, "logprobs": null, "finish_reason": finish}],
            }),
            Api::Chat { .. } => json!({
                "id": format!("chatcmpl-{}", self.id), "object": "chat.completion.chunk",
                "created": self.created, "model": self.source.model,
                "choices": [{"index": index, "delta": if delta.is_object() { delta } else { json!({"content": delta}) },
                             "logprobs": null, "finish_reason": finish}],
            }),
        };
        if let Some(usage) = usage {
            value["usage"] = usage;
        }
        value
    }

    /// `value`, a chunk of choice `index`, carrying the log-probabilities of `tokens` when the
    /// request asks for them.
    fn carrying(&self, mut value: Value, tokens: &[generation::TokenLogprobs]) -> Value {
        if let Some(bytes) = &self.bytes {
            value["choices"][0]["logprobs"] = match self.api {
                Api::Completion => logprobs::completion(bytes, tokens),
                Api::Chat { .. } => logprobs::chat(bytes, tokens),
            };
        }
        value
    }

    /// The first chunk of each choice: chat's assistant role (completions: empty text, or the
    /// prompt with `echo`), the first with the facts of where it `ran`.
    fn opening(&mut self, ran: &RanOn, shrunk: Option<&(u64, u64, String)>) -> Bytes {
        for choice in &mut self.choices {
            choice.pool = Some(ran.pool.clone());
        }
        let mut out = Vec::new();
        for index in 0..self.choices.len() {
            let delta = match self.api {
                Api::Completion => json!(self.openings[index]),
                Api::Chat { .. } => json!({"role": "assistant", "content": ""}),
            };
            let mut value = self.chunk(index, delta, None, None);
            if index == 0 {
                value["vramguard"] = pool_facts(ran);
                value["vramguard"]["model"] = json!(self.source.model);
                if let Some(s) = &self.source.substitution {
                    value["vramguard"]["requested_model"] = json!(s.requested);
                    value["vramguard"]["substituted"] = json!(format!("{:?}", s.reason));
                }
                if let Some((from, to, cut)) = shrunk {
                    value["vramguard"]["context"] = json!({"from": from, "to": to, "cut": cut});
                }
            }
            out.extend_from_slice(&event(&value));
        }
        Bytes::from(out)
    }

    /// The next bytes to send, or `None` when the stream is over.
    async fn next(&mut self) -> Option<Bytes> {
        while !self.done {
            let (index, event) = match self.events.as_mut()?.recv().await {
                Some(tagged) => tagged,
                // Every choice's task is gone without its end (they end before their channel).
                None => (
                    self.choices.iter().position(|c| !c.ended)?,
                    Event::End(Err(task_failed())),
                ),
            };
            if let Some(bytes) = self.on(index, event) {
                return Some(bytes);
            }
        }
        None
    }

    /// Take choice `index`'s `news`: what to send for it, if anything.
    fn on(&mut self, index: usize, news: Event) -> Option<Bytes> {
        match news {
            Event::Delta(delta) => {
                let ran = delta.facts.as_ref().map(|f| f.ran_on(&self.service));
                let choice = &mut self.choices[index];
                choice.tokens += 1;
                choice.sent += delta.text.len();
                // Moved to another pool (a failover mid-stream): say so in the next chunk.
                let moved = ran.filter(|ran| choice.pool.as_deref() != Some(ran.pool.as_str()));
                if let Some(ran) = &moved {
                    choice.pool = Some(ran.pool.clone());
                }
                // The log-probabilities of the tokens whose text this delta completes go with it.
                choice.logprobs_sent += delta.logprobs.len();
                if moved.is_none() && delta.text.is_empty() && delta.logprobs.is_empty() {
                    return None;
                }
                let chunk = self.chunk(index, json!(delta.text), None, None);
                let mut value = self.carrying(chunk, &delta.logprobs);
                if let Some(ran) = moved {
                    value["vramguard"] = pool_facts(&ran);
                }
                Some(event(&value))
            }
            Event::End(Ok(generated)) => {
                self.choices[index].ended = true;
                self.usage.add(self.n, index, &generated);
                let last = self.choices.iter().all(|c| c.ended);
                let mut out = self.last(index, &generated, last.then(|| self.usage.json()));
                if last {
                    self.done = true;
                    out.extend_from_slice(b"data: [DONE]\n\n");
                }
                Some(Bytes::from(out))
            }
            Event::End(Err(refused)) => {
                self.done = true;
                let error = OpenAiError::from_request(&refused.error, &self.id);
                let tokens = self.choices[index].tokens;
                let mut body = json!({
                    "message": format!("{}; {tokens} tokens had been sent, and nothing was replayed", error.message),
                    "type": error.kind, "param": null, "code": null,
                    "request_id": self.id,
                    "tokens_sent": tokens,
                    "resume": "send the prompt followed by the text received so far, with max_tokens reduced by tokens_sent",
                });
                // Which choice failed; the others stop with it, each having sent what it says.
                if self.choices.len() > 1 {
                    body["index"] = json!(index);
                    body["message"] = json!(format!(
                        "choice {index}: {}; its {tokens} tokens had been sent, and nothing was replayed; the other choices stopped with it",
                        error.message
                    ));
                    let sent: Vec<Value> = (self.choices.iter().enumerate())
                        .map(|(i, c)| json!({"index": i, "tokens_sent": c.tokens, "finished": c.ended}))
                        .collect();
                    body["choices"] = json!(sent);
                }
                let mut out = event(&json!({ "error": body })).to_vec();
                out.extend_from_slice(b"data: [DONE]\n\n");
                Some(Bytes::from(out))
            }
        }
    }

    /// The rest of choice `index`'s text, chat's tool calls and why it ended, with the rest of
    /// its log-probabilities (a stop string's tokens', whose text is cut, too); with `usage`
    /// when it is the last choice to end.
    fn last(&self, index: usize, generated: &generation::Generated, usage: Option<Value>) -> Vec<u8> {
        let tokens = generated
            .logprobs
            .as_deref()
            .and_then(|all| all.get(self.choices[index].logprobs_sent..))
            .unwrap_or_default();
        let (prose, calls) = match &self.api {
            Api::Chat { tools } if !tools.is_empty() => generated.tool_calls(tools),
            _ => (generated.text.clone(), Vec::new()),
        };
        let rest = prose.get(self.choices[index].sent..).unwrap_or_default();
        if calls.is_empty() {
            let last = self.chunk(index, json!(rest), Some(generated.finish.label()), usage);
            return event(&self.carrying(last, tokens)).to_vec();
        }
        let mut out = Vec::new();
        if !rest.trim().is_empty() {
            out.extend_from_slice(&event(&self.chunk(index, json!(rest.trim_end()), None, None)));
        }
        let mut calls = tool_calls_json(&calls, &self.id, index);
        for (i, call) in calls.as_array_mut().into_iter().flatten().enumerate() {
            call["index"] = json!(i);
        }
        out.extend_from_slice(&event(&self.chunk(index, json!({"tool_calls": calls}), None, None)));
        let last = self.chunk(index, json!({}), Some("tool_calls"), usage);
        out.extend_from_slice(&event(&self.carrying(last, tokens)));
        out
    }
}

/// The answer streamed: `opening` first, then each event of `stream`, with the headers of
/// where it `ran`.
fn sse(stream: Stream, opening: Bytes, ran: &RanOn, shrunk: Option<&(u64, u64, String)>) -> Response {
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
    pool_headers(headers, ran);
    model_header(headers, &model);
    if let Some((from, to, cut)) = shrunk {
        shrink_headers(headers, *from, *to, cut);
    }
    response
}
