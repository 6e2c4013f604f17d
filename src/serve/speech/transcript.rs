//! What a transcription is asked to do ([`Task`]) and what it gives back ([`Transcript`], its
//! [`Segment`]s), as every response format and the streamed events are written from it.

use std::io::Write;

/// What a speech model is asked to do with the audio.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// Text in the language spoken (`/v1/audio/transcriptions`).
    Transcribe,
    /// English text of speech in any language (`/v1/audio/translations`).
    Translate,
}

impl Task {
    /// The task as Whisper's prompt names it.
    pub(super) fn whisper(self) -> crate::runtime::speech::Task {
        match self {
            Task::Transcribe => crate::runtime::speech::Task::Transcribe,
            Task::Translate => crate::runtime::speech::Task::Translate,
        }
    }
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

/// A text's length over its length compressed by zlib (at zlib's default level, 6), as Whisper
/// computes a segment's `compression_ratio`: text that repeats itself compresses well, so a
/// ratio above 2.4 flags a decoding stuck in a loop. zlib-rs writes the bytes zlib writes, so
/// the ratio is Whisper's to the last digit.
pub fn compression_ratio(text: &str) -> f64 {
    let mut zlib = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::new(6));
    // Writing into a Vec cannot fail.
    zlib.write_all(text.as_bytes()).expect("compressing into memory");
    let compressed = zlib.finish().expect("compressing into memory");
    text.len() as f64 / compressed.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lengths Python's `zlib.compress` gives these texts (zlib 1.2.13, level 6), as Whisper's
    /// `compression_ratio` divides by them.
    #[test]
    fn the_compression_ratio_is_whispers() {
        let cases = [
            ("", 0, 8),
            (" Hello world.", 13, 21),
            (
                " The beach was a popular spot on a hot summer day. People were swimming in the ocean, building sandcastles, and playing beach volleyball.",
                137,
                110,
            ),
            (&" the".repeat(27), 108, 15),
            (" Ça va? Très bien, merci. 日本語のテキストも少し。", 64, 75),
        ];
        for (text, bytes, compressed) in cases {
            assert_eq!(compression_ratio(text), bytes as f64 / compressed as f64, "{text:?}");
        }
        // A loop of the same words is what the ratio flags (Whisper's threshold is 2.4).
        assert!(compression_ratio(&" the".repeat(27)) > 2.4);
    }
}
