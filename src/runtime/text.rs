//! A generation's text as its tokens come, at a cost per token that does not grow with the
//! answer: each token decodes only itself and a few tokens before it, and stop strings are
//! looked for only where a new one could have appeared.
//!
//! Decoding token by token and joining the pieces is wrong in two ways: a character may take
//! several byte-level tokens (the first alone decodes to U+FFFD), and some decoders read a
//! token differently at the start of a text (SentencePiece drops its leading space). So
//! [`Detokenizer`] keeps two offsets into the tokens, as serving engines do: `prefix`, where
//! the window it decodes starts, and `read`, up to which the text is final. Each token decodes
//! `tokens[prefix..]` and `tokens[prefix..read]`; what the first adds to the second is new text,
//! unless it ends in an unfinished character, which waits for the tokens that finish it.

use std::sync::Arc;

/// The text of a growing list of tokens, decoded incrementally. Special tokens are left out, as
/// when the whole list is decoded with `skip_special_tokens`.
#[derive(Clone)]
pub struct Detokenizer {
    tokenizer: Arc<tokenizers::Tokenizer>,
    tokens: Vec<u32>,
    /// Where the window decoded for each token starts: the tokens before `read` in it only give
    /// the new ones their context.
    prefix: usize,
    /// Tokens up to here are in `text`.
    read: usize,
    text: String,
}

impl Detokenizer {
    /// Nothing decoded yet.
    pub fn new(tokenizer: Arc<tokenizers::Tokenizer>) -> Detokenizer {
        Detokenizer {
            tokenizer,
            tokens: Vec::new(),
            prefix: 0,
            read: 0,
            text: String::new(),
        }
    }

    /// Add a token; its text, if it finishes any, is appended to [`Detokenizer::text`].
    pub fn push(&mut self, id: u32) -> Result<(), String> {
        self.tokens.push(id);
        let before = self.decode(self.prefix..self.read)?;
        let now = self.decode(self.prefix..self.tokens.len())?;
        // An unfinished character (or a token that adds nothing yet) waits for the next ones.
        if now.ends_with('\u{FFFD}') {
            return Ok(());
        }
        if let Some(new) = now.get(before.len()..).filter(|new| !new.is_empty()) {
            self.text.push_str(new);
            self.prefix = self.read;
            self.read = self.tokens.len();
        }
        Ok(())
    }

    /// The text of every finished character so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Every token pushed.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Whether the last tokens' text waits (an unfinished character, or tokens that add no
    /// text yet): they are not in [`Detokenizer::text`].
    pub fn waiting(&self) -> bool {
        self.read < self.tokens.len()
    }

    /// The tokens and their whole text, with what still waited (an unfinished character at the
    /// end reads as U+FFFD, as when the whole list is decoded).
    pub fn finish(mut self) -> Result<(Vec<u32>, String), String> {
        let before = self.decode(self.prefix..self.read)?;
        let now = self.decode(self.prefix..self.tokens.len())?;
        if let Some(rest) = now.get(before.len()..) {
            self.text.push_str(rest);
        }
        Ok((self.tokens, self.text))
    }

    fn decode(&self, range: std::ops::Range<usize>) -> Result<String, String> {
        if range.is_empty() {
            return Ok(String::new());
        }
        self.tokenizer
            .decode(&self.tokens[range], true)
            .map_err(|e| format!("cannot decode the tokens: {e}"))
    }
}

/// The bytes of text each token of a tokenizer stands for, read as its decoder reads them but
/// token by token: exact where a token holds part of a character (a byte-level BPE token, or
/// SentencePiece's byte fallback `<0xE2>`), which decoding the token alone would turn into
/// U+FFFD, and with the space SentencePiece's `▁` stands for even where a decoder strips it at
/// the start of a text. A decoder of another kind is read by decoding the token alone.
pub struct TokenBytes {
    tokenizer: Arc<tokenizers::Tokenizer>,
    reading: Reading,
}

