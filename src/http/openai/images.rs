//! Image search through `POST /v1/embeddings`: a request for a dual encoder's tower
//! ([`crate::serve::encoders::tower`]), whose towers embed texts and images into one space.
//! Images come as base64 `data:` URLs, in vLLM's multimodal form (`messages`, one text or image
//! part) or Jina's (`input: [{"image": ...}, {"text": ...}]`); the request's fields are read
//! into a tower job, handed down through the encoders' door, and its vectors, in the request's
//! order and normalized, sent as `embeddings` sends a sentence encoder's.

use axum::http::HeaderMap;
use axum::response::Response;
use base64::Engine;
use serde_json::Value;
use tokio::time::Instant;

use super::encode;
use super::error::OpenAiError;
use super::vectors;
use crate::http::state::AppState;
use crate::serve::encoders::tower::{self, Asked, Input, Towers};
use crate::serve::service::{Api, Kind};

/// Whether the body names a dual encoder's tower: this module answers it.
pub(super) fn serves(state: &AppState, body: &Value) -> bool {
    body["model"]
        .as_str()
        .and_then(|model| state.service.model(model))
        .is_some_and(|entry| entry.kind.tower().is_some())
}

/// Read, run and answer a request for a tower (its body as [`encode::parse`] gave it).
pub(super) async fn serve(
    state: &AppState,
    (headers, body, id, received): (&HeaderMap, Result<Value, OpenAiError>, &str, Instant),
) -> Result<Response, OpenAiError> {
    encode::encoded(state, (headers, body, id, received), read, vectors::body).await
}

/// Read and check a body for a tower model into a [`Towers`] job, with the model's name and
/// whether its vectors go as base64.
fn read(state: &AppState, body: Value, model: String, id: &str) -> Result<(Towers, (String, bool)), OpenAiError> {
    let (entry, tower) = super::model_for(state, &model, Api::Embeddings, id, Kind::tower)?;
    let (field, inputs) = inputs(&body)?;
    let fields = vectors::fields(&body)?;
    let asked = Asked {
        inputs,
        field,
        dimensions: fields.dimensions,
        truncate: fields.truncate,
    };
    let job = Towers::new(&state.service, entry, tower, asked).map_err(|e| OpenAiError::invalid(e.message, e.field))?;
    Ok((job, (model, fields.base64)))
}

/// The inputs of `input` (a string, or a list of strings, `{"text": ...}` and `{"image":
/// "data:..."}`) or of `messages` (one text or `image_url` part), and which field they came in.
fn inputs(body: &Value) -> Result<(&'static str, Vec<Input>), OpenAiError> {
    if !body.is_object() {
        return Err(OpenAiError::invalid("the body is not a JSON object", None));
    }
    match (&body["input"], &body["messages"]) {
        (Value::Null, Value::Null) => Err(OpenAiError::invalid("`input` is missing", Some("input"))),
        (Value::Null, messages) => Ok(("messages", vec![message(messages)?])),
        (input, Value::Null) => Ok(("input", input_list(input)?)),
        _ => Err(OpenAiError::invalid(
            "send `input` or `messages`, not both",
            Some("messages"),
        )),
    }
}

/// `input`'s items.
fn input_list(input: &Value) -> Result<Vec<Input>, OpenAiError> {
    let invalid = |message: String| OpenAiError::invalid(message, Some("input"));
    let items = match input {
        Value::String(_) => std::slice::from_ref(input),
        Value::Array(items) if items.is_empty() => return Err(invalid("`input` is an empty list".into())),
        Value::Array(items) => items.as_slice(),
        other => {
            return Err(invalid(format!(
                "`input` is {other}; for a dual encoder it is a string or a list of strings, {{\"text\": ...}} and {{\"image\": \"data:...\"}}"
            )));
        }
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::String(text) => Ok(Input::Text(text.clone())),
            Value::Object(o) => match (o.get("text"), o.get("image")) {
                (Some(Value::String(text)), None) => Ok(Input::Text(text.clone())),
                (None, Some(Value::String(url))) => data_url(url, &format!("input[{i}].image"), "input").map(Input::Image),
                _ => Err(invalid(format!(
                    "`input[{i}]` is {item}; an object input is {{\"text\": \"...\"}} or {{\"image\": \"data:...\"}}"
                ))),
            },
            other => Err(invalid(format!(
                "`input[{i}]` is {other}; each input is a string, {{\"text\": ...}} or {{\"image\": \"data:...\"}} (token ids are not taken by a dual encoder)"
            ))),
        })
        .collect()
}

