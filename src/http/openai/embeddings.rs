//! `POST /v1/embeddings` for sentence-transformers folders ([`crate::runtime::embedder`]): the
//! request's inputs (text, tokenized with the model's special tokens, or token ids as sent) run
//! as one request through the lifecycle, their batch axis the number of inputs, padded to the
//! longest; each vector pooled from `last_hidden_state` as the folder says, cut to `dimensions`
//! (then normalized again when the model normalizes) and sent as floats or base64.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::error::OpenAiError;
use crate::http::error::outcome_of_status;
use crate::http::headers::{decode_headers, model_header, pool_headers, request_id, with_request_id};
use crate::http::state::AppState;
use crate::protocol::headers::DECISION_HEADER;
use crate::runtime::embedder::{Embedder, HIDDEN_STATE, normalize};
use crate::serve::lifecycle;
use crate::serve::service::{ModelEntry, UNKNOWN_MODEL};

/// A checked embeddings request: its inputs' token ids and how to answer.
struct Job {
    /// The model named.
    model: String,
    /// Each input's tokens, in the request's order.
    inputs: Vec<Vec<u32>>,
    /// Send each vector as base64 of its little-endian f32s.
    base64: bool,
    /// Keep the first this many dimensions.
    dimensions: Option<usize>,
}

/// `POST /v1/embeddings`.
pub async fn embeddings(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let received = Instant::now();
    let id = request_id(&headers);
    let response = match serve(&state, &headers, body, &id, received).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    };
    with_request_id(response, &id)
}

/// Read, run and answer one request. A request refused while it is read is counted here; one
/// that reaches the lifecycle is counted there.
async fn serve(
    state: &AppState,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    id: &str,
    received: Instant,
) -> Result<Response, OpenAiError> {
    let service = &state.service;
    let mut named = UNKNOWN_MODEL.to_string();
    let checked = body
        .map_err(|e| OpenAiError::unreadable(&e, id))
        .and_then(|body| {
            let value: Value = serde_json::from_slice(&body)
                .map_err(|e| OpenAiError::invalid(format!("the body is not JSON: {e}"), None))?;
            if let Some(model) = value["model"].as_str() {
                named = model.to_string();
            }
            read(state, &value, id)
        })
        .and_then(|job| {
            let request = decode_headers(service, &job.model, id, headers, received)
                .map_err(|e| OpenAiError::from_request(&e, id))?;
            Ok((job, request))
        });
    let (job, mut request) = match checked {
        Ok(checked) => checked,
        Err(error) => {
            lifecycle::answered(service, &named, outcome_of_status(error.status), received);
            return Err(error);
        }
    };
    let entry = service.model(&job.model).expect("checked by read");
    let embedder = entry.embedder.expect("checked by read");
    let lengths: Vec<usize> = job.inputs.iter().map(Vec::len).collect();
    // The padding's id is never seen: the attention mask leaves it out of every token's
    // attention and the pooling reads only the tokens it keeps.
    request.inputs = Embedder::batch(&entry.signature, &job.inputs, 0);
    request.outputs = vec![HIDDEN_STATE.to_string()];
    // Its padding is masked out: it may share a run with other requests' inputs of other
    // lengths (`models[].batching`).
    request.pads = true;
    // A model's fallback would need the inputs tokenized again by its own tokenizer; nothing
    // rebuilds them for it yet, so it never answers here.
    request.allow_substitute = false;
    let served = state.batching.infer(request).await.map_err(|refused| {
        let mut error = OpenAiError::from_request(&refused.error, id);
        if let Some(d) = service.degraded.now() {
            error.message = format!("{} (degraded: {})", error.message, d.reason);
        }
        error
    })?;
    let hidden = served
        .outputs
        .iter()
        .find(|t| t.name == HIDDEN_STATE)
        .ok_or_else(|| OpenAiError::internal(format!("the run gave no `{HIDDEN_STATE}`"), id))?;
    let vectors = embedder
        .pool(hidden, &lengths)
        .map_err(|e| OpenAiError::internal(e, id))?;
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(index, vector)| {
            let vector = cut(vector, job.dimensions, embedder.normalize)?;
            let embedding = match job.base64 {
                true => {
                    let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
                    json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                }
                false => json!(vector),
            };
            Ok(json!({"object": "embedding", "index": index, "embedding": embedding}))
        })
        .collect::<Result<Vec<Value>, OpenAiError>>()?;
    let tokens: usize = lengths.iter().sum();
    let body = json!({"object": "list", "data": data, "model": job.model,
                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}});
    let mut response = axum::Json(body).into_response();
    let out = response.headers_mut();
    model_header(out, &job.model);
    out.insert(
        HeaderName::from_static(DECISION_HEADER),
        HeaderValue::from_static(served.action.label()),
    );
    let degraded = service.degraded.for_answer(&served.pool, &job.model);
    pool_headers(out, &served.pool, degraded.as_ref());
    Ok(response)
}

