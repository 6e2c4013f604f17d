//! A tool call read out of a generated answer: plain data the runtime reads from a model's text
//! (`runtime::chat`) and the API writes as OpenAI's `tool_calls`.

/// A tool call read out of generated text.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments as JSON text (what OpenAI's API carries).
    pub arguments: String,
}
