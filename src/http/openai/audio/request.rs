//! The request of `POST /v1/audio/transcriptions` and `/v1/audio/translations`, read from the
//! multipart form OpenAI's clients send (the `openai` package: one part per field, the audio as
//! a `file` part with its file name, repeated fields named with `[]`, booleans as `true`/`false`,
//! numbers as decimal text) and checked into an [`AudioRequest`], its file's bytes left as they
//! came for the service to read. Every refusal is a 400 naming the field at fault, but an audio
//! file over [`MAX_FILE_BYTES`], which is OpenAI's 413.
//!
//! Fields nobody knows are skipped, as JSON endpoints here skip unknown keys, so a client's
//! extra fields for another server do no harm. Fields of OpenAI's API that would change the
//! answer but are not served here (`include[]`, `chunking_strategy`, `keywords[]`,
//! `languages[]`, the known speakers, word timestamps) are refused by name rather than quietly
//! ignored: the client would otherwise take an answer for what it did not ask.

use axum::extract::Multipart;
use axum::extract::multipart::{Field, MultipartError, MultipartRejection};
use axum::http::StatusCode;

use super::formats::Format;
use crate::http::openai::OpenAiError;
use crate::serve::speech::Task;

/// The most bytes an audio file may have: OpenAI's limit for its audio endpoints ("25 MB", which
/// its 413 spells as 26214400 bytes), so a client that splits its audio for OpenAI splits it
/// for vramguard too. At 16 kHz 16-bit mono WAV that is about 13 minutes; compressed, hours.
pub const MAX_FILE_BYTES: usize = 25 << 20;

/// The most bytes of any other field: a prompt is a few hundred tokens (Whisper keeps at most
/// half its context of it), the rest are words.
const MAX_FIELD_BYTES: usize = 64 << 10;

/// The body the route must let through (`server.body_limit`, and axum's `DefaultBodyLimit` on
/// the route, whose own default of 2 MB would cut a file short): the largest file and room for
/// the other fields and the form's boundaries.
pub const BODY_BYTES: usize = MAX_FILE_BYTES + (1 << 20);

/// A checked transcription or translation request.
#[derive(Debug, Clone, PartialEq)]
pub struct AudioRequest {
    /// The configured model it names.
    pub model: String,
    /// The audio file's bytes, not yet decoded.
    pub file: Vec<u8>,
    /// The name the client gave the file, when it gave one (the format is read from the bytes).
    pub filename: Option<String>,
    /// The language spoken, lowercase, as sent: an ISO-639-1 code (`en`) or, as Whisper also
    /// takes it, a name (`english`); `None` to detect it. Always `None` for a translation.
    pub language: Option<String>,
    /// Text the model reads as what came before the audio (its style, its spelling of names).
    pub prompt: Option<String>,
    /// The sampling temperature, 0 to 1; 0 (the default) picks the likeliest token.
    pub temperature: f32,
    /// The answer's format.
    pub format: Format,
    /// Send the text as server-sent events while it is transcribed.
    pub stream: bool,
    /// Transcribe or translate: which endpoint it came to.
    pub task: Task,
}

/// A request that could not be read: its error, and the model it named if that much was read
/// (a refusal is counted under its model).
pub struct Unread {
    /// The `model` field, when it came before what was wrong.
    pub model: Option<String>,
    /// The answer.
    pub error: OpenAiError,
}

/// The fields as sent, before they are checked.
#[derive(Debug, Default)]
struct Form {
    model: Option<String>,
    file: Option<(Vec<u8>, Option<String>)>,
    language: Option<String>,
    prompt: Option<String>,
    temperature: Option<String>,
    response_format: Option<String>,
    stream: Option<String>,
    granularities: Vec<String>,
}

/// Fields of OpenAI's API not served here, each with why, refused when sent (by their name
/// before any `[`: `chunking_strategy[type]` is `chunking_strategy`).
const NOT_SERVED: [(&str, &str); 6] = [
    (
        "include",
        "token log-probabilities are not served for speech (each segment's `avg_logprob` is, in `verbose_json`)",
    ),
    (
        "chunking_strategy",
        "audio longer than 30 s is cut into windows as Whisper's own long-form decoding cuts it; voice-activity chunking is not served",
    ),
    ("keywords", "keywords are not served: give them in `prompt`"),
    (
        "languages",
        "a list of candidate languages is not served: give one `language`, or none to detect it",
    ),
    ("known_speaker_names", "speaker diarization is not served"),
    ("known_speaker_references", "speaker diarization is not served"),
];