/// How a tokenizer's decoder reads a token.
enum Reading {
    /// GPT-2's byte-level BPE: each character of a token stands for one byte (a token that has
    /// another character, an added token, is its UTF-8, as the decoder reads it).
    ByteLevel,
    /// SentencePiece's pieces: `space` (`▁`, as its `Metaspace` or `Replace` decoder names it)
    /// is a space and, with byte fallback, `<0xNN>` is byte NN.
    Pieces { space: char, byte_fallback: bool },
    /// Anything else: the token decoded alone.
    Decoded,
}

impl TokenBytes {
    /// How `tokenizer`'s decoder reads a token, from its kinds (a `Sequence`'s members).
    pub fn new(tokenizer: Arc<tokenizers::Tokenizer>) -> TokenBytes {
        let decoder = tokenizer
            .get_decoder()
            .and_then(|d| serde_json::to_value(d).ok())
            .unwrap_or_default();
        let members = match decoder["decoders"].as_array() {
            Some(members) => members.clone(),
            None => vec![decoder],
        };
        let has = |kind: &str| members.iter().any(|m| m["type"] == kind);
        // The one character a `Metaspace` decoder (or a `Replace` of it by a space) reads as a
        // space.
        let single = |s: &serde_json::Value| {
            let mut chars = s.as_str()?.chars();
            chars.next().filter(|_| chars.next().is_none())
        };
        let space = members.iter().find_map(|m| match m["type"].as_str() {
            Some("Metaspace") => single(&m["replacement"]),
            Some("Replace") if m["content"] == " " => single(&m["pattern"]["String"]),
            _ => None,
        });
        let byte_fallback = has("ByteFallback");
        let reading = match (has("ByteLevel"), space) {
            (true, _) => Reading::ByteLevel,
            (false, Some(space)) => Reading::Pieces { space, byte_fallback },
            (false, None) if byte_fallback => Reading::Pieces {
                space: '▁',
                byte_fallback,
            },
            (false, None) => Reading::Decoded,
        };
        TokenBytes { tokenizer, reading }
    }

    /// Whether every token's bytes are read from its piece (byte-level BPE or SentencePiece),
    /// not by decoding it alone, which loses the bytes of part of a character.
    pub fn exact(&self) -> bool {
        !matches!(self.reading, Reading::Decoded)
    }

    /// The bytes token `id` stands for (none for an id the tokenizer does not have).
    pub fn bytes(&self, id: u32) -> Vec<u8> {
        let Some(token) = self.tokenizer.id_to_token(id) else {
            return Vec::new();
        };
        match self.reading {
            Reading::ByteLevel => token
                .chars()
                .map(byte_level)
                .collect::<Option<Vec<u8>>>()
                .unwrap_or_else(|| token.into_bytes()),
            Reading::Pieces { space, byte_fallback } => {
                let byte = token
                    .strip_prefix("<0x")
                    .and_then(|t| t.strip_suffix('>'))
                    .filter(|hex| byte_fallback && hex.len() == 2)
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok());
                match byte {
                    Some(byte) => vec![byte],
                    None => token.replace(space, " ").into_bytes(),
                }
            }
            Reading::Decoded => self.tokenizer.decode(&[id], false).unwrap_or_default().into_bytes(),
        }
    }
}

/// The byte a character of GPT-2's byte-level alphabet stands for: the printable bytes are
/// their own character, and the other 68 (0 to 32, 127 to 160 and 173), in order, are U+0100
/// on.
fn byte_level(c: char) -> Option<u8> {
    match u32::from(c) {
        n @ (0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF) => Some(n as u8),
        n @ 0x100..=0x120 => Some((n - 0x100) as u8),
        n @ 0x121..=0x142 => Some((n - 0x121 + 127) as u8),
        0x143 => Some(173),
        _ => None,
    }
}

/// Where a search for `patterns` in a text that grew from `from` bytes must start, so that
/// it finds every occurrence that was not already whole in the text's first `from` bytes: the
/// longest pattern's length less one before `from`, on a character boundary.
pub fn tail_start(text: &str, from: usize, patterns: &[String]) -> usize {
    let longest = patterns.iter().map(String::len).max().unwrap_or(0);
    let mut start = from.min(text.len()).saturating_sub(longest.saturating_sub(1));
    while !text.is_char_boundary(start) {
        start -= 1;
    }
    start
}

