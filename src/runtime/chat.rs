//! Chat: a conversation rendered into one prompt by the model's chat template, and tool calls
//! read back out of the generated text.
//!
//! Templates are Jinja, as Hugging Face ships them in `tokenizer_config.json` (`chat_template`,
//! a string or named templates of which `tool_use` serves requests with tools), rendered the
//! way `transformers` does: `trim_blocks` and `lstrip_blocks`, Python's string methods, the
//! variables `messages`, `tools`, `add_generation_prompt`, `bos_token` and `eos_token`, and the
//! functions `raise_exception` and `strftime_now`. `builtin:chatml` is ChatML with tools in the
//! Hermes convention, which is also how tool calls are read back: `<tool_call>{"name": …,
//! "arguments": {…}}</tool_call>`.

use minijinja::{Environment, ErrorKind};
use serde_json::{Value, json};

use crate::config::{BuiltinChatTemplate, ChatTemplateSource};
use crate::core::tool_call::ToolCall;

/// The bundled ChatML template.
const CHATML: &str = include_str!("chatml.jinja");
/// Where a tool call starts and ends in the generated text (Hermes convention).
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
/// Where a tool call ends.
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// A model's chat template, compiled.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Whether a separate `tool_use` template serves requests with tools.
    tool_use: bool,
    bos_token: String,
    eos_token: String,
    /// The text that ends the assistant's turn (ChatML's `<|im_end|>`, else the EOS token).
    pub end_of_turn: String,
    /// Where it came from, for messages.
    pub origin: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

/// A special token in `tokenizer_config.json`: a string or `{"content": …}`.
fn special_token(config: &Value, name: &str) -> String {
    match &config[name] {
        Value::String(s) => s.clone(),
        Value::Object(o) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// Load the configured template: a builtin, a Jinja file, or a `tokenizer_config.json`
    /// holding one (the config resolved the path and checked the builtin's name).
    pub fn load(source: &ChatTemplateSource) -> Result<ChatTemplate, String> {
        let path = match source {
            ChatTemplateSource::Builtin(BuiltinChatTemplate::Chatml) => {
                return ChatTemplate::new(
                    CHATML.to_string(),
                    None,
                    String::new(),
                    String::new(),
                    &source.to_string(),
                );
            }
            ChatTemplateSource::File(path) => path,
        };
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
        if path.extension().is_some_and(|e| e == "json") {
            ChatTemplate::from_tokenizer_config(&text, &path.display().to_string())?
                .ok_or_else(|| format!("`{}` has no `chat_template`", path.display()))
        } else {
            ChatTemplate::new(text, None, String::new(), String::new(), &path.display().to_string())
        }
    }

    /// The template of a `tokenizer_config.json`, if it has one.
    pub fn from_tokenizer_config(text: &str, origin: &str) -> Result<Option<ChatTemplate>, String> {
        Self::from_tokenizer_files(text, origin, None)
    }

    /// The template of a tokenizer's files: the `chat_template.jinja` beside its
    /// `tokenizer_config.json` (`jinja`: its text and path; what `transformers` writes since
    /// 4.43, leaving the config without one), else the config's own `chat_template`; the
    /// config's `bos_token` and `eos_token` either way.
    pub fn from_tokenizer_files(
        text: &str,
        origin: &str,
        jinja: Option<(String, &str)>,
    ) -> Result<Option<ChatTemplate>, String> {
        let config: Value = serde_json::from_str(text).map_err(|e| format!("`{origin}` is not JSON: {e}"))?;
        let (bos, eos) = (special_token(&config, "bos_token"), special_token(&config, "eos_token"));
        if let Some((template, path)) = jinja {
            return ChatTemplate::new(template, None, bos, eos, path).map(Some);
        }
        let (default, tool_use) = match &config["chat_template"] {
            Value::Null => return Ok(None),
            Value::String(s) => (s.clone(), None),
            Value::Array(named) => {
                let find = |wanted: &str| {
                    named.iter().find_map(|t| {
                        (t["name"] == wanted)
                            .then(|| t["template"].as_str().map(str::to_string))
                            .flatten()
                    })
                };
                let default = find("default").ok_or_else(|| {
                    format!("`{origin}`: `chat_template` is a list without a template named `default`")
                })?;
                (default, find("tool_use"))
            }
            _ => {
                return Err(format!(
                    "`{origin}`: `chat_template` must be a string or a list of named templates"
                ));
            }
        };
        ChatTemplate::new(default, tool_use, bos, eos, origin).map(Some)
    }

    fn new(
        default: String,
        tool_use: Option<String>,
        bos_token: String,
        eos_token: String,
        origin: &str,
    ) -> Result<ChatTemplate, String> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        let compile = |env: &mut Environment<'static>, name: &'static str, source: String| {
            env.add_template_owned(name, source)
                .map_err(|e| format!("`{origin}`: the chat template does not compile: {e:#}"))
        };
        let uses_chatml = default.contains("<|im_end|>");
        compile(&mut env, "default", default)?;
        let has_tool_use = tool_use.is_some();
        if let Some(source) = tool_use {
            compile(&mut env, "tool_use", source)?;
        }
        let end_of_turn = if uses_chatml || eos_token.is_empty() {
            "<|im_end|>".to_string()
        } else {
            eos_token.clone()
        };
        Ok(ChatTemplate {
            env,
            tool_use: has_tool_use,
            bos_token,
            eos_token,
            end_of_turn,
            origin: origin.to_string(),
        })
    }

    /// The prompt for `messages` (already in the template's shape: see [`template_messages`]),
    /// ending where the assistant's answer starts.
    pub fn render(&self, messages: &[Value], tools: Option<&[Value]>) -> Result<String, String> {
        let name = if tools.is_some() && self.tool_use {
            "tool_use"
        } else {
            "default"
        };
        let template = self.env.get_template(name).map_err(|e| e.to_string())?;
        template
            .render(minijinja::context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => true,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| match e.kind() {
                // The template's own refusal (`raise_exception`): its words are the message.
                ErrorKind::InvalidOperation => e
                    .detail()
                    .unwrap_or("the chat template refused the request")
                    .to_string(),
                _ => format!("the chat template of this model failed: {e:#}"),
            })
    }
}

