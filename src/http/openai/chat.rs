//! What is particular to `POST /v1/chat/completions`: the messages and tools read, which tools
//! are offered and whether a call is forced (`tool_choice`), the fields not served refused by
//! name, and the tool calls the generation read back written as OpenAI's `tool_calls`. The
//! chat is rendered by its model's template, shortened by whole turns and given the grammar of
//! a structured output by the generation ([`generation::Chat`]).

use std::num::NonZeroU32;

use serde::{Deserialize, Deserializer};
use serde_json::{Value, json};

use super::body;
use super::error::OpenAiError;
use super::format;
use super::job::{Draft, Sampling, text_model};
use crate::core::tool_call::ToolCall;
use crate::http::state::AppState;
use crate::serve::generation::{self, Call};

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

/// A chat body: its messages, the tools sent and which of them the model is offered (and
/// whether it must call one), for the generation to render with the model's template.
pub(super) fn read<'a>(state: &'a AppState, body: &[u8], id: &str) -> Result<Draft<'a>, OpenAiError> {
    let value = body::parse(body)?;
    let sampling: Sampling = body::fields(&value)?;
    unserved(&body::fields(&value)?)?;
    // Owned: the messages and tools move out of the body.
    let request: ChatRequest = body::fields(value)?;
    let format = format::schema(request.response_format.as_ref())?;
    let logprobs = chat_logprobs(request.logprobs, request.top_logprobs)?;
    let model = text_model(state, &sampling.model, id)?;
    let tools = request.tools.unwrap_or_default();
    let tool_choice = |message: String| OpenAiError::invalid(message, Some("tool_choice"));
    let (offered, call) = match request.tool_choice {
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
            (true, Call::Named(name))
        }
        ToolChoice::Unknown => {
            return Err(tool_choice(
                "`tool_choice` may be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": …}}"
                    .into(),
            ));
        }
    };
    let max_tokens = request
        .max_completion_tokens
        .map(NonZeroU32::get)
        .or(sampling.max_tokens);
    let chat = generation::Chat {
        messages: request.messages,
        tools,
        offered,
        call,
    };
    Ok(Draft {
        model,
        sampling,
        prompts: generation::Prompts::Chat(chat),
        echo: false,
        max_tokens,
        format,
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
