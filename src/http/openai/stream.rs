//! `stream: true`: the answer as server-sent events, one chunk per piece of text, the last with
//! `finish_reason` and `usage`, then `data: [DONE]`. The first chunk names the serving pool; an
//! error after it is a final `error` event saying what was sent and how to resume.

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{Value, json};

use super::answer::unix_now;
use super::chat::tool_calls_json;
use super::error::OpenAiError;
use super::job::{Api, Job};
use crate::http::headers::{model_header, pool_facts, pool_headers, shrink_headers};
use crate::http::state::AppState;
use crate::pool::Pool;
use crate::runtime::text::{Detokenizer, first_at, tail_start};
use crate::serve::generate;
use crate::serve::lifecycle::RequestError;

/// One server-sent event carrying `value` as JSON.
fn event(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// How far a stream's text was searched for its held strings, and where the first one starts
/// once one was found. The text only grows, so a string found stays where it is, and one not
/// found can only be completed by what was added since: each search covers the growth and the
/// held strings' length before it, and none is made once one was found. A token then costs the
/// same however long the text held back after a tool call's opening tag grows.
#[derive(Debug, Default)]
struct Hold {
    searched: usize,
    found: Option<usize>,
}

impl Hold {
    /// Where a search of `text` (the text searched before, grown) for `held` must start, or
    /// `None` when there is nothing to search: one was found already.
    fn search_from(&self, text: &str, held: &[String]) -> Option<usize> {
        self.found.is_none().then(|| tail_start(text, self.searched, held))
    }

    /// Where the first of `held` starts in `text`, if one does.
    fn first(&mut self, text: &str, held: &[String]) -> Option<usize> {
        if let Some(start) = self.search_from(text, held) {
            self.found = first_at(text, start, held);
            self.searched = text.len();
        }
        self.found
    }
}

/// Text that can be sent now: all of `text` but an unfinished UTF-8 sequence at its end and
/// any tail that could still become one of the stop strings. `hold` is what earlier calls on a
/// shorter `text` (the same text, before it grew) learnt, so a call costs the same at any
/// length.
fn sendable<'a>(text: &'a str, hold: &mut Hold, stop: &[String]) -> &'a str {
    let mut end = text.trim_end_matches('\u{FFFD}').len();
    // Nothing from a stop string on: the text ends before it.
    if let Some(at) = hold.first(text, stop) {
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
/// counted `cancelled`. The stream reads its text with the tokenizer of the model that
/// answers (its fallback's, when that stood in), which the first token names.
pub(super) async fn streamed(
    state: &AppState,
    job: Job,
    id: &str,
    base: crate::serve::lifecycle::Request,
    rebuild: Option<generate::Rebuild>,
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
            generate::generate(&service, entry, prompt, &params, base, Some(tx), rebuild).await
        }
    });
    let stream = |source: &Arc<generate::Source>| Stream::new(service, job.api, id, Arc::clone(source));
    // Until the first token, a failure is an ordinary error response. The channel closes
    // without a token only when the generation ended before sending one.
    match rx.recv().await {
        Some(first) => {
            let pool = Arc::clone(&first.pool);
            let mut stream = Stream {
                running: Some((rx, task)),
                ..stream(&first.source)?
            };
            stream.push(first.id);
            let opening = stream.opening(&pool, first.shrunk.as_deref());
            Ok(sse(stream, opening, &pool, first.shrunk.as_deref()))
        }
        None => match task.await {
            Ok(Err(refused)) => Err(OpenAiError::from_request(&refused.error, id)),
            // Ended before any token (the end-of-text token came first): only the last chunk.
            Ok(Ok(generated)) => {
                let pool = Arc::clone(&generated.pool);
                let shrunk = generated.shrunk.clone();
                let source = Arc::clone(&generated.source);
                let mut stream = Stream {
                    finished: Some(Ok(generated)),
                    ..stream(&source)?
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
    /// The tokens so far and their text, decoded as they come.
    text: Detokenizer,
    /// Bytes of text already sent.
    sent: usize,
    /// Where the held strings were looked for in the text.
    hold: Hold,
    running: Option<Running>,
    finished: Option<Result<generate::Generated, crate::serve::lifecycle::Refused>>,
    done: bool,
    /// The pool the last token came from, once the first chunk has named it.
    pool: Option<String>,
    /// Strings whose text waits: the stop strings, and a tool call's opening tag.
    held: Vec<String>,
    api: Api,
    id: String,
    /// The model that answers, and its stop strings.
    source: Arc<generate::Source>,
    created: u64,
    service: Arc<crate::serve::service::Service>,
}

impl Stream {
    /// A stream of `source`'s tokens, nothing sent yet.
    fn new(
        service: Arc<crate::serve::service::Service>,
        api: Api,
        id: &str,
        source: Arc<generate::Source>,
    ) -> Result<Stream, OpenAiError> {
        let tokenizer = service
            .model(&source.model)
            .and_then(|m| m.tokenizer.clone())
            .ok_or_else(|| OpenAiError::internal(format!("model `{}` has no tokenizer", source.model), id))?;
        // Text from a stop string or a tool call's start on waits for the end, when the calls
        // are read back.
        let mut held = source.stop.clone();
        if matches!(&api, Api::Chat { tools } if !tools.is_empty()) {
            held.push(crate::runtime::chat::TOOL_CALL_OPEN.to_string());
        }
        Ok(Stream {
            text: Detokenizer::new(tokenizer),
            sent: 0,
            hold: Hold::default(),
            running: None,
            finished: None,
            done: false,
            pool: None,
            held,
            api,
            id: id.to_string(),
            source,
            created: unix_now(),
            service,
        })
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
    fn opening(&mut self, pool: &Arc<Pool>, shrunk: Option<&(u64, u64, String)>) -> Bytes {
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
    fn facts(&mut self, pool: &Arc<Pool>) -> Value {
        self.pool = Some(pool.name().to_string());
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

    /// Add a token to the text. One that cannot be decoded adds no text (the generation's own
    /// decoding fails on it and ends the stream with an error).
    fn push(&mut self, id: u32) {
        if let Err(error) = self.text.push(id) {
            tracing::warn!(request_id = %self.id, %error, "a streamed token has no text");
        }
    }

    /// The next bytes to send, or `None` when the stream is over.
    async fn next(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        loop {
            if self.finished.is_none() {
                let ready = sendable(self.text.text(), &mut self.hold, &self.held);
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
                            "message": format!("{}; {} tokens had been sent, and nothing was replayed", error.message, self.text.tokens().len()),
                            "type": error.kind, "param": null, "code": null,
                            "request_id": self.id,
                            "tokens_sent": self.text.tokens().len(),
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
                    self.push(token.id);
                    // Moved to another pool (a failover mid-stream): say so in the next chunk.
                    if self.pool.as_deref() != Some(token.pool.name()) {
                        let ready = sendable(self.text.text(), &mut self.hold, &self.held);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What is sendable of `text` searched whole, as if it had come in one piece.
    fn at_once<'a>(text: &'a str, held: &[String]) -> &'a str {
        sendable(text, &mut Hold::default(), held)
    }

    #[test]
    fn text_that_may_become_a_stop_string_or_is_an_unfinished_character_waits() {
        let stop = vec![" GPU".to_string()];
        assert_eq!(at_once("hello", &stop), "hello");
        assert_eq!(at_once("hello G", &stop), "hello");
        assert_eq!(at_once("hello GP", &stop), "hello");
        assert_eq!(at_once("hello Gx", &stop), "hello Gx");
        assert_eq!(at_once("hello GPUs", &stop), "hello");
        assert_eq!(at_once("caf\u{FFFD}", &[]), "caf");
    }

    #[test]
    fn a_tool_call_waits_from_its_opening_tag_on() {
        let held = vec![crate::runtime::chat::TOOL_CALL_OPEN.to_string()];
        assert_eq!(at_once("Let me check. <tool", &held), "Let me check. ");
        assert_eq!(at_once("Let me check. <tool_call>{\"name\"", &held), "Let me check. ");
        assert_eq!(at_once("a <b>", &held), "a <b>");
    }

    /// What a stream sends when its text grows by `pieces`: every chunk, as [`Stream::next`]
    /// cuts them.
    fn chunks(pieces: &[&str], held: &[String]) -> Vec<String> {
        let mut text = String::new();
        let (mut sent, mut hold) = (0, Hold::default());
        let mut out = Vec::new();
        for piece in pieces {
            text.push_str(piece);
            let ready = sendable(&text, &mut hold, held);
            // Searching the tail only decides as searching the whole text would.
            assert_eq!(ready, at_once(&text, held), "after {text:?}");
            if ready.len() > sent {
                out.push(ready[sent..].to_string());
                sent = ready.len();
            }
        }
        out
    }

    #[test]
    fn a_stop_string_split_across_chunks_never_leaks_even_in_part() {
        let stop = vec!["<|im_end|>".to_string(), "\n\nUser:".to_string()];
        let sent = chunks(
            &["The answer is 42", "<|im", "_e", "nd|", "> and more <|im_end|>"],
            &stop,
        );
        assert_eq!(sent, ["The answer is 42"]);
        let sent = chunks(&["Sure.\n", "\nUs", "er", ": again"], &stop);
        assert_eq!(sent.concat(), "Sure.");
        // A start that turns out to be something else is sent once it cannot be a stop string.
        let sent = chunks(&["a <|im", "_start|> b"], &stop);
        assert_eq!(sent, ["a ", "<|im_start|> b"]);
        // Multi-byte characters around and inside the stop string: cut on character boundaries.
        let stop = vec!["ünde".to_string()];
        let sent = chunks(&["grün", "d: Stü", "nde ja"], &stop);
        assert_eq!(sent.concat(), "gründ: St");
    }

    #[test]
    fn a_tool_call_split_across_chunks_waits_from_its_first_character() {
        let held = vec![
            "<|im_end|>".to_string(),
            crate::runtime::chat::TOOL_CALL_OPEN.to_string(),
        ];
        let sent = chunks(
            &[
                "Let me check.",
                " <",
                "tool_",
                "call>",
                "{\"name\": \"f\"}",
                "</tool_call>",
            ],
            &held,
        );
        assert_eq!(sent.concat(), "Let me check. ");
    }

    /// A tool call's text waits however long it grows, and holding it back costs nothing per
    /// token once its opening tag was found: the bytes searched for held strings over the
    /// whole stream stay within the text's length plus, per token, the held strings' length.
    #[test]
    fn a_long_tool_call_stays_held_back_and_its_tokens_are_not_searched_again() {
        let held = vec![
            "<|im_end|>".to_string(),
            crate::runtime::chat::TOOL_CALL_OPEN.to_string(),
        ];
        let longest = held.iter().map(String::len).max().unwrap();
        let pieces = [
            "Let me",
            " check.",
            " <tool",
            "_call>",
            "{\"name\": \"f\", \"arguments\": {",
        ]
        .into_iter()
        .chain(std::iter::repeat_n("\"k\": \"vé\", ", 5000));
        let (mut text, mut hold) = (String::new(), Hold::default());
        let (mut tokens, mut searched, mut after_tag) = (0, 0, 0);
        for piece in pieces {
            text.push_str(piece);
            tokens += 1;
            let bytes = hold.search_from(&text, &held).map_or(0, |start| text.len() - start);
            searched += bytes;
            if hold.found.is_some() {
                after_tag += bytes;
            }
            let ready = sendable(&text, &mut hold, &held);
            let expected = if tokens < 3 { text.as_str() } else { "Let me check. " };
            assert_eq!(ready, expected, "after {tokens} tokens");
        }
        assert!(hold.found.is_some());
        assert_eq!(after_tag, 0, "nothing is searched once the tag was found");
        assert!(
            searched <= text.len() + tokens * longest,
            "{searched} bytes searched for {tokens} tokens of {} bytes",
            text.len()
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// However a text is cut into pieces, each decision equals one made by searching the
        /// whole text, and what is sent is the start of the text before its first stop string
        /// (the rest of which goes with the last chunk).
        #[test]
        fn chunking_does_not_change_what_is_sent(
            words in proptest::collection::vec(proptest::sample::select(vec!["a", "é", "<", "|", "im", "_end", "end|>", " ", "GP", "U", "東"]), 0..80),
            cuts in proptest::collection::vec(1usize..6, 1..40),
        ) {
            let held = vec!["<|im_end|>".to_string(), " GPU".to_string(), "<tool_call>".to_string()];
            let mut pieces = Vec::new();
            let mut rest = words.as_slice();
            for n in cuts.iter().cycle() {
                if rest.is_empty() { break; }
                let (piece, after) = rest.split_at((*n).min(rest.len()));
                pieces.push(piece.concat());
                rest = after;
            }
            let whole = words.concat();
            let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let before_stop = &whole[..first_at(&whole, 0, &held).unwrap_or(whole.len())];
            let sent = chunks(&pieces, &held).concat();
            proptest::prop_assert!(before_stop.starts_with(&sent), "{:?} sent of {:?}", sent, whole);
        }
    }
}
