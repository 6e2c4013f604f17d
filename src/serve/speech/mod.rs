//! Speech to text on a Whisper model ([`crate::runtime::speech`]), below any protocol: the
//! audio's log-mel features, cut into 30-second windows, each window one run through the
//! lifecycle like any request's (placed, asked of the policy, failed over to the CPU pool once
//! after an allocator failure, batched with other requests' windows when the model has
//! `batching`), the whole transcription counted once. A window's run is the whole of its
//! decoding on the pool's device (encoder, then every token, the caches kept there:
//! [`crate::runtime::onnx`]'s window job), so what crosses the bus is its features in and its
//! tokens out.
//!
//! A request's parameters and its audio file are read first (`input.rs`): the file is read
//! through once for its length and loudest value, and decoded again window by window as the
//! windows are transcribed, so that its samples are never held whole. What it asks and what
//! comes back are the types of `transcript.rs`.
//!
//! Windows are cut as `transformers`' `generate` cuts them: features of the whole audio (of
//! audio of 30 s or less, padded to 30 s; computed a window at a time,
//! [`crate::runtime::audio::Features`]), a window at each seek, the seek moved on by what the
//! window's timestamps consumed, so a segment cut off at a window's end is decoded again whole
//! in the next ([`crate::runtime::speech::window_segments`]), timestamps asked or not: a window
//! decoded without them that writes pairs of them all the same is cut there too.
//! Windows follow each other (each starts where the last one's timestamps say), so one
//! transcription runs one window at a time; concurrent transcriptions' windows share runs. A
//! transcription's windows are a [`Series`]: while one transcription prepares its next window, a
//! batch that could go waits for it (up to `max_delay`), so transcriptions that move in step
//! keep sharing their runs.
//!
//! A window that failed over was decoded again from its features on the fallback, which is
//! never a replay of anything the client saw: streamed text goes out a window at a time, once
//! the window is decoded.

mod input;
mod transcript;

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::core::snapshot::Action;
use crate::core::tensor::{Tensor, TensorData};
use crate::pool::Pool;
use crate::pool::activity::Progress;
use crate::runtime::audio::AudioError;
use crate::runtime::speech::{SpeechModel, Whisper, WindowSegment, frames_at, seconds_at, window_segments};
use crate::serve::batching::{Batchers, Series};
use crate::serve::lifecycle::{self, Refused, Request, RequestError};
use crate::serve::metrics::FailoverReason;
use crate::serve::ran::RanOn;
use crate::serve::service::{Api, ModelEntry, Service};
pub use input::{Ask, Audio, Invalid, MAX_AUDIO_SECONDS, Params, Unreadable, params};
use transcript::compression_ratio;
pub use transcript::{Segment, Task, Transcript};

/// Where each window goes as it is decoded (streamed transcriptions).
pub type Sink = mpsc::Sender<Window>;

/// A window as it is decoded: its text, and where it ran (a stream's headers name the pool of
/// its first).
#[derive(Debug)]
pub struct Window {
    /// Its text (empty when it holds none).
    pub text: String,
    /// Where it ran.
    pub ran: RanOn,
    /// The decision that placed it.
    pub action: Action,
    /// Seconds of the audio that the text of this window and those before it covers: the next
    /// window starts there (the audio's length after the last). A stream that fails later
    /// says it, so the client sends only the rest.
    pub done: f64,
}

/// A finished transcription and where it ran.
#[derive(Debug)]
pub struct Transcribed {
    /// What it says.
    pub transcript: Transcript,
    /// Where its last window ran, degraded when any window's run was (one moved to the
    /// fallback) though the last ran where it normally runs.
    pub ran: RanOn,
    /// The decision that placed its last window.
    pub action: Action,
    /// Set when a window moved to the fallback pool after an allocator failure (the last such
    /// window's reason).
    pub retried: Option<FailoverReason>,
}

/// What one window's run gave.
struct Decoded {
    tokens: Vec<u32>,
    language: u32,
    sum_logprob: f64,
    no_speech_prob: f64,
}

/// Transcribe `audio` (read for `entry`'s model) with `entry`'s Whisper model, counted from
/// here as one request (`request` carries its id, deadline and priority; its inputs are built
/// here). Each window goes to `sink` as it is decoded.
pub async fn transcribe(
    service: &Service,
    batchers: &Batchers,
    entry: &ModelEntry,
    audio: Audio,
    params: &Params,
    mut request: Request,
    sink: Option<Sink>,
) -> Result<Transcribed, Refused> {
    let Some(speech) = entry.kind.speech() else {
        let error = RequestError::BadInput(format!(
            "model `{}` does not {}",
            entry.config.name,
            Api::Transcription.needs()
        ));
        return Err(lifecycle::reject(service, &entry.config.name, error, request.received));
    };
    let counted = lifecycle::Counted::start(service, &mut request);
    let transcribed = windows(service, batchers, speech, audio, params, &request, sink).await;
    counted.finish(transcribed.as_ref().map(|(_, pool)| pool.as_ref()));
    if let Ok((done, pool)) = &transcribed {
        let elapsed = Instant::now().duration_since(request.received).as_secs_f64();
        (service.metrics.speech).transcribed(&entry.config.name, pool.name(), done.transcript.duration, elapsed);
    }
    transcribed.map(|(done, _)| done)
}

