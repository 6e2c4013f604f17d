//! A text's tokens within its model's limit, as embeddings and a dual encoder's text tower
//! read them: the limit a model's folder sets, a text's tokens refused or cut to it as the
//! client asks, and the refusal of an input above it.

use tokenizers::Tokenizer;

use super::job::Invalid;
use crate::runtime::leading::leading;
use crate::serve::service::ModelEntry;

/// The most tokens a row may have, and what sets it (for the refusal's message).
pub(super) type Limit = Option<(usize, &'static str)>;

/// The most tokens a row of `entry` may have: `max_seq_length` when the folder gives one, or
/// the positions the model takes (`config.json`'s `max_position_embeddings`), the smaller.
pub(super) fn limit(entry: &ModelEntry, max_seq_length: Option<u64>) -> Limit {
    let seq = max_seq_length.map(|n| (n as usize, "max_seq_length"));
    let positions = entry.folder.context.map(|n| (n as usize, "max_position_embeddings"));
    match (seq, positions) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// The tokens of `text`, `input[i]`, with the model's special tokens: at most `limit`, or cut
/// to it when the client allows (`truncate`), as sentence-transformers cuts them (its own
/// tokens first, then `[CLS]`, `[SEP]` around what is left). Only as much of `text` as
/// `limit` tokens span is read ([`leading`]): a text of megabytes costs what the model takes.
pub(super) fn text_tokens(
    tokenizer: &Tokenizer,
    i: usize,
    text: &str,
    limit: Limit,
    truncate: bool,
) -> Result<Vec<u32>, Invalid> {
    use tokenizers::PostProcessor;
    let invalid = |message: String| Invalid::new(message, Some("input"));
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
pub(super) fn within(i: usize, ids: Vec<u32>, limit: Limit) -> Result<Vec<u32>, Invalid> {
    match limit {
        Some(limit) if ids.len() > limit.0 => Err(too_long(i, Some(ids.len()), limit)),
        _ => Ok(ids),
    }
}

/// The refusal of `input[i]`, of `tokens` (not counted past the limit when `None`), above the
/// model's limit.
fn too_long(i: usize, tokens: Option<usize>, (limit, what): (usize, &'static str)) -> Invalid {
    let how = match tokens {
        Some(n) => format!("has {n} tokens, above the model's {what} of {limit}"),
        None => format!("is longer than the model's {what} of {limit} tokens"),
    };
    Invalid::new(
        format!("`input[{i}]` {how}; shorten it, or send `truncate: true` to cut it"),
        Some("input"),
    )
}
