//! A model's vocabulary as `llguidance` reads it: the bytes each token id stands for, read
//! from the model's own `tokenizers::Tokenizer` (see [`super`]), and the trie
//! over them.

use llguidance::toktrie::{TokTrie, TokenizerEnv};
use std::sync::Arc;

use crate::runtime::text::TokenBytes;

/// A vocabulary as `llguidance` reads it.
pub(super) struct Vocabulary(pub(super) TokTrie);

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.0
    }

    /// Bytes to tokens through the trie, longest match first: only what a grammar spells out
    /// itself is tokenized here, never the prompt.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.0.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// The bytes each of `tokenizer`'s token ids stands for: added tokens their text (a special
/// one marked with [`TokTrie::SPECIAL_TOKEN_MARKER`], so a grammar never produces it as
/// text), the model's pieces as its decoder reads them ([`TokenBytes`]). An id with no token
/// is empty: never allowed. A decoder whose pieces' bytes cannot be read exactly is refused.
pub(super) fn token_bytes(tokenizer: &Arc<tokenizers::Tokenizer>) -> Result<Vec<Vec<u8>>, String> {
    let pieces = TokenBytes::new(Arc::clone(tokenizer));
    if !pieces.exact() {
        let decoder = tokenizer
            .get_decoder()
            .and_then(|d| serde_json::to_value(d).ok())
            .unwrap_or_default();
        return Err(format!(
            "its tokenizer's decoder ({}) is neither byte-level nor SentencePiece's",
            decoder["type"]
        ));
    }
    let added = tokenizer.get_added_tokens_decoder();
    let size = tokenizer.get_vocab(true).values().max().map_or(0, |&m| m + 1);
    Ok((0..size)
        .map(|id| match added.get(&id) {
            Some(token) => {
                let marker = token.special.then_some(TokTrie::SPECIAL_TOKEN_MARKER);
                marker.into_iter().chain(token.content.bytes()).collect()
            }
            None => pieces.bytes(id),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::chat::TOOL_CALL_OPEN;
    use serde_json::json;

    /// Every tokenizer of the real-model fixtures (one per family and exporter).
    fn fixture_tokenizers() -> Vec<(String, tokenizers::Tokenizer)> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/real");
        let mut found: Vec<_> = std::fs::read_dir(&root)
            .unwrap()
            .filter_map(|d| {
                let path = d.ok()?.path().join("tokenizer.json");
                path.exists().then_some(path)
            })
            .map(|p| (p.display().to_string(), tokenizers::Tokenizer::from_file(&p).unwrap()))
            .collect();
        found.sort_by(|a, b| a.0.cmp(&b.0));
        assert!(found.len() >= 5, "the fixtures' tokenizers: {}", found.len());
        found
    }

    /// [`crate::runtime::text::tests::sentencepiece`] with the pieces the sample text needs.
    fn sentencepiece() -> tokenizers::Tokenizer {
        let mut vocab = serde_json::Map::new();
        for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
            vocab.insert(t.to_string(), json!(i));
        }
        for b in 0..=255u32 {
            vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
        }
        for piece in [
            "▁", "{", "▁{", "\"", "a", "b", "h", "é", "hé", "l", "o", ":", "}", "1", "▁1", "▁hé", "ll", "lo",
        ] {
            let id = vocab.len();
            vocab.insert(piece.to_string(), json!(id));
        }
        let merges = [["▁", "{"], ["▁", "1"], ["h", "é"], ["▁", "hé"], ["l", "l"], ["l", "o"]];
        let special = |id: u32, content: &str| {
            json!({"id": id, "content": content, "special": true, "single_word": false,
                   "lstrip": false, "rstrip": false, "normalized": false})
        };
        let added = json!([special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")]);
        crate::runtime::text::tests::sentencepiece(json!(vocab), json!(merges), added)
    }

    /// Text with what a tokenizer spells in unusual ways: spaces, accents, characters several
    /// bytes long, an emoji, JSON punctuation and a non-special added token.
    const SAMPLE: &str = "héllo wörld {\"a\": [1, 2.5e-3, true, null]} 日本語 🎉\n\t<tool_call> done";

    #[test]
    fn each_token_s_bytes_are_what_the_fixtures_tokenizers_decode() {
        for (path, tokenizer) in fixture_tokenizers() {
            let tokenizer = Arc::new(tokenizer);
            let words = token_bytes(&tokenizer).unwrap();
            let ids = tokenizer.encode(SAMPLE, false).unwrap().get_ids().to_vec();
            let bytes: Vec<u8> = ids.iter().flat_map(|&id| words[id as usize].clone()).collect();
            assert_eq!(
                String::from_utf8(bytes).unwrap(),
                tokenizer.decode(&ids, true).unwrap(),
                "{path}"
            );
            // The special tokens are marked, never text; `<tool_call>` (added, not special) is.
            for name in ["<|im_end|>", "<|eot_id|>", "</s>", "<end_of_turn>", "<|end|>"] {
                let id = tokenizer.token_to_id(name).unwrap() as usize;
                assert_eq!(words[id][0], TokTrie::SPECIAL_TOKEN_MARKER, "{path}: {name}");
            }
            let call = tokenizer.token_to_id(TOOL_CALL_OPEN).unwrap() as usize;
            assert_eq!(words[call], TOOL_CALL_OPEN.as_bytes(), "{path}");
        }
    }

    #[test]
    fn sentencepiece_pieces_are_spaces_and_fallback_bytes() {
        let tokenizer = Arc::new(sentencepiece());
        let words = token_bytes(&tokenizer).unwrap();
        let ids = tokenizer.encode(SAMPLE, false).unwrap().get_ids().to_vec();
        let pieces: Vec<String> = ids.iter().map(|&id| tokenizer.id_to_token(id).unwrap()).collect();
        assert!(
            pieces.contains(&"▁hé".to_string()) && pieces.contains(&"<0xE6>".to_string()),
            "{pieces:?}"
        );
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| words[id as usize].clone()).collect();
        // The decoder strips the space SentencePiece put before the text; each token's bytes
        // keep theirs.
        let decoded = tokenizer.decode(&ids, true).unwrap();
        assert_eq!(String::from_utf8(bytes).unwrap(), format!(" {decoded}"));
        assert_eq!(decoded, SAMPLE);
        assert_eq!(words[2][0], TokTrie::SPECIAL_TOKEN_MARKER);
    }
}
