//! `POST /v1/audio/transcriptions` and `/v1/audio/translations` served end to end: the tiny
//! Whisper of `models/speech/whisper/` (random weights, exported by Optimum) through the
//! lifecycle, with real ONNX Runtime sessions; answers held to what `transformers`' `generate`
//! gives on the same audio (`reference.json`), every format readable, a window failed over to
//! the CPU pool giving the same text, and what is wrong with a request named in its 400.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::common::{TestServer, sample};

const WHISPER: &str = "models/speech/whisper/encoder_model.onnx";
const AUDIO: &str = "models/speech/audio";

/// A multipart form as OpenAI's SDK sends it: text fields, then the file.
pub(crate) fn form(fields: &[(&str, &str)], file: (&str, Vec<u8>)) -> (String, Vec<u8>) {
    let boundary = "vramguard-test-boundary-7d1f";
    let mut body = Vec::new();
    for (name, value) in fields {
        body.extend(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n").bytes(),
        );
    }
    let (filename, bytes) = file;
    body.extend(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
        )
        .bytes(),
    );
    body.extend(bytes);
    body.extend(format!("\r\n--{boundary}--\r\n").bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

/// Send a form to `path`: the status, the headers and the body as text.
pub(crate) async fn send(
    server: &TestServer,
    path: &str,
    fields: &[(&str, &str)],
    file: (&str, Vec<u8>),
) -> (StatusCode, reqwest::header::HeaderMap, String) {
    let (content_type, body) = form(fields, file);
    let response = reqwest::Client::new()
        .post(server.url(path))
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap();
    let (status, headers) = (response.status(), response.headers().clone());
    (status, headers, response.text().await.unwrap())
}

pub(crate) fn clip(name: &str) -> (&str, Vec<u8>) {
    let path = format!("{AUDIO}/{name}");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    (name_of(name), bytes)
}

fn name_of(name: &str) -> &str {
    name.rsplit('/').next().unwrap_or(name)
}

/// The model's references (`models/speech/whisper/reference.json`).
fn reference() -> Value {
    let path = "models/speech/whisper/reference.json";
    serde_json::from_str(&std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"))).unwrap()
}

pub(crate) fn cpu_server_yaml() -> String {
    format!(
        "models: [{{name: whisper, path: {WHISPER}}}, {{name: embed, path: 'builtin:embedder', tokenizer: 'builtin:embedder'}}]\n\
         pools: [{{name: cpu, provider: cpu, models: [whisper, embed]}}]\n"
    )
}

/// The request of a reference case (`reference.json`'s `short.<file>.cases.<case>`): the path
/// and the form's fields. `translate` (a language given to a translation) has no form: OpenAI's
/// translations take no `language`.
fn case_request(case: &str) -> Option<(&'static str, Vec<(&'static str, &'static str)>)> {
    let (transcriptions, translations) = ("/v1/audio/transcriptions", "/v1/audio/translations");
    let en = ("language", "en");
    match case {
        "transcribe" => Some((transcriptions, vec![en])),
        "timestamps" => Some((transcriptions, vec![en, ("response_format", "verbose_json")])),
        "detect" => Some((transcriptions, vec![])),
        "translate_detect" => Some((translations, vec![])),
        _ => None,
    }
}

#[tokio::test]
async fn a_short_clip_is_transcribed_as_transformers_generates_it() {
    let server = TestServer::start(&cpu_server_yaml()).await;
    let reference = reference();
    let clips = reference["short"].as_object().expect("reference.json has short clips");
    let mut checked = 0;
    for (name, clip) in clips {
        let path = format!("models/{}", clip["path"].as_str().unwrap());
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        for (case, want) in clip["cases"].as_object().unwrap() {
            let Some((endpoint, mut fields)) = case_request(case) else {
                continue;
            };
            fields.insert(0, ("model", "whisper"));
            let (status, headers, body) = send(&server, endpoint, &fields, (name, bytes.clone())).await;
            assert_eq!(status, StatusCode::OK, "{name} {case}: {body}");
            assert_eq!(headers["x-vramguard-pool"], "cpu");
            let answer: Value = serde_json::from_str(&body).unwrap();
            let text = want["text"].as_str().unwrap().trim();
            assert_eq!(answer["text"], text, "{name} {case}");
            if case == "timestamps" {
                let got = answer["segments"].as_array().unwrap();
                let want = want["segments"].as_array().unwrap();
                assert_eq!(got.len(), want.len(), "{name}: {body}");
                for (got, want) in got.iter().zip(want) {
                    for key in ["start", "end"] {
                        let (g, w) = (got[key].as_f64().unwrap(), want[key].as_f64().unwrap());
                        assert!((g - w).abs() < 1e-6, "{name} segment {key}: {g} vs {w}");
                    }
                    assert_eq!(got["tokens"], want["tokens"], "{name}");
                    assert_eq!(got["text"], want["text"], "{name}");
                }
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 16, "four clips, four cases each");
    server.stop().await;
}

#[tokio::test]
async fn the_builtin_whisper_is_the_fixture_written_into_the_cache_folder() {
    let server = TestServer::start(
        "models: [{name: whisper, path: 'builtin:whisper'}]\npools: [{name: cpu, provider: cpu, models: [whisper]}]\n",
    )
    .await;
    let reference = reference();
    for (name, clip) in reference["short"].as_object().unwrap() {
        let path = format!("models/{}", clip["path"].as_str().unwrap());
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let fields = [("model", "whisper"), ("language", "en")];
        let (status, _, body) = send(&server, "/v1/audio/transcriptions", &fields, (name, bytes)).await;
        assert_eq!(status, StatusCode::OK, "{name}: {body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        let want = clip["cases"]["transcribe"]["text"].as_str().unwrap().trim();
        assert_eq!(answer["text"], want, "{name}");
    }
    // Written under this test process's cache folder, never the user's.
    let home = vramguard::testing::cache_home().join("vramguard/builtin");
    let written: Vec<String> = std::fs::read_dir(&home)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(written.iter().any(|n| n.starts_with("whisper-")), "{written:?}");
    server.stop().await;
}

#[tokio::test]
async fn a_long_clip_is_transcribed_as_transformers_long_form_does() {
    let server = TestServer::start(&cpu_server_yaml()).await;
    let reference = reference();
    for (name, want) in reference["long"].as_object().expect("reference.json has long clips") {
        let file = format!("models/speech/whisper/audio/{name}");
        let bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{file}: {e}"));
        let fields = [
            ("model", "whisper"),
            ("language", "en"),
            ("response_format", "verbose_json"),
        ];
        let (status, _, body) = send(&server, "/v1/audio/transcriptions", &fields, (name, bytes)).await;
        assert_eq!(status, StatusCode::OK, "{name}: {body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        let got = answer["segments"].as_array().unwrap();
        let want_segments = want["segments"].as_array().unwrap();
        // Lossless files (WAV, FLAC) at 16 kHz: their samples are ffmpeg's to the bit, so the
        // features are transformers' and so is every token. (A lossy file is decoded by another
        // decoder than ffmpeg's, a few 1e-3 apart in the features: this random model's margins
        // are smaller than that.)
        assert_eq!(answer["text"], want["text"].as_str().unwrap().trim(), "{name}");
        assert_eq!(got.len(), want_segments.len(), "{name}");
        for (got, want) in got.iter().zip(want_segments) {
            for key in ["start", "end"] {
                let (g, w) = (got[key].as_f64().unwrap(), want[key].as_f64().unwrap());
                assert!((g - w).abs() < 1e-6, "{name} segment {key}: {g} vs {w}");
            }
            assert_eq!(got["tokens"], want["tokens"], "{name}");
        }
    }
    server.stop().await;
}

#[tokio::test]
async fn concurrent_long_clips_share_their_windows_runs_and_each_is_exact() {
    // One worker, windows batched up to four rows: four transcriptions of the long clip (two
    // WAV, two FLAC: the same samples, so the same windows) move in step.
    let yaml = format!(
        "models: [{{name: whisper, path: {WHISPER}, batching: {{max_batch: 4, max_delay: 30s}}}}]\n\
         pools: [{{name: cpu, provider: cpu, models: [whisper], workers: 1}}]\n"
    );
    let server = TestServer::start(&yaml).await;
    let reference = reference();
    let fields = [("model", "whisper"), ("language", "en"), ("response_format", "json")];
    let names = ["long-16k.wav", "long-16k.flac", "long-16k.wav", "long-16k.flac"];
    let answers = futures_util::future::join_all(names.iter().map(|name| {
        let file = format!("models/speech/whisper/audio/{name}");
        let bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{file}: {e}"));
        send(&server, "/v1/audio/transcriptions", &fields, (name, bytes))
    }))
    .await;
    for (name, (status, _, body)) in names.iter().zip(answers) {
        assert_eq!(status, StatusCode::OK, "{name}: {body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        let want = reference["long"][name]["text"].as_str().unwrap().trim();
        assert_eq!(answer["text"], want, "{name}, decoded in a batch");
    }
    let metrics = server.metrics().await;
    let labels = r#"{model="whisper",pool="cpu"}"#;
    let rows = sample(&metrics, &format!("vramguard_batch_rows_sum{labels}"));
    let runs = sample(&metrics, &format!("vramguard_batch_rows_count{labels}"));
    assert_eq!(rows, 16.0, "four windows each");
    // However their first windows met, from the second on the four run as one: at most 4 runs
    // for the first windows and 3 after. (Alternating, a lone window then the other three,
    // takes 8.)
    assert!(runs <= 7.0, "{runs} runs for 16 windows");
    server.stop().await;
}

#[tokio::test]
async fn different_clips_give_different_text_and_each_format_reads_back() {
    let server = TestServer::start(&cpu_server_yaml()).await;
    let fields = [("model", "whisper"), ("language", "en"), ("response_format", "text")];
    let (status, _, gpu) = send(&server, "/v1/audio/transcriptions", &fields, clip("gpu-16k.wav")).await;
    assert_eq!(status, StatusCode::OK, "{gpu}");
    let (_, _, memory) = send(&server, "/v1/audio/transcriptions", &fields, clip("memory-16k.wav")).await;
    assert_ne!(gpu, memory, "the model hears the audio: two clips, two texts");
    assert!(gpu.ends_with('\n'));

    let verbose = [
        ("model", "whisper"),
        ("language", "en"),
        ("response_format", "verbose_json"),
    ];
    let (_, _, body) = send(&server, "/v1/audio/transcriptions", &verbose, clip("gpu-16k.wav")).await;
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["task"], "transcribe");
    assert_eq!(answer["language"], "english");
    let duration = answer["duration"].as_f64().unwrap();
    assert!((duration - 59336.0 / 16000.0).abs() < 1e-9, "{duration}");
    let segments = answer["segments"].as_array().unwrap();
    assert!(!segments.is_empty());
    let mut last = 0.0;
    for s in segments {
        let (start, end) = (s["start"].as_f64().unwrap(), s["end"].as_f64().unwrap());
        assert!(start >= last - 1e-9 && end >= start, "{body}");
        last = end;
        assert!(s["avg_logprob"].as_f64().unwrap() <= 0.0);
        assert!((0.0..=1.0).contains(&s["no_speech_prob"].as_f64().unwrap()));
    }

    for (format, head) in [("srt", "1\n00:00:"), ("vtt", "WEBVTT\n\n00:00:")] {
        let fields = [("model", "whisper"), ("language", "en"), ("response_format", format)];
        let (status, headers, body) = send(&server, "/v1/audio/transcriptions", &fields, clip("gpu-16k.wav")).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(headers["content-type"].to_str().unwrap().starts_with("text/plain"));
        assert!(body.starts_with(head), "{format}: {body}");
        assert_eq!(
            body.matches(" --> ").count(),
            segments
                .iter()
                .filter(|s| !s["text"].as_str().unwrap().trim().is_empty())
                .count(),
            "{format}: {body}"
        );
    }
    server.stop().await;
}

/// What phones and Safari record, AAC in M4A, is transcribed as long as the clip is: its
/// encoder's 1024 frames of priming dropped, as ffmpeg drops them (kept, they made it 23 ms
/// longer and every word late). The fixture's model has random weights, so the text of a lossy
/// copy is not the WAV's: the features are held to `transformers`' in `speech_front_end.rs`.
#[tokio::test]
async fn a_phone_recording_in_m4a_is_transcribed_as_long_as_the_clip_is() {
    let server = TestServer::start(&cpu_server_yaml()).await;
    let fields = [
        ("model", "whisper"),
        ("language", "en"),
        ("response_format", "verbose_json"),
    ];
    let path = "/v1/audio/transcriptions";
    let (status, _, wav) = send(&server, path, &fields, clip("gpu-16k.wav")).await;
    assert_eq!(status, StatusCode::OK, "{wav}");
    let (status, _, m4a) = send(&server, path, &fields, clip("gpu.m4a")).await;
    assert_eq!(status, StatusCode::OK, "{m4a}");
    let (wav, m4a): (Value, Value) = (serde_json::from_str(&wav).unwrap(), serde_json::from_str(&m4a).unwrap());
    // The WAV's 59,336 samples, and the 296 frames at 44.1 kHz that pad AAC's last packet.
    assert_eq!(wav["duration"].as_f64().unwrap(), 59_336.0 / 16_000.0);
    assert_eq!(m4a["duration"].as_f64().unwrap(), 59_444.0 / 16_000.0, "{m4a}");
    assert_eq!(m4a["language"], "english");
    assert!(!m4a["segments"].as_array().unwrap().is_empty(), "{m4a}");
    server.stop().await;
}

#[tokio::test]
async fn a_stream_sends_the_text_as_deltas_that_add_up_to_the_done_event() {
    let server = TestServer::start(&cpu_server_yaml()).await;
    let fields = [("model", "whisper"), ("language", "en")];
    let (_, _, plain) = send(&server, "/v1/audio/transcriptions", &fields, clip("memory-16k.wav")).await;
    let want: Value = serde_json::from_str(&plain).unwrap();
    let fields = [("model", "whisper"), ("language", "en"), ("stream", "true")];
    let (status, headers, body) = send(&server, "/v1/audio/transcriptions", &fields, clip("memory-16k.wav")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(headers["content-type"], "text/event-stream");
    assert_eq!(headers["x-vramguard-pool"], "cpu", "the pool of its first window");
    assert_eq!(headers["x-vramguard-model"], "whisper");
    let events = events_of(&body);
    let (done, deltas) = events.split_last().unwrap();
    assert_eq!(done["type"], "transcript.text.done", "{body}");
    assert_eq!(done["text"], want["text"]);
    assert!(deltas.iter().all(|d| d["type"] == "transcript.text.delta"), "{body}");
    assert_eq!(deltas_of(deltas), want["text"].as_str().unwrap());
    server.stop().await;
}

/// Seconds of 16 kHz mono PCM as a WAV file.
fn wav(samples: &[i16]) -> Vec<u8> {
    vramguard::runtime::audio::wav(samples, 16_000, 1)
}

/// The 16-bit samples of a 16 kHz mono WAV fixture.
fn pcm(name: &str) -> Vec<i16> {
    let bytes = std::fs::read(format!("{AUDIO}/{name}")).unwrap();
    let at = bytes.windows(4).position(|w| w == b"data").expect("a data chunk") + 8;
    bytes[at..]
        .chunks_exact(2)
        .map(|b| i16::from_le_bytes([b[0], b[1]]))
        .collect()
}

/// `seconds` of 16 kHz speech: the fixture's two sentences again and again, a second of
/// silence after each.
pub(crate) fn sentences(seconds: usize) -> Vec<i16> {
    let (gpu, memory) = (pcm("gpu-16k.wav"), pcm("memory-16k.wav"));
    let length = seconds * 16_000;
    let mut samples = Vec::with_capacity(length);
    while samples.len() < length {
        for clip in [&gpu, &memory] {
            samples.extend(clip.iter());
            samples.extend(std::iter::repeat_n(0i16, 16_000));
        }
    }
    samples.truncate(length);
    samples
}

#[tokio::test]
async fn a_long_file_is_decoded_in_windows_and_counted_as_one_request() {
    let server = TestServer::start(&cpu_server_yaml()).await;
    let samples = sentences(75);
    let fields = [
        ("model", "whisper"),
        ("language", "en"),
        ("response_format", "verbose_json"),
    ];
    let (status, _, body) = send(
        &server,
        "/v1/audio/transcriptions",
        &fields,
        ("long.wav", wav(&samples)),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["duration"], 75.0);
    let segments = answer["segments"].as_array().unwrap();
    let seeks: std::collections::BTreeSet<u64> = segments.iter().map(|s| s["seek"].as_u64().unwrap()).collect();
    assert!(seeks.len() >= 3, "75 s take at least three windows: {seeks:?}");
    let metrics = server.metrics().await;
    let series = |name: &str, rest: &str| format!("vramguard_{name}{{model=\"whisper\",pool=\"cpu\"{rest}}}");
    assert_eq!(
        sample(&metrics, &series("requests_total", ",outcome=\"ok\"")),
        1.0,
        "{metrics}"
    );
    assert_eq!(sample(&metrics, &series("audio_seconds_total", "")), 75.0);
    assert_eq!(sample(&metrics, &series("audio_real_time_factor_count", "")), 1.0);
    // `/status` says the same, for the status page's speech panel.
    let status: Value = reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap();
    let speech = &status["speech"][0];
    assert_eq!(
        (
            &speech["model"],
            &speech["pool"],
            &speech["transcriptions"],
            &speech["audio_seconds"]
        ),
        (&json!("whisper"), &json!("cpu"), &json!(1), &json!(75.0)),
        "{status}"
    );
    let rtf = speech["real_time_factor"].as_f64().unwrap();
    let sum = sample(&metrics, &series("audio_real_time_factor_sum", ""));
    assert!((rtf - sum).abs() < 1e-9, "the mean of one: {rtf} vs {sum}");
    assert_eq!(
        status["speech"].as_array().unwrap().len(),
        1,
        "only the speech model: {status}"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_window_that_fails_on_the_device_is_decoded_again_on_the_cpu() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = failover_server(vramguard::testing::ADMIT_ALL).await;
    let fields = [("model", "whisper"), ("language", "en")];
    let (status, headers, at_rest) = send(&server, "/v1/audio/transcriptions", &fields, clip("gpu.mp3")).await;
    assert_eq!(status, StatusCode::OK, "{at_rest}");
    assert_eq!(headers["x-vramguard-pool"], "gpu");
    let response = server.post_json("/admin/sim/gpu0", &json!({"fail_next": 1})).await;
    assert_eq!(response.status(), StatusCode::OK);
    let (status, headers, moved) = send(&server, "/v1/audio/transcriptions", &fields, clip("gpu.mp3")).await;
    assert_eq!(status, StatusCode::OK, "{moved}");
    assert_eq!(headers["x-vramguard-pool"], "cpu", "retried on the fallback");
    assert_eq!(moved, at_rest, "the same text wherever it ran");
    // A long file whose first window moved and whose last ran on the device: degraded all the
    // same, though its pool is the device's.
    let (status, _, at_rest) = send(
        &server,
        "/v1/audio/transcriptions",
        &fields,
        clip("../whisper/audio/long-16k.wav"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{at_rest}");
    server.post_json("/admin/sim/gpu0", &json!({"fail_next": 1})).await;
    let (status, headers, moved) = send(
        &server,
        "/v1/audio/transcriptions",
        &fields,
        clip("../whisper/audio/long-16k.wav"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{moved}");
    assert_eq!(
        headers["x-vramguard-pool"], "gpu",
        "the windows after the first ran on the device"
    );
    assert!(headers.contains_key("x-vramguard-degraded"), "{headers:?}");
    assert_eq!(moved, at_rest);
    server.stop().await;
}

/// A server whose `gpu` pool, on a simulated device, falls back to `cpu`, under `policy`.
async fn failover_server(policy: &str) -> TestServer {
    TestServer::with_policy(
        &format!(
            "devices: [{{name: gpu0, kind: simulated, capacity: 512MiB}}]\n\
             models: [{{name: whisper, path: {WHISPER}}}]\n\
             pools:\n\
             - {{name: gpu, provider: simulated, device: gpu0, models: [whisper], fallback: cpu}}\n\
             - {{name: cpu, provider: cpu, models: [whisper]}}\n"
        ),
        policy,
    )
    .await
}

/// A stream's `data:` events, read.
fn events_of(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

/// The text its delta events add up to.
fn deltas_of(events: &[Value]) -> String {
    events
        .iter()
        .filter(|e| e["type"] == "transcript.text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect()
}

#[tokio::test]
async fn a_stream_says_in_its_events_where_a_later_window_ran() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = failover_server(vramguard::testing::ADMIT_ALL).await;
    let long = || clip("../whisper/audio/long-16k.wav");
    let fields = [("model", "whisper"), ("language", "en")];
    let (status, _, at_rest) = send(&server, "/v1/audio/transcriptions", &fields, long()).await;
    assert_eq!(status, StatusCode::OK, "{at_rest}");
    let at_rest: Value = serde_json::from_str(&at_rest).unwrap();
    // The first window fails on the device and is decoded again on the CPU pool: the headers
    // say so. The windows after it run on the device again, which only the events can say.
    server.post_json("/admin/sim/gpu0", &json!({"fail_next": 1})).await;
    let fields = [("model", "whisper"), ("language", "en"), ("stream", "true")];
    let (status, headers, body) = send(&server, "/v1/audio/transcriptions", &fields, long()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(headers["x-vramguard-pool"], "cpu", "the pool of its first window");
    assert!(headers.contains_key("x-vramguard-degraded"), "{headers:?}");
    let events = events_of(&body);
    assert_eq!(deltas_of(&events), at_rest["text"].as_str().unwrap(), "{body}");
    let moved: Vec<&Value> = events.iter().filter(|e| e.get("vramguard").is_some()).collect();
    let (first, done) = (moved[0], moved.last().unwrap());
    assert_eq!(first["type"], "transcript.text.delta", "{body}");
    assert_eq!(first["vramguard"]["pool"], "gpu", "{body}");
    assert_eq!(first["vramguard"]["simulated"], true, "{body}");
    assert_eq!(moved.len(), 2, "said once when it moved back, and at the end: {body}");
    assert_eq!(done["type"], "transcript.text.done", "{body}");
    assert_eq!(done["text"], at_rest["text"]);
    assert_eq!(done["vramguard"]["pool"], "gpu", "the pool of its last window: {body}");
    assert!(
        done["vramguard"]["degraded"].is_string(),
        "a window was served degraded: {body}"
    );
    // A stream whose windows all ran where its first did says nothing more.
    let (_, _, body) = send(&server, "/v1/audio/transcriptions", &fields, long()).await;
    let events = events_of(&body);
    assert!(events.iter().all(|e| e.get("vramguard").is_none()), "{body}");
    assert_eq!(deltas_of(&events), at_rest["text"].as_str().unwrap());
    server.stop().await;
}

#[tokio::test]
async fn a_stream_that_fails_after_its_text_began_says_how_much_audio_it_covers() {
    if crate::common::ran_in_own_process() {
        return;
    }
    // After an allocator failure the policy turns windows away: the first window, already
    // failed over, is sent; the second is refused, in the middle of the stream.
    let policy = "fn decide(req, state) {\n\
                  if state.pools[\"gpu\"].alloc_failures_recent > 0 { return reject(\"the accelerator failed a moment ago\"); }\n\
                  admit()\n}\n";
    let server = failover_server(policy).await;
    let long = || clip("../whisper/audio/long-16k.wav");
    let fields = [
        ("model", "whisper"),
        ("language", "en"),
        ("response_format", "verbose_json"),
    ];
    let (status, _, at_rest) = send(&server, "/v1/audio/transcriptions", &fields, long()).await;
    assert_eq!(status, StatusCode::OK, "{at_rest}");
    let at_rest: Value = serde_json::from_str(&at_rest).unwrap();
    let segments = at_rest["segments"].as_array().unwrap();
    // Where the second window starts (its seek, in frames of 10 ms), and the first's text.
    let second = segments
        .iter()
        .map(|s| s["seek"].as_u64().unwrap())
        .find(|&s| s > 0)
        .unwrap();
    let first_text: String = segments
        .iter()
        .filter(|s| s["seek"] == 0)
        .map(|s| s["text"].as_str().unwrap())
        .collect();
    server.post_json("/admin/sim/gpu0", &json!({"fail_next": 1})).await;
    let fields = [("model", "whisper"), ("language", "en"), ("stream", "true")];
    let (status, _, body) = send(&server, "/v1/audio/transcriptions", &fields, long()).await;
    assert_eq!(status, StatusCode::OK, "the stream began with its first window: {body}");
    let events = events_of(&body);
    assert_eq!(deltas_of(&events), first_text.trim_start(), "{body}");
    let last = events.last().unwrap();
    assert_eq!(last["type"], "error", "{body}");
    let error = &last["error"];
    assert_eq!(error["audio_seconds_done"], second as f64 / 100.0, "{body}");
    assert_eq!(error["audio_seconds"], at_rest["duration"], "{body}");
    assert!(error["request_id"].is_string(), "{body}");
    assert!(
        error["resume"].as_str().unwrap().contains("audio_seconds_done"),
        "{body}"
    );
    let message = error["message"].as_str().unwrap();
    assert!(message.contains("the accelerator failed a moment ago"), "{message}");
    assert!(message.contains("nothing was replayed"), "{message}");
    let metrics = server.metrics().await;
    assert_eq!(
        sample(
            &metrics,
            "vramguard_requests_total{model=\"whisper\",pool=\"\",outcome=\"rejected\"}"
        ),
        1.0,
        "counted once, as the policy's refusal (which no pool ran): {metrics}"
    );
    server.stop().await;
}

/// A request's fields, its file, and the field its 400 names and what its message says.
type Case<'a> = (Vec<(&'a str, &'a str)>, (&'a str, Vec<u8>), &'a str, &'a str);

#[tokio::test]
async fn what_is_wrong_with_a_request_is_named_in_its_400() {
    let server = TestServer::start(&cpu_server_yaml()).await;
    let path = "/v1/audio/transcriptions";
    let (bytes, mut corrupt) = (clip("gpu.mp3").1, clip("gpu-16k.wav").1);
    corrupt.truncate(40);
    let cases: Vec<Case> = vec![
        (
            vec![("model", "whisper")],
            ("notes.txt", b"plain text, not audio".to_vec()),
            "file",
            "not WAV, FLAC, MP3, Ogg, WebM or MP4 audio",
        ),
        (vec![("model", "whisper")], ("cut.wav", corrupt), "file", "file"),
        (
            vec![("model", "embed")],
            ("gpu.mp3", bytes.clone()),
            "model",
            "does not transcribe",
        ),
        (
            vec![("model", "whisper"), ("language", "xx")],
            ("gpu.mp3", bytes.clone()),
            "language",
            "xx",
        ),
    ];
    for (fields, file, param, says) in cases {
        let (status, _, body) = send(&server, path, &fields, file).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{fields:?}: {body}");
        let error: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(error["error"]["param"], param, "{body}");
        assert!(error["error"]["message"].as_str().unwrap().contains(says), "{body}");
    }
    let (status, _, body) = send(&server, path, &[("model", "nope")], ("gpu.mp3", bytes)).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    // The server is still there, and answers.
    let (status, _, body) = send(&server, path, &[("model", "whisper")], clip("gpu.ogg")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    server.stop().await;
}