/// `vector` cut to its first `dimensions` (Matryoshka), normalized again when the model
/// normalizes, as sentence-transformers' `truncate_dim` then `normalize` would.
fn cut(mut vector: Vec<f32>, dimensions: Option<usize>, normalizes: bool) -> Result<Vec<f32>, OpenAiError> {
    let Some(dimensions) = dimensions else {
        return Ok(vector);
    };
    if dimensions > vector.len() {
        return Err(dimensions_above(dimensions, vector.len()));
    }
    vector.truncate(dimensions);
    if normalizes {
        normalize(&mut vector);
    }
    Ok(vector)
}

/// The 400 for `dimensions` above the model's.
fn dimensions_above(dimensions: usize, size: usize) -> OpenAiError {
    OpenAiError::invalid(
        format!("`dimensions` is {dimensions}, above the model's {size}"),
        Some("dimensions"),
    )
}

/// Read and check a body into a [`Job`]. `user` (OpenAI's abuse monitoring) is accepted and
/// not read, as any field this server does not know.
fn read(state: &AppState, body: &Value, id: &str) -> Result<Job, OpenAiError> {
    if !body.is_object() {
        return Err(OpenAiError::invalid("the body is not a JSON object", None));
    }
    let model = match &body["model"] {
        Value::String(model) => model.clone(),
        Value::Null => return Err(OpenAiError::invalid("`model` is missing", Some("model"))),
        other => {
            return Err(OpenAiError::invalid(
                format!("`model` is {other}, not a string"),
                Some("model"),
            ));
        }
    };
    let entry = embedding_model(state, &model, id)?;
    let embedder = entry.embedder.expect("checked by embedding_model");
    let base64 = match &body["encoding_format"] {
        Value::Null => false,
        Value::String(f) if f == "float" => false,
        Value::String(f) if f == "base64" => true,
        other => {
            return Err(OpenAiError::invalid(
                format!("`encoding_format` is {other}; it is `float` or `base64`"),
                Some("encoding_format"),
            ));
        }
    };
    let size = entry
        .signature
        .outputs
        .iter()
        .find(|o| o.name == HIDDEN_STATE)
        .and_then(|o| usize::try_from(o.shape[2]).ok());
    let dimensions = match &body["dimensions"] {
        Value::Null => None,
        v => match v.as_u64().filter(|n| *n > 0) {
            Some(n) => {
                let n = n as usize;
                match size {
                    Some(size) if n > size => return Err(dimensions_above(n, size)),
                    _ => Some(n),
                }
            }
            None => {
                return Err(OpenAiError::invalid(
                    format!("`dimensions` is {v}, not a number above 0"),
                    Some("dimensions"),
                ));
            }
        },
    };
    let truncate = match &body["truncate"] {
        Value::Null => false,
        Value::Bool(b) => *b,
        other => {
            return Err(OpenAiError::invalid(
                format!("`truncate` is {other}, not true or false"),
                Some("truncate"),
            ));
        }
    };
    let limit = limit(entry, &embedder);
    let inputs = tokens(entry, &body["input"], limit, truncate)?;
    Ok(Job {
        model,
        inputs,
        base64,
        dimensions,
    })
}

/// The model named, when it embeds: an unknown one is OpenAI's 404, one that does not embed a
/// 400 naming `model`.
fn embedding_model<'a>(state: &'a AppState, model: &str, id: &str) -> Result<&'a ModelEntry, OpenAiError> {
    let service = &state.service;
    let entry = service
        .model(model)
        .ok_or_else(|| OpenAiError::unknown_model(service, model, id))?;
    if entry.embedder.is_none() || entry.tokenizer.is_none() {
        return Err(OpenAiError::invalid(
            format!(
                "model `{model}` does not embed (it needs a sentence-transformers folder: `modules.json` with a Pooling module)"
            ),
            Some("model"),
        ));
    }
    Ok(entry)
}

