//! Speech to text with Whisper: what its prompt asks of it ([`Task`]); a Whisper folder read
//! (`whisper.rs`, its languages in `languages.rs`) and held with its front end (`model.rs`);
//! the rules a window's tokens are picked by (`rules.rs`); and long audio cut into windows and
//! segments (`long.rs`).

/// What a Whisper prompt asks of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// Text in the language spoken (`<|transcribe|>`).
    Transcribe,
    /// English text of speech in any language (`<|translate|>`).
    Translate,
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
