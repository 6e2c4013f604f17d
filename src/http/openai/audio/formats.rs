//! A finished [`Transcript`] written as OpenAI's audio API answers it, in each
//! `response_format`: `json` (`{"text", "usage"}`), `text` (the text and a newline), `srt` and
//! `vtt` (subtitles, one cue per segment) and `verbose_json` (the task, language, duration and
//! every segment with the numbers Whisper keeps for it); and, with `stream=true`, as the
//! `transcript.text.delta` and `transcript.text.done` events OpenAI streams. Field names are
//! those the `openai` package's types read (`Transcription`, `TranscriptionVerbose`,
//! `TranscriptionSegment`, `TranscriptionTextDeltaEvent`, `TranscriptionTextDoneEvent`).
//!
//! The subtitles follow Whisper's own writers (`whisper/utils.py`): each cue is a segment's
//! text trimmed, its times rounded to the millisecond. Where Whisper would write a cue a parser
//! misreads, they differ: a segment with no text gives no cue (an empty cue ends early in SRT),
//! blank lines inside a text are dropped (a blank line ends a cue), and WebVTT's cue text has
//! `&`, `<` and `>` escaped as its syntax requires (which also keeps a `-->` in the text from
//! reading as a timing line; SRT gets Whisper's `->` in its place).

use axum::http::{HeaderValue, header};
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::serve::speech::{Segment, Task, Transcript};

/// What a transcription is answered in: the request's `response_format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `{"text": ..., "usage": ...}`, the default.
    Json,
    /// The text and a newline, as `text/plain`.
    Text,
    /// SubRip subtitles.
    Srt,
    /// WebVTT subtitles.
    Vtt,
    /// The text with its task, language, duration and segments.
    VerboseJson,
}

/// The content type OpenAI answers `text`, `srt` and `vtt` with.
const PLAIN: &str = "text/plain; charset=utf-8";

impl Format {
    /// Every format, in the order OpenAI's documentation lists them.
    pub const ALL: [Format; 5] = [
        Format::Json,
        Format::Text,
        Format::Srt,
        Format::VerboseJson,
        Format::Vtt,
    ];

    /// Its name, as `response_format` gives it.
    pub fn name(self) -> &'static str {
        match self {
            Format::Json => "json",
            Format::Text => "text",
            Format::Srt => "srt",
            Format::Vtt => "vtt",
            Format::VerboseJson => "verbose_json",
        }
    }

    /// The format `response_format` names, if it is one served here.
    pub fn named(name: &str) -> Option<Format> {
        Format::ALL.into_iter().find(|f| f.name() == name)
    }

    /// Whether it says when each segment is spoken (`srt`, `vtt`, `verbose_json`): the
    /// decoding must then produce Whisper's timestamp tokens.
    pub fn timestamps(self) -> bool {
        matches!(self, Format::Srt | Format::Vtt | Format::VerboseJson)
    }
}

/// The answer to a transcription in `format`, with OpenAI's content type: JSON for `json` and
/// `verbose_json`, `text/plain` for the others (OpenAI sends subtitles as `text/plain` too).
pub fn answer(transcript: &Transcript, format: Format) -> Response {
    let body = match format {
        Format::Json => return axum::Json(json_body(transcript)).into_response(),
        Format::VerboseJson => return axum::Json(verbose_json(transcript)).into_response(),
        Format::Text => format!("{}\n", transcript.text.trim()),
        Format::Srt => srt(&transcript.segments),
        Format::Vtt => vtt(&transcript.segments),
    };
    let mut response = body.into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(PLAIN));
    response
}

/// `json`: the text (trimmed, as OpenAI sends it: Whisper's text starts with a space) and the
/// audio's duration as OpenAI's `whisper-1` reports its usage.
fn json_body(transcript: &Transcript) -> Value {
    json!({"text": transcript.text.trim(), "usage": usage(transcript)})
}

/// `usage` as OpenAI's `whisper-1` gives it: the audio's seconds, rounded up to a whole second
/// (a clip of 8.47 s is `9`).
fn usage(transcript: &Transcript) -> Value {
    json!({"type": "duration", "seconds": transcript.duration.ceil() as u64})
}

/// `verbose_json`: everything [`json_body`] has and the task, the language, the duration and
/// the segments. A translation's language is the text's, English, as OpenAI's
/// `TranslationVerbose` says.
fn verbose_json(transcript: &Transcript) -> Value {
    let (task, language) = match transcript.task {
        Task::Transcribe => ("transcribe", transcript.language.as_str()),
        Task::Translate => ("translate", "english"),
    };
    let segments: Vec<Value> = transcript.segments.iter().map(segment).collect();
    json!({
        "task": task,
        "language": language,
        "duration": transcript.duration,
        "text": transcript.text.trim(),
        "segments": segments,
        "usage": usage(transcript),
    })
}