/// The most tokens an input may have, and what sets it: the folder's `max_seq_length`, or the
/// positions the model takes (`config.json`'s `max_position_embeddings`), the smaller.
fn limit(entry: &ModelEntry, embedder: &Embedder) -> Option<(usize, &'static str)> {
    let seq = embedder.max_seq_length.map(|n| (n as usize, "max_seq_length"));
    let positions = entry.folder.context.map(|n| (n as usize, "max_position_embeddings"));
    match (seq, positions) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// `input`'s token ids, one list per input: a string or strings tokenized with the model's
/// special tokens, token ids (one list or several) as sent; each at most `limit`, or cut to it
/// when the client allows (`truncate`).
fn tokens(
    entry: &ModelEntry,
    input: &Value,
    limit: Option<(usize, &'static str)>,
    truncate: bool,
) -> Result<Vec<Vec<u32>>, OpenAiError> {
    let tokenizer = entry.tokenizer.as_ref().expect("checked by embedding_model");
    let invalid = |message: String| OpenAiError::invalid(message, Some("input"));
    let texts_or_ids: Vec<Result<&str, Vec<u32>>> = match input {
        Value::String(text) => vec![Ok(text.as_str())],
        Value::Array(items) if items.is_empty() => return Err(invalid("`input` is an empty list".into())),
        Value::Array(items) if items.iter().all(Value::is_number) => vec![Err(ids(items, tokenizer)?)],
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(text) => Ok(Ok(text.as_str())),
                Value::Array(ids_of) => ids(ids_of, tokenizer).map(Err),
                other => Err(invalid(format!(
                    "`input[{i}]` is {other}; each input is a string or a list of token ids"
                ))),
            })
            .collect::<Result<_, _>>()?,
        Value::Null => return Err(invalid("`input` is missing".into())),
        other => {
            return Err(invalid(format!(
                "`input` is {other}; it is a string, a list of strings, a list of token ids or a list of lists of token ids"
            )));
        }
    };
    texts_or_ids
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            let ids = match item {
                Ok(text) => {
                    if text.is_empty() {
                        return Err(invalid(format!("`input[{i}]` is an empty string")));
                    }
                    let encoded = tokenizer
                        .encode(text, true)
                        .map_err(|e| invalid(format!("`input[{i}]` cannot be tokenized: {e}")))?;
                    match limit {
                        Some((limit, _)) if truncate && encoded.len() > limit => cut_text(tokenizer, text, limit)
                            .map_err(|e| invalid(format!("`input[{i}]` cannot be tokenized: {e}")))?,
                        _ => encoded.get_ids().to_vec(),
                    }
                }
                Err(ids) if ids.is_empty() => return Err(invalid(format!("`input[{i}]` is an empty list of tokens"))),
                Err(mut ids) => {
                    if let Some((limit, _)) = limit.filter(|_| truncate) {
                        ids.truncate(limit);
                    }
                    ids
                }
            };
            if let Some((limit, what)) = limit
                && ids.len() > limit
            {
                return Err(invalid(format!(
                    "`input[{i}]` has {} tokens, above the model's {what} of {limit}; shorten it, or send `truncate: true` to cut it",
                    ids.len()
                )));
            }
            Ok(ids)
        })
        .collect()
}

/// `text`'s tokens cut to `limit` as sentence-transformers cuts them: its own tokens cut
/// first, then the special tokens (`[CLS]`, `[SEP]`) added around what is left.
fn cut_text(tokenizer: &tokenizers::Tokenizer, text: &str, limit: usize) -> tokenizers::Result<Vec<u32>> {
    use tokenizers::PostProcessor;
    let added = tokenizer.get_post_processor().map_or(0, |p| p.added_tokens(false));
    let mut encoding = tokenizer.encode(text, false)?;
    encoding.truncate(limit.saturating_sub(added), 0, tokenizers::TruncationDirection::Right);
    Ok(tokenizer.post_process(encoding, None, true)?.get_ids().to_vec())
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
