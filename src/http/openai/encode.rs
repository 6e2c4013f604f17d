//! What `POST /v1/embeddings` and `POST /v1/rerank` share: a body read and checked into a job
//! naming its model, its rows run as one request through the lifecycle (their number the batch
//! axis; with other requests' rows when the model has `batching`), and the answer sent with the headers every answer has (model, decision, pool).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tokio::time::Instant;

use super::error::OpenAiError;
use crate::core::snapshot::Action;
use crate::core::tensor::Tensor;
use crate::http::error::outcome_of_status;
use crate::http::headers::{decode_headers, model_header, pool_headers, request_id, with_request_id};
use crate::http::state::AppState;
use crate::protocol::headers::DECISION_HEADER;
use crate::serve::lifecycle::{self, Served};
use crate::serve::metrics::Outcome;
use crate::serve::ran::RanOn;
use crate::serve::service::{ModelEntry, Service, UNKNOWN_MODEL};

/// A checked request: the model it names.
pub(super) trait Job {
    /// The configured model it runs on.
    fn model(&self) -> &str;
}

/// Read `body` (as [`parse`] gave it, which `read` takes, its texts with it) into a job with
/// `read`, build its inputs with `inputs` (the tensors and the one output to ask for), and run
/// them through the lifecycle; the job and the output that came back. A request refused while
/// it is read is counted here, and one whose client goes away while it is read (its texts
/// being tokenized: [`blocking`]) is counted `cancelled`; one that reaches the lifecycle is
/// counted there.
pub(super) async fn run<J: Job>(
    state: &AppState,
    (headers, body, id, received): (&HeaderMap, Result<Value, OpenAiError>, &str, Instant),
    read: impl AsyncFnOnce(&AppState, Value, &str) -> Result<J, OpenAiError>,
    inputs: impl FnOnce(&ModelEntry, &J) -> (Vec<Tensor>, &'static str),
) -> Result<(J, Served, Tensor), OpenAiError> {
    let service = &state.service;
    let mut reading = Reading {
        service,
        model: UNKNOWN_MODEL.to_string(),
        received,
        armed: true,
    };
    let checked = match body {
        Ok(value) => {
            if let Some(model) = value["model"].as_str() {
                reading.model = model.to_string();
            }
            read(state, value, id).await
        }
        Err(error) => Err(error),
    }
    .and_then(|job| {
        let request = decode_headers(service, job.model(), id, headers, received)
            .map_err(|e| OpenAiError::from_request(&e, id))?;
        Ok((job, request))
    });
    reading.armed = false;
    let (job, mut request) = match checked {
        Ok(checked) => checked,
        Err(error) => {
            lifecycle::answered(service, &reading.model, outcome_of_status(error.status), received);
            return Err(error);
        }
    };
    let entry = service.model(job.model()).expect("checked by read");
    let (tensors, output) = inputs(entry, &job);
    request.inputs = tensors;
    request.outputs = vec![output.to_string()];
    // Its rows are right-padded with the attention mask at 0 over the padding: it may share a
    // run with other requests' rows of other lengths (`models[].batching`).
    request.pads = true;
    // A model's fallback would need the inputs tokenized again by its own tokenizer; nothing
    // rebuilds them for it yet, so it never answers here.
    request.allow_substitute = false;
    let mut served = state
        .batching
        .infer(request)
        .await
        .map_err(|refused| refusal(service, &refused, id))?;
    let at = served
        .outputs
        .iter()
        .position(|t| t.name == output)
        .ok_or_else(|| OpenAiError::internal(format!("the run gave no `{output}`"), id))?;
    let given = served.outputs.swap_remove(at);
    Ok((job, served, given))
}

/// A request being read, counted `cancelled` when its future is dropped then (its client went
/// away), as [`lifecycle::Counted`] counts one dropped later.
struct Reading<'a> {
    service: &'a Service,
    /// The model the body names, once read.
    model: String,
    received: Instant,
    /// Set until the body is read.
    armed: bool,
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        if self.armed {
            lifecycle::answered(self.service, &self.model, Outcome::cancelled, self.received);
        }
    }
}

