//! What is particular to `POST /v1/chat/completions`: messages rendered by the model's chat
//! template, the tools offered, a chat shortened by whole turns, tool calls read back into
//! OpenAI's `tool_calls`, and the grammar of a structured output (`response_format`, a forced
//! or strict tool call). Templates and the reading of calls are [`crate::runtime::chat`], the
//! grammars [`crate::runtime::grammar`].

use std::num::NonZeroU32;
use std::sync::Arc;

use serde::{Deserialize, Deserializer};
use serde_json::{Value, json};

use super::body;
use super::error::OpenAiError;
use super::format;
use super::job::{Api, Draft, PromptIn, Sampling, Stop, text_model};
use crate::http::state::AppState;
use crate::runtime::chat::{ChatTemplate, Invalid, ToolCall};
use crate::runtime::grammar::{Grammar, Json, Otherwise, Shape, Tool};
use crate::serve::generation;
use crate::serve::service::Generator;

/// The body of `POST /v1/chat/completions` but for what it shares with completions
/// ([`Sampling`]) and what is not served ([`Unserved`]), each read from the body on its own.
#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Vec<Value>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: ToolChoice,
    /// OpenAI's newer name for `max_tokens` (0 refused by its own name as it is read).
    #[serde(default)]
    max_completion_tokens: Option<NonZeroU32>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<u32>,
    #[serde(default)]
    response_format: Option<Value>,
}

/// Chat fields that would change the answer and that are not served: refused by [`unserved`],
/// never ignored.
#[derive(Debug, Default, Deserialize)]
struct Unserved {
    /// OpenAI's deprecated form of `tools`.
    #[serde(default)]
    functions: Option<Value>,
    #[serde(default)]
    function_call: Option<Value>,
    #[serde(default)]
    modalities: Option<Vec<String>>,
    #[serde(default)]
    audio: Option<Value>,
    #[serde(default)]
    web_search_options: Option<Value>,
}

/// Refuse the first field of `fields` that asks for what is not served, naming it and why.
fn unserved(fields: &Unserved) -> Result<(), OpenAiError> {
    let given = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
    let refusal = if given(&fields.functions) || given(&fields.function_call) {
        let name = if given(&fields.functions) {
            "functions"
        } else {
            "function_call"
        };
        Some((
            name,
            format!("`{name}` (OpenAI's deprecated form of tools) is not supported: send `tools` and `tool_choice`"),
        ))
    } else if fields
        .modalities
        .as_ref()
        .is_some_and(|m| m.iter().any(|m| m != "text"))
        || given(&fields.audio)
    {
        let name = if given(&fields.audio) { "audio" } else { "modalities" };
        Some((name, format!("`{name}`: the models served here answer in text only")))
    } else if given(&fields.web_search_options) {
        Some((
            "web_search_options",
            "`web_search_options` is not supported: nothing here searches the web".to_string(),
        ))
    } else {
        None
    };
    match refusal {
        Some((name, message)) => Err(OpenAiError::invalid(message, Some(name))),
        None => Ok(()),
    }
}

/// `tool_choice`.
#[derive(Debug, Default, PartialEq)]
enum ToolChoice {
    /// The model may call a tool offered (the default, also when `null`).
    #[default]
    Auto,
    /// The tools are not offered to the model.
    None,
    /// `required`: a call to some tool, forced.
    Required,
    /// `{"type": "function", "function": {"name": …}}`: a call to that function, forced.
    Function(String),
    /// Any other value, refused by [`read`] with `tool_choice` named (not as a malformed body).
    Unknown,
}

impl<'de> Deserialize<'de> for ToolChoice {
    /// Never fails: what is not served is refused by [`read`] with `tool_choice` named.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        Ok(match &value {
            Value::Null => ToolChoice::Auto,
            Value::String(s) => match s.as_str() {
                "auto" => ToolChoice::Auto,
                "none" => ToolChoice::None,
                "required" => ToolChoice::Required,
                _ => ToolChoice::Unknown,
            },
            Value::Object(_) if value["type"] == "function" => match value["function"]["name"].as_str() {
                Some(name) => ToolChoice::Function(name.to_string()),
                None => ToolChoice::Unknown,
            },
            _ => ToolChoice::Unknown,
        })
    }
}

/// Whether a chat's answer must be a tool call, and of which function.
#[derive(Debug, Clone, Copy)]
enum Call<'a> {
    /// It may be one, or not.
    Free,
    /// A call of any tool offered.
    Any,
    /// A call of this function.
    Named(&'a str),
}