/// The first place in `text` where one of `patterns` starts, looking only from `start` on.
pub fn first_at(text: &str, start: usize, patterns: &[String]) -> Option<usize> {
    let tail = &text[start..];
    patterns
        .iter()
        .filter_map(|p| tail.find(p.as_str()))
        .min()
        .map(|at| start + at)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A SentencePiece-style tokenizer as Llama 2, Mistral and Phi-3 ship theirs (`▁` for a
    /// space, `<0xXX>` byte fallback for what the vocabulary lacks, and the decoder sequence
    /// that strips the first space), of `vocab` (piece to id), `merges` and `added` tokens.
    pub(crate) fn sentencepiece(
        vocab: serde_json::Value,
        merges: serde_json::Value,
        added: serde_json::Value,
    ) -> tokenizers::Tokenizer {
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
            "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                      "vocab": vocab, "merges": merges}
        });
        tokenizers::Tokenizer::from_bytes(json.to_string()).expect("a SentencePiece tokenizer")
    }

    /// The decoder fixture's tokenizer (a generation's text is tested with it too).
    pub(crate) fn fixture() -> Arc<tokenizers::Tokenizer> {
        let json = crate::core::model::BuiltinModel::Decoder
            .tokenizer()
            .expect("ships one");
        Arc::new(tokenizers::Tokenizer::from_bytes(json).expect("the fixture's tokenizer"))
    }

    /// Pushes `tokens` one at a time, checking after each that the text so far is the start
    /// of the whole decode; gives what it finishes with.
    fn incrementally(tokenizer: &Arc<tokenizers::Tokenizer>, tokens: &[u32]) -> String {
        let mut text = Detokenizer::new(Arc::clone(tokenizer));
        for (i, &id) in tokens.iter().enumerate() {
            text.push(id).unwrap();
            let whole = tokenizer.decode(&tokens[..=i], true).unwrap();
            assert!(
                whole.starts_with(text.text()),
                "{:?} is not the start of {whole:?}",
                text.text()
            );
            assert!(
                !text.text().ends_with('\u{FFFD}'),
                "an unfinished character was let through"
            );
        }
        let (pushed, finished) = text.finish().unwrap();
        assert_eq!(pushed, tokens);
        finished
    }

    #[test]
    fn multi_byte_characters_come_out_whole_once_their_last_byte_arrives() {
        let tokenizer = fixture();
        let prose = "Grüße aus Köln: 東京 🎉 naïve café, ½ — done.";
        let tokens = tokenizer.encode(prose, false).unwrap().get_ids().to_vec();
        // Byte-level tokens: the rarer characters take several, the first of which is no text.
        assert!(tokens.len() > prose.chars().count() / 2, "{tokens:?}");
        let mut text = Detokenizer::new(Arc::clone(&tokenizer));
        let mut seen = Vec::new();
        for &id in &tokens {
            text.push(id).unwrap();
            seen.push(text.text().to_string());
        }
        assert!(
            seen.iter().any(|s| s.ends_with("Gr")),
            "text came before the 'ü' finished: {seen:?}"
        );
        assert!(seen.iter().all(|s| prose.starts_with(s.as_str())), "{seen:?}");
        assert_eq!(text.text(), tokenizer.decode(&tokens, true).unwrap());
        assert_eq!(
            incrementally(&tokenizer, &tokens),
            tokenizer.decode(&tokens, true).unwrap()
        );
    }

    #[test]
    fn an_unfinished_character_at_the_end_is_in_the_finished_text_as_the_whole_decode_has_it() {
        let tokenizer = fixture();
        let tokens = tokenizer.encode("ok 🎉", false).unwrap().get_ids().to_vec();
        let cut = &tokens[..tokens.len() - 1];
        let mut text = Detokenizer::new(Arc::clone(&tokenizer));
        for &id in cut {
            text.push(id).unwrap();
        }
        let whole = tokenizer.decode(cut, true).unwrap();
        assert!(whole.ends_with('\u{FFFD}'), "{whole:?}");
        assert_eq!(text.text(), whole.trim_end_matches('\u{FFFD}'));
        assert!(text.text().starts_with("ok"));
        assert_eq!(text.finish().unwrap().1, whole);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Any tokens of the fixture's vocabulary (special ones too, which decode to nothing),
        /// decoded a token at a time, give the whole decode, over long generations.
        #[test]
        fn incremental_text_is_the_whole_decode(tokens in proptest::collection::vec(0u32..512, 0..600)) {
            let tokenizer = fixture();
            prop_assert_eq!(incrementally(&tokenizer, &tokens), tokenizer.decode(&tokens, true).unwrap());
        }
    }

    /// A byte-level tokenizer's tokens stand for the bytes its decoder gives them, one
    /// character split over several tokens included: together they are the text's bytes,
    /// though such a token alone is not UTF-8.
    #[test]
    fn byte_level_tokens_are_their_exact_bytes() {
        let tokenizer = fixture();
        let bytes = TokenBytes::new(Arc::clone(&tokenizer));
        assert!(matches!(bytes.reading, Reading::ByteLevel));
        for id in 0..tokenizer.get_vocab_size(true) as u32 {
            let alone = tokenizer.decode(&[id], false).unwrap();
            if !alone.contains('\u{FFFD}') {
                assert_eq!(bytes.bytes(id), alone.as_bytes(), "token {id}");
            }
        }
        let text = "Grüße aus Köln, 東京: ok";
        let ids = tokenizer.encode(text, false).unwrap().get_ids().to_vec();
        let each: Vec<Vec<u8>> = ids.iter().map(|&id| bytes.bytes(id)).collect();
        assert_eq!(each.concat(), text.as_bytes());
        assert!(
            each.iter().any(|b| std::str::from_utf8(b).is_err()),
            "a token holds part of a character"
        );
    }

    /// SentencePiece's pieces with byte fallback (Llama 2's, Mistral's): `▁` is a space, kept
    /// at the start too, and `<0xC3>` is that byte.
    #[test]
    fn sentencepiece_pieces_and_fallback_bytes_are_their_exact_bytes() {
        let mut vocab = serde_json::json!({"<unk>": 0});
        for b in 0..=255u32 {
            vocab[format!("<0x{b:02X}>")] = serde_json::json!(b + 1);
        }
        for (i, piece) in ["▁", "h", "i", "▁h", "▁hi"].iter().enumerate() {
            vocab[*piece] = serde_json::json!(257 + i);
        }
        let merges = serde_json::json!(["▁ h", "▁h i"]);
        let tokenizer = Arc::new(sentencepiece(vocab, merges, serde_json::json!([])));
        let ids = tokenizer.encode("hi é", false).unwrap().get_ids().to_vec();
        assert_eq!(ids, [261, 257, 0xC3 + 1, 0xA9 + 1]);
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), "hi é");
        let bytes = TokenBytes::new(Arc::clone(&tokenizer));
        let each: Vec<Vec<u8>> = ids.iter().map(|&id| bytes.bytes(id)).collect();
        assert_eq!(each, [b" hi".to_vec(), b" ".to_vec(), vec![0xC3], vec![0xA9]]);
        assert_eq!(bytes.bytes(9999), Vec::<u8>::new(), "an id the tokenizer does not have");
    }

    #[test]
    fn a_search_from_the_tail_finds_what_the_new_text_completed() {
        let stop = vec!["<|im_end|>".to_string(), "END".to_string()];
        let text = "héllo wörld <|im_";
        let grown = format!("{text}end|> more");
        let start = tail_start(&grown, text.len(), &stop);
        assert!(
            start < text.find('<').unwrap(),
            "the stop string began before the new text"
        );
        assert_eq!(first_at(&grown, start, &stop), grown.find("<|im_end|>"));
        // A character boundary, even when the window starts inside a multi-byte character.
        let text = "ééééé";
        for from in 0..=text.len() {
            assert!(text.is_char_boundary(tail_start(text, from, &["xyz".into()])));
        }
        assert_eq!(first_at("abc", tail_start("abc", 3, &[]), &[]), None);
    }
}
