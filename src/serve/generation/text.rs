//! A generation's text, decoded once as its tokens come ([`Detokenizer`]): where a stop
//! string ends it, its final text, and for a streamed generation the deltas, text that may be
//! sent now. A delta holds back an unfinished character and any tail that could still become a
//! stop string or, when the request offers tools, a tool call's opening tag (the calls are read
//! back from the whole text at the end). Each token costs the same however long the text is:
//! the stop strings and held strings are looked for only where the new text could have
//! completed one. A delta also says how many tokens' text became whole in what was sent, so
//! that what is sent of a token (its log-probabilities) goes with the end of its text; a
//! token's own bytes, which those log-probabilities name, are its [`Spelling`].

use std::collections::VecDeque;
use std::sync::Arc;

use crate::runtime::chat::TOOL_CALL_OPEN;
use crate::runtime::text::{Detokenizer, TokenBytes, first_at, tail_start};
use crate::serve::service::Service;

/// How a model's tokens read as bytes, for their log-probabilities: exact where a token holds
/// part of a character, which decoding it alone would turn into U+FFFD.
pub struct Spelling(TokenBytes);

impl Spelling {
    /// How the tokens of `model` read (the model that answered); `None` when it has no
    /// tokenizer.
    pub fn of(service: &Service, model: &str) -> Option<Spelling> {
        let tokenizer = service.model(model)?.kind.tokenizer()?;
        Some(Spelling(TokenBytes::new(Arc::clone(tokenizer))))
    }

    /// The bytes of text token `id` stands for.
    pub fn bytes(&self, id: u32) -> Vec<u8> {
        self.0.bytes(id)
    }
}

/// A generation's text as its tokens come.
pub(super) struct Text {
    decoded: Detokenizer,
    /// Strings that end the text (not included).
    stop: Vec<String>,
    /// Where the first stop string starts, once the text holds one.
    stop_at: Option<usize>,
    /// Characters of the text decoded so far.
    chars: usize,
    /// A streamed generation's deltas so far.
    deltas: Option<Deltas>,
}

/// What a streamed generation's text was cut into so far.
struct Deltas {
    /// Strings whose text waits: the stop strings, and a tool call's opening tag.
    held: Vec<String>,
    /// Where the held strings were looked for.
    hold: Hold,
    /// Bytes of text already handed out.
    sent: usize,
    /// Where the text of each token whose text was not all handed out yet ends (`usize::MAX`
    /// while it waits), oldest first.
    ends: VecDeque<usize>,
}

/// What a streamed generation's token lets it send.
#[derive(Debug, PartialEq)]
pub(super) struct Sent {
    /// Text not sent before that may be sent now (empty while it waits).
    pub(super) text: String,
    /// Tokens whose text is now all sent and was not before, oldest first after those of
    /// earlier deltas.
    pub(super) tokens: usize,
}

impl Text {
    /// Nothing decoded yet. A `streamed` generation's tokens give deltas; one that offers
    /// `tools` holds its text back from a tool call's opening tag on.
    pub(super) fn new(tokenizer: Arc<tokenizers::Tokenizer>, stop: &[String], streamed: bool, tools: bool) -> Text {
        let deltas = streamed.then(|| {
            let mut held = stop.to_vec();
            if tools {
                held.push(TOOL_CALL_OPEN.to_string());
            }
            Deltas {
                held,
                hold: Hold::default(),
                sent: 0,
                ends: VecDeque::new(),
            }
        });
        Text {
            decoded: Detokenizer::new(tokenizer),
            stop: stop.to_vec(),
            stop_at: None,
            chars: 0,
            deltas,
        }
    }

    /// Add a token: for a streamed generation, the text that may be sent now and was not yet
    /// (empty while it waits), and the tokens it completes. A stop string is looked for where
    /// the new text could have completed one.
    pub(super) fn push(&mut self, id: u32) -> Result<Option<Sent>, String> {
        let searched = self.decoded.text().len();
        self.decoded.push(id)?;
        let grown = self.decoded.text();
        self.chars += grown[searched..].chars().count();
        self.stop_at = first_at(grown, tail_start(grown, searched, &self.stop), &self.stop);
        Ok(self.deltas.as_mut().map(|deltas| {
            let ready = sendable(grown, &mut deltas.hold, &deltas.held);
            let text = ready.get(deltas.sent..).unwrap_or_default().to_string();
            deltas.sent = deltas.sent.max(ready.len());
            // A token whose text waits ends where the text that finishes it does.
            deltas.ends.push_back(usize::MAX);
            if !self.decoded.waiting() {
                for end in deltas.ends.iter_mut().rev().take_while(|end| **end == usize::MAX) {
                    *end = grown.len();
                }
            }
            let whole = deltas.ends.iter().take_while(|&&end| end <= deltas.sent).count();
            deltas.ends.drain(..whole);
            Sent { text, tokens: whole }
        }))
    }

