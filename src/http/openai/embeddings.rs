//! `POST /v1/embeddings` for sentence-transformers folders ([`crate::runtime::embedder`]): the
//! request's inputs (text, tokenized with the model's special tokens, or token ids as sent) run
//! as one request through the lifecycle, their batch axis the number of inputs, padded to the
//! longest; each vector as the graph pooled it (or pooled here from `last_hidden_state`, for a
//! graph kept as exported), cut to `dimensions` (then normalized again when the model
//! normalizes) and sent as floats or base64.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::encode;
use super::error::OpenAiError;
use super::images;
use super::vectors::{dimensions, encoding_format, item, text_tokens, truncate, within};
use crate::http::state::AppState;
use crate::runtime::embedder::Embedder;
use crate::serve::service::{Api, Kind};

/// A checked embeddings request: its inputs' token ids and how to answer.
struct Job {
    /// The model named.
    model: String,
    /// How its token vectors are pooled.
    embedder: Embedder,
    /// Each input's tokens, in the request's order.
    inputs: Vec<Vec<u32>>,
    /// Send each vector as base64 of its little-endian f32s.
    base64: bool,
    /// Keep the first this many dimensions.
    dimensions: Option<usize>,
}

impl encode::Job for Job {
    fn model(&self) -> &str {
        &self.model
    }
}

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
        return images::serve(state, headers, value, id, received).await;
    }
    let (job, served, given) = encode::run(state, (headers, parsed, id, received), read, |entry, job: &Job| {
        // The padding's id is never seen: the attention mask leaves it out of every token's
        // attention and the pooling reads only the tokens it keeps.
        let inputs = Embedder::batch(&entry.signature, &job.inputs, 0);
        (inputs, Embedder::output(&entry.signature))
    })
    .await?;
    let lengths: Vec<usize> = job.inputs.iter().map(Vec::len).collect();
    let embedder = job.embedder;
    let vectors = embedder
        .vectors(&given, &lengths)
        .map_err(|e| OpenAiError::internal(e, id))?;
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(index, vector)| item(index, vector, job.dimensions, embedder.normalize, job.base64))
        .collect::<Result<Vec<Value>, OpenAiError>>()?;
    let tokens: usize = lengths.iter().sum();
    let body = json!({"object": "list", "data": data, "model": job.model,
                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}});
    Ok(encode::answer(state, &job.model, &served, body))
}

/// Read and check a body into a [`Job`], its texts tokenized off the async runtime (stopping
/// when the client goes away). `user` (OpenAI's abuse monitoring) is accepted and not read, as
/// any field this server does not know.
async fn read(state: &AppState, mut body: Value, id: &str) -> Result<Job, OpenAiError> {
    let model = encode::model_named(&body)?;
    let (entry, (embedder, tokenizer)) = super::model_for(state, &model, Api::Embeddings, id, Kind::embedder)?;
    let tokenizer = Arc::clone(tokenizer);
    let base64 = encoding_format(&body)?;
    let dimensions = dimensions(&body, Embedder::size(&entry.signature))?;
    let truncate = truncate(&body, entry.config.auto_truncate)?;
    let limit = encode::limit(entry, embedder.max_seq_length);
    let inputs = inputs(body["input"].take(), &tokenizer)?;
    let inputs = encode::blocking(id, move |gone| {
        inputs
            .into_iter()
            .enumerate()
            .map(|(i, input)| match input {
                _ if gone() => Err(OpenAiError::invalid("the client went away", None)),
                Input::Text(text) => text_tokens(&tokenizer, i, &text, limit, truncate),
                Input::Ids(mut ids) => {
                    if let Some((limit, _)) = limit.filter(|_| truncate) {
                        ids.truncate(limit);
                    }
                    within(i, ids, limit)
                }
            })
            .collect()
    })
    .await?;
    Ok(Job {
        model,
        embedder,
        inputs,
        base64,
        dimensions,
    })
}

/// One input as the body holds it.
enum Input {
    /// A text, to tokenize.
    Text(String),
    /// Token ids, as sent.
    Ids(Vec<u32>),
}

/// `input`'s inputs, in OpenAI's forms: a string, a list of strings, a list of token ids, or a
/// list of lists of token ids (not strings and lists together), none empty.
fn inputs(input: Value, tokenizer: &tokenizers::Tokenizer) -> Result<Vec<Input>, OpenAiError> {
    let invalid = |message: String| OpenAiError::invalid(message, Some("input"));
    let items = match input {
        Value::String(text) => return Ok(vec![Input::Text(text)]),
        Value::Array(items) if items.is_empty() => return Err(invalid("`input` is an empty list".into())),
        Value::Array(items) if items.iter().all(Value::is_number) => {
            return Ok(vec![Input::Ids(ids(&items, tokenizer)?)]);
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
            Value::Array(list) => ids(&list, tokenizer).map(Input::Ids),
            other => Err(invalid(format!(
                "`input[{i}]` is {other}; each input is a string or a list of token ids"
            ))),
        })
        .collect()
}

/// A list of token ids, each one of the model's.
fn ids(items: &[Value], tokenizer: &tokenizers::Tokenizer) -> Result<Vec<u32>, OpenAiError> {
    let vocabulary = tokenizer.get_vocab_size(true) as u64;
    items
        .iter()
        .map(|v| {
            v.as_u64().filter(|&t| t < vocabulary).map(|t| t as u32).ok_or_else(|| {
                OpenAiError::invalid(
                    format!(
                        "`input` holds {v}, not a token id of the model (0 to {})",
                        vocabulary - 1
                    ),
                    Some("input"),
                )
            })
        })
        .collect()
}