/// `strftime_now(format)`: the local time now, as `transformers` offers templates.
#[allow(unsafe_code)]
fn strftime_now(format: String) -> Result<String, minijinja::Error> {
    let bad = || minijinja::Error::new(ErrorKind::InvalidOperation, "strftime_now: bad format");
    let format = std::ffi::CString::new(format).map_err(|_| bad())?;
    // SAFETY: time() and localtime_r() write only to the locals given; strftime writes at most
    // `buf.len()` bytes into `buf` and returns how many it wrote (0 when it did not fit).
    unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return Err(bad());
        }
        let mut buf = [0u8; 256];
        let n = libc::strftime(buf.as_mut_ptr().cast(), buf.len(), format.as_ptr(), &tm);
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    }
}

/// `tojson` as `transformers` gives it to templates: Python's `json.dumps(value, indent=…)`, keys
/// in their order and nothing escaped for HTML (minijinja's own writes `'` as `\u0027` and no
/// spaces), so a tool's schema reads as the model saw it in training.
fn tojson(value: &minijinja::Value, kwargs: minijinja::value::Kwargs) -> Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let formatter = PythonJson {
        indent: indent.map(|n| vec![b' '; n]),
        level: 0,
        has_value: false,
    };
    serde::Serialize::serialize(value, &mut serde_json::Serializer::with_formatter(&mut out, formatter))
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let text = String::from_utf8(out).expect("serde_json writes UTF-8");
    Ok(minijinja::Value::from_safe_string(text))
}

/// The layout of Python's `json.dumps`: `", "` and `": "` between items on one line, or with
/// `indent`, each item on its own line after `","`.
struct PythonJson {
    indent: Option<Vec<u8>>,
    level: usize,
    has_value: bool,
}

impl PythonJson {
    fn open<W: ?Sized + std::io::Write>(&mut self, w: &mut W, bracket: &[u8]) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(bracket)
    }

    fn close<W: ?Sized + std::io::Write>(&mut self, w: &mut W, bracket: &[u8]) -> std::io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        w.write_all(bracket)
    }

    fn item<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            w.write_all(if self.indent.is_some() { b"," } else { b", " })?;
        }
        self.newline(w)
    }

    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(indent) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.level {
                w.write_all(indent)?;
            }
        }
        Ok(())
    }
}