/// The one input of vLLM's `messages` form: a dual encoder's vector is of one text or one
/// image, so the messages hold one part (a string content, or one `text` or `image_url` part).
fn message(messages: &Value) -> Result<Input, OpenAiError> {
    let invalid = |message: String| OpenAiError::invalid(message, Some("messages"));
    let Some(list) = messages.as_array() else {
        return Err(invalid(format!("`messages` is {messages}, not a list of messages")));
    };
    let mut parts = Vec::new();
    for (m, message) in list.iter().enumerate() {
        match &message["content"] {
            Value::String(text) => parts.push((format!("messages[{m}].content"), Ok(text.clone()))),
            Value::Array(items) => {
                for (p, part) in items.iter().enumerate() {
                    let at = format!("messages[{m}].content[{p}]");
                    let read = match (part["type"].as_str(), &part["text"], &part["image_url"]) {
                        (Some("text"), Value::String(text), _) => Ok(text.clone()),
                        (Some("image_url"), _, url) => match url["url"].as_str() {
                            Some(url) => Err(url.to_string()),
                            None => {
                                return Err(invalid(format!(
                                    "`{at}.image_url` is {url}, not {{\"url\": \"data:...\"}}"
                                )));
                            }
                        },
                        _ => {
                            return Err(invalid(format!(
                                "`{at}` is {part}; a part is {{\"type\": \"text\", \"text\": ...}} or {{\"type\": \"image_url\", \"image_url\": {{\"url\": \"data:...\"}}}}"
                            )));
                        }
                    };
                    parts.push((at, read));
                }
            }
            other => {
                return Err(invalid(format!(
                    "`messages[{m}].content` is {other}, not a string or a list of parts"
                )));
            }
        }
    }
    match parts.len() {
        1 => {
            let (at, part) = parts.pop().expect("one part");
            match part {
                Ok(text) => Ok(Input::Text(text)),
                Err(url) => data_url(&url, &format!("{at}.image_url.url"), "messages").map(Input::Image),
            }
        }
        n => Err(invalid(format!(
            "`messages` holds {n} parts; a dual encoder embeds one text or one image per vector: send one part, or several inputs in `input`"
        ))),
    }
}

/// The bytes of a base64 `data:` URL (`data:image/png;base64,...`) under `at`; a web URL is
/// refused, since this server fetches nothing.
fn data_url(url: &str, at: &str, field: &'static str) -> Result<Vec<u8>, OpenAiError> {
    let invalid = |message: String| OpenAiError::invalid(message, Some(field));
    if url.starts_with("http://") || url.starts_with("https://") {
        return Err(invalid(format!(
            "`{at}` is a web URL; this server does not fetch images: send the image as a base64 `data:` URL"
        )));
    }
    let Some((header, data)) = url.strip_prefix("data:").and_then(|rest| rest.split_once(',')) else {
        return Err(invalid(format!(
            "`{at}` is not a `data:` URL (`data:image/png;base64,...`)"
        )));
    };
    let Some(media) = header.strip_suffix(";base64") else {
        return Err(invalid(format!("`{at}` is a `data:` URL without `;base64`")));
    };
    if !(media.is_empty() || media.starts_with("image/")) {
        return Err(invalid(format!("`{at}` is of type `{media}`, not an image")));
    }
    // Refused from its length, before a large file is decoded.
    if let Some(why) = tower::oversized(data.len()) {
        return Err(invalid(format!("`{at}`: {why}")));
    }
    base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|e| invalid(format!("`{at}` is not base64: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(r: Result<(&'static str, Vec<Input>), OpenAiError>) -> String {
        r.expect_err("an error").message
    }

    fn ok(r: Result<(&'static str, Vec<Input>), OpenAiError>) -> (&'static str, Vec<Input>) {
        r.unwrap_or_else(|e| panic!("{}", e.message))
    }

    #[test]
    fn jina_s_list_and_vllm_s_messages_give_texts_and_images_in_order() {
        let png = "data:image/png;base64,iVBORw0=";
        let (field, read) = ok(inputs(&json!({"input": ["a cat", {"image": png}, {"text": "a dog"}]})));
        assert_eq!(field, "input");
        let kinds: Vec<String> = read
            .iter()
            .map(|i| match i {
                Input::Text(t) => t.clone(),
                Input::Image(b) => format!("{} bytes", b.len()),
            })
            .collect();
        assert_eq!(kinds, ["a cat", "5 bytes", "a dog"]);
        let messages =
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png}}]}]});
        assert!(matches!(ok(inputs(&messages)), ("messages", v) if matches!(v[..], [Input::Image(_)])));
        let text = json!({"messages": [{"role": "user", "content": "a cat"}]});
        assert!(matches!(ok(inputs(&text)).1[..], [Input::Text(ref t)] if t == "a cat"));
    }

    #[test]
    fn web_urls_bad_data_urls_and_several_parts_are_refused_naming_where() {
        assert_eq!(
            err(inputs(&json!({"input": [{"image": "https://example.com/cat.png"}]}))),
            "`input[0].image` is a web URL; this server does not fetch images: send the image as a base64 `data:` URL"
        );
        assert_eq!(
            err(inputs(
                &json!({"input": ["x", {"image": "data:text/plain;base64,aGk="}]})
            )),
            "`input[1].image` is of type `text/plain`, not an image"
        );
        assert_eq!(
            err(inputs(&json!({"input": [{"image": "data:image/png,raw"}]}))),
            "`input[0].image` is a `data:` URL without `;base64`"
        );
        assert!(
            err(inputs(&json!({"input": [{"image": "data:image/png;base64,@@"}]})))
                .starts_with("`input[0].image` is not base64")
        );
        assert!(err(inputs(&json!({"input": [[1, 2]]}))).contains("token ids are not taken by a dual encoder"));
        let two = json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}, {"type": "text", "text": "x"}]}]});
        assert!(err(inputs(&two)).starts_with("`messages` holds 2 parts"));
        assert_eq!(
            err(inputs(&json!({"input": "x", "messages": []}))),
            "send `input` or `messages`, not both"
        );
        // Base64 of more than the 20 MiB an image file may have.
        let huge = format!("data:image/png;base64,{}", "A".repeat((20 << 20) / 3 * 4 + 8));
        assert!(err(inputs(&json!({"input": [{"image": huge}]}))).contains("above the limit of"));
    }
}
