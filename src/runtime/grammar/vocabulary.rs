//! A model's vocabulary as `llguidance` reads it: the bytes each token id stands for, read
//! from the model's own `tokenizers::Tokenizer` (see [`super`]), and the trie
//! over them.

use llguidance::toktrie::{TokTrie, TokenizerEnv};
use serde_json::Value;

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

/// How a tokenizer's pieces become text.
#[derive(Debug, PartialEq)]
enum Spelling {
    /// Byte-level BPE (GPT-2, Llama 3, Qwen): each character of a piece stands for one byte.
    ByteLevel,
    /// SentencePiece (Llama 2, Mistral, Gemma, Phi-3): `space` stands for a space, and with
    /// `byte_fallback`, `<0xXX>` for that byte.
    Pieces { space: char, byte_fallback: bool },
}

/// How `tokenizer`'s decoder spells its pieces, read from its serialized form (the decoders of
/// a sequence are not public otherwise).
fn spelling(tokenizer: &tokenizers::Tokenizer) -> Result<Spelling, String> {
    let decoder = tokenizer.get_decoder().ok_or("its tokenizer has no decoder")?;
    let decoder = serde_json::to_value(decoder).map_err(|e| e.to_string())?;
    let parts = match decoder["decoders"].as_array() {
        Some(parts) => parts.clone(),
        None => vec![decoder.clone()],
    };
    let single = |s: &Value| {
        let mut chars = s.as_str()?.chars();
        chars.next().filter(|_| chars.next().is_none())
    };
    let (mut byte_level, mut byte_fallback, mut space) = (false, false, None);
    for part in &parts {
        match part["type"].as_str() {
            Some("ByteLevel") => byte_level = true,
            Some("ByteFallback") => byte_fallback = true,
            Some("Metaspace") => space = single(&part["replacement"]),
            Some("Replace") if part["content"] == " " => space = single(&part["pattern"]["String"]),
            _ => {}
        }
    }
    match (byte_level, space) {
        (true, _) => Ok(Spelling::ByteLevel),
        (false, Some(space)) => Ok(Spelling::Pieces { space, byte_fallback }),
        (false, None) => Err(format!(
            "its tokenizer's decoder ({}) is neither byte-level nor SentencePiece's",
            decoder["type"]
        )),
    }
}

/// GPT-2's byte-level alphabet: the character each byte is written as.
fn byte_level_alphabet() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (char::from(b), b)
            } else {
                next += 1;
                (char::from_u32(next - 1).expect("below the surrogates"), b)
            }
        })
        .collect()
}

/// The bytes each of `tokenizer`'s token ids stands for: added tokens their text (a special
/// one marked with [`TokTrie::SPECIAL_TOKEN_MARKER`], so a grammar never produces it as
/// text), the model's pieces as its decoder spells them. An id with no token, or a piece whose
/// bytes cannot be told, is empty: never allowed.
pub(super) fn token_bytes(tokenizer: &tokenizers::Tokenizer) -> Result<Vec<Vec<u8>>, String> {
    let spelling = spelling(tokenizer)?;
    let alphabet = byte_level_alphabet();
    let added = tokenizer.get_added_tokens_decoder();
    let size = tokenizer.get_vocab(true).values().max().map_or(0, |&m| m + 1);
    Ok((0..size)
        .map(|id| {
            if let Some(token) = added.get(&id) {
                let marker = token.special.then_some(TokTrie::SPECIAL_TOKEN_MARKER);
                return marker.into_iter().chain(token.content.bytes()).collect();
            }
            let Some(piece) = tokenizer.id_to_token(id) else {
                return Vec::new();
            };
            match spelling {
                Spelling::ByteLevel => piece
                    .chars()
                    .map(|c| alphabet.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_default(),
                Spelling::Pieces { space, byte_fallback } => {
                    let byte = piece
                        .strip_prefix("<0x")
                        .and_then(|hex| hex.strip_suffix('>'))
                        .filter(|hex| byte_fallback && hex.len() == 2)
                        .and_then(|hex| u8::from_str_radix(hex, 16).ok());
                    match byte {
                        Some(byte) => vec![byte],
                        None => piece.replace(space, " ").into_bytes(),
                    }
                }
            }
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

    /// A SentencePiece-style tokenizer as Llama 2, Mistral and Phi-3 ship theirs: `▁` for a
    /// space, `<0xXX>` byte fallback for what the vocabulary lacks, and the decoder sequence
    /// that strips the first space.
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
        let config = json!({
            "version": "1.0",
            "added_tokens": [
                {"id": 0, "content": "<unk>", "special": true, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false},
                {"id": 1, "content": "<s>", "special": true, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false},
                {"id": 2, "content": "</s>", "special": true, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false},
            ],
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
            "pre_tokenizer": null,
            "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                      "vocab": vocab, "merges": merges},
        });
        tokenizers::Tokenizer::from_bytes(config.to_string()).unwrap()
    }

    /// Text with what a tokenizer spells in unusual ways: spaces, accents, characters several
    /// bytes long, an emoji, JSON punctuation and a non-special added token.
    const SAMPLE: &str = "héllo wörld {\"a\": [1, 2.5e-3, true, null]} 日本語 🎉\n\t<tool_call> done";

    #[test]
    fn each_token_s_bytes_are_what_the_fixtures_tokenizers_decode() {
        for (path, tokenizer) in fixture_tokenizers() {
            assert_eq!(spelling(&tokenizer).unwrap(), Spelling::ByteLevel, "{path}");
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
        let tokenizer = sentencepiece();
        assert_eq!(
            spelling(&tokenizer).unwrap(),
            Spelling::Pieces {
                space: '▁',
                byte_fallback: true
            }
        );
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
