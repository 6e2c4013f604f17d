use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::DefaultBodyLimit;
use axum::http::{Request, header};
use axum::routing::post;
use tower_service::Service as _;

use super::*;

/// The boundary the `openai` package wrote when its form was captured.
const BOUNDARY: &str = "d648f1f1499233b204b2515b05c1575d";

/// A text part, as the `openai` package writes one.
fn part(name: &str, value: &str) -> Vec<u8> {
    format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n").into_bytes()
}

/// A file part, as the `openai` package writes `file=("a.wav", bytes)`.
fn file(bytes: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/x-wav\r\n\r\n"
    )
    .into_bytes();
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
    out
}

/// A form of `parts`, closed.
fn form(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut out = parts.concat();
    out.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    out
}

/// `body` sent with `content_type` to a route that reads it as the audio routes must be set
/// up (`DefaultBodyLimit::max(BODY_BYTES)`): what [`read`] made of it.
async fn send(body: Vec<u8>, content_type: &str, task: Task) -> Result<AudioRequest, Unread> {
    let slot = Arc::new(Mutex::new(None));
    let kept = Arc::clone(&slot);
    let mut router = Router::new()
        .route(
            "/",
            post(move |form: Result<Multipart, MultipartRejection>| async move {
                let read = read(form, task).await;
                *kept.lock().unwrap() = Some(read);
            }),
        )
        .layer(DefaultBodyLimit::max(BODY_BYTES));
    let request = Request::post("/")
        .header(header::CONTENT_TYPE, content_type)
        .body(Body::from(body))
        .unwrap();
    router.call(request).await.unwrap();
    slot.lock().unwrap().take().expect("the handler ran")
}

/// A form of `parts` sent as the `openai` package sends it, to transcribe.
async fn transcribe(parts: &[Vec<u8>]) -> Result<AudioRequest, Unread> {
    let kind = format!("multipart/form-data; boundary={BOUNDARY}");
    send(form(parts), &kind, Task::Transcribe).await
}

/// The refusal of a form of `parts`: status, param and message.
async fn refused(parts: &[Vec<u8>]) -> (u16, Option<String>, String) {
    match transcribe(parts).await {
        Ok(request) => panic!("read: {request:?}"),
        Err(Unread { error, .. }) => (
            error.status.as_u16(),
            error.param.map(|p| p.into_owned()),
            error.message,
        ),
    }
}

/// Every field the `openai` package sends for `transcriptions.create(file=("a.wav", ...),
/// model=..., language="en", prompt=..., temperature=0.0, response_format="verbose_json",
/// timestamp_granularities=["segment"])`, in its order and spelling (captured from it).
#[tokio::test]
async fn the_form_the_openai_package_sends_is_read_whole() {
    let parts = [
        part("model", "whisper"),
        part("language", "EN"),
        part("prompt", "Glossary: vramguard."),
        part("response_format", "verbose_json"),
        part("temperature", "0.0"),
        part("timestamp_granularities[]", "segment"),
        file(b"RIFF...."),
    ];
    let Ok(request) = transcribe(&parts).await else {
        panic!("refused")
    };
    assert_eq!(
        request,
        AudioRequest {
            model: "whisper".into(),
            file: b"RIFF....".to_vec(),
            filename: Some("a.wav".into()),
            language: Some("en".into()),
            prompt: Some("Glossary: vramguard.".into()),
            temperature: 0.0,
            format: Format::VerboseJson,
            stream: false,
            task: Task::Transcribe,
        }
    );
}

#[tokio::test]
async fn absent_fields_take_openais_defaults_and_unknown_ones_are_skipped() {
    let parts = [
        part("model", "whisper"),
        part("foo", "1"),
        part("prompt", "  "),
        part("language", ""),
        file(b"fLaC"),
    ];
    let Ok(request) = transcribe(&parts).await else {
        panic!("refused")
    };
    assert_eq!(
        (request.format, request.temperature, request.stream),
        (Format::Json, 0.0, false)
    );
    assert_eq!((request.language, request.prompt), (None, None));
}

#[tokio::test]
async fn a_stream_of_text_is_read_and_a_translation_has_no_language() {
    let parts = [
        part("model", "whisper"),
        part("stream", "true"),
        part("temperature", "0.5"),
        part("response_format", "text"),
        file(b"OggS"),
    ];
    let Ok(request) = transcribe(&parts).await else {
        panic!("refused")
    };
    assert_eq!(
        (request.stream, request.temperature, request.format),
        (true, 0.5, Format::Text)
    );
    let parts = [part("model", "whisper"), part("language", "de"), file(b"ID3")];
    let kind = format!("multipart/form-data; boundary={BOUNDARY}");
    let Ok(request) = send(form(&parts), &kind, Task::Translate).await else {
        panic!("refused")
    };
    assert_eq!((request.task, request.language), (Task::Translate, None));
}

