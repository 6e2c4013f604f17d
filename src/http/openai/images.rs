//! Image search through `POST /v1/embeddings`: a dual encoder's towers
//! ([`crate::runtime::tower`]) embed texts and images into one space. A model that is a text
//! tower takes texts, and images too when its config names its vision tower (`images`); a
//! vision tower named directly takes images. Images come as base64 `data:` URLs, in vLLM's
//! multimodal form (`messages`, one text or image part) or Jina's (`input: [{"image": ...},
//! {"text": ...}]`); each is decoded and preprocessed off the async runtime, and each tower's
//! inputs run as one request through the lifecycle (admission, policy, failover, counting) on
//! that tower's model. The vectors come back in the request's order, normalized.

use axum::http::HeaderMap;
use axum::response::Response;
use base64::Engine;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::encode::{answer, infer};
use super::error::OpenAiError;
use super::vectors::{dimensions, encoding_format, item, text_tokens, truncate};
use crate::http::error::outcome_of_status;
use crate::http::headers::decode_headers;
use crate::http::state::AppState;
use crate::runtime::image::{self, MAX_IMAGE_BYTES};
use crate::runtime::tower::Tower;
use crate::serve::lifecycle;
use crate::serve::service::ModelEntry;

/// One input, in the request's order.
enum Input {
    /// A text.
    Text(String),
    /// An image file's bytes.
    Image(Vec<u8>),
}

/// Whether the body names a dual encoder's tower: this module answers it.
pub(super) fn serves(state: &AppState, body: &Value) -> bool {
    body["model"]
        .as_str()
        .and_then(|model| state.service.model(model))
        .is_some_and(|entry| entry.kind.tower().is_some())
}

