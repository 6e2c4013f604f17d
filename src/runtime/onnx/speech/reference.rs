//! The window job and the long-form loop against `transformers`: the tokens
//! `WhisperForConditionalGeneration.generate` gives for the fixture's clips, greedy
//! (`models/speech/whisper/reference.json`, written by `make.py` there), from features this
//! crate computes of the same files. The loop here is the one the serve layer runs: a window at
//! each seek, its tokens cut into segments, the seek moved on ([`window_segments`]).

use std::path::Path;

use serde_json::Value;

use super::tests::{Harness, fixture, inputs, rows};
use super::*;
use crate::runtime::audio::mel::LogMel;
use crate::runtime::speech::{Task, WindowSegment, frames_at, window_segments};

fn reference() -> Value {
    let text = std::fs::read_to_string(fixture().join("reference.json")).expect("reference.json (make fixtures)");
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<i64> {
    v.as_array()
        .expect("a list of ids")
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect()
}

/// The 16 kHz samples of `path` (relative to `models/`).
fn samples(path: &str) -> Vec<f32> {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(path);
    crate::runtime::audio::decode(std::fs::read(file).unwrap(), 16_000, 600).unwrap()
}

/// What one window of the loop gave.
struct Window {
    seek: u64,
    frames: u64,
    prompt: Vec<i64>,
    tokens: Vec<i64>,
    consumed: u64,
}

/// The long-form loop over the features of `audio` from `prompt`, greedy, each window's
/// computed as the serve layer computes it: its windows and segments.
fn long_form(
    job: &mut Harness,
    whisper: &Whisper,
    mel: &LogMel,
    audio: &[f32],
    mut prompt: Vec<i64>,
) -> (Vec<Window>, Vec<WindowSegment>) {
    let total = mel.frames_long(audio.len()) as u64;
    let loudest = mel.loudest(audio);
    let (mut seek, mut windows, mut segments) = (0, Vec::new(), Vec::new());
    while seek < total {
        assert!(windows.len() < 50, "the seek moves on");
        let frames = frames_at(total, seek, 3000);
        let cut = mel.window_long(audio, loudest, seek as usize);
        let limit = i64::from(whisper.max_new_tokens(prompt.len()));
        let out = rows(&job.run(inputs(&[(&cut, prompt.clone(), limit)])).unwrap());
        let (tokens, language, _, _) = out.into_iter().next().unwrap();
        prompt.iter_mut().filter(|t| **t == DETECT).for_each(|t| *t = language);
        let generated: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
        let result = window_segments(&generated, seek, frames, whisper.tokens.timestamp_begin);
        windows.push(Window {
            seek,
            frames,
            prompt: prompt.clone(),
            tokens,
            consumed: result.consumed,
        });
        segments.extend(result.segments);
        seek += result.consumed;
    }
    (windows, segments)
}

/// The reference's generated tokens of a window without its end token.
fn without_eos(generated: Vec<i64>, eos: u32) -> Vec<i64> {
    match generated.split_last() {
        Some((&last, rest)) if last == i64::from(eos) => rest.to_vec(),
        _ => generated,
    }
}

/// Where `windows` and `segments` differ from the reference's (`windows` and `segments` as
/// `references.py` records them), if anywhere.
fn differences(whisper: &Whisper, windows: &[Window], segments: &[WindowSegment], expected: &Value) -> Option<String> {
    let reference = expected["windows"].as_array().expect("the reference's windows");
    if windows.len() != reference.len() {
        return Some(format!("{} windows, the reference {}", windows.len(), reference.len()));
    }
    for (i, (w, e)) in windows.iter().zip(reference).enumerate() {
        let want = without_eos(ids(&e["generated"]), whisper.tokens.eos);
        let ours = (w.seek, w.frames, &w.prompt, &w.tokens, w.consumed);
        let theirs = (
            e["seek_frames"].as_u64().unwrap(),
            e["window_frames"].as_u64().unwrap(),
            &ids(&e["prompt"]),
            &want,
            e["advance_frames"].as_u64().unwrap(),
        );
        if ours != theirs {
            return Some(format!(
                "window {i} (seek, frames, prompt, tokens, advance): {ours:?}\n   reference {theirs:?}"
            ));
        }
    }
    // Cases without timestamps record no segments.
    let reference = expected["segments"].as_array()?;
    if segments.len() != reference.len() {
        return Some(format!(
            "{} segments, the reference {}",
            segments.len(),
            reference.len()
        ));
    }
    for (i, (s, e)) in segments.iter().zip(reference).enumerate() {
        let tokens: Vec<i64> = s.tokens.iter().map(|&t| i64::from(t)).collect();
        let text = whisper.text(&s.tokens).unwrap();
        // The reference rounds its times to 0.01 s.
        let close = |ours: f64, key: &str| (ours - e[key].as_f64().unwrap()).abs() < 0.006;
        if !close(s.start, "start") || !close(s.end, "end") || tokens != ids(&e["tokens"]) || text != e["text"] {
            return Some(format!("segment {i}: {s:?} {text:?}\n   reference {e}"));
        }
    }
    None
}

#[test]
fn short_clips_give_generates_windows_and_segments_in_every_case() {
    let whisper = Whisper::read(&fixture()).unwrap().unwrap();
    let mut job = Harness::open(&fixture());
    let mel = LogMel::new(whisper.mel).unwrap();
    let reference = reference();
    let (mut held, mut differ) = (0, Vec::new());
    for (name, clip) in reference["short"].as_object().unwrap() {
        let audio = samples(clip["path"].as_str().unwrap());
        for (case, expected) in clip["cases"].as_object().unwrap() {
            let args = &expected["generate_kwargs"];
            let task = match args["task"].as_str() {
                Some("translate") => Task::Translate,
                _ => Task::Transcribe,
            };
            let timestamps = args["return_timestamps"] == true;
            let prompt = whisper
                .prompt(task, args["language"].as_str(), timestamps, &[])
                .unwrap();
            let (windows, segments) = long_form(&mut job, &whisper, &mel, &audio, prompt);
            held += 1;
            assert_eq!(
                windows[0].prompt,
                ids(&expected["prompt_ids"]),
                "{name} {case}: the prompt"
            );
            // What generate returns: its segments' tokens, one after another, and their text.
            let all: Vec<u32> = segments.iter().flat_map(|s| s.tokens.iter().copied()).collect();
            let output: Vec<i64> = all.iter().map(|&t| i64::from(t)).collect();
            assert_eq!(
                output,
                ids(&expected["generate_output"]),
                "{name} {case}: generate's output"
            );
            assert_eq!(
                whisper.text(&all).unwrap(),
                expected["text"].as_str().unwrap(),
                "{name} {case}"
            );
            if let Some(difference) = differences(&whisper, &windows, &segments, expected) {
                differ.push(format!("{name} {case}: {difference}"));
            }
        }
    }
    assert_eq!(held, 20, "four clips, five cases each");
    assert!(
        differ.is_empty(),
        "{} of {held} differ:\n{}",
        differ.len(),
        differ.join("\n")
    );
}

#[test]
fn the_long_clip_gives_the_long_form_windows_seeks_and_segments() {
    let whisper = Whisper::read(&fixture()).unwrap().unwrap();
    let mut job = Harness::open(&fixture());
    let mel = LogMel::new(whisper.mel).unwrap();
    let reference = reference();
    // The same 75 s in WAV and FLAC.
    for name in ["long-16k.wav", "long-16k.flac"] {
        let expected = &reference["long"][name];
        let audio = samples(&format!("speech/whisper/audio/{name}"));
        let frames = mel.frames_long(audio.len());
        assert_eq!(
            frames as u64,
            expected["features"]["frames"].as_u64().unwrap(),
            "{name}"
        );
        let top = mel.loudest(&audio).feature();
        let max = expected["features"]["max"].as_f64().unwrap() as f32;
        assert!(
            (top - max).abs() < 1e-4,
            "{name}: the whole audio's maximum: {top} against {max}"
        );
        let prompt = whisper.prompt(Task::Transcribe, Some("en"), true, &[]).unwrap();
        let (windows, segments) = long_form(&mut job, &whisper, &mel, &audio, prompt);
        assert_eq!(differences(&whisper, &windows, &segments, expected), None, "{name}");
        assert!(windows.len() >= 3, "{name}: {} windows", windows.len());
        let all: Vec<u32> = segments.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let output: Vec<i64> = all.iter().map(|&t| i64::from(t)).collect();
        assert_eq!(output, ids(&expected["generate_output"]), "{name}");
        assert_eq!(
            whisper.text(&all).unwrap(),
            expected["text"].as_str().unwrap(),
            "{name}"
        );
    }
}
