//! What is particular to `POST /v1/chat/completions`: messages rendered by the model's chat
//! template, the tools offered, a chat shortened by whole turns, and tool calls read back into
//! OpenAI's `tool_calls`. Templates and the reading of calls are [`crate::runtime::chat`].

use std::sync::Arc;

use serde::{Deserialize, Deserializer};
use serde_json::{Value, json};

use super::error::OpenAiError;
use super::job::{Api, Draft, PromptIn, Sampling, Stop, refuse_unsupported, text_model};
use crate::http::state::AppState;
use crate::runtime::chat::{ChatTemplate, ToolCall};
use crate::serve::generation;

/// The body of `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
struct ChatRequest {
    #[serde(flatten)]
    sampling: Sampling,
    messages: Vec<Value>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: ToolChoice,
    /// OpenAI's newer name for `max_tokens`.
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<u32>,
    #[serde(default)]
    response_format: Option<Value>,
}

/// `tool_choice`. Without constrained decoding a call cannot be forced: only `auto` and `none`
/// are served, and a forced call is refused rather than answered with text the client did not
/// ask for.
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
    Function,
    /// Any other value, refused as a forced call is (not as a malformed body), as it always was.
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
            Value::Object(_) if value["type"] == "function" => ToolChoice::Function,
            _ => ToolChoice::Unknown,
        })
    }
}

/// A chat body: its messages rendered by the model's template, with the tools offered, and the
/// end of the assistant's turn added to `stop`.
pub(super) fn read(state: &AppState, body: &[u8], id: &str) -> Result<Draft, OpenAiError> {
    let request: ChatRequest = serde_json::from_slice(body)
        .map_err(|e| OpenAiError::invalid(format!("the body is not a chat completion request: {e}"), None))?;
    refuse_unsupported([
        (request.logprobs == Some(true), "logprobs"),
        (request.top_logprobs.is_some(), "top_logprobs"),
        (
            request
                .response_format
                .as_ref()
                .is_some_and(|f| !f.is_null() && f["type"] != "text"),
            "response_format",
        ),
    ])?;
    let entry = text_model(state, &request.sampling.model, id)?;
    let template = entry.chat.clone().ok_or_else(|| {
        OpenAiError::invalid(
            format!(
                "model `{}` has no chat template (set `models[].chat_template`, or put a tokenizer_config.json with `chat_template` beside its tokenizer); /v1/completions takes plain prompts",
                request.sampling.model
            ),
            Some("model"),
        )
    })?;
    let messages = crate::runtime::chat::template_messages(&request.messages)
        .map_err(|e| OpenAiError::invalid(e, Some("messages")))?;
    let tools = request.tools.unwrap_or_default();
    crate::runtime::chat::check_tools(&tools).map_err(|e| OpenAiError::invalid(e, Some("tools")))?;
    let offered = match request.tool_choice {
        ToolChoice::Auto => !tools.is_empty(),
        ToolChoice::None => false,
        ToolChoice::Required | ToolChoice::Function | ToolChoice::Unknown => {
            return Err(OpenAiError::invalid(
                "`tool_choice` may be \"auto\" or \"none\": forcing a call is not supported",
                Some("tool_choice"),
            ));
        }
    };
    let offered_tools = offered.then_some(tools.as_slice());
    let text = template
        .render(&messages, offered_tools)
        .map_err(|e| OpenAiError::invalid(e, Some("messages")))?;
    let tokenizer = Arc::clone(entry.tokenizer.as_ref().expect("checked by text_model"));
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
    let max_tokens = request.max_completion_tokens.or(request.sampling.max_tokens);
    let mut sampling = request.sampling;
    sampling.stop = Some(with_end_of_turn(sampling.stop.take(), &template)?);
    Ok(Draft {
        sampling,
        prompts: vec![PromptIn::Text(text)],
        echo: false,
        api: Api::Chat { tools: names },
        max_tokens,
        shorten: Some(shorten),
    })
}

/// The client's `stop` with the end of the assistant's turn added: it ends the answer even where
/// it is not a single token.
fn with_end_of_turn(stop: Option<Stop>, template: &ChatTemplate) -> Result<Stop, OpenAiError> {
    let end = template.end_of_turn.clone();
    Ok(match stop {
        None => Stop::Many(vec![end]),
        Some(Stop::One(s)) => Stop::Many(vec![s, end]),
        Some(Stop::Many(mut v)) => {
            if v.len() > 4 {
                return Err(OpenAiError::invalid("`stop` takes at most 4 strings", Some("stop")));
            }
            v.push(end);
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
    fn tool_choice_serves_auto_and_none_and_names_a_forced_call() {
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
            ToolChoice::Function
        );
        assert_eq!(choice(json!("sometimes")), ToolChoice::Unknown);
        assert_eq!(choice(json!(3)), ToolChoice::Unknown);
        let absent = json!({"model": "m", "messages": []});
        assert_eq!(
            serde_json::from_value::<ChatRequest>(absent).unwrap().tool_choice,
            ToolChoice::Auto
        );
    }
}