/// Read, run and answer a request for a tower. A request refused while it is read is counted
/// here; each tower's run is counted by the lifecycle.
pub(super) async fn serve(
    state: &AppState,
    headers: &HeaderMap,
    body: &Value,
    id: &str,
    received: Instant,
) -> Result<Response, OpenAiError> {
    let service = &state.service;
    let model = body["model"].as_str().expect("checked by serves");
    let checked = read(state, body, model).and_then(|read| {
        // Each tower's request is made now, so a bad header is refused before anything runs.
        let request = |name: &str| decode_headers(service, name, id, headers, received);
        let texts = (!read.texts.is_empty())
            .then(|| request(model))
            .transpose()
            .map_err(|e| OpenAiError::from_request(&e, id))?;
        let images = (!read.images.is_empty())
            .then(|| request(&read.vision.expect("images only with a vision tower").config.name))
            .transpose()
            .map_err(|e| OpenAiError::from_request(&e, id))?;
        Ok((read, texts, images))
    });
    let (read, texts, images) = match checked {
        Ok(checked) => checked,
        Err(error) => {
            lifecycle::answered(service, model, outcome_of_status(error.status), received);
            return Err(error);
        }
    };
    let (files, field) = (read.images, read.field);
    let image_indexes: Vec<usize> = files.iter().map(|(i, _)| *i).collect();
    let pixels = match files.is_empty() {
        true => Vec::new(),
        // Decoding and resizing are CPU work of up to tens of milliseconds an image.
        false => {
            let vision = read.vision.expect("images only with a vision tower");
            let preprocessor = preprocessor(vision).clone();
            tokio::task::spawn_blocking(move || {
                files
                    .iter()
                    .map(|(i, bytes)| {
                        let at = match field {
                            "input" => format!("input[{i}]"),
                            _ => field.to_string(),
                        };
                        image::decode(bytes)
                            .map(|rgb| preprocessor.pixels(&rgb))
                            .map_err(|e| OpenAiError::invalid(format!("`{at}`: {e}"), Some(field)))
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .await
            .map_err(|e| OpenAiError::internal(format!("preprocessing the images failed: {e}"), id))
            .and_then(|r| r)
            .inspect_err(|e| lifecycle::answered(service, model, outcome_of_status(e.status), received))?
        }
    };
    // The texts run first, then the images; the answer's headers are of the last run.
    let mut vectors: Vec<(usize, Vec<f32>)> = Vec::new();
    let mut last = None;
    if let Some(mut request) = texts {
        let entry = read.text.expect("a text model when there are texts");
        let (indexes, ids): (Vec<usize>, Vec<Vec<u32>>) = read.texts.into_iter().unzip();
        let tower = entry.kind.tower().expect("a text tower");
        request.inputs = tower.text_batch(&entry.signature, &ids);
        let (served, out) = run(state, entry, request, id).await?;
        vectors.extend(indexes.into_iter().zip(out));
        last = Some(served);
    }
    if let Some(mut request) = images {
        let vision = read.vision.expect("images only with a vision tower");
        let size = preprocessor(vision).size().expect("checked when the model was read");
        request.inputs = vec![Tower::image_batch(pixels, size)];
        let (served, out) = run(state, vision, request, id).await?;
        vectors.extend(image_indexes.into_iter().zip(out));
        last = Some(served);
    }
    vectors.sort_by_key(|(i, _)| *i);
    let data = vectors
        .into_iter()
        .map(|(i, vector)| item(i, vector, read.dimensions, true, read.base64))
        .collect::<Result<Vec<Value>, OpenAiError>>()?;
    let served = last.expect("every request has an input");
    let body = json!({"object": "list", "data": data, "model": model,
                      "usage": {"prompt_tokens": read.tokens, "total_tokens": read.tokens}});
    Ok(answer(state, model, &served, body))
}

/// A vision tower's preprocessing.
fn preprocessor(vision: &ModelEntry) -> &image::Preprocessor {
    match vision.kind.tower() {
        Some(Tower::Image(p, _)) => p,
        _ => unreachable!("checked by read: the vision model is a vision tower"),
    }
}

/// Run one tower's request; its normalized vectors.
async fn run(
    state: &AppState,
    entry: &ModelEntry,
    mut request: lifecycle::Request,
    id: &str,
) -> Result<(lifecycle::Served, Vec<Vec<f32>>), OpenAiError> {
    let tower = entry.kind.tower().expect("a tower");
    request.outputs = vec![tower.output().to_string()];
    // A model's fallback is another model with its own space: its vectors could not be
    // compared with this one's.
    request.allow_substitute = false;
    let served = infer(&state.service, request, id).await?;
    let output = served
        .outputs
        .iter()
        .find(|t| t.name == tower.output())
        .ok_or_else(|| OpenAiError::internal(format!("the run gave no `{}`", tower.output()), id))?;
    let vectors = tower.vectors(output).map_err(|e| OpenAiError::internal(e, id))?;
    Ok((served, vectors))
}

/// A checked request.
struct Read<'a> {
    /// The text tower, when the model is one.
    text: Option<&'a ModelEntry>,
    /// The vision tower images run on, when the model has one.
    vision: Option<&'a ModelEntry>,
    /// Each text's index and tokens.
    texts: Vec<(usize, Vec<u32>)>,
    /// Each image's index and file bytes.
    images: Vec<(usize, Vec<u8>)>,
    /// The field the inputs came in (`input` or `messages`), for messages about an image.
    field: &'static str,
    /// Send base64.
    base64: bool,
    /// Keep this many dimensions.
    dimensions: Option<usize>,
    /// The texts' tokens, for `usage`.
    tokens: usize,
}

/// Read and check a body for a tower model.
fn read<'a>(state: &'a AppState, body: &Value, model: &str) -> Result<Read<'a>, OpenAiError> {
    let service = &state.service;
    let entry = service.model(model).expect("checked by serves");
    let tower = entry.kind.tower().expect("checked by serves");
    let (field, inputs) = inputs(body)?;
    let (text, vision) = match tower {
        Tower::Text { .. } => (
            Some(entry),
            entry.config.images.as_deref().and_then(|v| service.model(v)),
        ),
        Tower::Image(..) => (None, Some(entry)),
    };
    let base64 = encoding_format(body)?;
    let dimensions = dimensions(body, tower.dimensions(&entry.signature))?;
    let truncate = truncate(body, entry.config.auto_truncate)?;
    let mut read = Read {
        text,
        vision,
        texts: Vec::new(),
        images: Vec::new(),
        field,
        base64,
        dimensions,
        tokens: 0,
    };
    for (i, input) in inputs.into_iter().enumerate() {
        match input {
            Input::Text(text) => {
                let Some(Tower::Text { max_positions, .. }) = read.text.and_then(|t| t.kind.tower()) else {
                    return Err(OpenAiError::invalid(
                        format!("model `{model}` embeds images only (a vision tower); send texts to its text tower"),
                        Some(field),
                    ));
                };
                let tokenizer = entry.kind.tokenizer().expect("a text tower has its tokenizer");
                let limit = max_positions.map(|n| (n as usize, "max_position_embeddings"));
                let ids = text_tokens(tokenizer, i, &text, limit, truncate)?;
                read.tokens += ids.len();
                read.texts.push((i, ids));
            }
            Input::Image(bytes) => {
                if vision.is_none() {
                    return Err(OpenAiError::invalid(
                        format!(
                            "model `{model}` embeds text only: its config names no vision tower (`models[].images`)"
                        ),
                        Some(field),
                    ));
                }
                read.images.push((i, bytes));
            }
        }
    }
    Ok(read)
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
    if data.len() / 4 * 3 > MAX_IMAGE_BYTES + 2 {
        return Err(invalid(format!(
            "`{at}`: {}",
            image::ImageError::TooManyBytes(data.len() / 4 * 3)
        )));
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
        r.err().expect("an error").message
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
        let huge = format!("data:image/png;base64,{}", "A".repeat(MAX_IMAGE_BYTES / 3 * 4 + 8));
        assert!(err(inputs(&json!({"input": [{"image": huge}]}))).contains("above the limit of"));
    }
}