/// Decode every window of `audio` in turn: the transcription, and the pool its last window
/// ran on.
async fn windows(
    service: &Service,
    batchers: &Batchers,
    speech: &SpeechModel,
    mut audio: Audio,
    params: &Params,
    request: &Request,
    sink: Option<Sink>,
) -> Result<(Transcribed, Arc<Pool>), Refused> {
    let whisper = &speech.whisper;
    // Due from now: concurrent transcriptions' first windows wait for this one's features.
    let series: Series = batchers.series(&request.model);
    let config = whisper.mel;
    let window_frames = config.frames();
    let samples = audio.features.samples();
    let long = samples > config.window_samples();
    let total = speech.mel.frames_long(samples) as u64;
    let duration = audio.duration();
    // Long audio is always decoded with timestamps: they say where the next window starts.
    let timestamps = params.timestamps || long;
    let mut language = params.language.clone();
    let (mut seek, mut index) = (0u64, 0u64);
    let mut all_tokens = Vec::new();
    let mut segments: Vec<Segment> = Vec::new();
    let mut last: Option<lifecycle::Served> = None;
    let mut detected = None;
    let (mut retried, mut ran_on) = (None, Vec::<Arc<Pool>>::new());
    while seek < total {
        let frames = frames_at(total, seek, window_frames as u64);
        let (back, input) = window_features(speech, audio, seek).await;
        audio = back;
        let input = input.map_err(|e| Refused {
            pool: last.as_ref().map(|served| Arc::clone(&served.pool)),
            error: input::unreadable_window(e),
        })?;
        // The language was checked when the request was read.
        // The client's prompt conditions the first window only (`transformers`' default
        // `prompt_condition_type`, "first-segment").
        let previous: &[u32] = if index == 0 { &params.prompt } else { &[] };
        let prompt = whisper
            .prompt(params.task.whisper(), language.as_deref(), timestamps, previous)
            .map_err(|e| Refused {
                pool: None,
                error: RequestError::BadInput(e),
            })?;
        let run = window_request(request, whisper, input, &prompt, params, index);
        let served = batchers.place_next(run, &series).await?;
        let decoded = decoded(&served.outputs).map_err(|e| failed(&served.pool, e))?;
        // `sum_logprob` counts the end token when the window ended before its limit: Whisper's
        // mean divides by the tokens and that end.
        let ended = decoded.tokens.len() < whisper.max_new_tokens(prompt.len()) as usize;
        let avg_logprob = decoded.sum_logprob / (decoded.tokens.len() + usize::from(ended)).max(1) as f64;
        if detected.is_none() {
            let name = whisper.language_name(decoded.language).map(str::to_string);
            // transformers detects the language once, from the first window, and keeps it.
            if language.is_none() && whisper.multilingual {
                language = name.clone();
            }
            detected = Some(name.unwrap_or_else(|| "english".to_string()));
        }
        let (window_segments, consumed) = cut(whisper, &decoded, seek, frames, samples);
        let text = window_text(whisper, &window_segments).map_err(|e| failed(&served.pool, e))?;
        if let Some(sink) = &sink {
            let window = Window {
                text,
                ran: service.ran_on(&served.pool, &request.model),
                action: served.action,
                done: seconds_at(seek + consumed.max(1)).min(duration),
            };
            // A client that went away stops the transcription where it is waited on.
            let _ = sink.send(window).await;
        }
        // The text is the segments' tokens: what a window decoded past its last whole segment
        // is decoded again from the next window's seek.
        all_tokens.extend(window_segments.iter().flat_map(|s| s.tokens.iter().copied()));
        for piece in window_segments {
            let text = whisper.text(&piece.tokens).map_err(|e| failed(&served.pool, e))?;
            segments.push(Segment {
                id: segments.len(),
                seek,
                start: piece.start,
                end: piece.end,
                compression_ratio: compression_ratio(&text),
                text,
                tokens: piece.tokens,
                temperature: params.temperature,
                avg_logprob,
                no_speech_prob: decoded.no_speech_prob,
            });
        }
        retried = served.retried.or(retried);
        if !ran_on.iter().any(|p| Arc::ptr_eq(p, &served.pool)) {
            ran_on.push(Arc::clone(&served.pool));
        }
        last = Some(served);
        seek += consumed.max(1);
        index += 1;
    }
    let served = last.expect("audio has at least one window");
    let text = whisper.text(&all_tokens).map_err(|e| failed(&served.pool, e))?;
    let runs: Vec<&Pool> = ran_on.iter().map(Arc::as_ref).collect();
    let transcribed = Transcribed {
        transcript: Transcript {
            text,
            language: detected.unwrap_or_else(|| "english".to_string()),
            duration,
            segments,
            task: params.task,
        },
        ran: service.ran_on_runs(&served.pool, &request.model, &runs),
        action: served.action,
        retried,
    };
    Ok((transcribed, served.pool))
}

