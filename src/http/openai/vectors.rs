//! What `/v1/embeddings` reads and answers, whichever kind of model embeds (a sentence encoder,
//! `embeddings`; a dual encoder's tower, `images`): the request's common fields
//! (`encoding_format`, `dimensions`, `truncate`) and the answer's body, each vector a `data`
//! item of floats or base64.

use base64::Engine;
use serde_json::{Value, json};

use super::error::OpenAiError;
use crate::serve::encoders::embed::Vectors;

/// The answer's body: each vector of `answer` a `data` item, as floats or base64 (as asked), for
/// `model`.
pub(super) fn body(answer: Vectors, (model, base64): (String, bool)) -> Value {
    let data: Vec<Value> = (answer.vectors.into_iter().enumerate())
        .map(|(index, vector)| item(index, vector, base64))
        .collect();
    let tokens = answer.tokens;
    json!({"object": "list", "data": data, "model": model,
           "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
}

/// The `data` item of the input at `index`: its vector, as floats or base64 of its
/// little-endian f32s.
fn item(index: usize, vector: Vec<f32>, base64: bool) -> Value {
    let embedding = match base64 {
        true => {
            let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
            json!(base64::engine::general_purpose::STANDARD.encode(bytes))
        }
        false => json!(vector),
    };
    json!({"object": "embedding", "index": index, "embedding": embedding})
}

/// The fields every embeddings request may have, whichever kind of model embeds.
pub(super) struct Fields {
    /// `encoding_format`: the vectors go as base64 (else floats).
    pub(super) base64: bool,
    /// `dimensions`: how many of each vector's to keep (the model's job checks it has them).
    pub(super) dimensions: Option<usize>,
    /// `truncate` (TEI's): an input longer than the model takes is cut rather than refused;
    /// `None` when the request does not say (the model's `auto_truncate` decides).
    pub(super) truncate: Option<bool>,
}

/// `body`'s [`Fields`], each checked in that order.
pub(super) fn fields(body: &Value) -> Result<Fields, OpenAiError> {
    Ok(Fields {
        base64: encoding_format(body)?,
        dimensions: dimensions(body)?,
        truncate: truncate(body)?,
    })
}

/// `encoding_format`: whether the vectors go as base64 (else floats).
fn encoding_format(body: &Value) -> Result<bool, OpenAiError> {
    match &body["encoding_format"] {
        Value::Null => Ok(false),
        Value::String(f) if f == "float" => Ok(false),
        Value::String(f) if f == "base64" => Ok(true),
        other => Err(OpenAiError::invalid(
            format!("`encoding_format` is {other}; it is `float` or `base64`"),
            Some("encoding_format"),
        )),
    }
}

/// `dimensions`, a number above 0.
fn dimensions(body: &Value) -> Result<Option<usize>, OpenAiError> {
    match &body["dimensions"] {
        Value::Null => Ok(None),
        v => match v.as_u64().filter(|n| *n > 0) {
            Some(n) => Ok(Some(n as usize)),
            None => Err(OpenAiError::invalid(
                format!("`dimensions` is {v}, not a number above 0"),
                Some("dimensions"),
            )),
        },
    }
}

/// `truncate`, true or false when given.
fn truncate(body: &Value) -> Result<Option<bool>, OpenAiError> {
    match &body["truncate"] {
        Value::Null => Ok(None),
        Value::Bool(b) => Ok(Some(*b)),
        other => Err(OpenAiError::invalid(
            format!("`truncate` is {other}, not true or false"),
            Some("truncate"),
        )),
    }
}
