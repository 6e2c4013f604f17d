//! Running a checked [`Job`] and answering it whole, as one completion object (a choice per
//! generation) with the serving pool's facts in `x-vramguard-*` headers (`stream.rs` answers it
//! streamed).

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::time::Instant;

use super::chat::tool_calls_json;
use super::error::OpenAiError;
use super::job::{Api, Job};
use super::logprobs;
use super::run::{Out, Resend, Usage, generate_all};
use super::stream::unix_now;
use crate::http::headers::{decode_headers, header_value, model_header, pool_headers, shrink_headers};
use crate::http::state::AppState;
use crate::protocol::headers::{ALLOW_SHRINK_HEADER, DECISION_HEADER};
use crate::serve::generation::{self, Spelling};
use crate::serve::lifecycle;

/// The lifecycle request a checked job runs as, from the headers every protocol shares.
pub(super) fn request(
    state: &AppState,
    headers: &HeaderMap,
    job: &Job,
    id: &str,
    received: Instant,
) -> Result<lifecycle::Request, OpenAiError> {
    let service = &state.service;
    let mut base =
        decode_headers(service, &job.model, id, headers, received).map_err(|e| OpenAiError::from_request(&e, id))?;
    let entry = service.model(&job.model).expect("checked by text_model");
    // Cutting a prompt changes the answer: only when the client (or the model's config) allows.
    base.meta.allow_shrink = header_value::<bool>(headers, ALLOW_SHRINK_HEADER, "`true` or `false`")
        .map_err(|e| OpenAiError::from_request(&e, id))?
        .unwrap_or(entry.config.allow_shrink);
    Ok(base)
}

/// Run a checked job as `base` and answer it whole, every choice (each counted by its
/// generation). A choice that fails fails the answer, as a single generation's failure would.
pub(super) async fn run(
    state: &AppState,
    job: Job,
    base: lifecycle::Request,
    id: &str,
    resend: Option<Resend>,
) -> Result<Response, OpenAiError> {
    let service = &state.service;
    let (outs, ends): (Vec<Out>, Vec<_>) = (0..job.choices())
        .map(|_| {
            let (end, ended) = tokio::sync::oneshot::channel();
            (Out { sink: None, end }, ended)
        })
        .unzip();
    generate_all(service, &job, base, id, outs, resend.map(std::sync::Arc::new)).await;
    let mut generated = Vec::with_capacity(ends.len());
    for ended in ends {
        let result = ended
            .await
            .map_err(|e| OpenAiError::internal(format!("a generation ended unanswered: {e}"), id))?;
        generated.push(result.map_err(|refused| {
            let mut error = OpenAiError::from_request(&refused.error, id);
            if let Some(reason) = service.degraded_reason() {
                error.message = format!("{} (degraded: {reason})", error.message);
            }
            error
        })?);
    }
    let first = generated.first().expect("a job has a choice");
    // The model that answered: the one asked for, or its fallback.
    let model = first.source.model.as_str();
    let body = whole(state, &job, model, &generated, id);
    let mut response = axum::Json(body).into_response();
    let out = response.headers_mut();
    model_header(out, model);
    out.insert(
        HeaderName::from_static(DECISION_HEADER),
        HeaderValue::from_static(first.action.label()),
    );
    pool_headers(out, &service.ran_on(&first.pool, &job.model));
    if let Some((from, to, cut)) = &first.shrunk {
        shrink_headers(out, *from, *to, cut);
    }
    Ok(response)
}

/// A whole answer's body: the completion object, one choice per generation in the job's order.
fn whole(state: &AppState, job: &Job, model: &str, generated: &[generation::Generated], id: &str) -> Value {
    // Only an answer that gives log-probabilities spells its tokens.
    let bytes = (job.params.logprobs.is_some())
        .then(|| Spelling::of(&state.service, model))
        .flatten();
    let mut usage = Usage::default();
    let mut choices = Vec::with_capacity(generated.len());
    for (index, generated) in generated.iter().enumerate() {
        usage.add(job.n, index, generated);
        choices.push(choice(job, index, generated, bytes.as_ref(), id));
    }
    let (id, object) = match job.api {
        Api::Completion => (format!("cmpl-{id}"), "text_completion"),
        Api::Chat { .. } => (format!("chatcmpl-{id}"), "chat.completion"),
    };
    json!({"id": id, "object": object, "created": unix_now(), "model": model,
           "choices": choices, "usage": usage.json()})
}

/// Choice `index` of a whole answer: a completion's text (after its prompt's, with `echo`), or
/// chat's message with its tool calls read back; with the tokens' log-probabilities when asked
/// for (`bytes`: the model's tokens' bytes).
fn choice(job: &Job, index: usize, generated: &generation::Generated, bytes: Option<&Spelling>, id: &str) -> Value {
    let logprobs = |shape: fn(&Spelling, &[generation::TokenLogprobs]) -> Value| match (&generated.logprobs, bytes) {
        (Some(tokens), Some(bytes)) => shape(bytes, tokens),
        _ => Value::Null,
    };
    match &job.api {
        Api::Completion => {
            let text = format!("{}{}", job.echo_of(index).unwrap_or_default(), generated.text);
            json!({"text": text, "index": index, "logprobs": logprobs(logprobs::completion),
                   "finish_reason": generated.finish.label()})
        }
        Api::Chat { tools } => {
            let (prose, calls) = generated.tool_calls(tools);
            let mut message = json!({"role": "assistant", "content": prose});
            let finish = if calls.is_empty() {
                generated.finish.label()
            } else {
                let prose = prose.trim();
                message["content"] = if prose.is_empty() { Value::Null } else { json!(prose) };
                message["tool_calls"] = tool_calls_json(&calls, id, index);
                "tool_calls"
            };
            json!({"index": index, "message": message, "logprobs": logprobs(logprobs::chat),
                   "finish_reason": finish})
        }
    }
}
