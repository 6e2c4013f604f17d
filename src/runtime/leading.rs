//! A text's first tokens without tokenizing all of it, so that a text far longer than a model
//! takes costs what the model takes, not what the client sent: a 40 MB string tokenized whole
//! holds about 85 bytes per input byte (the normalized copy, its byte alignments, the
//! pre-tokenizer's splits and every token's offsets and text) for seconds.
//!
//! A prefix of the text is tokenized instead, and of its tokens only those the rest of the text
//! cannot change are kept: a tokenizer reads each pre-tokenized word alone (WordPiece, BPE,
//! Unigram), so the words before the prefix's last one are the whole text's, except where a
//! normalizer, a pre-tokenizer's pattern or an added token (`<|endoftext|>` cut in two) reads a
//! few characters across the cut; the tokens ending within [`MARGIN`] bytes of it (or the
//! longest added token, if longer) are left out too. When the prefix settles too few tokens
//! (long runs of what the pre-tokenizer drops, such as whitespace, or one long word), it
//! doubles, so the work is at most twice that of the prefix that does. A tokenizer without a
//! pre-tokenizer reads the whole text as one word: there, the prefix grows to the whole text.
//!
//! Embeddings and rerank keep the first tokens ([`leading`]); a generation's prompt is refused
//! when it has more than its model takes ([`encode_within`]), from the same prefix.

use tokenizers::{Encoding, Tokenizer, TruncationDirection};

/// The bytes before a prefix's end whose tokens are not kept: more than any pattern of a
/// normalizer or pre-tokenizer shipped with a model reads ahead.
const MARGIN: usize = 128;

/// The bytes of text the first prefix gives each token asked for: about twice what a token of
/// prose spans, so that the first prefix usually settles them all.
const BYTES_PER_TOKEN: usize = 8;

/// The start of a text's tokens.
#[derive(Debug)]
pub struct Leading {
    /// The text's first tokens, at most the number asked for, without special tokens (the
    /// tokenizer's `post_process` adds them), as tokenizing the whole text and cutting it
    /// gives them.
    pub encoding: Encoding,
    /// How many tokens the whole text has, when the prefix read was the whole text; `None`
    /// when it has more than the number asked for and the rest was not read.
    pub total: Option<usize>,
}

impl Leading {
    /// Whether the text has more tokens than `encoding` holds.
    pub fn cut(&self) -> bool {
        self.total != Some(self.encoding.len())
    }
}

/// The first `n` tokens of `text` (all of them when it has no more), without special tokens,
/// reading no more of `text` than they span (twice, at most) and a margin.
pub fn leading(tokenizer: &Tokenizer, text: &str, n: usize) -> tokenizers::Result<Leading> {
    let margin = tokenizer
        .get_added_tokens_decoder()
        .values()
        .map(|t| t.content.len())
        .fold(MARGIN, usize::max);
    let mut size = n
        .saturating_add(1)
        .saturating_mul(BYTES_PER_TOKEN)
        .saturating_add(margin);
    loop {
        let end = char_boundary(text, size);
        let mut encoding = tokenizer.encode(&text[..end], false)?;
        let whole = end == text.len();
        let settled = if whole {
            encoding.len()
        } else {
            settled(&encoding, end, margin)
        };
        if whole || settled > n {
            let total = whole.then_some(encoding.len());
            encoding.truncate(settled.min(n), 0, TruncationDirection::Right);
            // What truncating set aside is not wanted.
            drop(encoding.take_overflowing());
            return Ok(Leading { encoding, total });
        }
        size = size.saturating_mul(2);
    }
}

/// A text tokenized within a limit ([`encode_within`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bounded {
    /// Every token of the text: at most the limit.
    Tokens(Vec<u32>),
    /// More tokens than the limit: `at_least` of them were read.
    Over {
        /// Tokens read (more than the limit): the whole text's when `whole`.
        at_least: usize,
        /// Whether the whole text was read (`at_least` is then its count).
        whole: bool,
    },
}

/// Every token of `text` (with what the tokenizer adds to any text when `add_special`), or that
/// it has more than `limit`, found from its first `limit + 1` tokens ([`leading`]): refusing a
/// text far past the limit costs about what the longest text the limit allows costs.
pub fn encode_within(
    tokenizer: &Tokenizer,
    text: &str,
    add_special: bool,
    limit: usize,
) -> tokenizers::Result<Bounded> {
    let head = leading(tokenizer, text, limit.saturating_add(1))?;
    let (count, whole) = match head.total {
        Some(total) => (total, true),
        None => (head.encoding.len(), false),
    };
    if count > limit {
        return Ok(Bounded::Over { at_least: count, whole });
    }
    // The whole text was read and is within the limit: what the tokenizer adds to it, as
    // `encode` would have added it.
    let ids = tokenizer
        .post_process(head.encoding, None, add_special)?
        .get_ids()
        .to_vec();
    Ok(match ids.len() > limit {
        true => Bounded::Over {
            at_least: ids.len(),
            whole: true,
        },
        false => Bounded::Tokens(ids),
    })
}

