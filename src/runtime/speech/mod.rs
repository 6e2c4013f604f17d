//! Speech to text with Whisper: what a transcription gives back ([`Transcript`], its
//! [`Segment`]s), as every response format and the streamed events are written from it; a
//! Whisper folder read (`whisper.rs`, its languages in `languages.rs`) and held with its front
//! end (`model.rs`); the rules a window's tokens are picked by (`rules.rs`); and long audio cut
//! into windows and segments (`long.rs`).

/// What a speech model is asked to do with the audio.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// Text in the language spoken (`/v1/audio/transcriptions`).
    Transcribe,
    /// English text of speech in any language (`/v1/audio/translations`).
    Translate,
}

/// A finished transcription: its text, the language it was read in, and its segments.
#[derive(Debug, Clone, PartialEq)]
pub struct Transcript {
    /// The whole text, as the segments' texts joined.
    pub text: String,
    /// The language, as Whisper names it in full (`english`): given by the client, or detected.
    pub language: String,
    /// Seconds of audio.
    pub duration: f64,
    /// Its segments in order: with start and end from the timestamp tokens when the request
    /// asked for timestamps, else one segment per window spanning it.
    pub segments: Vec<Segment>,
    /// What was asked.
    pub task: Task,
}

/// One stretch of a transcript, as OpenAI's `verbose_json` lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    /// Its number, from 0.
    pub id: usize,
    /// The frame of the features (10 ms each) where its window started.
    pub seek: u64,
    /// Seconds from the start of the audio.
    pub start: f64,
    /// Seconds from the start of the audio.
    pub end: f64,
    /// Its text.
    pub text: String,
    /// Its tokens (text and timestamp tokens, without the window's prompt).
    pub tokens: Vec<u32>,
    /// The temperature its window was decoded at.
    pub temperature: f32,
    /// The mean log-probability of its window's tokens.
    pub avg_logprob: f64,
    /// Its text's length over its length compressed with zlib (repetition shows as a high ratio).
    pub compression_ratio: f64,
    /// The probability of `<|nospeech|>` at its window's first step.
    pub no_speech_prob: f64,
}

mod languages;
pub mod long;
mod model;
pub mod rules;
pub mod whisper;

pub use long::{WindowResult, WindowSegment, frames_at, seconds_at, window_segments};
pub use model::SpeechModel;
pub use rules::{Rules, pick};
pub use whisper::{DETECT, Dims, INPUT_STRIDE, TIME_PRECISION, Tokens, Whisper};
