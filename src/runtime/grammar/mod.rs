//! Structured outputs by constrained decoding: a JSON schema, or a tool call in the format chat
//! reads calls back in ([`super::chat::split_tool_calls`]), compiled by `llguidance` against a
//! model's tokenizer into a [`Grammar`]; a generation under one keeps a [`Constrained`] matcher
//! that gives, before each pick, the [`Mask`] of the tokens that keep its text in the grammar
//! (the end-of-text tokens only where the grammar may end), and says when nothing may follow.
//!
//! `llguidance` sees a vocabulary as the bytes each token id stands for. `vocabulary.rs` reads
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
//! keywords ignored. What a schema may hold is bounded (`schema.rs`: its properties, `enum`
//! values and depth), and so is the engine's work ([`limits`]), so that a hostile schema is
//! refused rather than compiled for seconds; `schema.rs` also refuses a `$ref` that leads back
//! to itself with nothing in between, which would admit no answer.

use std::sync::{Arc, Mutex, OnceLock};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};

use super::chat::{TOOL_CALL_CLOSE, TOOL_CALL_OPEN};

mod schema;
mod vocabulary;

use schema::Size;
use vocabulary::{Vocabulary, token_bytes};

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
            Shape::Json(json) => size.check(json.schema)?,
            Shape::ToolCall { tools, otherwise } => {
                for parameters in tools.iter().filter_map(|t| t.parameters) {
                    size.check(parameters)?;
                }
                if let Some(Otherwise::Json(json)) = otherwise {
                    size.check(json.schema)?;
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
        // A grammar no text can start (its schema unsatisfiable in a way the checks above do
        // not see) fails here, in the engine's words.
        let first = start
            .compute_mask()
            .map_err(|e| format!("{what} admits no answer: nothing may start it ({e})"))?;
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

/// What one compilation may spend: `llguidance`'s defaults, but its errors without the
/// grammar's whole text (the client's own schema, which can be long).
fn limits() -> ParserLimits {
    ParserLimits {
        verbose_errors: false,
        ..ParserLimits::default()
    }
}

/// `llguidance`'s view of a model's vocabulary, its end-of-text tokens among it.
fn factory(tokenizer: &Arc<tokenizers::Tokenizer>, eos: &[u32]) -> Result<ParserFactory, String> {
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
    use super::schema::{DEEPEST, MOST_ENUM_VALUES, MOST_PROPERTIES};
    use super::*;

    /// The first fixture's grammar compiler (the fixtures share one tokenizer), its
    /// `<|endoftext|>` ending answers.
    fn grammars() -> (Grammars, Arc<tokenizers::Tokenizer>) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/real/qwen2-optimum/tokenizer.json");
        let tokenizer = Arc::new(tokenizers::Tokenizer::from_file(path).unwrap());
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
