//! Log-probabilities in OpenAI's shapes: chat's `logprobs: {"content": [{token, logprob, bytes,
//! top_logprobs}]}` and completions' `logprobs: {tokens, token_logprobs, top_logprobs,
//! text_offset}`. A token's `bytes` are exact ([`Spelling`], the answering model's); its `token`
//! text is those bytes read as UTF-8, a part of a character as U+FFFD.

use serde_json::{Map, Value, json};

use crate::serve::generation::{Spelling, TokenLogprobs};

/// Chat's `logprobs` of `tokens`.
pub(super) fn chat(bytes: &Spelling, tokens: &[TokenLogprobs]) -> Value {
    let entry = |id: u32, logprob: f32| {
        let b = bytes.bytes(id);
        json!({"token": String::from_utf8_lossy(&b), "logprob": logprob, "bytes": b})
    };
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut token = entry(t.token, t.logprobs.logprob);
            token["top_logprobs"] = t.logprobs.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
            token
        })
        .collect();
    json!({ "content": content })
}

/// Completions' `logprobs` of `tokens` (`text_offset`: where each token's text starts in the
/// answer's text, in characters).
pub(super) fn completion(bytes: &Spelling, tokens: &[TokenLogprobs]) -> Value {
    let text = |id: u32| String::from_utf8_lossy(&bytes.bytes(id)).into_owned();
    let top = |t: &TokenLogprobs| -> Map<String, Value> {
        t.logprobs.top.iter().map(|&(id, lp)| (text(id), json!(lp))).collect()
    };
    json!({
        "tokens": tokens.iter().map(|t| text(t.token)).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprobs.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(top).collect::<Vec<_>>(),
        "text_offset": tokens.iter().map(|t| t.text_offset).collect::<Vec<_>>(),
    })
}
