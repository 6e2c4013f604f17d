//! A chat made a prompt for its model: the messages and tools checked and rendered by the
//! model's chat template (`runtime::chat`), how the chat is shortened by whole turns, the
//! grammar of a structured output (`response_format`, a forced or strict tool call:
//! `runtime::grammar`), and the tool calls read back from the finished text. A protocol hands
//! the chat as it was sent ([`Chat`]); what is wrong comes back as an [`Invalid`] naming the
//! field at fault.

use std::sync::Arc;

use serde_json::Value;

use super::{Generated, Invalid, Shorten};
use crate::core::tool_call::ToolCall;
use crate::runtime::chat::{ChatTemplate, split_tool_calls};
use crate::runtime::grammar::{Grammar, Json, Otherwise, Shape, Tool};
use crate::serve::service::{Generator, ModelEntry};

/// The field a structured output's format is read from, and what a schema the grammar engine
/// refuses is named by.
const FORMAT: &str = "response_format";

/// Whether a chat's answer must be a tool call, and of which function.
#[derive(Debug, Clone, PartialEq)]
pub enum Call {
    /// It may be one, or not.
    Free,
    /// A call of any tool offered.
    Any,
    /// A call of this function (one of the tools sent).
    Named(String),
}

/// A chat as its request sent it.
#[derive(Debug, Clone)]
pub struct Chat {
    /// Its messages, as sent.
    pub messages: Vec<Value>,
    /// The tools sent (OpenAI's `{"type": "function", "function": {…}}`).
    pub tools: Vec<Value>,
    /// Whether the tools are offered to the model (not with `tool_choice: "none"`).
    pub offered: bool,
    /// Whether a call is forced.
    pub call: Call,
}

/// A chat rendered for its model.
pub(super) struct Rendered {
    /// The prompt's text, the template's output.
    pub(super) text: String,
    /// How it is cut by whole turns when the policy shrinks the context.
    pub(super) shorten: Shorten,
    /// The grammar its answer follows, if any.
    pub(super) grammar: Option<Grammar>,
    /// The end of the assistant's turn, a stop string unless a grammar ends the answer itself
    /// (where the grammar allows that text, in a JSON string, it is part of the answer).
    pub(super) end_of_turn: Option<String>,
    /// The names of the tools offered (empty: none).
    pub(super) tools: Vec<String>,
}

/// `chat` rendered by `entry`'s template, with `text`'s grammar for its answer: in `format`
/// (a JSON schema and its strictness), a call the chat forces, or either when a tool is strict.
pub(super) fn rendered(
    entry: &ModelEntry,
    text: &Generator,
    chat: Chat,
    format: Option<&(Value, bool)>,
) -> Result<Rendered, Invalid> {
    let template = text.chat.clone().ok_or_else(|| Invalid::Field {
        message: format!(
            "model `{}` has no chat template (set `models[].chat_template`, or put a tokenizer_config.json with `chat_template` beside its tokenizer); /v1/completions takes plain prompts",
            entry.config.name
        ),
        at: "model".into(),
    })?;
    let at = |e: crate::runtime::chat::Invalid| Invalid::Field {
        message: e.to_string(),
        at: e.at,
    };
    let messages = crate::runtime::chat::template_messages(&chat.messages).map_err(at)?;
    let tools = chat.tools;
    crate::runtime::chat::check_tools(&tools).map_err(at)?;
    let grammar = grammar_of(text, &tools, chat.offered, &chat.call, format)?;
    let offered_tools = chat.offered.then_some(tools.as_slice());
    let rendered = template
        .render(&messages, offered_tools)
        .map_err(|e| Invalid::field(e, "messages"))?;
    let names = match chat.offered {
        true => (tools.iter())
            .filter_map(|t| t["function"]["name"].as_str().map(str::to_string))
            .collect(),
        false => Vec::new(),
    };
    let end_of_turn = grammar.is_none().then(|| template.end_of_turn.clone());
    let shorten = shorten_chat(
        template,
        Arc::clone(&text.tokenizer),
        messages,
        offered_tools.map(<[Value]>::to_vec),
    );
    Ok(Rendered {
        text: rendered,
        shorten,
        grammar,
        end_of_turn,
        tools: names,
    })
}

