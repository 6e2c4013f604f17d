//! OpenAI's audio API for speech to text (`/v1/audio/transcriptions` and
//! `/v1/audio/translations`): the multipart request read and checked (`request.rs`, its tests
//! in `request/`), then handed to the service ([`crate::serve::speech`]), which checks it
//! against its model, reads its audio and transcribes it; what comes back is answered in its
//! `response_format` or as streamed events (`formats.rs`, its tests in `formats/`). No audio
//! or model work is done here. See `docs/speech.md`.

pub mod formats;
pub mod request;

use std::sync::Arc;

use axum::extract::State;
use axum::extract::multipart::{Multipart, MultipartRejection};
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::encode;
use super::error::OpenAiError;
use crate::http::error::outcome_of_status;
use crate::http::headers::decode_headers;
use crate::http::state::AppState;
use crate::serve::lifecycle;
use crate::serve::service::{Api, Kind, UNKNOWN_MODEL};
use crate::serve::speech::{self, Ask, Audio, Params, Task, Unreadable};
use request::AudioRequest;

/// `POST /v1/audio/transcriptions`.
pub async fn transcriptions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    form: Result<Multipart, MultipartRejection>,
) -> Response {
    handle(state, headers, form, Task::Transcribe).await
}

/// `POST /v1/audio/translations`.
pub async fn translations(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    form: Result<Multipart, MultipartRejection>,
) -> Response {
    handle(state, headers, form, Task::Translate).await
}

async fn handle(
    state: Arc<AppState>,
    headers: HeaderMap,
    form: Result<Multipart, MultipartRejection>,
    task: Task,
) -> Response {
    let headers = &headers;
    encode::respond(headers, |id, received| async move {
        serve(state, headers, form, task, &id, received).await
    })
    .await
}

/// A request read and checked against its model: its audio read, the parameters, and the
/// lifecycle request built from its headers.
struct Checked {
    request: AudioRequest,
    audio: Audio,
    params: Params,
    lifecycle: lifecycle::Request,
}

/// Read, run and answer one request.
async fn serve(
    state: Arc<AppState>,
    headers: &HeaderMap,
    form: Result<Multipart, MultipartRejection>,
    task: Task,
    id: &str,
    received: Instant,
) -> Result<Response, OpenAiError> {
    let service = &state.service;
    let (model, read) = match request::read(form, task).await {
        Ok(request) => (
            request.model.clone(),
            check(&state, request, headers, id, received).await,
        ),
        Err(unread) => (
            unread.model.unwrap_or_else(|| UNKNOWN_MODEL.to_string()),
            Err(unread.error),
        ),
    };
    let checked = match read {
        Ok(checked) => checked,
        Err(error) => {
            lifecycle::answered(service, &model, outcome_of_status(error.status), received);
            return Err(error);
        }
    };
    if checked.request.stream {
        return Ok(streamed(state, checked, id.to_string()).await);
    }
    let entry = service.model(&model).expect("checked");
    let done = speech::transcribe(
        service,
        &state.batching,
        entry,
        checked.audio,
        &checked.params,
        checked.lifecycle,
        None,
    )
    .await
    .map_err(|refused| encode::refusal(service, &refused, id))?;
    let response = formats::answer(&done.transcript, checked.request.format);
    Ok(encode::stamped(&model, done.action, &done.ran, response))
}

/// Hand `request` to its model (a speech model) to be checked and its audio read, and build
/// its lifecycle request from `headers`.
async fn check(
    state: &AppState,
    mut request: AudioRequest,
    headers: &HeaderMap,
    id: &str,
    received: Instant,
) -> Result<Checked, OpenAiError> {
    let (_, model) = super::model_for(state, &request.model, Api::Transcription, id, Kind::speech)?;
    let ask = Ask {
        task: request.task,
        language: request.language.clone(),
        prompt: request.prompt.clone(),
        temperature: request.temperature,
        timestamps: request.format.timestamps(),
        seed: seed_of(id),
    };
    let params = speech::params(model, ask).map_err(|e| OpenAiError::invalid(e.message, Some(e.field)))?;
    let lifecycle = decode_headers(&state.service, &request.model, id, headers, received)
        .map_err(|e| OpenAiError::from_request(&e, id))?;
    // The file's bytes (up to 25 MiB) go to the service, which keeps them while it transcribes
    // (its samples are decoded from them a window at a time). A client that goes away stops
    // the reading at its next packet.
    let audio = Audio::read(model, std::mem::take(&mut request.file))
        .await
        .map_err(|unreadable| match unreadable {
            Unreadable::File(why) => OpenAiError::invalid(format!("`file`: {why}"), Some("file")),
            Unreadable::Failed(why) => {
                tracing::error!(%why, "reading a request's audio did not finish");
                OpenAiError::internal("reading the request failed".into(), id)
            }
        })?;
    Ok(Checked {
        request,
        audio,
        params,
        lifecycle,
    })
}

