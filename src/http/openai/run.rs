//! A request's body read into a checked [`Job`], and the job's generation run: when the
//! generation's model cannot take it and its fallback may, the body is read again as if it
//! named the fallback (its template, its tokenizer) and handed back to the generation, which
//! never calls into `http` itself.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use serde_json::Value;

use super::chat;
use super::error::OpenAiError;
use super::job::{self, Job};
use crate::http::state::AppState;
use crate::serve::generation::{self, Generated, Params, Placed, Prompt};
use crate::serve::lifecycle::{Refused, Request};
use crate::serve::service::Service;

/// Decode and check the body into a [`Job`]: a chat's or a completion's.
pub(super) fn read_job(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
    id: &str,
    chat: bool,
) -> Result<Job, OpenAiError> {
    let body = body.map_err(|e| OpenAiError::unreadable(&e, id))?;
    let draft = if chat {
        chat::read(state, &body, id)?
    } else {
        job::read_completion(state, &body, id)?
    };
    job::checked(state, draft, id)
}

/// What a request's model's fallback is asked with: the body as the client sent it.
pub(super) struct Resend {
    /// The server, whose models read the body.
    pub(super) state: Arc<AppState>,
    /// The body.
    pub(super) body: Bytes,
    /// Whether it is a chat.
    pub(super) chat: bool,
}

impl Resend {
    /// The prompt and parameters of the body read again as if it named `fallback`.
    fn job_for(&self, fallback: &str, id: &str) -> Result<(Prompt, Params), String> {
        let mut value: Value = serde_json::from_slice(&self.body).map_err(|e| e.to_string())?;
        value["model"] = Value::String(fallback.to_string());
        let body = serde_json::to_vec(&value).map_err(|e| e.to_string())?;
        let job = read_job(&self.state, Ok(Bytes::from(body)), id, self.chat).map_err(|e| e.message)?;
        Ok((job.prompt, job.params))
    }
}

/// Run `job`'s generation as `base` (request `id`), its deltas to `sink` when it is streamed;
/// with `resend`, the model's fallback may answer instead.
pub(super) async fn generate(
    service: &Service,
    job: (&str, Prompt, &Params),
    base: Request,
    id: &str,
    sink: Option<generation::Sink>,
    resend: Option<Resend>,
) -> Result<Generated, Refused> {
    let (model, prompt, params) = job;
    let entry = service.model(model).expect("checked by text_model");
    let prefilled = match generation::place(service, entry, prompt, params, base).await? {
        Placed::Prefilled(prefilled) => prefilled,
        Placed::Fallback(fallback) => {
            let rebuilt = match &resend {
                Some(resend) => resend.job_for(fallback.model(), id),
                None => Err("nothing can make its prompt again".to_string()),
            };
            fallback.place(rebuilt).await?
        }
    };
    prefilled.run(sink).await
}