/// The grammar a chat's answer follows, compiled for `text`'s tokenizer, if any: a call when
/// `call` forces one; else, with tools `offered` of which one is strict or with a `format`, a
/// call of any tool or an answer in that format (prose, without one); else the `format`.
fn grammar_of(
    text: &Generator,
    tools: &[Value],
    offered: bool,
    call: &Call,
    format: Option<&(Value, bool)>,
) -> Result<Option<Grammar>, Invalid> {
    let answer = format.map(|(schema, strict)| Json {
        schema,
        strict: *strict,
    });
    let callable: Vec<Tool<'_>> = tools
        .iter()
        .map(|t| Tool {
            name: t["function"]["name"].as_str().unwrap_or_default(),
            parameters: t["function"].get("parameters"),
            strict: t["function"]["strict"] == true,
        })
        .filter(|t| !matches!(call, Call::Named(name) if t.name != name))
        .collect();
    let strict_tool = callable.iter().any(|t| t.strict);
    let shape = match (call, offered) {
        (Call::Any | Call::Named(_), _) => Shape::ToolCall {
            tools: &callable,
            otherwise: None,
        },
        (Call::Free, true) if answer.is_some() || strict_tool => {
            // A response format that cannot compile is named as such, not as the tools'.
            if let Some(format) = format {
                format_grammar(text, format)?;
            }
            let otherwise = Some(answer.map_or(Otherwise::Prose, Otherwise::Json));
            Shape::ToolCall {
                tools: &callable,
                otherwise,
            }
        }
        _ => return format.map(|format| format_grammar(text, format)).transpose(),
    };
    text.grammars
        .compile(shape)
        .map(Some)
        .map_err(|e| Invalid::field(e, "tools"))
}

/// The grammar of an answer in `format` (a JSON schema and its strictness) for `text`'s model;
/// a schema the engine cannot take is refused naming `response_format`.
pub(super) fn format_grammar(text: &Generator, (schema, strict): &(Value, bool)) -> Result<Grammar, Invalid> {
    text.grammars
        .compile(Shape::Json(Json {
            schema,
            strict: *strict,
        }))
        .map_err(|e| Invalid::field(format!("`{FORMAT}`: {e}"), FORMAT))
}

/// How a chat is shortened: the system messages stay, and the oldest turns after them go,
/// whole (a turn starts at a user message), until the prompt fits; the latest turn always stays.
fn shorten_chat(
    template: Arc<ChatTemplate>,
    tokenizer: Arc<tokenizers::Tokenizer>,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
) -> Shorten {
    Arc::new(move |to: u64| {
        let system = messages.iter().take_while(|m| m["role"] == "system").count();
        let starts: Vec<usize> = (system + 1..messages.len())
            .filter(|&i| messages[i]["role"] == "user")
            .collect();
        let mut shortest = None;
        for start in starts {
            let kept: Vec<Value> = messages[..system].iter().chain(&messages[start..]).cloned().collect();
            let text = template.render(&kept, tools.as_deref())?;
            let ids = tokenizer
                .encode(text.as_str(), false)
                .map_err(|e| format!("the shortened chat cannot be tokenized: {e}"))?
                .get_ids()
                .to_vec();
            if ids.len() as u64 <= to {
                let cut = format!(
                    "{} of {} messages: the oldest turns after the system prompt",
                    start - system,
                    messages.len()
                );
                return Ok((ids, cut));
            }
            shortest = Some(ids.len());
        }
        Err(match shortest {
            Some(n) => format!("the system prompt and the latest turn alone take {n} tokens"),
            None => "the chat has a single turn, and turns are cut whole".to_string(),
        })
    })
}

impl Generated {
    /// Its text split into prose and the calls it makes of the tools `offered` (by name): a
    /// call block naming another function, or not closed, stays in the prose as written.
    pub fn tool_calls(&self, offered: &[String]) -> (String, Vec<ToolCall>) {
        let offered: Vec<&str> = offered.iter().map(String::as_str).collect();
        split_tool_calls(&self.text, &offered)
    }
}
