//! What `/v1/embeddings` answers with, whichever model embeds: the request's common fields
//! (`encoding_format`, `dimensions`, `truncate`), a text's tokens within the model's limit, and
//! each vector's `data` item. Sentence-transformers folders (`embeddings`) and dual encoders'
//! towers (`images`) both answer through it; the run and the headers are [`super::encode`]'s.

use base64::Engine;
use serde_json::{Value, json};

use super::error::OpenAiError;
use crate::runtime::embedder::normalize;
use crate::runtime::leading::leading;

/// The `data` item of the input at `index`: its vector cut to `dimensions`, as floats or
/// base64.
pub(super) fn item(
    index: usize,
    vector: Vec<f32>,
    dimensions: Option<usize>,
    normalizes: bool,
    base64: bool,
) -> Result<Value, OpenAiError> {
    let vector = cut(vector, dimensions, normalizes)?;
    let embedding = match base64 {
        true => {
            let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
            json!(base64::engine::general_purpose::STANDARD.encode(bytes))
        }
        false => json!(vector),
    };
    Ok(json!({"object": "embedding", "index": index, "embedding": embedding}))
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

/// `encoding_format`: whether the vectors go as base64 (else floats).
pub(super) fn encoding_format(body: &Value) -> Result<bool, OpenAiError> {
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

/// `dimensions`: how many of each vector's to keep, at most the model's `size` (when known).
pub(super) fn dimensions(body: &Value, size: Option<usize>) -> Result<Option<usize>, OpenAiError> {
    match &body["dimensions"] {
        Value::Null => Ok(None),
        v => match v.as_u64().filter(|n| *n > 0) {
            Some(n) => {
                let n = n as usize;
                match size {
                    Some(size) if n > size => Err(dimensions_above(n, size)),
                    _ => Ok(Some(n)),
                }
            }
            None => Err(OpenAiError::invalid(
                format!("`dimensions` is {v}, not a number above 0"),
                Some("dimensions"),
            )),
        },
    }
}

/// `truncate` (TEI's): whether an input longer than the model takes is cut rather than refused;
/// when the request does not say, the model's `auto_truncate`.
pub(super) fn truncate(body: &Value, auto: bool) -> Result<bool, OpenAiError> {
    match &body["truncate"] {
        Value::Null => Ok(auto),
        Value::Bool(b) => Ok(*b),
        other => Err(OpenAiError::invalid(
            format!("`truncate` is {other}, not true or false"),
            Some("truncate"),
        )),
    }
}

/// The tokens of `text`, `input[i]`, with the model's special tokens: at most `limit`, or cut
/// to it when the client allows (`truncate`), as sentence-transformers cuts them (its own
/// tokens first, then `[CLS]`, `[SEP]` around what is left). Only as much of `text` as
/// `limit` tokens span is read ([`leading`]): a text of megabytes costs what the model takes.
pub(super) fn text_tokens(
    tokenizer: &tokenizers::Tokenizer,
    i: usize,
    text: &str,
    limit: Option<(usize, &'static str)>,
    truncate: bool,
) -> Result<Vec<u32>, OpenAiError> {
    use tokenizers::PostProcessor;
    let invalid = |message: String| OpenAiError::invalid(message, Some("input"));
    if text.is_empty() {
        return Err(invalid(format!("`input[{i}]` is an empty string")));
    }
    let unreadable = |e: tokenizers::Error| invalid(format!("`input[{i}]` cannot be tokenized: {e}"));
    let Some((limit, what)) = limit else {
        // Nothing says how many the model takes: the whole text.
        return Ok(tokenizer.encode(text, true).map_err(unreadable)?.get_ids().to_vec());
    };
    let added = tokenizer.get_post_processor().map_or(0, |p| p.added_tokens(false));
    let own = leading(tokenizer, text, limit.saturating_sub(added)).map_err(unreadable)?;
    if own.cut() && !truncate {
        return Err(too_long(i, own.total.map(|n| n + added), (limit, what)));
    }
    let encoding = tokenizer.post_process(own.encoding, None, true).map_err(unreadable)?;
    within(i, encoding.get_ids().to_vec(), Some((limit, what)))
}

/// `ids`, when `input[i]` has no more than `limit` tokens.
pub(super) fn within(i: usize, ids: Vec<u32>, limit: Option<(usize, &'static str)>) -> Result<Vec<u32>, OpenAiError> {
    match limit {
        Some(limit) if ids.len() > limit.0 => Err(too_long(i, Some(ids.len()), limit)),
        _ => Ok(ids),
    }
}

/// The 400 for `input[i]`, of `tokens` (not counted past the limit when `None`), above the
/// model's limit.
fn too_long(i: usize, tokens: Option<usize>, (limit, what): (usize, &'static str)) -> OpenAiError {
    let how = match tokens {
        Some(n) => format!("has {n} tokens, above the model's {what} of {limit}"),
        None => format!("is longer than the model's {what} of {limit} tokens"),
    };
    OpenAiError::invalid(
        format!("`input[{i}]` {how}; shorten it, or send `truncate: true` to cut it"),
        Some("input"),
    )
}
