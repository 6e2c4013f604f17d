//! `POST /v1/embeddings` for sentence encoders ([`crate::serve::encoders::embed`]): the
//! request's fields read into an embed job (its inputs: texts, or token ids as sent), handed
//! down through the encoders' door, and each vector it answers with sent as floats or base64. A
//! request for a dual encoder's tower goes to `images`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::Value;
use tokio::time::Instant;

use super::encode;
use super::error::OpenAiError;
use super::images;
use super::vectors;
use crate::http::state::AppState;
use crate::serve::encoders::embed::{Asked, Embed, Input};
use crate::serve::service::{Api, Kind};

/// `POST /v1/embeddings`.
pub async fn embeddings(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let (state, headers) = (&*state, &headers);
    encode::respond(headers, |id, received| async move {
        serve(state, headers, body, &id, received).await
    })
    .await
}

/// Read, run and answer one request; a request for a dual encoder's tower goes to [`images`].
async fn serve(
    state: &AppState,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    id: &str,
    received: Instant,
) -> Result<Response, OpenAiError> {
    let parsed = encode::parse(body, id);
    if let Ok(value) = &parsed
        && images::serves(state, value)
    {
        return images::serve(state, (headers, parsed, id, received)).await;
    }
    encode::encoded(state, (headers, parsed, id, received), read, vectors::body).await
}

/// Read and check a body into an [`Embed`] job, with the model's name and whether its vectors
/// go as base64. `user` (OpenAI's abuse monitoring) is accepted and not read, as any field
/// this server does not know.
fn read(state: &AppState, mut body: Value, model: String, id: &str) -> Result<(Embed, (String, bool)), OpenAiError> {
    let (entry, parts) = super::model_for(state, &model, Api::Embeddings, id, Kind::embedder)?;
    let fields = vectors::fields(&body)?;
    let asked = Asked {
        inputs: inputs(body["input"].take())?,
        dimensions: fields.dimensions,
        truncate: fields.truncate,
    };
    let job = Embed::new(entry, parts, asked).map_err(|e| OpenAiError::invalid(e.message, e.field))?;
    Ok((job, (model, fields.base64)))
}

/// `input`'s inputs, in OpenAI's forms: a string, a list of strings, a list of token ids, or a
/// list of lists of token ids (not strings and lists together), none empty.
fn inputs(input: Value) -> Result<Vec<Input>, OpenAiError> {
    let invalid = |message: String| OpenAiError::invalid(message, Some("input"));
    let items = match input {
        Value::String(text) => return Ok(vec![Input::Text(text)]),
        Value::Array(items) if items.is_empty() => return Err(invalid("`input` is an empty list".into())),
        Value::Array(items) if items.iter().all(Value::is_number) => {
            return Ok(vec![Input::Ids(items)]);
        }
        Value::Array(items) => items,
        Value::Null => return Err(invalid("`input` is missing".into())),
        other => {
            return Err(invalid(format!(
                "`input` is {other}; it is a string, a list of strings, a list of token ids or a list of lists of token ids"
            )));
        }
    };
    let first = |f: fn(&Value) -> bool| items.iter().position(f);
    if let (Some(text), Some(list)) = (first(Value::is_string), first(Value::is_array)) {
        return Err(invalid(format!(
            "`input[{text}]` is a string and `input[{list}]` a list of token ids; `input` is a list of strings or a list of lists of token ids, not both"
        )));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::String(text) => Ok(Input::Text(text)),
            Value::Array(list) if list.is_empty() => Err(invalid(format!("`input[{i}]` is an empty list of tokens"))),
            Value::Array(list) => Ok(Input::Ids(list)),
            other => Err(invalid(format!(
                "`input[{i}]` is {other}; each input is a string or a list of token ids"
            ))),
        })
        .collect()
}
