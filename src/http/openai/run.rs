//! A request's body read into a checked [`Job`], and the job's generations run, one per choice,
//! all at once: when a generation's model cannot take it and its fallback may, the body is read
//! again as if it named the fallback (its template, its tokenizer) and handed back to the
//! generation, which never calls into `http` itself.

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
use tokio::sync::{Semaphore, oneshot};

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
    job::checked(draft, id)
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
    /// Prompt `index` of the body and its parameters, read again as if it named `fallback`.
    fn job_for(&self, fallback: &str, id: &str, index: usize) -> Result<(Prompt, Params), String> {
        let mut value: Value = serde_json::from_slice(&self.body).map_err(|e| e.to_string())?;
        value["model"] = Value::String(fallback.to_string());
        let body = serde_json::to_vec(&value).map_err(|e| e.to_string())?;
        let job = read_job(&self.state, Ok(Bytes::from(body)), id, self.chat).map_err(|e| e.message)?;
        let prompt = job
            .prompts
            .into_iter()
            .nth(index)
            .ok_or("the fallback reads fewer prompts")?;
        Ok((prompt, job.params))
    }
}

/// Where one choice's generation goes: its text as it comes when it is streamed, and its end.
pub(super) struct Out {
    pub(super) sink: Option<generation::Sink>,
    pub(super) end: oneshot::Sender<Result<Generated, Refused>>,
}

/// Run each of the job's choices (`outs`, one per choice in the job's order) as a generation
/// of its own, all at once so that they batch on their pool: each prompt placed as one request
/// (`base`, request `id`); with `resend`, a prompt's model's fallback may answer it instead.
pub(super) async fn generate_all(
    service: &Service,
    job: &Job,
    base: Request,
    id: &str,
    outs: Vec<Out>,
    resend: Option<Arc<Resend>>,
) {
    let mut outs = outs.into_iter();
    let entry = service.model(&job.model).expect("checked by text_model");
    // A request's own prompts wait for each other's runs rather than fill the pool's queue.
    let gate = Semaphore::new(generation::prompts_at_once(service, entry));
    let prompts = job.prompts.iter().enumerate().map(|(index, prompt)| {
        let outs: Vec<Out> = outs.by_ref().take(job.n).collect();
        let resend = resend.as_ref().map(|r| (Arc::clone(r), index));
        generate(
            service,
            (&job.model, prompt.clone(), &job.params),
            (base.clone(), &gate),
            id,
            outs,
            resend,
        )
    });
    futures_util::future::join_all(prompts.collect::<Vec<_>>()).await;
}

/// Run one prompt's generations (one per `outs`: OpenAI's `n`) as `base` (request `id`): its
/// one run, once `gate` lets it (the request's prompts placed at once), then each generation
/// from its own copy of the cache, its deltas to its sink when it is streamed and its end to
/// its `out`; with `resend` (and the prompt's index in the body), the model's fallback may
/// answer instead.
async fn generate(
    service: &Service,
    job: (&str, Prompt, &Params),
    (base, gate): (Request, &Semaphore),
    id: &str,
    outs: Vec<Out>,
    resend: Option<(Arc<Resend>, usize)>,
) {
    let (model, prompt, params) = job;
    let entry = service.model(model).expect("checked by text_model");
    let permit = gate.acquire().await.expect("the gate is never closed");
    let mut base = base;
    // Admitted as its `n` generations: one run of the prompt, a cache for each.
    base.generations = outs.len() as u64;
    let placed = match generation::place(service, entry, prompt, params, base).await {
        Ok(Placed::Prefilled(prefilled)) => Ok(prefilled),
        Ok(Placed::Fallback(fallback)) => {
            let rebuilt = match &resend {
                Some((resend, index)) => resend.job_for(fallback.model(), id, *index),
                None => Err("nothing can make its prompt again".to_string()),
            };
            fallback.place(rebuilt).await
        }
        Err(refused) => Err(refused),
    };
    drop(permit);
    let prefilled = match placed {
        Ok(prefilled) => prefilled,
        Err(refused) => {
            for out in outs {
                let _ = out.end.send(Err(refused.clone()));
            }
            return;
        }
    };
    let runs = prefilled
        .fork(outs.len())
        .into_iter()
        .zip(outs)
        .map(|(prefilled, out)| async move {
            let generated = prefilled.run(out.sink).await;
            let _ = out.end.send(generated);
        });
    futures_util::future::join_all(runs).await;
}

/// An answer's `usage`: each prompt's tokens once, however many choices it has, and every
/// choice's tokens.
#[derive(Debug, Default)]
pub(super) struct Usage {
    prompt: usize,
    completion: usize,
}

impl Usage {
    /// Count choice `index` of a job of `n` generations per prompt.
    pub(super) fn add(&mut self, n: usize, index: usize, generated: &Generated) {
        if index.is_multiple_of(n.max(1)) {
            self.prompt += generated.prompt_tokens;
        }
        self.completion += generated.tokens.len();
    }

    /// OpenAI's `usage` object.
    pub(super) fn json(&self) -> Value {
        serde_json::json!({"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                           "total_tokens": self.prompt + self.completion})
    }
}