/// The first char boundary of `text` at or after `at` (its length past the end).
fn char_boundary(text: &str, at: usize) -> usize {
    if at >= text.len() {
        return text.len();
    }
    (at..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len())
}

/// How many of the first tokens of `encoding`, the tokens of a prefix `end` bytes long, the
/// text after it cannot change: those of every word before the last, ending `margin` bytes or
/// more before `end`.
fn settled(encoding: &Encoding, end: usize, margin: usize) -> usize {
    let words = encoding.get_word_ids();
    let last = words.iter().rev().find_map(|w| *w);
    let offsets = encoding.get_offsets();
    (0..encoding.len())
        .take_while(|&i| (words[i].is_none() || words[i] != last) && offsets[i].1 + margin <= end)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// Tokenizers of every kind shipped here, each with an added token to write in a text.
    const TOKENIZERS: [(&str, &str); 4] = [
        // WordPiece behind BERT's normalizer and pre-tokenizer.
        ("models/embed/bert-mean-normalize/tokenizer.json", "[SEP]"),
        // Byte-level BPE behind GPT-2's pattern, with added tokens.
        ("models/embed/qwen3-lasttoken/tokenizer.json", "<|endoftext|>"),
        ("models/decoder/tokenizer.json", "<|im_end|>"),
        // CLIP's BPE: a lowercasing normalizer, words ending in `</w>`.
        ("models/embed/clip/tokenizer.json", "<|endoftext|>"),
    ];

    fn tokenizer(path: &str) -> Tokenizer {
        Tokenizer::from_file(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
    }

    /// Texts of every kind a tokenizer splits differently: prose, punctuation, numbers, accents
    /// and scripts a normalizer rewrites, long words, runs of whitespace, and added tokens
    /// written in the text.
    fn texts(added: &str) -> Vec<String> {
        let corpus =
            std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("models/decoder_corpus.txt")).unwrap();
        let mut texts = vec![
            corpus.clone(),
            corpus.replace(' ', "   \t"),
            format!("Grüße aus Köln: 東京タワー 🎉 naïve café, ½ — {added} they'll say it's 3.14159{added}{added}")
                .repeat(40),
            "supercalifragilisticexpialidocious".repeat(200),
            format!("{}{}", " ".repeat(5000), "the queue is full ".repeat(300)),
            "a,b;c.d!e?f".repeat(500),
            "12345678901234567890 ".repeat(300),
        ];
        // Words longer than WordPiece reads (100 characters: one `[UNK]` whole, pieces when cut).
        texts.push(format!("{} ", "abcdefghij".repeat(15)).repeat(30));
        // Cuts at every few bytes of a text with added tokens in it, as the prefixes end there.
        let head: String = corpus.chars().take(100).collect();
        let mixed = format!("{head}{added}").repeat(20);
        texts.extend((0..40).map(|i| format!("{}{mixed}", "x ".repeat(i))));
        texts
    }

    #[test]
    fn the_first_tokens_are_those_of_the_whole_text_cut() {
        for (path, added) in TOKENIZERS {
            let tokenizer = tokenizer(path);
            for (t, text) in texts(added).iter().enumerate() {
                let whole = tokenizer.encode(text.as_str(), false).unwrap();
                for n in [0, 1, 7, 64, 125, 512, 4096] {
                    let got = leading(&tokenizer, text, n).unwrap();
                    let take = n.min(whole.len());
                    let at = format!("{path}, text {t}, n {n}");
                    assert_eq!(got.encoding.get_ids(), &whole.get_ids()[..take], "{at}");
                    assert_eq!(got.encoding.get_offsets(), &whole.get_offsets()[..take], "{at}");
                    assert_eq!(got.cut(), whole.len() > n, "{at}");
                    assert!(got.total.is_none_or(|total| total == whole.len()), "{at}");
                }
            }
        }
    }

    /// The invariant [`leading`] rests on, at every cut: the tokens a prefix settles are the
    /// whole text's.
    #[test]
    fn every_prefix_settles_only_tokens_the_whole_text_has() {
        for (path, added) in TOKENIZERS {
            let tokenizer = tokenizer(path);
            let margin = tokenizer
                .get_added_tokens_decoder()
                .values()
                .map(|t| t.content.len())
                .fold(MARGIN, usize::max);
            let words = format!("{} ", "abcdefghij".repeat(15));
            let text =
                format!("Grüße, naïve café {added}they'll {words}{words}pay 3.14159{added}{added}   x\t").repeat(3);
            let whole = tokenizer.encode(text.as_str(), false).unwrap();
            let mut most = 0;
            for end in (1..text.len()).filter(|&i| text.is_char_boundary(i)) {
                let prefix = tokenizer.encode(&text[..end], false).unwrap();
                let n = settled(&prefix, end, margin);
                assert_eq!(prefix.get_ids()[..n], whole.get_ids()[..n], "{path}, cut at {end}");
                most = most.max(n);
            }
            assert!(
                most > whole.len() / 2,
                "{path}: the prefixes settled at most {most} tokens"
            );
        }
    }

    #[test]
    fn a_long_text_is_read_only_as_far_as_its_first_tokens() {
        let tokenizer = tokenizer("models/embed/bert-mean-normalize/tokenizer.json");
        let text = "the server defers the request ".repeat(100_000);
        let got = leading(&tokenizer, &text, 512).unwrap();
        assert_eq!(got.encoding.len(), 512);
        assert_eq!(got.total, None, "the rest is not read");
        // The last token kept ends within the first prefix read.
        let end = got.encoding.get_offsets()[511].1;
        assert!(end <= 513 * BYTES_PER_TOKEN + MARGIN, "{end}");
        // A text that is whole within the first prefix is counted.
        let short = leading(&tokenizer, "the server defers", 512).unwrap();
        let all = tokenizer.encode("the server defers", false).unwrap().len();
        assert_eq!(
            (short.encoding.len(), short.total, short.cut()),
            (all, Some(all), false)
        );
    }

    /// A text within the limit comes back as every token of it, as the tokenizer gives them,
    /// what it adds to any text included when asked.
    #[test]
    fn a_text_within_the_limit_is_tokenized_whole() {
        let decoder = tokenizer("models/decoder/tokenizer.json");
        let text = "The GPU keeps its weights in memory. ".repeat(20);
        let ids = decoder.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(
            encode_within(&decoder, &text, false, ids.len()).unwrap(),
            Bounded::Tokens(ids.clone())
        );
        // One token short of the limit: the whole was tokenized, and says so.
        assert_eq!(
            encode_within(&decoder, &text, false, ids.len() - 1).unwrap(),
            Bounded::Over {
                at_least: ids.len(),
                whole: true
            }
        );
        // BERT's [CLS] and [SEP], added as `encode` adds them, and counted.
        let bert = tokenizer("models/embed/bert-mean-normalize/tokenizer.json");
        let special = bert.encode(text.as_str(), true).unwrap().get_ids().to_vec();
        assert_eq!(
            encode_within(&bert, &text, true, special.len()).unwrap(),
            Bounded::Tokens(special.clone())
        );
        assert!(matches!(
            encode_within(&bert, &text, true, special.len() - 1).unwrap(),
            Bounded::Over { whole: true, .. }
        ));
    }

    /// A text far past the limit is found over it from a prefix: the count is more than the
    /// limit and far less than the whole text's.
    #[test]
    fn a_text_far_past_the_limit_is_refused_from_a_prefix() {
        let tokenizer = tokenizer("models/decoder/tokenizer.json");
        let text = "word ".repeat(100_000);
        let all = tokenizer.encode(text.as_str(), false).unwrap().len();
        let Bounded::Over { at_least, whole } = encode_within(&tokenizer, &text, false, 1000).unwrap() else {
            panic!("500 KB of words is more than 1000 tokens");
        };
        assert!(!whole);
        assert!(at_least > 1000 && at_least <= 8 * 1001, "{at_least}");
        assert!(at_least < all / 10, "{at_least} of {all}");
    }

    /// A text that packs more than the assumed bytes into each token is not misjudged: its
    /// prefix settles too few tokens, so it is read whole. (Here 10,000 spaces that the
    /// normalizer strips, as SentencePiece's collapses runs of them.)
    #[test]
    fn a_text_of_long_tokens_is_tokenized_whole() {
        let mut tokenizer = tokenizer("models/decoder/tokenizer.json");
        tokenizer
            .with_normalizer(Some(tokenizers::normalizers::Strip::new(true, true)))
            .expect("a normalizer is set");
        let text = format!("{}The GPU", " ".repeat(10_000));
        let ids = tokenizer.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        assert!(ids.len() <= 4, "{ids:?}");
        assert_eq!(
            encode_within(&tokenizer, &text, false, 10).unwrap(),
            Bounded::Tokens(ids)
        );
    }
}