/// The features of `audio`'s window at `seek`, off the async threads (a few milliseconds of
/// decoding and of CPU for its frames), `audio` coming back with them. Its decoding stops at the
/// next packet once this future is dropped (the client went away).
async fn window_features(speech: &SpeechModel, mut audio: Audio, seek: u64) -> (Audio, Result<Vec<f32>, AudioError>) {
    let mel = Arc::clone(&speech.mel);
    crate::core::blocking::until_dropped(move |stopped| {
        let window = audio.features.window(&mel, seek as usize, stopped);
        (audio, window)
    })
    .await
    .expect("computing features does not panic: a decoder's panic is an error")
}

/// Window `index`'s run: its features and prompt as the window job takes them (one row).
fn window_request(
    request: &Request,
    whisper: &Whisper,
    features: Vec<f32>,
    prompt: &[i64],
    params: &Params,
    index: u64,
) -> Request {
    let mut run = request.clone();
    // Its own place in the request's progress: its runs start the transcription's, and what
    // admission holds for it (budgets) is given back when the window is decoded.
    run.progress = Progress::batch(vec![request.progress.clone()]);
    let bins = whisper.mel.bins as i64;
    let frames = (features.len() as i64) / bins.max(1);
    let most = whisper.max_new_tokens(prompt.len());
    run.inputs = vec![
        Tensor {
            name: "input_features".into(),
            shape: vec![1, bins, frames],
            data: TensorData::Fp32(features),
        },
        Tensor {
            name: "decoder_input_ids".into(),
            shape: vec![1, prompt.len() as i64],
            data: TensorData::Int64(prompt.to_vec()),
        },
        Tensor {
            name: "max_new_tokens".into(),
            shape: vec![1],
            data: TensorData::Int64(vec![i64::from(most)]),
        },
        Tensor {
            name: "temperature".into(),
            shape: vec![1],
            data: TensorData::Fp32(vec![params.temperature]),
        },
        Tensor {
            name: "seed".into(),
            shape: vec![1],
            data: TensorData::Int64(vec![params.seed.wrapping_add(index) as i64]),
        },
    ];
    run.outputs = ["tokens", "language", "sum_logprob", "no_speech_prob"]
        .map(String::from)
        .to_vec();
    // Its features are all it needs: it may run again on the fallback from them.
    run.pads = false;
    run.allow_substitute = false;
    run
}

/// A window job's outputs, read.
fn decoded(outputs: &[Tensor]) -> Result<Decoded, String> {
    let find = |name: &str| {
        outputs
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| format!("the window's run gave no `{name}`"))
    };
    let (TensorData::Int64(tokens), TensorData::Int64(language)) = (&find("tokens")?.data, &find("language")?.data)
    else {
        return Err("the window's `tokens` and `language` are not INT64".into());
    };
    let (TensorData::Fp32(sum), TensorData::Fp32(no_speech)) =
        (&find("sum_logprob")?.data, &find("no_speech_prob")?.data)
    else {
        return Err("the window's `sum_logprob` and `no_speech_prob` are not FP32".into());
    };
    Ok(Decoded {
        tokens: tokens.iter().take_while(|&&t| t >= 0).map(|&t| t as u32).collect(),
        language: language.first().map_or(0, |&l| l as u32),
        sum_logprob: sum.first().copied().map_or(0.0, f64::from),
        no_speech_prob: no_speech.first().copied().map_or(0.0, f64::from),
    })
}

/// A window's segments and the frames it consumed, as `transformers` cuts every window,
/// timestamps asked or not: at its pairs of timestamp tokens, which a window decoded without
/// timestamps may write all the same (no rule forbids them then; a model of random weights
/// does), the seek then moving to the last pair's time and what follows decoded again in the
/// next window. A model that names no `<|notimestamps|>` has no timestamp tokens for
/// `transformers`: its window is one segment over the audio it holds.
fn cut(whisper: &Whisper, decoded: &Decoded, seek: u64, frames: u64, samples: usize) -> (Vec<WindowSegment>, u64) {
    if whisper.tokens.no_timestamps.is_some() {
        let result = window_segments(&decoded.tokens, seek, frames, whisper.tokens.timestamp_begin);
        return (result.segments, result.consumed);
    }
    let end = samples as f64 / f64::from(whisper.mel.rate);
    let whole = WindowSegment {
        start: 0.0,
        end,
        tokens: decoded.tokens.clone(),
    };
    (vec![whole], frames)
}

/// The text of a window's segments, as one piece of a stream.
fn window_text(whisper: &Whisper, segments: &[WindowSegment]) -> Result<String, String> {
    let tokens: Vec<u32> = segments.iter().flat_map(|s| s.tokens.iter().copied()).collect();
    whisper.text(&tokens)
}

/// A window's answer that cannot be read (a fault of the server, logged): the client's error
/// names the pool, as any failed run's does.
fn failed(pool: &Arc<Pool>, why: String) -> Refused {
    tracing::error!(pool = pool.name(), %why, "a speech window's answer could not be read");
    Refused::at(
        pool,
        RequestError::Failed {
            pool: pool.name().to_string(),
        },
    )
}