/// The grammar a chat's answer follows, compiled for `entry`'s tokenizer, if any: a call when
/// `call` forces one; else, with tools `offered` of which one is strict or with a
/// `response_format`, a call of any tool or an answer in that format (prose, without one);
/// else the `response_format`.
fn grammar_of(
    text: &Generator,
    tools: &[Value],
    offered: bool,
    call: Call<'_>,
    format: Option<&(Value, bool)>,
) -> Result<Option<Grammar>, OpenAiError> {
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
                format::compiled(text, format)?;
            }
            let otherwise = Some(answer.map_or(Otherwise::Prose, Otherwise::Json));
            Shape::ToolCall {
                tools: &callable,
                otherwise,
            }
        }
        _ => return format.map(|format| format::compiled(text, format)).transpose(),
    };
    text.grammars
        .compile(shape)
        .map(Some)
        .map_err(|e| OpenAiError::invalid(e, Some("tools")))
}

/// A chat body: its messages rendered by the model's template, with the tools offered, and the
/// end of the assistant's turn added to `stop`.
pub(super) fn read(state: &AppState, body: &[u8], id: &str) -> Result<Draft, OpenAiError> {
    let value = body::parse(body)?;
    let sampling: Sampling = body::fields(&value)?;
    unserved(&body::fields(&value)?)?;
    // Owned: the messages and tools move out of the body.
    let request: ChatRequest = body::fields(value)?;
    let format = format::schema(request.response_format.as_ref())?;
    let logprobs = chat_logprobs(request.logprobs, request.top_logprobs)?;
    let (_, text) = text_model(state, &sampling.model, id)?;
    let template = text.chat.clone().ok_or_else(|| {
        OpenAiError::invalid(
            format!(
                "model `{}` has no chat template (set `models[].chat_template`, or put a tokenizer_config.json with `chat_template` beside its tokenizer); /v1/completions takes plain prompts",
                sampling.model
            ),
            Some("model"),
        )
    })?;
    let at = |e: Invalid| OpenAiError::invalid_at(e.to_string(), e.at);
    let messages = crate::runtime::chat::template_messages(&request.messages).map_err(at)?;
    let tools = request.tools.unwrap_or_default();
    crate::runtime::chat::check_tools(&tools).map_err(at)?;
    let tool_choice = |message: String| OpenAiError::invalid(message, Some("tool_choice"));
    let (offered, call) = match &request.tool_choice {
        ToolChoice::Auto => (!tools.is_empty(), Call::Free),
        ToolChoice::None => (false, Call::Free),
        ToolChoice::Required | ToolChoice::Function(_) if tools.is_empty() => {
            return Err(tool_choice(
                "`tool_choice` forces a call, and no `tools` are offered".into(),
            ));
        }
        ToolChoice::Required => (true, Call::Any),
        ToolChoice::Function(name) => {
            if !tools.iter().any(|t| t["function"]["name"] == name.as_str()) {
                return Err(tool_choice(format!(
                    "`tool_choice` names `{name}`, which is not among the `tools`"
                )));
            }
            (true, Call::Named(name.as_str()))
        }
        ToolChoice::Unknown => {
            return Err(tool_choice(
                "`tool_choice` may be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": …}}"
                    .into(),
            ));
        }
    };
    let grammar = grammar_of(text, &tools, offered, call, format.as_ref())?;
    let offered_tools = offered.then_some(tools.as_slice());
    let tokenizer = Arc::clone(&text.tokenizer);
    let text = template
        .render(&messages, offered_tools)
        .map_err(|e| OpenAiError::invalid(e, Some("messages")))?;
    let shorten = shorten_chat(
        Arc::clone(&template),
        tokenizer,
        messages,
        offered_tools.map(<[Value]>::to_vec),
    );
    let names = if offered {
        tools
            .iter()
            .filter_map(|t| t["function"]["name"].as_str().map(str::to_string))
            .collect()
    } else {
        Vec::new()
    };
    let max_tokens = request
        .max_completion_tokens
        .map(NonZeroU32::get)
        .or(sampling.max_tokens);
    let mut sampling = sampling;
    // A grammar ends the answer itself, and where it allows the end-of-turn string as text (in
    // a JSON string) that text is part of the answer.
    let end = grammar.is_none().then_some(&template.end_of_turn);
    sampling.stop = Some(with_end_of_turn(sampling.stop.take(), end)?);
    Ok(Draft {
        sampling,
        prompts: vec![PromptIn::Text(text)],
        echo: false,
        api: Api::Chat { tools: names },
        max_tokens,
        shorten: Some(shorten),
        grammar,
        logprobs,
    })
}

