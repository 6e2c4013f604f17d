//! OpenAI-compatible text generation, embeddings and rerank: `GET /v1/models[/{id}]`,
//! `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/embeddings` and
//! `POST /v1/rerank` (and, in `audio`, speech to text's request and answers), with errors in
//! OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`), so clients built on the
//! `openai` package work unchanged. Generation itself is [`crate::serve::generation`], which
//! also makes the request a job for its model (chat templates, tokenizing, grammars) and reads
//! tool calls back: these files only read the API's fields and write its answers.
//!
//! `stream: true` answers with server-sent events: one chunk per piece of text, the last with
//! `finish_reason` and `usage`, then `data: [DONE]`. The first chunk carries a `vramguard`
//! object naming the pool that serves the request and, while degraded, why, that pool's limits
//! and its estimated delay (the same facts a non-streamed answer has in `x-vramguard-*`
//! headers). An error before the first token is an ordinary error response; after it, a final
//! `error` event with the request id, the tokens already sent and how to resume, never a
//! silent replay. A chat request offering tools is never run twice once its first token is
//! picked, streamed or not: a tool call may already have acted on the client's side.
//!
//! An answer has a choice per generation: each prompt's (a completion may send several) `n`
//! times, all run at once (`run`), each prompt's `n` from one run of it.
//!
//! A request is read and checked into a job (`job`, with chat's part in `chat`, and the
//! `response_format` both take in `format`), then run and
//! answered whole (`answer`) or streamed (`stream`), both running its generations through `run`
//! (which reads the body again for the model's fallback when the generation asks for it);
//! `error` is OpenAI's error shape, `body` reads every JSON body's fields (a field at fault
//! named by its path), `logprobs` the tokens' log-probabilities in OpenAI's
//! shapes. No two of these files use each other. `embeddings` and `rerank` are those endpoints:
//! each parses its request into a job of [`crate::serve::encoders`] (whose kind does the model
//! work), and `encode` hands it down through the encoders' one door and sends the answer with
//! its headers; `embeddings` hands a request for a dual encoder's tower to `images` (image
//! search), and both read their common fields and write their vectors with `vectors`. They use
//! `error` and `body` too.

mod answer;
pub mod audio;
mod body;
mod chat;
mod embeddings;
mod encode;
mod error;
mod format;
mod images;
mod job;
mod logprobs;
mod rerank;
mod run;
mod stream;
mod vectors;

pub use audio::{transcriptions, translations};
pub use embeddings::embeddings;
pub use error::OpenAiError;
pub use rerank::rerank;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::time::Instant;

use super::error::outcome_of_status;
use super::headers::{request_id, with_request_id};
use super::state::AppState;
use crate::serve::lifecycle;
use crate::serve::service::{Api, Kind, ModelEntry, UNKNOWN_MODEL};

/// `GET /v1/models`: the models that generate text (decoders with a tokenizer), those that
/// embed (sentence-transformers folders, and each tower of a dual encoder such as CLIP), those
/// that rerank (cross-encoders) and those that transcribe (Whisper exports): every model an
/// OpenAI client can name.
pub async fn models(State(state): State<Arc<AppState>>) -> axum::Json<Value> {
    let data: Vec<Value> = state
        .service
        .models
        .iter()
        .filter(|m| listed(m))
        .map(model_object)
        .collect();
    axum::Json(json!({"object": "list", "data": data}))
}

/// `GET /v1/models/{id}`: one model of the list (`client.models.retrieve`); any other name,
/// configured models that do not generate text included, is OpenAI's 404 `model_not_found`.
/// The route takes the rest of the path: a configured name is one segment, but an id with `/`
/// in it (`org/model`, as clients of other servers write one) is answered as OpenAI would.
pub async fn model(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let service = &state.service;
    let request = request_id(&headers);
    let response = match service.model(&id) {
        Some(entry) if listed(entry) => axum::Json(model_object(entry)).into_response(),
        Some(_) => OpenAiError::model_not_found(
            format!("model `{id}` does not generate text, embed, rerank nor transcribe"),
            &request,
        )
        .into_response(),
        None => OpenAiError::unknown_model(service, &id, &request).into_response(),
    };
    with_request_id(response, &request)
}

/// Whether a model is one of `GET /v1/models`: a decoder with a tokenizer, an embedder, a
/// reranker, a dual encoder's tower (`/v1/embeddings` takes texts for one, images for the
/// other) or a speech model.
fn listed(entry: &ModelEntry) -> bool {
    entry.kind.serves_openai()
}

/// The model named, of a kind that answers `api`, with what `parts` reads from its kind: the one
/// lookup of every endpoint. An unknown model is OpenAI's 404 naming those there are; one of
/// another kind a 400 naming `model` and saying what the API needs ([`Api::needs`]).
pub(super) fn model_for<'a, T>(
    state: &'a AppState,
    model: &str,
    api: Api,
    id: &str,
    parts: impl FnOnce(&'a Kind) -> Option<T>,
) -> Result<(&'a ModelEntry, T), OpenAiError> {
    let service = &state.service;
    let entry = service
        .model(model)
        .ok_or_else(|| OpenAiError::unknown_model(service, model, id))?;
    let parts = parts(&entry.kind)
        .ok_or_else(|| OpenAiError::invalid(format!("model `{model}` does not {}", api.needs()), Some("model")))?;
    Ok((entry, parts))
}

/// A model as OpenAI's model object describes it.
fn model_object(entry: &ModelEntry) -> Value {
    json!({"id": entry.config.name, "object": "model", "created": 0, "owned_by": "vramguard"})
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

/// Read, run and answer one request, the request id on every answer. A request refused while
/// it is read and checked is counted here; one that reaches its generation is counted there.
async fn serve(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    chat: bool,
) -> Response {
    let received = Instant::now();
    let id = request_id(headers);
    // A cheap handle on the body, read again when the request is refused, or for the model's
    // fallback.
    let kept = body.as_ref().ok().cloned();
    let checked = run::read_job(state, body, &id, chat)
        .and_then(|job| answer::request(state, headers, &job, &id, received).map(|base| (job, base)));
    let result = match checked {
        Ok((job, base)) => {
            let has_fallback = state
                .service
                .model(&job.model)
                .is_some_and(|m| m.config.fallback_model.is_some());
            // Kept only when the model's fallback may be asked: it reads the body again.
            let resend = match &kept {
                Some(body) if base.allow_substitute && has_fallback => Some(run::Resend {
                    state: Arc::clone(state),
                    body: body.clone(),
                    chat,
                }),
                _ => None,
            };
            if job.stream {
                stream::streamed(state, job, &id, base, resend).await
            } else {
                answer::run(state, job, base, &id, resend).await
            }
        }
        Err(error) => {
            let model = kept.as_deref().and_then(model_named);
            let model = model.as_deref().unwrap_or(UNKNOWN_MODEL);
            lifecycle::answered(&state.service, model, outcome_of_status(error.status), received);
            Err(error)
        }
    };
    let response = match result {
        Ok(response) => response,
        Err(error) => error.into_response(),
    };
    with_request_id(response, &id)
}

/// The `model` a body names, read on its own (the body may be wrong in every other way), for
/// counting a refusal under the model it was for.
fn model_named(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        model: String,
    }
    serde_json::from_slice::<Named>(body).ok().map(|n| n.model)
}