impl serde_json::ser::Formatter for PythonJson {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.item(w, first)
    }
    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.item(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

/// A message or a tool a chat request cannot have: where it is in the request
/// (`messages[2].content`, which OpenAI's errors give as their `param`) and what is wrong there.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("`{at}` {why}")]
pub struct Invalid {
    /// Its path in the request.
    pub at: String,
    /// What is wrong, said after the path.
    pub why: String,
}

/// What is wrong at `at`.
fn invalid(at: impl Into<String>, why: impl Into<String>) -> Invalid {
    Invalid {
        at: at.into(),
        why: why.into(),
    }
}

/// A message's `content` as text: a string, `null`, or text parts.
fn content_text(content: &Value, at: &str) -> Result<Value, Invalid> {
    match content {
        Value::Null => Ok(Value::Null),
        Value::String(_) => Ok(content.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match (part["type"].as_str(), part["text"].as_str()) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some(kind), _) if kind != "text" => {
                        return Err(invalid(
                            format!("{at}.content[{j}].type"),
                            format!("is `{kind}`: parts of that type are not supported (text only)"),
                        ));
                    }
                    _ => {
                        return Err(invalid(
                            format!("{at}.content[{j}]"),
                            "must be {\"type\": \"text\", \"text\": \"…\"}",
                        ));
                    }
                }
            }
            Ok(Value::String(text))
        }
        _ => Err(invalid(
            format!("{at}.content"),
            "must be a string, null or a list of text parts",
        )),
    }
}

/// OpenAI's `messages`, checked and put in the shape chat templates expect: `content` as text,
/// a tool call's `arguments` as an object (OpenAI sends a JSON string), `developer` as `system`.
pub fn template_messages(messages: &[Value]) -> Result<Vec<Value>, Invalid> {
    if messages.is_empty() {
        return Err(invalid("messages", "must hold at least one message"));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let at = format!("messages[{i}]");
            let role = m["role"]
                .as_str()
                .ok_or_else(|| invalid(format!("{at}.role"), "must be a string"))?;
            let role = match role {
                "developer" => "system",
                "system" | "user" | "assistant" | "tool" => role,
                other => {
                    return Err(invalid(
                        format!("{at}.role"),
                        format!("is `{other}`, not one of system, developer, user, assistant, tool"),
                    ));
                }
            };
            let content = content_text(&m["content"], &at)?;
            if content.is_null() && !(role == "assistant" && m.get("tool_calls").is_some()) {
                return Err(invalid(format!("{at}.content"), "is missing"));
            }
            let mut out = json!({"role": role, "content": content});
            if let Some(name) = m.get("name") {
                out["name"] = name.clone();
            }
            if role == "tool" {
                let id = m["tool_call_id"]
                    .as_str()
                    .ok_or_else(|| invalid(format!("{at}.tool_call_id"), "must name the call this answers"))?;
                out["tool_call_id"] = json!(id);
            }
            if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
                if role != "assistant" {
                    return Err(invalid(
                        format!("{at}.tool_calls"),
                        "is given, and only assistant messages carry tool calls",
                    ));
                }
                let calls = calls
                    .as_array()
                    .ok_or_else(|| invalid(format!("{at}.tool_calls"), "must be a list"))?;
                let calls = calls
                    .iter()
                    .enumerate()
                    .map(|(j, c)| {
                        let name = c["function"]["name"].as_str().ok_or_else(|| {
                            invalid(format!("{at}.tool_calls[{j}].function.name"), "must be a string")
                        })?;
                        let arguments = match &c["function"]["arguments"] {
                            Value::String(s) => serde_json::from_str(s).unwrap_or_else(|_| json!(s)),
                            Value::Null => json!({}),
                            other => other.clone(),
                        };
                        Ok(json!({"id": c["id"], "type": "function",
                                  "function": {"name": name, "arguments": arguments}}))
                    })
                    .collect::<Result<Vec<Value>, Invalid>>()?;
                out["tool_calls"] = Value::Array(calls);
            }
            Ok(out)
        })
        .collect()
}

/// OpenAI's `tools`, checked: functions with a name. They go to the template as given.
pub fn check_tools(tools: &[Value]) -> Result<(), Invalid> {
    for (i, tool) in tools.iter().enumerate() {
        if tool["type"] != "function" {
            return Err(invalid(format!("tools[{i}].type"), "must be \"function\""));
        }
        let name = tool["function"]["name"].as_str().unwrap_or_default();
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
            return Err(invalid(
                format!("tools[{i}].function.name"),
                "must be 1 or more letters, digits, `_` or `-`",
            ));
        }
        if let Some(p) = tool["function"].get("parameters")
            && !p.is_object()
        {
            return Err(invalid(
                format!("tools[{i}].function.parameters"),
                "must be a JSON Schema object",
            ));
        }
    }
    Ok(())
}

