//! A `/v1/` JSON body read into the types of its fields, by one mechanism for every endpoint: a
//! value its field does not take is a 400 whose `param` is the field's path in the body
//! (`max_tokens`, `messages[2].content`, `response_format.json_schema.strict`), and whose
//! message names it and says, in a client author's words rather than Rust's, what the field
//! takes and what came (`` `max_tokens`: expected a non-negative integer (at most 4294967295),
//! got -1 ``).
//!
//! Paths are tracked by `serde_path_to_error`. A struct read with `#[serde(flatten)]` would lose
//! them (serde buffers the fields of a flattened struct and reads them apart from the body's
//! deserializer), so a request made of several parts reads each part with [`fields`] from the
//! one [`parse`]d body.

use serde::{Deserialize, Deserializer};
use serde_json::Value;
use serde_json::error::Category;

use super::error::OpenAiError;

/// The body as JSON: an object, or the 400 saying why not. A value JSON cannot hold (a number
/// out of range, `1e400`) is named by its path, as a field of the wrong type is.
pub(super) fn parse(body: &[u8]) -> Result<Value, OpenAiError> {
    let mut reader = serde_json::Deserializer::from_slice(body);
    let value: Value = serde_path_to_error::deserialize(&mut reader).map_err(|e| located(e, "the body is not JSON"))?;
    reader
        .end()
        .map_err(|e| OpenAiError::invalid(format!("the body is not JSON: {e}"), None))?;
    if !value.is_object() {
        return Err(OpenAiError::invalid("the body is not a JSON object", None));
    }
    Ok(value)
}

/// The fields `T` reads from `body` (a [`parse`]d body, borrowed for small fields or owned to
/// move large ones out of it); fields `T` does not name are left alone.
pub(super) fn fields<'de, T, D>(body: D) -> Result<T, OpenAiError>
where
    T: Deserialize<'de>,
    D: Deserializer<'de, Error = serde_json::Error>,
{
    serde_path_to_error::deserialize(body).map_err(|e| located(e, "the body is not a request this endpoint takes"))
}

/// The 400 for `error`: naming the field at its path, or, for what is wrong with the body as a
/// whole, saying `whole` and serde's words.
fn located(error: serde_path_to_error::Error<serde_json::Error>, whole: &str) -> OpenAiError {
    let path = error.path().to_string();
    let inner = error.into_inner();
    let text = inner.to_string();
    // Text that is not JSON is the body's fault, wherever it stops; a number too large for a
    // float is JSON, and its field's.
    let syntax = !matches!(inner.classify(), Category::Data) && !text.starts_with("number out of range");
    if syntax {
        return OpenAiError::invalid(format!("{whole}: {text}"), None);
    }
    // serde_json's message ends with where in the text it went wrong: the path says it better.
    let at = format!(" at line {} column {}", inner.line(), inner.column());
    let text = text.strip_suffix(at.as_str()).unwrap_or(&text);
    // A missing field is the error of the object that lacks it: its path is the object's.
    if let Some(name) = text.strip_prefix("missing field `").and_then(|n| n.strip_suffix('`')) {
        let path = match path.as_str() {
            "." => name.to_string(),
            parent => format!("{parent}.{name}"),
        };
        return OpenAiError::invalid_at(format!("`{path}` is missing"), path);
    }
    if path == "." {
        return OpenAiError::invalid(format!("{whole}: {text}"), None);
    }
    OpenAiError::invalid_at(format!("`{path}`: {}", plain(text)), path)
}

/// serde's "invalid type: string \"hot\", expected f32" as "expected a number, got \"hot\"";
/// any other message as it is.
fn plain(text: &str) -> String {
    let Some(rest) = text
        .strip_prefix("invalid type: ")
        .or_else(|| text.strip_prefix("invalid value: "))
    else {
        return match text {
            "number out of range" => "the number is out of range".to_string(),
            _ => text.to_string(),
        };
    };
    // serde's expectations never hold ", expected ": the last one splits them.
    let Some((got, expected)) = rest.rsplit_once(", expected ") else {
        return text.to_string();
    };
    format!("expected {}, got {}", expectation(expected), unexpected(got))
}

