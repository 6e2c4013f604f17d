//! Text tokenized at a cost bounded by what a model takes: a prompt far longer than its
//! context (a 10,000-word message to a 4,096-position model, a string as long as the body
//! limit allows) is found too long from a prefix of it, so refusing it costs about what
//! tokenizing the longest text the model could take costs, not the text's own length.

use tokenizers::Tokenizer;

/// Bytes of text a token is first taken to stand for when choosing the prefix to tokenize:
/// English runs at about 4 with real models' vocabularies, code and JSON at about 3. A text
/// that packs more into its tokens is not misjudged: its prefix then holds too few tokens to
/// decide, and a prefix twice as long is tried, up to the whole text.
const BYTES_PER_TOKEN: usize = 4;

/// How far back from the prefix's end to look for whitespace to cut at, so that the prefix's
/// last word is tokenized as the whole text's is.
const CUT_LOOKBACK: usize = 256;

/// Text tokenized within a limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bounded {
    /// Every token of the text: at most the limit.
    Tokens(Vec<u32>),
    /// More tokens than the limit: a prefix of the text alone has `at_least` of them.
    Over {
        /// Tokens of the prefix tokenized (more than the limit).
        at_least: usize,
        /// Whether the whole text was tokenized (`at_least` is then its count).
        whole: bool,
    },
}

/// Tokenize `text` (with what the tokenizer adds to any text when `add_special`), or find it has
/// more than `limit` tokens from a prefix of it: first about `(limit + 1) × BYTES_PER_TOKEN`
/// bytes (cut before whitespace), then twice as much while the prefix has no more than `limit`
/// tokens, up to the whole text. Refusing a text far past the limit costs about what tokenizing
/// the longest text the limit allows costs, whatever the text's own length; the most any text
/// costs is about twice its own tokenization.
pub fn encode_within(
    tokenizer: &Tokenizer,
    text: &str,
    add_special: bool,
    limit: usize,
) -> tokenizers::Result<Bounded> {
    let mut budget = limit.saturating_add(1).saturating_mul(BYTES_PER_TOKEN);
    while let Some(prefix) = prefix_of(text, budget) {
        let count = tokenizer.encode(prefix, add_special)?.len();
        if count > limit {
            return Ok(Bounded::Over {
                at_least: count,
                whole: false,
            });
        }
        budget = budget.saturating_mul(2);
    }
    let ids = tokenizer.encode(text, add_special)?.get_ids().to_vec();
    Ok(match ids.len() > limit {
        true => Bounded::Over {
            at_least: ids.len(),
            whole: true,
        },
        false => Bounded::Tokens(ids),
    })
}

/// The first `budget` bytes or so of `text`, cut before a whitespace character when there is
/// one in the last [`CUT_LOOKBACK`] bytes (else at a character boundary); `None` when the text
/// is no longer, and is tokenized whole.
fn prefix_of(text: &str, budget: usize) -> Option<&str> {
    if text.len() <= budget {
        return None;
    }
    let mut end = budget;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let from = end.saturating_sub(CUT_LOOKBACK);
    let cut = text[from..end]
        .char_indices()
        .rev()
        .find(|(_, c)| c.is_whitespace())
        .map_or(end, |(i, _)| from + i);
    Some(&text[..cut])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::model::BuiltinModel;

    fn tokenizer() -> Tokenizer {
        Tokenizer::from_bytes(BuiltinModel::Decoder.tokenizer().unwrap()).unwrap()
    }

    /// A text within the limit comes back as every token of it, as the tokenizer gives them.
    #[test]
    fn a_text_within_the_limit_is_tokenized_whole() {
        let tokenizer = tokenizer();
        let text = "The GPU keeps its weights in memory. ".repeat(20);
        let ids = tokenizer.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(
            encode_within(&tokenizer, &text, false, ids.len()).unwrap(),
            Bounded::Tokens(ids.clone())
        );
        // One token short of the limit: the whole was tokenized, and says so.
        assert_eq!(
            encode_within(&tokenizer, &text, false, ids.len() - 1).unwrap(),
            Bounded::Over {
                at_least: ids.len(),
                whole: true
            }
        );
    }

    /// A text far past the limit is found over it from a prefix: the count is more than the
    /// limit and far less than the whole text's.
    #[test]
    fn a_text_far_past_the_limit_is_refused_from_a_prefix() {
        let tokenizer = tokenizer();
        let text = "word ".repeat(100_000);
        let all = tokenizer.encode(text.as_str(), false).unwrap().len();
        let Bounded::Over { at_least, whole } = encode_within(&tokenizer, &text, false, 1000).unwrap() else {
            panic!("500 KB of words is more than 1000 tokens");
        };
        assert!(!whole);
        // A prefix of about 4 bytes a token, twice that at most.
        assert!(at_least > 1000 && at_least <= 8 * 1001, "{at_least}");
        assert!(at_least < all / 10, "{at_least} of {all}");
    }

    /// A text that packs more than the assumed bytes into each token is not misjudged: its
    /// prefix has few tokens, so it is tokenized whole. (Here 10,000 spaces that the
    /// normalizer strips, as SentencePiece's collapses runs of them.)
    #[test]
    fn a_text_of_long_tokens_is_tokenized_whole() {
        let mut tokenizer = tokenizer();
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

    /// The prefix is cut before whitespace and at a character boundary, never inside a
    /// character or a word.
    #[test]
    fn the_prefix_ends_before_whitespace_or_at_a_character() {
        let text = "é".repeat(5);
        assert_eq!(prefix_of(&text, 10), None, "no longer than the budget: whole");
        let long = "é".repeat(100);
        assert_eq!(prefix_of(&long, 11), Some("é".repeat(5).as_str()));
        let words = "abc defgh ".repeat(100);
        let cut = prefix_of(&words, 48).unwrap();
        assert_eq!(cut, &words[..43]);
        assert!(words[cut.len()..].starts_with(' '));
    }
}