/// Chat's `logprobs` (whether to give each token's) and `top_logprobs` (how many of the most
/// likely tokens' beside it, 0 to 20, only with `logprobs`), as the alternatives a token gets.
fn chat_logprobs(logprobs: Option<bool>, top: Option<u32>) -> Result<Option<u32>, OpenAiError> {
    let top_logprobs = |message: &str| OpenAiError::invalid(message, Some("top_logprobs"));
    match (logprobs == Some(true), top.unwrap_or(0)) {
        (_, top) if top > 20 => Err(top_logprobs("`top_logprobs` must be from 0 to 20")),
        (false, 0) => Ok(None),
        (false, _) => Err(top_logprobs("`top_logprobs` needs `logprobs: true`")),
        (true, top) => Ok(Some(top)),
    }
}

/// The client's `stop` with `end`, the end of the assistant's turn, added: it ends the answer
/// even where it is not a single token.
fn with_end_of_turn(stop: Option<Stop>, end: Option<&String>) -> Result<Stop, OpenAiError> {
    let end = end.cloned();
    Ok(match stop {
        None => Stop::Many(end.into_iter().collect()),
        Some(Stop::One(s)) => Stop::Many(std::iter::once(s).chain(end).collect()),
        Some(Stop::Many(mut v)) => {
            if v.len() > 4 {
                return Err(OpenAiError::invalid("`stop` takes at most 4 strings", Some("stop")));
            }
            v.extend(end);
            Stop::Many(v)
        }
    })
}

/// How a chat is shortened: the system messages stay, and the oldest turns after them go,
/// whole (a turn starts at a user message), until the prompt fits; the latest turn always stays.
fn shorten_chat(
    template: Arc<ChatTemplate>,
    tokenizer: Arc<tokenizers::Tokenizer>,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
) -> generation::Shorten {
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

/// OpenAI's `tool_calls` of choice `choice`, each with an id unique to the request.
pub(super) fn tool_calls_json(calls: &[ToolCall], id: &str, choice: usize) -> Value {
    let of_choice = match choice {
        0 => String::new(),
        c => format!("_{c}"),
    };
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"id": format!("call_{i}_{id}{of_choice}"), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}})
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_choice_reads_auto_none_and_a_forced_call() {
        let choice = |value: Value| {
            let request = json!({"model": "m", "messages": [], "tool_choice": value});
            serde_json::from_value::<ChatRequest>(request).unwrap().tool_choice
        };
        assert_eq!(choice(json!("auto")), ToolChoice::Auto);
        assert_eq!(choice(Value::Null), ToolChoice::Auto);
        assert_eq!(choice(json!("none")), ToolChoice::None);
        assert_eq!(choice(json!("required")), ToolChoice::Required);
        assert_eq!(
            choice(json!({"type": "function", "function": {"name": "weather"}})),
            ToolChoice::Function("weather".into())
        );
        assert_eq!(choice(json!({"type": "function"})), ToolChoice::Unknown);
        assert_eq!(choice(json!("sometimes")), ToolChoice::Unknown);
        assert_eq!(choice(json!(3)), ToolChoice::Unknown);
        let absent = json!({"model": "m", "messages": []});
        assert_eq!(
            serde_json::from_value::<ChatRequest>(absent).unwrap().tool_choice,
            ToolChoice::Auto
        );
    }

    #[test]
    fn fields_asking_for_what_is_not_served_are_refused_by_name_and_the_rest_pass() {
        let refused = |extra: Value| {
            let mut request = json!({"model": "m", "messages": []});
            request
                .as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let fields: Unserved = serde_json::from_value(request).unwrap();
            unserved(&fields).err().map(|e| (e.param, e.message))
        };
        for (extra, param, why) in [
            (json!({"functions": [{"name": "f"}]}), "functions", "send `tools`"),
            (json!({"function_call": "auto"}), "function_call", "send `tools`"),
            (json!({"modalities": ["text", "audio"]}), "modalities", "text only"),
            (json!({"audio": {"voice": "alloy"}}), "audio", "text only"),
            (
                json!({"web_search_options": {}}),
                "web_search_options",
                "searches the web",
            ),
        ] {
            let (got, message) = refused(extra.clone()).unwrap_or_else(|| panic!("{extra} passed"));
            assert_eq!(got.as_deref(), Some(param), "{extra}");
            assert!(message.contains(why), "{extra}: {message}");
        }
        for passes in [
            json!({}),
            json!({"modalities": ["text"]}),
            json!({"functions": null, "audio": null}),
            json!({"user": "u", "store": false, "metadata": {"a": "b"}, "service_tier": "auto"}),
        ] {
            assert!(refused(passes.clone()).is_none(), "{passes}");
        }
    }
}