/// Split generated text into its prose and its tool calls: each `<tool_call>{"name": …,
/// "arguments": …}</tool_call>` naming one of `offered` becomes a call. A block that is not
/// such JSON, names a function not offered, or is not closed stays in the text, as the model
/// wrote it.
pub fn split_tool_calls(text: &str, offered: &[&str]) -> (String, Vec<ToolCall>) {
    let mut prose = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(TOOL_CALL_OPEN) {
        let after = &rest[start + TOOL_CALL_OPEN.len()..];
        let Some(end) = after.find(TOOL_CALL_CLOSE) else {
            break;
        };
        let call = serde_json::from_str::<Value>(after[..end].trim()).ok().and_then(|v| {
            let name = v["name"].as_str().filter(|n| offered.contains(n))?.to_string();
            let arguments = match &v["arguments"] {
                Value::String(s) => s.clone(),
                Value::Null => "{}".to_string(),
                other => other.to_string(),
            };
            Some(ToolCall { name, arguments })
        });
        let block_end = start + TOOL_CALL_OPEN.len() + end + TOOL_CALL_CLOSE.len();
        match call {
            Some(call) => {
                prose.push_str(&rest[..start]);
                calls.push(call);
            }
            None => prose.push_str(&rest[..block_end]),
        }
        rest = &rest[block_end..];
    }
    prose.push_str(rest);
    let prose = if calls.is_empty() {
        prose
    } else {
        prose.trim().to_string()
    };
    (prose, calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chatml() -> ChatTemplate {
        ChatTemplate::load(&ChatTemplateSource::Builtin(BuiltinChatTemplate::Chatml)).expect("builtin")
    }

    #[test]
    fn a_separate_chat_template_jinja_wins_and_takes_the_config_s_special_tokens() {
        let config = r#"{"bos_token": "<s>", "eos_token": "</s>", "chat_template": "ignored"}"#;
        let jinja = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}".to_string();
        let template =
            ChatTemplate::from_tokenizer_files(config, "tokenizer_config.json", Some((jinja, "chat_template.jinja")))
                .unwrap()
                .unwrap();
        let messages = template_messages(&[serde_json::json!({"role": "user", "content": "hi"})]).unwrap();
        assert_eq!(template.render(&messages, None).unwrap(), "<s>hi</s>");
        assert_eq!(template.origin, "chat_template.jinja");
        let only_config = ChatTemplate::from_tokenizer_files(config, "tokenizer_config.json", None)
            .unwrap()
            .unwrap();
        assert_eq!(only_config.render(&messages, None).unwrap(), "ignored");
    }

    #[test]
    fn chatml_renders_a_conversation_and_ends_with_the_assistant_turn() {
        let messages = template_messages(&[
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": [{"type": "text", "text": "Hi"}]}),
        ])
        .unwrap();
        let prompt = chatml().render(&messages, None).unwrap();
        assert_eq!(
            prompt,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn chatml_offers_tools_and_replays_calls_and_results() {
        let tools = [json!({"type": "function", "function": {"name": "get_free_vram",
                             "parameters": {"type": "object", "properties": {"gpu": {"type": "integer"}}}}})];
        check_tools(&tools).unwrap();
        let messages = template_messages(&[
            json!({"role": "user", "content": "How much VRAM is free?"}),
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_free_vram", "arguments": "{\"gpu\": 0}"}}]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "12 GiB"}),
        ])
        .unwrap();
        let prompt = chatml().render(&messages, Some(&tools)).unwrap();
        assert!(
            prompt.starts_with("<|im_start|>system\nYou may call one or more functions"),
            "{prompt}"
        );
        assert!(
            prompt.contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\":"),
            "{prompt}"
        );
        assert!(
            prompt.contains(
                "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_free_vram\", \"arguments\": {\"gpu\": 0}}\n</tool_call><|im_end|>\n"
            ),
            "{prompt}"
        );
        assert!(
            prompt.ends_with(
                "<|im_start|>user\n<tool_response>\n12 GiB\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
            ),
            "{prompt}"
        );
    }

    #[test]
    fn a_tokenizer_config_template_gets_its_special_tokens_and_can_refuse() {
        let config = json!({
            "bos_token": {"content": "<s>"}, "eos_token": "</s>",
            "chat_template": "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}[{{ m.role|upper }}] {{ m.content.strip() }}{{ eos_token }}{% endfor %}",
        });
        let template = ChatTemplate::from_tokenizer_config(&config.to_string(), "t")
            .unwrap()
            .unwrap();
        assert_eq!(template.end_of_turn, "</s>");
        let ok = template_messages(&[json!({"role": "user", "content": "  hi "})]).unwrap();
        assert_eq!(template.render(&ok, None).unwrap(), "<s>[USER] hi</s>");
        let refused = template_messages(&[json!({"role": "system", "content": "x"})]).unwrap();
        assert_eq!(template.render(&refused, None).unwrap_err(), "no system role");
        assert!(ChatTemplate::from_tokenizer_config("{}", "t").unwrap().is_none());
    }

    #[test]
    fn tojson_writes_what_pythons_json_dumps_writes() {
        let config =
            json!({"chat_template": "{{ tools[0]|tojson }}|{{ tools[0]|tojson(indent=2) }}|{{ []|tojson(indent=2) }}"});
        let template = ChatTemplate::from_tokenizer_config(&config.to_string(), "t")
            .unwrap()
            .unwrap();
        // Keys in the request's order, `'` and `<` as they are, Python's separators.
        let tool = json!({"type": "function", "function": {"name": "f", "description": "it's <b>", "parameters": {"b": [1, 2.5], "a": {}}}});
        let text = template.render(&[], Some(&[tool])).unwrap();
        assert_eq!(
            text,
            "{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": \"it's <b>\", \"parameters\": {\"b\": [1, 2.5], \"a\": {}}}}|\
             {\n  \"type\": \"function\",\n  \"function\": {\n    \"name\": \"f\",\n    \"description\": \"it's <b>\",\n    \"parameters\": {\n      \"b\": [\n        1,\n        2.5\n      ],\n      \"a\": {}\n    }\n  }\n}|[]"
        );
        let config = json!({"chat_template": "{{ messages|tojson(sort_keys=true) }}"});
        let template = ChatTemplate::from_tokenizer_config(&config.to_string(), "t")
            .unwrap()
            .unwrap();
        assert!(template.render(&[], None).is_err());
    }

    #[test]
    fn named_templates_serve_tools_with_tool_use() {
        let config = json!({"chat_template": [
            {"name": "default", "template": "plain"},
            {"name": "tool_use", "template": "tools: {{ tools | length }}"}]});
        let template = ChatTemplate::from_tokenizer_config(&config.to_string(), "t")
            .unwrap()
            .unwrap();
        let messages = template_messages(&[json!({"role": "user", "content": "x"})]).unwrap();
        assert_eq!(template.render(&messages, None).unwrap(), "plain");
        let tools = [json!({"type": "function", "function": {"name": "f"}})];
        assert_eq!(template.render(&messages, Some(&tools)).unwrap(), "tools: 1");
    }

    #[test]
    fn bad_messages_and_tools_are_refused_by_name() {
        let err = |m: Value| template_messages(&[m]).unwrap_err();
        assert_eq!(
            err(json!({"role": "bot", "content": "x"})).to_string(),
            "`messages[0].role` is `bot`, not one of system, developer, user, assistant, tool"
        );
        assert_eq!(
            err(json!({"role": "user"})).to_string(),
            "`messages[0].content` is missing"
        );
        let part = err(json!({"role": "user", "content": [{"type": "image_url"}]}));
        assert_eq!(part.at, "messages[0].content[0].type");
        assert!(part.why.contains("image_url"), "{part}");
        assert_eq!(
            err(json!({"role": "tool", "content": "x"})).at,
            "messages[0].tool_call_id"
        );
        assert!(template_messages(&[]).is_err());
        assert!(check_tools(&[json!({"type": "function", "function": {"name": "a b"}})]).is_err());
        assert!(check_tools(&[json!({"type": "retrieval"})]).is_err());
    }

    #[test]
    fn tool_calls_are_read_back_and_anything_else_stays_text() {
        let text = "Checking.\n<tool_call>\n{\"name\": \"get_free_vram\", \"arguments\": {\"gpu\": 0}}\n</tool_call>";
        let (prose, calls) = split_tool_calls(text, &["get_free_vram"]);
        assert_eq!(prose, "Checking.");
        assert_eq!(
            calls,
            vec![ToolCall {
                name: "get_free_vram".into(),
                arguments: "{\"gpu\":0}".into()
            }]
        );
        // Not offered, not JSON, not closed: text as written.
        for text in [
            "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>",
            "<tool_call>not json</tool_call>",
            "<tool_call>{\"name\": \"get_free_vram\"",
        ] {
            assert_eq!(split_tool_calls(text, &["get_free_vram"]), (text.to_string(), vec![]));
        }
    }
}