    /// Characters of the text decoded so far: where the next token's text starts (a token
    /// that ends in an unfinished character adds none until the tokens finishing it come).
    pub(super) fn chars(&self) -> usize {
        self.chars
    }

    /// Whether a stop string ended the text.
    pub(super) fn stopped(&self) -> bool {
        self.stop_at.is_some()
    }

    /// Every token pushed.
    pub(super) fn tokens(&self) -> &[u32] {
        self.decoded.tokens()
    }

    /// The tokens and their text, with what still waited (an unfinished character at the end),
    /// cut before the first stop string: the one that ended it, or one that what waited
    /// completed.
    pub(super) fn finish(self) -> Result<(Vec<u32>, String), String> {
        let searched = self.decoded.text().len();
        let (tokens, mut text) = self.decoded.finish()?;
        let stop = &self.stop;
        if let Some(cut) = self
            .stop_at
            .or_else(|| first_at(&text, tail_start(&text, searched, stop), stop))
        {
            text.truncate(cut);
        }
        Ok((tokens, text))
    }
}

/// How far a stream's text was searched for its held strings, and where the first one starts
/// once one was found. The text only grows, so a string found stays where it is, and one not
/// found can only be completed by what was added since: each search covers the growth and the
/// held strings' length before it, and none is made once one was found. A token then costs the
/// same however long the text held back after a tool call's opening tag grows.
#[derive(Debug, Default)]
struct Hold {
    searched: usize,
    found: Option<usize>,
}

impl Hold {
    /// Where a search of `text` (the text searched before, grown) for `held` must start, or
    /// `None` when there is nothing to search: one was found already.
    fn search_from(&self, text: &str, held: &[String]) -> Option<usize> {
        self.found.is_none().then(|| tail_start(text, self.searched, held))
    }

    /// Where the first of `held` starts in `text`, if one does.
    fn first(&mut self, text: &str, held: &[String]) -> Option<usize> {
        if let Some(start) = self.search_from(text, held) {
            self.found = first_at(text, start, held);
            self.searched = text.len();
        }
        self.found
    }
}