/// Read and check the form of a request for `task`.
pub async fn read(form: Result<Multipart, MultipartRejection>, task: Task) -> Result<AudioRequest, Unread> {
    let mut fields = Form::default();
    let unread = |fields: &Form, error| Unread {
        model: fields.model.clone(),
        error,
    };
    let mut multipart = form.map_err(|e| unread(&fields, not_multipart(&e)))?;
    loop {
        let field = match multipart.next_field().await {
            Ok(Some(field)) => field,
            Ok(None) => break,
            Err(e) => return Err(unread(&fields, unreadable(&e))),
        };
        if let Err(error) = take(&mut fields, field, task).await {
            return Err(unread(&fields, error));
        }
    }
    check(&mut fields, task).map_err(|error| unread(&fields, error))
}

/// Keep `field` in `fields` if it is one read here, or refuse it if it is one not served.
async fn take(fields: &mut Form, field: Field<'_>, task: Task) -> Result<(), OpenAiError> {
    let Some(name) = field.name().map(str::to_string) else {
        // A part without a name is no field; its bytes are skipped with it.
        return Ok(());
    };
    let base = name.split('[').next().unwrap_or_default();
    if let Some((param, why)) = NOT_SERVED.iter().find(|(n, _)| *n == base) {
        return Err(OpenAiError::invalid(format!("`{name}`: {why}"), Some(param)));
    }
    let slot = match base {
        "file" => {
            let filename = field.file_name().map(str::to_string);
            let bytes = bytes_of(field, "file", MAX_FILE_BYTES).await?;
            return once(&mut fields.file, "file", (bytes, filename));
        }
        "timestamp_granularities" => {
            let value = text_of(field, "timestamp_granularities").await?;
            fields.granularities.push(value);
            return Ok(());
        }
        "model" => (&mut fields.model, "model"),
        // A translation's source language is detected: the field is OpenAI's only for
        // transcriptions, and like any other field it does not know, skipped.
        "language" if task == Task::Transcribe => (&mut fields.language, "language"),
        "prompt" => (&mut fields.prompt, "prompt"),
        "temperature" => (&mut fields.temperature, "temperature"),
        "response_format" => (&mut fields.response_format, "response_format"),
        "stream" => (&mut fields.stream, "stream"),
        _ => return Ok(()),
    };
    let value = text_of(field, slot.1).await?;
    once(slot.0, slot.1, value)
}

/// Set `slot` to `value`, or refuse a field sent twice (which of the two was meant?).
fn once<T>(slot: &mut Option<T>, name: &'static str, value: T) -> Result<(), OpenAiError> {
    if slot.is_some() {
        return Err(OpenAiError::invalid(
            format!("`{name}` is sent more than once"),
            Some(name),
        ));
    }
    *slot = Some(value);
    Ok(())
}