/// Run `work` (tokenizing a request's texts, decoding its audio: CPU work of up to seconds) off
/// the async runtime, stopped when the client goes away
/// ([`until_dropped`](crate::core::blocking::until_dropped)).
pub(super) async fn blocking<T: Send + 'static>(
    id: &str,
    work: impl FnOnce(&dyn Fn() -> bool) -> Result<T, OpenAiError> + Send + 'static,
) -> Result<T, OpenAiError> {
    crate::core::blocking::until_dropped(work).await.map_err(|e| {
        // `work` catches what a client's input can make it do: this is a fault of ours, or a
        // shutdown, whose detail is for the log.
        tracing::error!(error = %e, "reading a request did not finish");
        OpenAiError::internal("reading the request failed".into(), id)
    })?
}

/// An endpoint's response to a request with `headers`: what `serve` answers (given the
/// request's id, kept or made, and when it arrived), or its error in OpenAI's shape, with the
/// id in `x-request-id` either way.
pub(super) async fn respond<F>(headers: &HeaderMap, serve: impl FnOnce(String, Instant) -> F) -> Response
where
    F: Future<Output = Result<Response, OpenAiError>>,
{
    let received = Instant::now();
    let id = request_id(headers);
    let response = serve(id.clone(), received)
        .await
        .unwrap_or_else(IntoResponse::into_response);
    with_request_id(response, &id)
}

/// The body of a request: JSON, or the 400 saying why not.
pub(super) fn parse(body: Result<Bytes, BytesRejection>, id: &str) -> Result<Value, OpenAiError> {
    let body = body.map_err(|e| OpenAiError::unreadable(&e, id))?;
    super::body::parse(&body)
}

/// Run `request` through the lifecycle; a refusal in OpenAI's shape, saying when the server
/// is degraded.
pub(super) async fn infer(service: &Service, request: lifecycle::Request, id: &str) -> Result<Served, OpenAiError> {
    lifecycle::infer(service, request)
        .await
        .map_err(|refused| refusal(service, &refused, id))
}

/// A refusal in OpenAI's shape, saying when the server is degraded.
pub(super) fn refusal(service: &Service, refused: &lifecycle::Refused, id: &str) -> OpenAiError {
    let mut error = OpenAiError::from_request(&refused.error, id);
    if let Some(reason) = service.degraded_reason() {
        error.message = format!("{} (degraded: {reason})", error.message);
    }
    error
}

/// `body` as the answer to a request for `model` that `served` ran, with its headers.
pub(super) fn answer(state: &AppState, model: &str, served: &Served, body: Value) -> Response {
    let ran = state.service.ran_on(&served.pool, model);
    stamped(model, served.action, &ran, axum::Json(body).into_response())
}

/// `response` with the headers every answer has: the model, the decision that placed it and
/// where it ran (saying when it is degraded).
pub(super) fn stamped(model: &str, action: Action, ran: &RanOn, mut response: Response) -> Response {
    let out = response.headers_mut();
    model_header(out, model);
    out.insert(
        HeaderName::from_static(DECISION_HEADER),
        HeaderValue::from_static(action.label()),
    );
    pool_headers(out, ran);
    response
}

/// The model named in `body`'s `model`: a string, or the 400 naming it.
pub(super) fn model_named(body: &Value) -> Result<String, OpenAiError> {
    if !body.is_object() {
        return Err(OpenAiError::invalid("the body is not a JSON object", None));
    }
    match &body["model"] {
        Value::String(model) => Ok(model.clone()),
        Value::Null => Err(OpenAiError::invalid("`model` is missing", Some("model"))),
        other => Err(OpenAiError::invalid(
            format!("`model` is {other}, not a string"),
            Some("model"),
        )),
    }
}

/// The most tokens a row may have, and what sets it: `max_seq_length` when the folder gives
/// one, or the positions the model takes (`config.json`'s `max_position_embeddings`), the
/// smaller.
pub(super) fn limit(entry: &ModelEntry, max_seq_length: Option<u64>) -> Option<(usize, &'static str)> {
    let seq = max_seq_length.map(|n| (n as usize, "max_seq_length"));
    let positions = entry.folder.context.map(|n| (n as usize, "max_position_embeddings"));
    match (seq, positions) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}
