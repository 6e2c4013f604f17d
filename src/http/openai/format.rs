//! Structured outputs' `response_format`, which chat and completions both take (as vLLM's
//! completions do): read into the JSON schema the answer follows, which the generation compiles
//! into a grammar for the model named ([`crate::serve::generation::job()`]). A field of it that
//! is wrong is named by its path (`response_format.json_schema.strict`); a schema the engine
//! cannot take, by `response_format`.

use serde_json::{Value, json};

use super::error::OpenAiError;

/// The field's name, and what a schema the engine refuses is named by.
const FIELD: &str = "response_format";

/// `response_format` as a JSON schema the answer follows, with OpenAI's `strict`: `None` for
/// `{"type": "text"}` (or none given).
pub(super) fn schema(format: Option<&Value>) -> Result<Option<(Value, bool)>, OpenAiError> {
    let invalid = |at: &str, why: &str| {
        let path = format!("{FIELD}{at}");
        OpenAiError::invalid_at(format!("`{path}` {why}"), path)
    };
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format["type"].as_str() {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some((json!({"type": "object"}), true))),
        Some("json_schema") => {
            let spec = &format["json_schema"];
            if spec["name"].as_str().is_none_or(str::is_empty) {
                return Err(invalid(".json_schema.name", "must be a non-empty string"));
            }
            let strict = match &spec["strict"] {
                Value::Null => false,
                Value::Bool(strict) => *strict,
                _ => return Err(invalid(".json_schema.strict", "must be true or false")),
            };
            match &spec["schema"] {
                // OpenAI's schema is optional: an answer without one is any JSON object.
                Value::Null => Ok(Some((json!({"type": "object"}), strict))),
                schema @ Value::Object(_) => Ok(Some((schema.clone(), strict))),
                _ => Err(invalid(".json_schema.schema", "must be a JSON Schema object")),
            }
        }
        _ => Err(invalid(".type", "must be \"text\", \"json_object\" or \"json_schema\"")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_format_reads_as_a_schema_and_strictness_or_is_refused_by_its_path() {
        let read = |format: Value| schema(Some(&format));
        // `OpenAiError` is not `Debug`: what is accepted is read through `ok()`.
        let accepted = |format: Value| read(format).ok().expect("accepted");
        assert_eq!(accepted(Value::Null), None);
        assert_eq!(accepted(json!({"type": "text"})), None);
        assert_eq!(
            accepted(json!({"type": "json_object"})),
            Some((json!({"type": "object"}), true))
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let spec = |strict: Value| json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}});
        assert_eq!(accepted(spec(json!(true))), Some((schema.clone(), true)));
        assert_eq!(accepted(spec(Value::Null)), Some((schema.clone(), false)));
        let unnamed = json!({"type": "json_schema", "json_schema": {"schema": schema}});
        for (bad, path) in [
            (json!({"type": "yaml"}), "response_format.type"),
            (unnamed, "response_format.json_schema.name"),
            (spec(json!("yes")), "response_format.json_schema.strict"),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}),
                "response_format.json_schema.schema",
            ),
        ] {
            let error = read(bad.clone()).unwrap_err();
            assert_eq!(error.param.as_deref(), Some(path), "{bad}");
            assert!(
                error.message.starts_with(&format!("`{path}` ")),
                "{bad}: {}",
                error.message
            );
        }
    }
}