/// One segment of `verbose_json`, with its text as decoded (Whisper's leading space kept, as
/// OpenAI keeps it).
fn segment(s: &Segment) -> Value {
    json!({
        "id": s.id,
        "seek": s.seek,
        "start": s.start,
        "end": s.end,
        "text": s.text,
        "tokens": s.tokens,
        // The temperature as the request wrote it (0.2, not the f32's 0.20000000298023224).
        "temperature": s.temperature.to_string().parse::<f64>().unwrap_or(0.0),
        "avg_logprob": s.avg_logprob,
        "compression_ratio": s.compression_ratio,
        "no_speech_prob": s.no_speech_prob,
    })
}

/// SubRip: numbered cues from 1, `HH:MM:SS,mmm --> HH:MM:SS,mmm`, each followed by a blank line.
fn srt(segments: &[Segment]) -> String {
    let mut out = String::new();
    for (n, (s, text)) in cues(segments, |t| t.replace("-->", "->")).enumerate() {
        let (start, end) = (timestamp(s.start, ','), timestamp(s.end, ','));
        out.push_str(&format!("{}\n{start} --> {end}\n{text}\n\n", n + 1));
    }
    out
}

/// WebVTT: the `WEBVTT` header, then cues `HH:MM:SS.mmm --> HH:MM:SS.mmm`, each followed by a
/// blank line.
fn vtt(segments: &[Segment]) -> String {
    let mut out = String::from("WEBVTT\n\n");
    let escape = |t: &str| t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    for (s, text) in cues(segments, escape) {
        let (start, end) = (timestamp(s.start, '.'), timestamp(s.end, '.'));
        out.push_str(&format!("{start} --> {end}\n{text}\n\n"));
    }
    out
}

/// The segments that show a text, each with its text as a cue carries it: `escape`d, trimmed,
/// its lines trimmed and blank ones dropped.
fn cues<'a>(
    segments: &'a [Segment],
    escape: impl Fn(&str) -> String + 'a,
) -> impl Iterator<Item = (&'a Segment, String)> + 'a {
    segments.iter().filter_map(move |s| {
        let lines: Vec<&str> = s.text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
        (!lines.is_empty()).then(|| (s, escape(&lines.join("\n"))))
    })
}

/// `seconds` as a subtitle's `HH:MM:SS` and milliseconds after `marker`, rounded to the
/// millisecond as Whisper's `format_timestamp` rounds (half to even, Python's `round`), so
/// 59.9996 s is `00:01:00,000`; a negative time is 0.
fn timestamp(seconds: f64, marker: char) -> String {
    let ms = (seconds.max(0.0) * 1000.0).round_ties_even() as u64;
    let (hours, minutes) = (ms / 3_600_000, ms / 60_000 % 60);
    let (secs, millis) = (ms / 1000 % 60, ms % 1000);
    format!("{hours:02}:{minutes:02}:{secs:02}{marker}{millis:03}")
}

/// `stream=true`: a piece of the text as it is transcribed (`transcript.text.delta`). The
/// pieces add up to [`done_event`]'s text when the first is sent without the space Whisper's
/// text starts with. `facts` (where its window ran, when the stream's headers do not say it)
/// go beside OpenAI's fields as `vramguard`.
pub fn delta_event(text: &str, facts: Option<Value>) -> Event {
    let mut event = json!({"type": "transcript.text.delta", "delta": text});
    if let Some(facts) = facts {
        event["vramguard"] = facts;
    }
    Event::default().data(event.to_string())
}

/// `stream=true`: the last event, the whole text (`transcript.text.done`). Its `usage` is left
/// out: the `openai` package types it as the token counts OpenAI bills its newer models by,
/// while Whisper's is the audio's duration, which a non-streamed `json` answer gives. `facts`
/// go beside OpenAI's fields as `vramguard`, as [`delta_event`]'s do.
pub fn done_event(transcript: &Transcript, facts: Option<Value>) -> Event {
    let mut event = json!({"type": "transcript.text.done", "text": transcript.text.trim()});
    if let Some(facts) = facts {
        event["vramguard"] = facts;
    }
    Event::default().data(event.to_string())
}

#[cfg(test)]
mod tests;
