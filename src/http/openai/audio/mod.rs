//! OpenAI's audio API for speech to text (`/v1/audio/transcriptions` and
//! `/v1/audio/translations`): the multipart request read and checked (`request.rs`, its tests
//! in `request/`), and a finished transcript written in each `response_format` or as the
//! streamed events (`formats.rs`, its tests in `formats/`). Neither uses the other but for the
//! `Format` a request asks for. See `docs/speech.md`.

pub mod formats;
pub mod request;