/// Text that can be sent now: all of `text` but an unfinished UTF-8 sequence at its end and
/// any tail that could still become one of the stop strings. `hold` is what earlier calls on a
/// shorter `text` (the same text, before it grew) learnt, so a call costs the same at any
/// length.
fn sendable<'a>(text: &'a str, hold: &mut Hold, stop: &[String]) -> &'a str {
    let mut end = text.trim_end_matches('\u{FFFD}').len();
    // Nothing from a stop string on: the text ends before it.
    if let Some(at) = hold.first(text, stop) {
        end = end.min(at);
    }
    for s in stop {
        // The longest end of the text that is a beginning of the stop string waits.
        for k in (1..s.len().min(end + 1)).rev() {
            if text.is_char_boundary(end - k) && s.starts_with(&text[end - k..end]) {
                end -= k;
                break;
            }
        }
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::chat::TOOL_CALL_OPEN;
    use crate::runtime::text::tests::fixture;

    /// A streamed generation's text token by token: its deltas never reach the stop string,
    /// together they are the final text once the stop ended it, and a generation that is not
    /// streamed cuts none.
    #[test]
    fn deltas_are_the_final_text_and_stop_before_the_stop_string() {
        let tokenizer = fixture();
        let prose = "Grüße aus Köln: the GPU is full, and more";
        let tokens = tokenizer.encode(prose, false).unwrap().get_ids().to_vec();
        let stop = vec!["GPU is".to_string()];
        let mut streamed = Text::new(Arc::clone(&tokenizer), &stop, true, false);
        let mut whole = Text::new(Arc::clone(&tokenizer), &stop, false, false);
        let mut sent = String::new();
        for &id in &tokens {
            sent.push_str(&streamed.push(id).unwrap().expect("a streamed generation's delta").text);
            assert_eq!(whole.push(id).unwrap(), None);
            assert_eq!(streamed.stopped(), whole.stopped());
            if streamed.stopped() {
                break;
            }
        }
        assert!(streamed.stopped(), "the stop string ends it");
        let (_, text) = streamed.finish().unwrap();
        assert_eq!(text, "Grüße aus Köln: the ");
        assert_eq!(whole.finish().unwrap().1, text);
        assert_eq!(sent, text);
    }

    /// A delta counts the tokens whose text is all in what was sent with it and before: never
    /// one whose text (an unfinished character, a start of the stop string) still waits, every
    /// token once its text went out, and none of a stop string's.
    #[test]
    fn a_delta_counts_the_tokens_its_text_completes() {
        let tokenizer = fixture();
        let prose = "Grüße aus Köln, 東京: the GPU is full, and more";
        let tokens = tokenizer.encode(prose, false).unwrap().get_ids().to_vec();
        for stop in [vec![], vec!["GPU is".to_string()]] {
            let mut text = Text::new(Arc::clone(&tokenizer), &stop, true, false);
            let (mut sent, mut whole) = (String::new(), 0);
            for (pushed, &id) in tokens.iter().enumerate() {
                let offset = text.chars();
                let delta = text.push(id).unwrap().unwrap();
                sent.push_str(&delta.text);
                whole += delta.tokens;
                assert!(whole <= pushed + 1);
                let done = tokenizer.decode(&tokens[..whole], true).unwrap();
                assert!(
                    sent.starts_with(&done),
                    "{whole} tokens {done:?} are not all in {sent:?}"
                );
                let next = tokenizer.decode(&tokens[..=whole.min(pushed)], true).unwrap();
                assert!(
                    whole > pushed || !sent.starts_with(&next) || next == done,
                    "token {whole} waits though {next:?} was sent"
                );
                // Where each token's text starts, in characters of the text.
                let before = tokenizer.decode(&tokens[..pushed], true).unwrap();
                assert_eq!(offset, before.trim_end_matches('\u{FFFD}').chars().count());
                if text.stopped() {
                    break;
                }
            }
            let all = text.tokens().len();
            match stop.is_empty() {
                true => assert_eq!(whole, all, "every token's text went out"),
                false => assert!(whole < all, "the stop string's tokens never count"),
            }
        }
    }

    /// What is sendable of `text` searched whole, as if it had come in one piece.
    fn at_once<'a>(text: &'a str, held: &[String]) -> &'a str {
        sendable(text, &mut Hold::default(), held)
    }

    #[test]
    fn text_that_may_become_a_stop_string_or_is_an_unfinished_character_waits() {
        let stop = vec![" GPU".to_string()];
        assert_eq!(at_once("hello", &stop), "hello");
        assert_eq!(at_once("hello G", &stop), "hello");
        assert_eq!(at_once("hello GP", &stop), "hello");
        assert_eq!(at_once("hello Gx", &stop), "hello Gx");
        assert_eq!(at_once("hello GPUs", &stop), "hello");
        assert_eq!(at_once("caf\u{FFFD}", &[]), "caf");
    }

    #[test]
    fn a_tool_call_waits_from_its_opening_tag_on() {
        let held = vec![TOOL_CALL_OPEN.to_string()];
        assert_eq!(at_once("Let me check. <tool", &held), "Let me check. ");
        assert_eq!(at_once("Let me check. <tool_call>{\"name\"", &held), "Let me check. ");
        assert_eq!(at_once("a <b>", &held), "a <b>");
    }

    /// What a stream is sent when its text grows by `pieces`: every delta, as [`Text::push`]
    /// cuts them.
    fn chunks(pieces: &[&str], held: &[String]) -> Vec<String> {
        let mut text = String::new();
        let (mut sent, mut hold) = (0, Hold::default());
        let mut out = Vec::new();
        for piece in pieces {
            text.push_str(piece);
            let ready = sendable(&text, &mut hold, held);
            // Searching the tail only decides as searching the whole text would.
            assert_eq!(ready, at_once(&text, held), "after {text:?}");
            if ready.len() > sent {
                out.push(ready[sent..].to_string());
                sent = ready.len();
            }
        }
        out
    }

    #[test]
    fn a_stop_string_split_across_chunks_never_leaks_even_in_part() {
        let stop = vec!["<|im_end|>".to_string(), "\n\nUser:".to_string()];
        let sent = chunks(
            &["The answer is 42", "<|im", "_e", "nd|", "> and more <|im_end|>"],
            &stop,
        );
        assert_eq!(sent, ["The answer is 42"]);
        let sent = chunks(&["Sure.\n", "\nUs", "er", ": again"], &stop);
        assert_eq!(sent.concat(), "Sure.");
        // A start that turns out to be something else is sent once it cannot be a stop string.
        let sent = chunks(&["a <|im", "_start|> b"], &stop);
        assert_eq!(sent, ["a ", "<|im_start|> b"]);
        // Multi-byte characters around and inside the stop string: cut on character boundaries.
        let stop = vec!["ünde".to_string()];
        let sent = chunks(&["grün", "d: Stü", "nde ja"], &stop);
        assert_eq!(sent.concat(), "gründ: St");
    }

    #[test]
    fn a_tool_call_split_across_chunks_waits_from_its_first_character() {
        let held = vec!["<|im_end|>".to_string(), TOOL_CALL_OPEN.to_string()];
        let sent = chunks(
            &[
                "Let me check.",
                " <",
                "tool_",
                "call>",
                "{\"name\": \"f\"}",
                "</tool_call>",
            ],
            &held,
        );
        assert_eq!(sent.concat(), "Let me check. ");
    }

    /// A tool call's text waits however long it grows, and holding it back costs nothing per
    /// token once its opening tag was found: the bytes searched for held strings over the
    /// whole stream stay within the text's length plus, per token, the held strings' length.
    #[test]
    fn a_long_tool_call_stays_held_back_and_its_tokens_are_not_searched_again() {
        let held = vec!["<|im_end|>".to_string(), TOOL_CALL_OPEN.to_string()];
        let longest = held.iter().map(String::len).max().unwrap();
        let pieces = [
            "Let me",
            " check.",
            " <tool",
            "_call>",
            "{\"name\": \"f\", \"arguments\": {",
        ]
        .into_iter()
        .chain(std::iter::repeat_n("\"k\": \"vé\", ", 5000));
        let (mut text, mut hold) = (String::new(), Hold::default());
        let (mut tokens, mut searched, mut after_tag) = (0, 0, 0);
        for piece in pieces {
            text.push_str(piece);
            tokens += 1;
            let bytes = hold.search_from(&text, &held).map_or(0, |start| text.len() - start);
            searched += bytes;
            if hold.found.is_some() {
                after_tag += bytes;
            }
            let ready = sendable(&text, &mut hold, &held);
            let expected = if tokens < 3 { text.as_str() } else { "Let me check. " };
            assert_eq!(ready, expected, "after {tokens} tokens");
        }
        assert!(hold.found.is_some());
        assert_eq!(after_tag, 0, "nothing is searched once the tag was found");
        assert!(
            searched <= text.len() + tokens * longest,
            "{searched} bytes searched for {tokens} tokens of {} bytes",
            text.len()
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// However a text is cut into pieces, each decision equals one made by searching the
        /// whole text, and what is sent is the start of the text before its first stop string
        /// (the rest of which goes with the last chunk).
        #[test]
        fn chunking_does_not_change_what_is_sent(
            words in proptest::collection::vec(proptest::sample::select(vec!["a", "é", "<", "|", "im", "_end", "end|>", " ", "GP", "U", "東"]), 0..80),
            cuts in proptest::collection::vec(1usize..6, 1..40),
        ) {
            let held = vec!["<|im_end|>".to_string(), " GPU".to_string(), "<tool_call>".to_string()];
            let mut pieces = Vec::new();
            let mut rest = words.as_slice();
            for n in cuts.iter().cycle() {
                if rest.is_empty() { break; }
                let (piece, after) = rest.split_at((*n).min(rest.len()));
                pieces.push(piece.concat());
                rest = after;
            }
            let whole = words.concat();
            let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let before_stop = &whole[..first_at(&whole, 0, &held).unwrap_or(whole.len())];
            let sent = chunks(&pieces, &held).concat();
            proptest::prop_assert!(before_stop.starts_with(&sent), "{:?} sent of {:?}", sent, whole);
        }
    }
}
