//! Structured outputs by constrained decoding: a JSON schema, or a tool call in the format chat
//! reads calls back in ([`super::chat::split_tool_calls`]), compiled by `llguidance` against a
//! model's tokenizer into a [`Grammar`]; a generation under one keeps a [`Constrained`] matcher
//! that gives, before each pick, the [`Mask`] of the tokens that keep its text in the grammar
//! (the end-of-text tokens only where the grammar may end), and says when nothing may follow.
//!
//! `llguidance` sees a vocabulary as the bytes each token id stands for. [`token_bytes`] reads
//! them from the model's own `tokenizers::Tokenizer`: a byte-level BPE's pieces through
//! GPT-2's byte-to-character map, SentencePiece's pieces with `▁` as a space and `<0xXX>` as
//! that byte, and added tokens as their text, the special ones marked special, so that a
//! grammar never spells them out: they are what the generation's text leaves out. The
//! vocabulary and its trie are built once per model, on its first constrained request
//! ([`Grammars`]), which also keeps the grammars it compiled last: a generation starts its own
//! matcher from one (sharing its lexer's cache), so a schema sent again is not compiled again.
//!
//! JSON is compiled without free whitespace: `", "` between items, `": "` after keys, nothing
//! else, so a model cannot wander in blank space until `max_tokens` and a tool call reads as
//! the JSON Hermes-style templates show. A `strict` schema must be honoured whole: a keyword
//! the engine does not support is an error naming it; a schema that is not strict has such
//! keywords ignored. What a schema may hold is bounded ([`MOST_PROPERTIES`], [`MOST_ENUM_VALUES`],
//! [`DEEPEST`]), and so is the engine's work ([`limits`]), so that a hostile schema is refused
//! rather than compiled for seconds.

use std::sync::{Arc, Mutex, OnceLock};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};

use super::chat::{TOOL_CALL_CLOSE, TOOL_CALL_OPEN};

/// A model's grammar compiler: its tokenizer and end-of-text tokens, and `llguidance`'s view
/// of them, built on the first constrained request and kept.
pub struct Grammars {
    tokenizer: Arc<tokenizers::Tokenizer>,
    eos: Vec<u32>,
    factory: OnceLock<Result<ParserFactory, String>>,
    /// The grammars compiled last, by their source, the most recent last: clients send the same
    /// schema again and again, and a compilation costs about as much as a dozen tokens.
    recent: Mutex<Vec<(String, Grammar)>>,
}

/// How many compiled grammars a model keeps for the next requests that send the same schema.
const RECENT: usize = 16;

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("eos", &self.eos)
            .field("built", &self.factory.get().is_some())
            .finish_non_exhaustive()
    }
}

/// What a constrained answer must be.
#[derive(Debug, Clone, Copy)]
pub enum Shape<'a> {
    /// JSON following a schema.
    Json(Json<'a>),
    /// One call of one of `tools`, as `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`,
    /// or, when `otherwise` says so, an answer that is no call.
    ToolCall {
        /// The functions it may call.
        tools: &'a [Tool<'a>],
        /// What may answer instead (none: a call must).
        otherwise: Option<Otherwise<'a>>,
    },
}

/// A JSON schema an answer follows.
#[derive(Debug, Clone, Copy)]
pub struct Json<'a> {
    /// The schema.
    pub schema: &'a Value,
    /// Every keyword in it is honoured (else those the engine does not support are ignored).
    pub strict: bool,
}

/// What may answer instead of a tool call.
#[derive(Debug, Clone, Copy)]
pub enum Otherwise<'a> {
    /// Text holding no call's opening tag.
    Prose,
    /// JSON following a schema.
    Json(Json<'a>),
}

/// A function a constrained tool call may call.
#[derive(Debug, Clone, Copy)]
pub struct Tool<'a> {
    /// Its name.
    pub name: &'a str,
    /// The JSON Schema of its arguments (none: any object).
    pub parameters: Option<&'a Value>,
    /// Whether its schema is honoured whole (OpenAI's `strict`).
    pub strict: bool,
}

