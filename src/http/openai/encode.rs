//! What `POST /v1/embeddings` and `POST /v1/rerank` share: a body parsed into a job of
//! [`crate::serve::encoders`], handed down through its one door, and the answer sent with the
//! headers every answer has (model, decision, pool); with the speech endpoints, its id on every
//! answer ([`respond`]) and a refusal saying when the server is degraded ([`refusal`]).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tokio::time::Instant;

use super::error::OpenAiError;
use crate::core::snapshot::Action;
use crate::http::error::outcome_of_status;
use crate::http::headers::{decode_headers, model_header, pool_headers, request_id, with_request_id};
use crate::http::state::AppState;
use crate::protocol::headers::DECISION_HEADER;
use crate::serve::encoders::{self, Failure, Job};
use crate::serve::lifecycle;
use crate::serve::ran::RanOn;
use crate::serve::service::{Service, UNKNOWN_MODEL};

/// Answer one request of an encoder's API (`/v1/embeddings`, `/v1/rerank`): `read` parses
/// `body` (as [`parse`] gave it, naming a model: [`model_named`]) into its job and what its
/// answer's format needs, the job goes down through the one door ([`encoders::run`]), and
/// `format` makes the answer's body of what comes back, sent with the headers every answer
/// has. A request refused while it is read, or for its headers, is counted here; the door
/// counts the rest.
pub(super) async fn encoded<J: Job, F>(
    state: &AppState,
    (headers, body, id, received): (&HeaderMap, Result<Value, OpenAiError>, &str, Instant),
    read: impl FnOnce(&AppState, Value, String, &str) -> Result<(J, F), OpenAiError>,
    format: impl FnOnce(J::Answer, F) -> Value,
) -> Result<Response, OpenAiError> {
    let service = &state.service;
    let named = body.as_ref().ok().and_then(|v| v["model"].as_str()).map(str::to_string);
    let checked = body.and_then(|value| {
        let model = model_named(&value)?;
        read(state, value, model, id)
    });
    let checked = checked.and_then(|(job, how)| {
        let request = decode_headers(service, job.model(), id, headers, received)
            .map_err(|e| OpenAiError::from_request(&e, id))?;
        Ok((job, how, request.meta))
    });
    let (job, how, meta) = checked.inspect_err(|error| {
        let model = named.as_deref().unwrap_or(UNKNOWN_MODEL);
        lifecycle::answered(service, model, outcome_of_status(error.status), received);
    })?;
    let model = job.model().to_string();
    let done = encoders::run(service, &state.batching, job, meta, received)
        .await
        .map_err(|failure| match failure {
            Failure::Invalid(invalid) => OpenAiError::invalid(invalid.message, invalid.field),
            Failure::Refused(refused) => refusal(service, &refused, id),
            Failure::Internal(message) => OpenAiError::internal(message, id),
        })?;
    let body = format(done.answer, how);
    Ok(stamped(
        &model,
        done.action,
        &done.ran,
        axum::Json(body).into_response(),
    ))
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

/// A refusal in OpenAI's shape, saying when the server is degraded.
pub(super) fn refusal(service: &Service, refused: &lifecycle::Refused, id: &str) -> OpenAiError {
    let mut error = OpenAiError::from_request(&refused.error, id);
    if let Some(reason) = service.degraded_reason() {
        error.message = format!("{} (degraded: {reason})", error.message);
    }
    error
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
fn model_named(body: &Value) -> Result<String, OpenAiError> {
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