/// A sampler's seed from the request's id: a request sent again with the same id samples the
/// same tokens (temperature above 0).
fn seed_of(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// What a streamed transcription sends: a window, or its end.
enum Piece {
    Text(speech::Window),
    End(Result<speech::Transcribed, lifecycle::Refused>),
}

/// `stream=true`: the transcription runs in its own task; each window's text is a
/// `transcript.text.delta` event as it is decoded, then `transcript.text.done`. The response
/// waits for the first window, so its headers name the pool that ran it and say when it is
/// degraded, as every answer's do, and a refusal before it is an ordinary error response;
/// after it, the events say what the headers could not ([`Streaming`]).
async fn streamed(state: Arc<AppState>, checked: Checked, id: String) -> Response {
    let (pieces, mut received) = mpsc::channel::<Piece>(8);
    let model = checked.request.model.clone();
    let duration = checked.audio.duration();
    let (task_state, task_model) = (Arc::clone(&state), model.clone());
    tokio::spawn(async move {
        let (sink, mut texts) = mpsc::channel::<speech::Window>(8);
        let service = &task_state.service;
        let entry = service.model(&task_model).expect("checked");
        let run = speech::transcribe(
            service,
            &task_state.batching,
            entry,
            checked.audio,
            &checked.params,
            checked.lifecycle,
            Some(sink),
        );
        tokio::pin!(run);
        let end = loop {
            tokio::select! {
                Some(window) = texts.recv() => {
                    if pieces.send(Piece::Text(window)).await.is_err() {
                        // The client went away: dropping the run stops it and counts it cancelled.
                        return;
                    }
                }
                end = &mut run => break end,
            }
        };
        while let Ok(window) = texts.try_recv() {
            let _ = pieces.send(Piece::Text(window)).await;
        }
        let _ = pieces.send(Piece::End(end)).await;
    });
    let first = match received.recv().await {
        Some(Piece::End(Err(refused))) => {
            return encode::refusal(&state.service, &refused, &id).into_response();
        }
        Some(piece) => piece,
        None => return OpenAiError::internal("the transcription ended without an answer".into(), &id).into_response(),
    };
    let ran = match &first {
        Piece::Text(window) => (window.ran.clone(), window.action),
        Piece::End(Ok(done)) => (done.ran.clone(), done.action),
        Piece::End(Err(_)) => unreachable!("answered above"),
    };
    let streaming = Streaming {
        state: Arc::clone(&state),
        id,
        duration,
        first: true,
        pool: ran.0.pool.clone(),
        moved: false,
        done: 0.0,
    };
    let events = futures_util::stream::unfold(
        (Some(first), received, streaming),
        |(mut next, mut rx, mut streaming)| async move {
            // A window that holds no text sends nothing, but what it covered counts as sent.
            let event = loop {
                let piece = match next.take() {
                    Some(piece) => piece,
                    None => rx.recv().await?,
                };
                if let Some(event) = streaming.event(piece) {
                    break event;
                }
            };
            Some((Ok::<_, std::convert::Infallible>(event), (None, rx, streaming)))
        },
    );
    let response = Sse::new(events).into_response();
    encode::stamped(&model, ran.1, &ran.0, response)
}

/// A stream's events past its headers, which went out with its first window. What they could
/// not say, the events do, in a `vramguard` object beside OpenAI's fields (as a chat stream's
/// chunks carry it): a delta whose window ran on another pool than the window before it names
/// that pool and, while it is degraded, why; the done event does when any window moved. An
/// `error` event after text says how much of the audio that text covers and how to ask for the
/// rest: nothing sent is sent again, and nothing is replayed.
struct Streaming {
    state: Arc<AppState>,
    id: String,
    /// Seconds of the request's audio.
    duration: f64,
    /// No text sent yet: the first delta's text is trimmed at its start, as the done event's is,
    /// so that the deltas add up to it.
    first: bool,
    /// The pool of the last window.
    pool: String,
    /// Some window ran on another pool than the one the headers name.
    moved: bool,
    /// Seconds of the audio whose text has been sent.
    done: f64,
}

impl Streaming {
    /// The event `piece` is, or `None` for a window with no text.
    fn event(&mut self, piece: Piece) -> Option<Event> {
        match piece {
            Piece::Text(window) => {
                self.done = window.done;
                let facts = (window.ran.pool != self.pool).then(|| crate::http::headers::pool_facts(&window.ran));
                self.pool = window.ran.pool;
                self.moved |= facts.is_some();
                let text = if self.first {
                    window.text.trim_start()
                } else {
                    &window.text
                };
                if text.is_empty() && facts.is_none() {
                    return None;
                }
                self.first &= text.is_empty();
                Some(formats::delta_event(text, facts))
            }
            Piece::End(Ok(done)) => {
                let facts = self.moved.then(|| crate::http::headers::pool_facts(&done.ran));
                Some(formats::done_event(&done.transcript, facts))
            }
            Piece::End(Err(refused)) => {
                let error = encode::refusal(&self.state.service, &refused, &self.id);
                let mut body = error.body();
                let (done, of) = (self.done, self.duration);
                body["message"] = json!(format!(
                    "{}; the text of the audio's first {done:.2} s (of {of:.2} s) had been sent, and nothing was replayed",
                    error.message
                ));
                body["audio_seconds_done"] = json!(done);
                body["audio_seconds"] = json!(of);
                body["resume"] = json!(
                    "send the audio after audio_seconds_done as a new transcription (the text received so far as its prompt): its text follows what was sent"
                );
                Some(Event::default().data(json!({"type": "error", "error": body}).to_string()))
            }
        }
    }
}