/// Each field at fault is named, with why, in a 400.
#[tokio::test]
async fn every_bad_field_is_a_400_naming_it() {
    let (model, audio) = (part("model", "whisper"), file(b"RIFF"));
    let with = |extra: &[(&str, &str)]| -> Vec<Vec<u8>> {
        let mut parts = vec![model.clone()];
        parts.extend(extra.iter().map(|(n, v)| part(n, v)));
        parts.push(audio.clone());
        parts
    };
    let cases: Vec<(Vec<Vec<u8>>, &str, &str)> = vec![
        (vec![audio.clone()], "model", "`model` is missing"),
        (vec![part("model", " "), audio.clone()], "model", "`model` is empty"),
        (with(&[("model", "other")]), "model", "`model` is sent more than once"),
        (vec![model.clone()], "file", "`file` is missing"),
        (vec![model.clone(), file(b"")], "file", "`file` is empty"),
        (
            with(&[("response_format", "xml")]),
            "response_format",
            "one of json, text, srt, verbose_json, vtt",
        ),
        (
            with(&[("response_format", "diarized_json")]),
            "response_format",
            "speaker diarization is not served",
        ),
        (
            with(&[("temperature", "hot")]),
            "temperature",
            "`temperature` is `hot`, not a number",
        ),
        (
            with(&[("temperature", "1.5")]),
            "temperature",
            "between 0 and 1; got 1.5",
        ),
        (with(&[("temperature", "-0.1")]), "temperature", "between 0 and 1"),
        (with(&[("temperature", "NaN")]), "temperature", "between 0 and 1"),
        (
            with(&[("stream", "yes")]),
            "stream",
            "`stream` is `yes`: `true` or `false`",
        ),
        (
            with(&[("stream", "true"), ("response_format", "srt")]),
            "stream",
            "takes `response_format` `json` or `text`, not `srt`",
        ),
        (
            with(&[
                ("response_format", "verbose_json"),
                ("timestamp_granularities[]", "word"),
            ]),
            "timestamp_granularities",
            "word timestamps are not served",
        ),
        (
            with(&[("timestamp_granularities[]", "segment")]),
            "timestamp_granularities",
            "needs `response_format` `verbose_json`, not `json`",
        ),
        (
            with(&[
                ("response_format", "verbose_json"),
                ("timestamp_granularities", "sentence"),
            ]),
            "timestamp_granularities",
            "has `sentence`: `segment` or `word`",
        ),
        (with(&[("language", "en-US")]), "language", "an ISO-639-1 code"),
        (
            with(&[("include[]", "logprobs")]),
            "include",
            "token log-probabilities are not served",
        ),
        (
            with(&[("chunking_strategy[type]", "server_vad")]),
            "chunking_strategy",
            "voice-activity chunking is not served",
        ),
        (
            with(&[("known_speaker_names[]", "agent")]),
            "known_speaker_names",
            "diarization",
        ),
        (
            with(&[("prompt", &"a".repeat(MAX_FIELD_BYTES + 1))]),
            "prompt",
            "larger than the limit of 65536 bytes",
        ),
    ];
    for (parts, param, message) in cases {
        let (status, given, said) = refused(&parts).await;
        assert_eq!((status, given.as_deref()), (400, Some(param)), "{said}");
        assert!(said.contains(message), "{said:?} should say {message:?}");
    }
    let mut not_text = part("prompt", "x");
    let at = not_text.len() - 3;
    not_text[at] = 0xff;
    let (status, param, said) = refused(&[model.clone(), not_text, audio.clone()]).await;
    assert_eq!(
        (status, param.as_deref(), said.as_str()),
        (400, Some("prompt"), "`prompt` is not UTF-8 text")
    );
}

/// A file of OpenAI's largest size passes the route's limit and the field's; a byte more is
/// OpenAI's 413, counted under the model the form named before it.
#[tokio::test]
async fn the_file_may_have_25_mib_and_not_a_byte_more() {
    let at_limit = vec![7u8; MAX_FILE_BYTES];
    let Ok(request) = transcribe(&[part("model", "whisper"), file(&at_limit)]).await else {
        panic!("refused")
    };
    assert_eq!(request.file.len(), MAX_FILE_BYTES);
    let over = vec![7u8; MAX_FILE_BYTES + 1];
    let Err(unread) = transcribe(&[part("model", "whisper"), file(&over)]).await else {
        panic!("read")
    };
    assert_eq!(unread.model.as_deref(), Some("whisper"));
    assert_eq!(
        (unread.error.status, unread.error.param.as_deref()),
        (StatusCode::PAYLOAD_TOO_LARGE, Some("file"))
    );
    assert_eq!(
        unread.error.message,
        "`file` is larger than the limit of 26214400 bytes"
    );
}

/// A body past the route's limit is cut there, whatever field carries it: a 413, as the
/// connection answers a body over `server.body_limit`.
#[tokio::test]
async fn a_body_over_the_routes_limit_is_a_413() {
    let parts = [
        part("model", "whisper"),
        part("padding", &"x".repeat(BODY_BYTES)),
        file(b"RIFF"),
    ];
    let Err(unread) = transcribe(&parts).await else {
        panic!("read")
    };
    assert_eq!(
        unread.error.status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "{}",
        unread.error.message
    );
    assert!(
        unread.error.message.starts_with("the multipart form could not be read"),
        "{}",
        unread.error.message
    );
}

#[tokio::test]
async fn a_body_that_is_not_a_multipart_form_is_a_400_saying_so() {
    let Err(unread) = send(
        br#"{"model": "whisper"}"#.to_vec(),
        "application/json",
        Task::Transcribe,
    )
    .await
    else {
        panic!("read")
    };
    assert_eq!(unread.error.status, StatusCode::BAD_REQUEST);
    assert!(
        unread.error.message.starts_with("the body is not a multipart form"),
        "{}",
        unread.error.message
    );
    // A form cut off before its end is malformed, not a request.
    let mut cut = form(&[part("model", "whisper"), file(b"RIFF")]);
    cut.truncate(cut.len() - 20);
    let kind = format!("multipart/form-data; boundary={BOUNDARY}");
    let Err(unread) = send(cut, &kind, Task::Transcribe).await else {
        panic!("read")
    };
    assert_eq!(unread.error.status, StatusCode::BAD_REQUEST);
    assert!(
        unread.error.message.starts_with("the multipart form could not be read"),
        "{}",
        unread.error.message
    );
    assert_eq!(unread.model.as_deref(), Some("whisper"));
}