/// A grammar compiled for one model: each generation under it starts its own matcher from it.
/// Its first mask is computed when it is compiled, before the request is admitted.
#[derive(Clone)]
pub struct Grammar {
    start: Arc<Matcher>,
    first: Mask,
    what: Arc<str>,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.what)
    }
}

impl PartialEq for Grammar {
    /// The same compiled grammar (two compilations of one schema are two grammars).
    fn eq(&self, other: &Grammar) -> bool {
        Arc::ptr_eq(&self.start, &other.start)
    }
}

/// The tokens a generation may pick next.
#[derive(Debug, Clone)]
pub struct Mask(SimpleVob);

impl Mask {
    /// Leave only the allowed tokens' logits: every other one, and any position past the
    /// tokenizer's vocabulary (a model's padded rows), becomes -inf.
    pub fn apply(&self, logits: &mut [f32]) {
        let words = self.0.as_slice();
        for (word, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(word).copied().unwrap_or(0);
            // Whole words first: a JSON grammar allows none of most of them, a string all.
            match bits {
                u32::MAX => continue,
                0 => {
                    chunk.fill(f32::NEG_INFINITY);
                    continue;
                }
                _ => {}
            }
            for (bit, logit) in chunk.iter_mut().enumerate() {
                if bits >> bit & 1 == 0 {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Whether `token` may be picked.
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }
}

/// A generation's matcher: where its text is in its grammar.
pub struct Constrained(Matcher);

impl Constrained {
    /// Take `token`, picked under the last mask. True when the grammar is finished: nothing may
    /// follow, not even more text it would accept.
    pub fn accept(&mut self, token: u32) -> Result<bool, String> {
        self.0
            .consume_token(token)
            .map_err(|e| format!("the grammar refused token {token}: {e}"))?;
        Ok(self.0.is_stopped())
    }

    /// The mask of the next pick.
    pub fn mask(&mut self) -> Result<Mask, String> {
        self.0
            .compute_mask()
            .map(Mask)
            .map_err(|e| format!("the grammar's next mask: {e}"))
    }
}

impl Grammar {
    /// A generation's own matcher at the grammar's start, and the mask of its first pick.
    pub fn start(&self) -> (Constrained, Mask) {
        (Constrained(Matcher::clone(&self.start)), self.first.clone())
    }
}

impl Grammars {
    /// The compiler of a model with `tokenizer`, whose answers end with any of `eos`.
    pub fn new(tokenizer: Arc<tokenizers::Tokenizer>, eos: Vec<u32>) -> Grammars {
        Grammars {
            tokenizer,
            eos,
            factory: OnceLock::new(),
            recent: Mutex::default(),
        }
    }

    /// Compile `shape` for this model: the message says what the engine could not take.
    pub fn compile(&self, shape: Shape<'_>) -> Result<Grammar, String> {
        let factory = self
            .factory
            .get_or_init(|| factory(&self.tokenizer, &self.eos))
            .as_ref()
            .map_err(|e| format!("this model's output cannot be constrained: {e}"))?;
        let mut size = Size::default();
        match shape {
            Shape::Json(json) => size.add(json.schema, 0)?,
            Shape::ToolCall { tools, otherwise } => {
                for parameters in tools.iter().filter_map(|t| t.parameters) {
                    size.add(parameters, 0)?;
                }
                if let Some(Otherwise::Json(json)) = otherwise {
                    size.add(json.schema, 0)?;
                }
            }
        }
        // The grammar, and its whole source, which a compiled grammar is found again by.
        let (source, grammar, what) = match shape {
            Shape::Json(json) => {
                let schema = with_options(json.schema, json.strict);
                let source = schema.to_string();
                (
                    source,
                    TopLevelGrammar::from_json_schema(schema),
                    "a JSON schema".to_string(),
                )
            }
            Shape::ToolCall { tools, otherwise } => {
                let lark = tool_call_lark(tools, otherwise);
                let names: Vec<&str> = tools.iter().map(|t| t.name).collect();
                (
                    lark.clone(),
                    TopLevelGrammar::from_lark(lark),
                    format!("a call of {}", names.join(" or ")),
                )
            }
        };
        let mut recent = self
            .recent
            .lock()
            .expect("no compilation panics while it holds the lock");
        if let Some(at) = recent.iter().position(|(s, _)| *s == source) {
            let hit = recent.remove(at);
            let grammar = hit.1.clone();
            recent.push(hit);
            return Ok(grammar);
        }
        // Compiled outside the lock: others' requests find their own grammars meanwhile.
        drop(recent);
        let mut start = Matcher::new(factory.create_parser(grammar));
        let first = start.compute_mask().map_err(|e| e.to_string())?;
        let grammar = Grammar {
            start: Arc::new(start),
            first: Mask(first),
            what: what.into(),
        };
        let mut recent = self
            .recent
            .lock()
            .expect("no compilation panics while it holds the lock");
        if recent.len() == RECENT {
            recent.remove(0);
        }
        recent.push((source, grammar.clone()));
        Ok(grammar)
    }
}

/// The most properties (over every object) the schemas of one grammar may name: `llguidance`
/// spends about the square of an object's optional properties compiling it (a thousand took
/// over a second) and recurses per property. OpenAI bounds its structured outputs the same way.
const MOST_PROPERTIES: usize = 500;
/// The most `enum` values the schemas of one grammar may list.
const MOST_ENUM_VALUES: usize = 1000;
/// The deepest a schema may nest, in JSON levels.
const DEEPEST: usize = 64;

/// What the schemas of one grammar hold, against the limits above.
#[derive(Default)]
struct Size {
    properties: usize,
    enum_values: usize,
}

impl Size {
    /// Count `schema` in, at JSON depth `depth`: an error says which limit it passes.
    fn add(&mut self, schema: &Value, depth: usize) -> Result<(), String> {
        if depth >= DEEPEST {
            return Err(format!(
                "the schema nests {DEEPEST} levels deep or more; at most {} are compiled",
                DEEPEST - 1
            ));
        }
        let children: Box<dyn Iterator<Item = &Value>> = match schema {
            Value::Object(object) => {
                self.properties += object
                    .get("properties")
                    .and_then(Value::as_object)
                    .map_or(0, |p| p.len());
                self.enum_values += object.get("enum").and_then(Value::as_array).map_or(0, |e| e.len());
                Box::new(object.values())
            }
            Value::Array(items) => Box::new(items.iter()),
            _ => return Ok(()),
        };
        if self.properties > MOST_PROPERTIES {
            return Err(format!(
                "the schemas name more than {MOST_PROPERTIES} properties, the most compiled"
            ));
        }
        if self.enum_values > MOST_ENUM_VALUES {
            return Err(format!(
                "the schemas list more than {MOST_ENUM_VALUES} `enum` values, the most compiled"
            ));
        }
        children.into_iter().try_for_each(|child| self.add(child, depth + 1))
    }
}

/// What one compilation may spend: `llguidance`'s defaults, but its errors without the
/// grammar's whole text (the client's own schema, which can be long).
fn limits() -> ParserLimits {
    ParserLimits {
        verbose_errors: false,
        ..ParserLimits::default()
    }
}

/// `llguidance`'s view of a model's vocabulary, its end-of-text tokens among it.
fn factory(tokenizer: &tokenizers::Tokenizer, eos: &[u32]) -> Result<ParserFactory, String> {
    let words = token_bytes(tokenizer)?;
    let size = words.len() as u32;
    let eos: Vec<u32> = eos.iter().copied().filter(|&t| t < size).collect();
    let Some(&first) = eos.first() else {
        return Err("it names no end-of-text token in its vocabulary, so no answer could end".into());
    };
    let trie = TokTrie::from(&TokRxInfo::new(size, first), &words).with_eos_tokens(&eos);
    let env: TokEnv = Arc::new(Vocabulary(trie));
    let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    // Its warnings would go to standard error; a grammar's errors come back as values.
    factory.quiet();
    *factory.limits_mut() = limits();
    Ok(factory)
}

/// A vocabulary as `llguidance` reads it.
struct Vocabulary(TokTrie);

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
pub fn token_bytes(tokenizer: &tokenizers::Tokenizer) -> Result<Vec<Vec<u8>>, String> {
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

/// A JSON schema with the options every constrained answer is compiled under (see the module's
/// documentation); a client's own `x-guidance` options are replaced.
fn with_options(schema: &Value, strict: bool) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(object) = &mut schema {
        object.insert(
            "x-guidance".into(),
            json!({"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": false,
                   "lenient": !strict}),
        );
    }
    schema
}

/// The Lark grammar of one call of one of `tools`, in the Hermes format chat reads calls back
/// in, or of what `otherwise` says may answer instead.
fn tool_call_lark(tools: &[Tool<'_>], otherwise: Option<Otherwise<'_>>) -> String {
    let lark_string = |s: &str| Value::String(s.to_string()).to_string();
    let mut lark = String::from(match otherwise {
        None => "start: call\n",
        Some(Otherwise::Prose) => "start: call | PROSE\n",
        Some(Otherwise::Json(_)) => "start: call | answer\n",
    });
    let names: Vec<String> = (0..tools.len()).map(|i| format!("tool_{i}")).collect();
    lark.push_str(&format!(
        "call: {} ({}) {}\n",
        lark_string(&format!("{TOOL_CALL_OPEN}\n")),
        names.join(" | "),
        lark_string(&format!("\n{TOOL_CALL_CLOSE}")),
    ));
    for (rule, tool) in names.iter().zip(tools) {
        let arguments = tool.parameters.cloned().unwrap_or_else(|| json!({"type": "object"}));
        let call = json!({
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        });
        lark.push_str(&format!("{rule}: %json {}\n", with_options(&call, tool.strict)));
    }
    match otherwise {
        None => {}
        Some(Otherwise::Prose) => {
            let open = regex::escape(TOOL_CALL_OPEN);
            lark.push_str(&format!("PROSE: /(?s:.+)/ & ~/(?s:.*{open}.*)/\n"));
        }
        Some(Otherwise::Json(json)) => {
            lark.push_str(&format!("answer: %json {}\n", with_options(json.schema, json.strict)));
        }
    }
    lark
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// The first fixture's grammar compiler, its `<|endoftext|>` ending answers.
    fn grammars() -> (Grammars, Arc<tokenizers::Tokenizer>) {
        let tokenizer = Arc::new(fixture_tokenizers().remove(0).1);
        let eos = vec![tokenizer.token_to_id("<|endoftext|>").unwrap()];
        (Grammars::new(Arc::clone(&tokenizer), eos.clone()), tokenizer)
    }

    /// Greedy decoding under `grammar` from logits that favour `favour` (token ids, in turn)
    /// and otherwise the highest id: the text, and whether the grammar finished it.
    fn generate(grammar: &Grammar, tokenizer: &tokenizers::Tokenizer, steps: usize) -> (String, bool) {
        let (mut matcher, mut mask) = grammar.start();
        let mut ids = Vec::new();
        let size = tokenizer.get_vocab_size(true) + 7;
        for step in 0..steps {
            // Logits that vary with the step, some past the vocabulary (padded rows).
            let mut logits: Vec<f32> = (0..size).map(|i| ((i * 31 + step * 17) % 97) as f32).collect();
            mask.apply(&mut logits);
            assert!(
                logits[tokenizer.get_vocab_size(true)..]
                    .iter()
                    .all(|l| *l == f32::NEG_INFINITY)
            );
            let next = (0..size).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap() as u32;
            assert!(mask.allows(next));
            if next == tokenizer.token_to_id("<|endoftext|>").unwrap() {
                return (tokenizer.decode(&ids, true).unwrap(), true);
            }
            ids.push(next);
            if matcher.accept(next).unwrap() {
                return (tokenizer.decode(&ids, true).unwrap(), true);
            }
            mask = matcher.mask().unwrap();
        }
        (tokenizer.decode(&ids, true).unwrap(), false)
    }

    #[test]
    fn a_masked_generation_follows_its_schema() {
        let (grammars, tokenizer) = grammars();
        let schema = json!({"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["city", "unit", "days"], "additionalProperties": false});
        let grammar = grammars
            .compile(Shape::Json(Json {
                schema: &schema,
                strict: true,
            }))
            .unwrap();
        let (text, finished) = generate(&grammar, &tokenizer, 200);
        assert!(finished, "{text}");
        let value: Value = serde_json::from_str(&text).unwrap();
        assert!(value["city"].as_str().unwrap().chars().count() <= 12, "{text}");
        assert!(
            ["celsius", "fahrenheit"].contains(&value["unit"].as_str().unwrap()),
            "{text}"
        );
        assert!((1..=9).contains(&value["days"].as_i64().unwrap()), "{text}");
        // Compact, with the separators the module names.
        assert!(text.starts_with("{\"city\": \""), "{text}");
    }

    #[test]
    fn a_forced_tool_call_reads_back_as_a_call_with_valid_arguments() {
        let (grammars, tokenizer) = grammars();
        let weather = json!({"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                             "required": ["city"], "additionalProperties": false});
        let tools = [
            Tool {
                name: "get_weather",
                parameters: Some(&weather),
                strict: true,
            },
            Tool {
                name: "noop",
                parameters: None,
                strict: false,
            },
        ];
        let grammar = grammars
            .compile(Shape::ToolCall {
                tools: &tools,
                otherwise: None,
            })
            .unwrap();
        let (text, finished) = generate(&grammar, &tokenizer, 300);
        assert!(finished, "{text}");
        let (prose, calls) = super::super::chat::split_tool_calls(&text, &["get_weather", "noop"]);
        assert_eq!((prose.as_str(), calls.len()), ("", 1), "{text}");
        if calls[0].name == "get_weather" {
            let arguments: Value = serde_json::from_str(&calls[0].arguments).unwrap();
            assert!(
                ["Paris", "Oslo"].contains(&arguments["city"].as_str().unwrap()),
                "{text}"
            );
        }
    }

    #[test]
    fn prose_may_answer_under_auto_but_never_holds_a_call_s_tag() {
        let (grammars, tokenizer) = grammars();
        let tools = [Tool {
            name: "noop",
            parameters: None,
            strict: true,
        }];
        let grammar = grammars
            .compile(Shape::ToolCall {
                tools: &tools,
                otherwise: Some(Otherwise::Prose),
            })
            .unwrap();
        let (mut matcher, _) = grammar.start();
        // Prose is accepted, and then the tag cannot start a call inside it.
        for id in tokenizer.encode("Sunny today. ", false).unwrap().get_ids() {
            assert!(!matcher.accept(*id).unwrap());
        }
        let open = tokenizer.token_to_id(TOOL_CALL_OPEN).unwrap();
        assert!(!matcher.mask().unwrap().allows(open));
        let (matcher, first) = grammar.start();
        drop(matcher);
        assert!(first.allows(open));
    }

    #[test]
    fn what_the_engine_cannot_compile_is_named() {
        let (grammars, _) = grammars();
        let compile = |schema: Value, strict| {
            grammars.compile(Shape::Json(Json {
                schema: &schema,
                strict,
            }))
        };
        // A keyword it does not support: refused when strict, ignored otherwise.
        let unknown = json!({"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}});
        let error = compile(unknown.clone(), true).unwrap_err();
        assert!(error.contains("no-such-format"), "{error}");
        assert!(compile(unknown, false).is_ok());
        let error = compile(
            json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
            true,
        )
        .unwrap_err();
        assert!(error.contains("missing"), "{error}");
        // Unsatisfiable.
        let error = compile(json!({"type": "integer", "minimum": 5, "maximum": 1}), true).unwrap_err();
        assert!(!error.is_empty());
    }

    #[test]
    fn a_schema_too_large_to_compile_quickly_is_refused_by_what_is_too_large() {
        let (grammars, _) = grammars();
        let compile = |schema: &Value| grammars.compile(Shape::Json(Json { schema, strict: true }));
        let properties = |n: usize| {
            let p: serde_json::Map<String, Value> =
                (0..n).map(|i| (format!("p{i}"), json!({"type": "string"}))).collect();
            json!({"type": "object", "properties": p})
        };
        assert!(compile(&properties(MOST_PROPERTIES)).is_ok());
        let error = compile(&properties(MOST_PROPERTIES + 1)).unwrap_err();
        assert!(error.contains("properties"), "{error}");
        let error = compile(&json!({"enum": (0..=MOST_ENUM_VALUES).collect::<Vec<_>>()})).unwrap_err();
        assert!(error.contains("enum"), "{error}");
        let deep = (0..DEEPEST).fold(
            json!({"type": "string"}),
            |inner, _| json!({"type": "array", "items": inner}),
        );
        let error = compile(&deep).unwrap_err();
        assert!(error.contains("deep"), "{error}");
        // The tools' schemas count together.
        let half = properties(MOST_PROPERTIES / 2 + 1);
        let tools = [
            Tool {
                name: "a",
                parameters: Some(&half),
                strict: true,
            },
            Tool {
                name: "b",
                parameters: Some(&half),
                strict: true,
            },
        ];
        let error = grammars
            .compile(Shape::ToolCall {
                tools: &tools,
                otherwise: None,
            })
            .unwrap_err();
        assert!(error.contains("properties"), "{error}");
    }

    #[test]
    fn a_schema_sent_again_is_compiled_once_and_each_generation_has_its_own_matcher() {
        let (grammars, tokenizer) = grammars();
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
        let compile = |strict| {
            grammars
                .compile(Shape::Json(Json {
                    schema: &schema,
                    strict,
                }))
                .unwrap()
        };
        let first = compile(true);
        assert_eq!(first, compile(true), "the same compiled grammar");
        assert_ne!(first, compile(false), "strictness is part of the grammar");
        // Two generations from one grammar move on independently.
        let (mut one, _) = first.start();
        let (mut two, _) = first.start();
        for id in tokenizer.encode("{\"n\": 12", false).unwrap().get_ids() {
            one.accept(*id).unwrap();
        }
        let close = tokenizer.token_to_id("}").unwrap();
        assert!(one.mask().unwrap().allows(close));
        assert!(!two.mask().unwrap().allows(close));
        // Only the last few are kept.
        for n in 0..RECENT {
            let other = json!({"type": "integer", "minimum": n});
            grammars
                .compile(Shape::Json(Json {
                    schema: &other,
                    strict: true,
                }))
                .unwrap();
        }
        assert_ne!(first, compile(true), "compiled again once it was no longer recent");
    }

    #[test]
    fn a_model_without_an_end_token_is_refused() {
        let (_, tokenizer) = grammars();
        let error = Grammars::new(tokenizer, vec![])
            .compile(Shape::Json(Json {
                schema: &json!({"type": "object"}),
                strict: true,
            }))
            .unwrap_err();
        assert!(error.contains("end-of-text"), "{error}");
    }
}