/// What serde names as expected, in JSON's words.
fn expectation(expected: &str) -> String {
    let unsigned = |max: u64| format!("a non-negative integer (at most {max})");
    match expected {
        "u8" => unsigned(u8::MAX.into()),
        "u16" => unsigned(u16::MAX.into()),
        "u32" => unsigned(u32::MAX.into()),
        "u64" | "usize" => unsigned(u64::MAX),
        "a nonzero u32" => format!("a positive integer (at most {})", u32::MAX),
        "i8" | "i16" | "i32" | "i64" | "isize" => "an integer".to_string(),
        "f32" | "f64" => "a number".to_string(),
        "a sequence" => "an array".to_string(),
        "a map" => "an object".to_string(),
        other => other.to_string(),
    }
}

/// What serde says came (`integer \`-1\``, `string "hot"`, `sequence`), as JSON writes it.
fn unexpected(got: &str) -> String {
    let quoted = |prefix: &str| {
        got.strip_prefix(prefix)
            .and_then(|v| v.strip_prefix('`'))
            .and_then(|v| v.strip_suffix('`'))
            .map(str::to_string)
    };
    if let Some(v) = quoted("integer ")
        .or_else(|| quoted("floating point "))
        .or_else(|| quoted("boolean "))
    {
        return v;
    }
    if let Some(s) = got.strip_prefix("string ") {
        return s.to_string();
    }
    match got {
        "sequence" => "an array".to_string(),
        "map" => "an object".to_string(),
        "unit value" | "null" => "null".to_string(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use serde_json::json;

    use super::*;

    #[derive(Debug, Deserialize)]
    struct Request {
        #[allow(dead_code)]
        model: String,
        #[serde(default)]
        #[allow(dead_code)]
        max_tokens: Option<u32>,
        #[serde(default)]
        #[allow(dead_code)]
        messages: Vec<Message>,
    }

    #[derive(Debug, Deserialize)]
    struct Message {
        #[allow(dead_code)]
        content: String,
    }

    /// The param and message of the refusal of `body`.
    fn refused(body: &str) -> (Option<String>, String) {
        let error = parse(body.as_bytes())
            .and_then(|value| fields::<Request, _>(&value))
            .expect_err("refused");
        (error.param.map(|p| p.into_owned()), error.message)
    }

    #[test]
    fn a_field_of_the_wrong_type_is_named_by_its_path_in_plain_words() {
        let cases = [
            (
                json!({"model": "m", "max_tokens": -1}),
                "max_tokens",
                "`max_tokens`: expected a non-negative integer (at most 4294967295), got -1",
            ),
            (
                json!({"model": "m", "max_tokens": "many"}),
                "max_tokens",
                "`max_tokens`: expected a non-negative integer (at most 4294967295), got \"many\"",
            ),
            (
                json!({"model": "m", "messages": [{"content": "a"}, {"content": 3}]}),
                "messages[1].content",
                "`messages[1].content`: expected a string, got 3",
            ),
            (
                json!({"model": "m", "messages": {"content": "a"}}),
                "messages",
                "`messages`: expected an array, got an object",
            ),
            (json!({"max_tokens": 1}), "model", "`model` is missing"),
            (
                json!({"model": "m", "messages": [{}]}),
                "messages[0].content",
                "`messages[0].content` is missing",
            ),
        ];
        for (body, param, message) in cases {
            assert_eq!(
                refused(&body.to_string()),
                (Some(param.to_string()), message.to_string()),
                "{body}"
            );
        }
    }

    #[test]
    fn a_number_json_cannot_hold_is_named_and_a_broken_body_is_not_json() {
        assert_eq!(
            refused(r#"{"model": "m", "max_tokens": 1e400}"#),
            (
                Some("max_tokens".to_string()),
                "`max_tokens`: the number is out of range".to_string()
            )
        );
        assert_eq!(
            refused(r#"{"model": "#),
            (
                None,
                "the body is not JSON: EOF while parsing a value at line 1 column 10".to_string()
            )
        );
        let (param, message) = refused(r#"{"model": "m"} x"#);
        assert_eq!(param, None);
        assert!(message.starts_with("the body is not JSON: trailing"), "{message}");
        assert_eq!(refused("[1, 2]"), (None, "the body is not a JSON object".to_string()));
    }
}