/// A field's bytes, at most `limit` of them: more is a 413 for the file (OpenAI's status for
/// audio over its limit), a 400 for any other field.
async fn bytes_of(mut field: Field<'_>, name: &'static str, limit: usize) -> Result<Vec<u8>, OpenAiError> {
    let mut bytes = Vec::new();
    while let Some(chunk) = field.chunk().await.map_err(|e| unreadable(&e))? {
        if bytes.len() + chunk.len() > limit {
            let message = format!("`{name}` is larger than the limit of {limit} bytes");
            let status = match name {
                "file" => StatusCode::PAYLOAD_TOO_LARGE,
                _ => StatusCode::BAD_REQUEST,
            };
            return Err(OpenAiError {
                status,
                ..OpenAiError::invalid(message, Some(name))
            });
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

/// A field's text, at most [`MAX_FIELD_BYTES`] of UTF-8.
async fn text_of(field: Field<'_>, name: &'static str) -> Result<String, OpenAiError> {
    let bytes = bytes_of(field, name, MAX_FIELD_BYTES).await?;
    String::from_utf8(bytes).map_err(|_| OpenAiError::invalid(format!("`{name}` is not UTF-8 text"), Some(name)))
}

/// The 400 for a body that is not a multipart form.
fn not_multipart(rejection: &MultipartRejection) -> OpenAiError {
    OpenAiError {
        status: rejection.status(),
        ..OpenAiError::invalid(
            format!(
                "the body is not a multipart form ({}): send the audio as `file` and the other fields as parts of `multipart/form-data`, as OpenAI's clients do",
                rejection.body_text()
            ),
            None,
        )
    }
}

/// A form whose parts could not be read: malformed (400), or cut by a limit on the body, with
/// the status the connection answers that limit with (413 over `server.body_limit`).
fn unreadable(error: &MultipartError) -> OpenAiError {
    OpenAiError {
        status: crate::net::conn::refused_status(error).unwrap_or(error.status()),
        ..OpenAiError::invalid(
            format!("the multipart form could not be read: {}", error.body_text()),
            None,
        )
    }
}

/// The request `fields` make, or the 400 naming the first field at fault. OpenAI's rules:
/// `timestamp_granularities[]` only with `verbose_json`; a stream is text, so only `json` and
/// `text` stream.
fn check(fields: &mut Form, task: Task) -> Result<AudioRequest, OpenAiError> {
    let model = match fields.model.as_deref().map(str::trim) {
        None => return Err(OpenAiError::invalid("`model` is missing", Some("model"))),
        Some("") => return Err(OpenAiError::invalid("`model` is empty", Some("model"))),
        Some(model) => model.to_string(),
    };
    let (file, filename) = match fields.file.take() {
        None => {
            return Err(OpenAiError::invalid(
                "`file` is missing: send the audio as a part named `file`",
                Some("file"),
            ));
        }
        Some((bytes, _)) if bytes.is_empty() => return Err(OpenAiError::invalid("`file` is empty", Some("file"))),
        Some(file) => file,
    };
    let format = match fields.response_format.as_deref().map(str::trim) {
        None | Some("") => Format::Json,
        Some(name) => Format::named(name).ok_or_else(|| {
            let names = Format::ALL.map(Format::name);
            let why = match name {
                "diarized_json" => " (speaker diarization is not served)".to_string(),
                _ => String::new(),
            };
            OpenAiError::invalid(
                format!("`response_format` is `{name}`{why}: one of {}", names.join(", ")),
                Some("response_format"),
            )
        })?,
    };
    let stream = flag(fields.stream.as_deref(), "stream")?;
    if stream && format.timestamps() {
        return Err(OpenAiError::invalid(
            format!(
                "`stream` sends the text as `transcript.text.delta` events, without times: it takes `response_format` `json` or `text`, not `{}`",
                format.name()
            ),
            Some("stream"),
        ));
    }
    granularities(&fields.granularities, format)?;
    Ok(AudioRequest {
        model,
        file,
        filename,
        language: language(fields.language.as_deref())?,
        prompt: fields.prompt.take().filter(|p| !p.trim().is_empty()),
        temperature: temperature(fields.temperature.as_deref())?,
        format,
        stream,
        task,
    })
}

/// `timestamp_granularities[]`: `segment` is what every timestamped format gives; `word` is
/// refused, and any granularity asks for `verbose_json`, as OpenAI requires.
fn granularities(given: &[String], format: Format) -> Result<(), OpenAiError> {
    const PARAM: Option<&str> = Some("timestamp_granularities");
    for granularity in given.iter().map(|g| g.trim()) {
        match granularity {
            "segment" => {}
            "word" => {
                return Err(OpenAiError::invalid(
                    "word timestamps are not served: they need each token aligned to the audio through the decoder's cross-attention, which is not done yet; `segment` is",
                    PARAM,
                ));
            }
            other => {
                return Err(OpenAiError::invalid(
                    format!("`timestamp_granularities[]` has `{other}`: `segment` or `word`"),
                    PARAM,
                ));
            }
        }
    }
    if !given.is_empty() && format != Format::VerboseJson {
        return Err(OpenAiError::invalid(
            format!(
                "`timestamp_granularities[]` needs `response_format` `verbose_json`, not `{}`",
                format.name()
            ),
            PARAM,
        ));
    }
    Ok(())
}

/// A boolean field as the `openai` package sends one (`true`/`false`); absent is false.
fn flag(value: Option<&str>, name: &'static str) -> Result<bool, OpenAiError> {
    match value.map(str::trim) {
        None => Ok(false),
        Some(v) if v.eq_ignore_ascii_case("true") => Ok(true),
        Some(v) if v.eq_ignore_ascii_case("false") => Ok(false),
        Some(v) => Err(OpenAiError::invalid(
            format!("`{name}` is `{v}`: `true` or `false`"),
            Some(name),
        )),
    }
}

/// `temperature`: a number from 0 to 1, as OpenAI documents it; absent is 0.
fn temperature(value: Option<&str>) -> Result<f32, OpenAiError> {
    let Some(text) = value.map(str::trim) else {
        return Ok(0.0);
    };
    let param = Some("temperature");
    let t: f32 = text
        .parse()
        .map_err(|_| OpenAiError::invalid(format!("`temperature` is `{text}`, not a number"), param))?;
    if !(0.0..=1.0).contains(&t) {
        return Err(OpenAiError::invalid(
            format!("`temperature` must be between 0 and 1; got {text}"),
            param,
        ));
    }
    Ok(t)
}

/// `language`: letters only (an ISO-639-1 code, or a name as Whisper takes one), lowercased;
/// empty is none. Whether the model knows it is the model's to say.
fn language(value: Option<&str>) -> Result<Option<String>, OpenAiError> {
    match value.map(str::trim) {
        None | Some("") => Ok(None),
        Some(l) if l.chars().all(|c| c.is_ascii_alphabetic()) => Ok(Some(l.to_ascii_lowercase())),
        Some(l) => Err(OpenAiError::invalid(
            format!("`language` is `{l}`: an ISO-639-1 code such as `en`"),
            Some("language"),
        )),
    }
}

#[cfg(test)]
mod tests;
