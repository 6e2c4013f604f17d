//! What a transcription starts from: the client's parameters checked against its model
//! ([`params`]: the language known, the prompt tokenized and fitting the model's context) and
//! its audio file read ([`Audio::read`]), each refusal naming the request's field at fault.

use std::sync::Arc;

use super::transcript::Task;
use crate::runtime::audio::{AudioError, Features};
use crate::runtime::speech::SpeechModel;

/// The most seconds of audio one request may have: two hours. Its samples are never held
/// whole (a window's are, [`Features`]); OpenAI's 25 MB file limit holds less than that for
/// any compressed format but WAV at a low rate.
pub const MAX_AUDIO_SECONDS: u64 = 2 * 3600;

/// What a client asks of a transcription, as its API reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct Ask {
    /// Transcribe or translate.
    pub task: Task,
    /// The language spoken, as sent (a code, or Whisper's name for it); `None`: detect it.
    pub language: Option<String>,
    /// Text that comes before the audio (OpenAI's `prompt`: spelling, style).
    pub prompt: Option<String>,
    /// Softmax temperature; 0 picks the most likely token.
    pub temperature: f32,
    /// Segments with their times.
    pub timestamps: bool,
    /// The sampler's seed.
    pub seed: u64,
}

/// How to transcribe: an [`Ask`] checked against its model ([`params`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// Transcribe or translate.
    pub task: Task,
    /// The language spoken (a code or Whisper's name for it); `None`: detected from the first
    /// window.
    pub language: Option<String>,
    /// Text tokens that come before the audio (OpenAI's `prompt`: spelling, style).
    pub prompt: Vec<u32>,
    /// Softmax temperature; 0 picks the most likely token.
    pub temperature: f32,
    /// Segments with their times from the timestamp tokens (audio over one window is decoded
    /// with them whatever this says: they decide where each next window starts).
    pub timestamps: bool,
    /// The sampler's seed (window `i` samples from `seed + i`).
    pub seed: u64,
}

/// A field of a request its model cannot take.
#[derive(Debug, Clone, PartialEq)]
pub struct Invalid {
    /// What is wrong, for the client.
    pub message: String,
    /// The request's field at fault (`language`, `prompt` or `model`).
    pub field: &'static str,
}

/// `ask` checked against the speech model `speech`: its language one the model knows, its
/// prompt tokenized and, with the model's own tokens, within its context, so that a window
/// never fails on what the client sent.
pub fn params(speech: &SpeechModel, ask: Ask) -> Result<Params, Invalid> {
    let whisper = &speech.whisper;
    let invalid = |message, field| Invalid { message, field };
    if let Some(language) = &ask.language {
        whisper.language_token(language).map_err(|e| invalid(e, "language"))?;
    }
    let prompt = match &ask.prompt {
        Some(text) => whisper
            .tokenizer()
            .encode(format!(" {}", text.trim()), false)
            .map_err(|e| invalid(format!("`prompt` cannot be tokenized: {e}"), "prompt"))?
            .get_ids()
            .to_vec(),
        None => Vec::new(),
    };
    whisper
        .prompt(ask.task.whisper(), ask.language.as_deref(), ask.timestamps, &prompt)
        .map_err(|e| invalid(e, if ask.language.is_some() { "language" } else { "model" }))?;
    Ok(Params {
        task: ask.task,
        language: ask.language,
        prompt,
        temperature: ask.temperature,
        timestamps: ask.timestamps,
        seed: ask.seed,
    })
}

/// A request's audio, read once through for what only the whole of it says (its length and
/// its loudest value); each window's features are decoded from its file again as the window
/// is transcribed ([`Features`]), so no more than a window of its samples is held.
#[derive(Debug)]
pub struct Audio {
    pub(super) features: Features,
    /// The samples per second its features are computed at.
    rate: u32,
}

/// Why a request's audio could not be read.
#[derive(Debug, Clone, PartialEq)]
pub enum Unreadable {
    /// The file: what is wrong with it, for the client (a 400 naming `file`).
    File(String),
    /// The reading did not finish: a fault of the server's, or its shutdown (for the log).
    Failed(String),
}

impl Audio {
    /// The audio file `file` (its bytes as the client sent them) read for the speech model
    /// `speech`, off the async threads (tens of milliseconds a minute of audio): at most
    /// [`MAX_AUDIO_SECONDS`]. Stops at its next packet once this future is dropped (the client
    /// went away).
    pub async fn read(speech: &SpeechModel, file: Vec<u8>) -> Result<Audio, Unreadable> {
        let mel = Arc::clone(&speech.mel);
        let rate = mel.config().rate;
        let scan = move |stopped: &dyn Fn() -> bool| Features::scan(file, &mel, MAX_AUDIO_SECONDS, stopped);
        match crate::core::blocking::until_dropped(scan).await {
            Ok(Ok(features)) => Ok(Audio { features, rate }),
            Ok(Err(e)) => Err(Unreadable::File(e.to_string())),
            Err(e) => Err(Unreadable::Failed(e.to_string())),
        }
    }

    /// Seconds of audio.
    pub fn duration(&self) -> f64 {
        self.features.samples() as f64 / f64::from(self.rate)
    }
}

/// A window whose features could not be read a second time (the first reading of its file
/// went through): the client went away, or what the file held changed, which is a fault.
pub(super) fn unreadable_window(error: AudioError) -> crate::serve::lifecycle::RequestError {
    use crate::serve::lifecycle::RequestError;
    match error {
        AudioError::Stopped => RequestError::ClientGone,
        error => {
            tracing::error!(%error, "a window of audio read once could not be read again");
            RequestError::BadInput(format!("`file`: {error}"))
        }
    }
}
