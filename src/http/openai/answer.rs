//! Running a checked [`Job`] and answering it whole, as one completion object with the serving
//! pool's facts in `x-vramguard-*` headers (`stream.rs` answers it streamed).

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::time::Instant;

use super::chat::tool_calls_json;
use super::error::OpenAiError;
use super::job::{Api, Job};
use super::logprobs;
use super::run::{Resend, generate};
use super::stream::unix_now;
use crate::http::headers::{decode_headers, header_value, model_header, pool_headers, shrink_headers};
use crate::http::state::AppState;
use crate::protocol::headers::{ALLOW_SHRINK_HEADER, DECISION_HEADER};
use crate::runtime::text::TokenBytes;
use crate::serve::generation;
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

/// Run a checked job as `base` and answer it whole (counted by the generation).
pub(super) async fn run(
    state: &AppState,
    job: Job,
    base: lifecycle::Request,
    id: &str,
    resend: Option<Resend>,
) -> Result<Response, OpenAiError> {
    let service = &state.service;
    let generated = generate(service, (&job.model, job.prompt, &job.params), base, id, None, resend)
        .await
        .map_err(|refused| {
            let degraded = service.degraded.now();
            let mut error = OpenAiError::from_request(&refused.error, id);
            if let Some(d) = degraded {
                error.message = format!("{} (degraded: {})", error.message, d.reason);
            }
            error
        })?;
    // The model that answered: the one asked for, or its fallback.
    let model = generated.source.model.as_str();
    let body = whole(state, &job.api, &generated, id);
    let mut response = axum::Json(body).into_response();
    let out = response.headers_mut();
    model_header(out, model);
    out.insert(
        HeaderName::from_static(DECISION_HEADER),
        HeaderValue::from_static(generated.action.label()),
    );
    let degraded = service.degraded.for_answer(&generated.pool, &job.model);
    pool_headers(out, &generated.pool, degraded.as_ref());
    if let Some((from, to, cut)) = &generated.shrunk {
        shrink_headers(out, *from, *to, cut);
    }
    Ok(response)
}

/// A whole answer's body: the completion object, with chat's tool calls read back and the
/// tokens' log-probabilities when asked for.
fn whole(state: &AppState, api: &Api, generated: &generation::Generated, id: &str) -> Value {
    let model = generated.source.model.as_str();
    let bytes = logprobs::token_bytes(&state.service, model);
    let logprobs = |shape: fn(&TokenBytes, &[generation::TokenLogprobs]) -> Value| match (&generated.logprobs, &bytes) {
        (Some(tokens), Some(bytes)) => shape(bytes, tokens),
        _ => Value::Null,
    };
    let completion = generated.tokens.len();
    let usage = json!({"prompt_tokens": generated.prompt_tokens, "completion_tokens": completion,
                       "total_tokens": generated.prompt_tokens + completion});
    match api {
        Api::Completion => json!({
            "id": format!("cmpl-{id}"),
            "object": "text_completion",
            "created": unix_now(),
            "model": model,
            "choices": [{"text": generated.text, "index": 0, "logprobs": logprobs(logprobs::completion),
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
                "model": model,
                "choices": [{"index": 0, "message": message, "logprobs": logprobs(logprobs::chat),
                             "finish_reason": finish}],
                "usage": usage,
            })
        }
    }
}
