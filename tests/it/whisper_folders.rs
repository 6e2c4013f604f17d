//! Whisper folders at the edges of what `transformers` decodes, served end to end
//! (`models/speech/whisper-endless/`, made by `models/speech/whisper/make_variants.py` with its
//! references): a decoder that never ends a window, which `transformers` runs to `max_length`
//! and, where the window wrote pairs of timestamp tokens (nothing forbids them when timestamps
//! are not asked), cuts there and decodes another window from the last pair's time; and the same
//! folder without `max_length` and `no_timestamps_token_id` in its generation config, as older
//! exports are, which `transformers` runs without timestamps and within 20 new tokens.

use std::path::Path;

use reqwest::StatusCode;
use serde_json::Value;

use crate::common::TestServer;
use crate::transcriptions::send;

const ENDLESS: &str = "models/speech/whisper-endless";

/// `models/speech/whisper-endless/reference.json`.
fn reference() -> Value {
    let path = format!("{ENDLESS}/reference.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))).unwrap()
}

/// A server of the Whisper folder `folder` on the CPU.
async fn server(folder: &Path) -> TestServer {
    TestServer::start(&format!(
        "models: [{{name: whisper, path: '{}'}}]\npools: [{{name: cpu, provider: cpu, models: [whisper]}}]\n",
        folder.join("encoder_model.onnx").display()
    ))
    .await
}

/// The reference's clip, as a file to send.
fn clip(reference: &Value) -> (&'static str, Vec<u8>) {
    let path = format!("models/{}", reference["clip"].as_str().unwrap());
    (
        "clip.wav",
        std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}")),
    )
}

/// The text of a transcription in English as JSON, checked to be a 200.
async fn transcribed(server: &TestServer, file: (&str, Vec<u8>)) -> String {
    let fields = [("model", "whisper"), ("language", "en")];
    let (status, _, body) = send(server, "/v1/audio/transcriptions", &fields, file).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    answer["text"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn a_window_that_never_ends_is_cut_at_its_timestamp_pairs_as_transformers_cuts_it() {
    let reference = reference();
    let want = &reference["with_keys"];
    // What makes this case: more than one window from a clip of 30 s, each run to max_length.
    assert!(want["windows"].as_array().unwrap().len() > 1);
    let server = server(Path::new(ENDLESS)).await;
    let text = transcribed(&server, clip(&reference)).await;
    assert_eq!(text, want["text"].as_str().unwrap().trim());
    server.stop().await;
}

#[tokio::test]
async fn a_folder_without_max_length_or_no_timestamps_is_served_as_transformers_runs_it() {
    let reference = reference();
    let scratch = vramguard::testing::Scratch::new();
    for entry in std::fs::read_dir(ENDLESS).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, scratch.path().join(path.file_name().unwrap())).unwrap();
    }
    let config = scratch.path().join("generation_config.json");
    let mut generation: Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    for key in reference["removed_keys"].as_array().unwrap() {
        generation
            .as_object_mut()
            .unwrap()
            .remove(key.as_str().unwrap())
            .unwrap();
    }
    std::fs::write(&config, generation.to_string()).unwrap();
    let server = server(scratch.path()).await;
    let text = transcribed(&server, clip(&reference)).await;
    assert_eq!(text, reference["without_keys"]["text"].as_str().unwrap().trim());
    // Timestamps, which `transformers` refuses to decode for it, are refused naming the key:
    // asked for, or needed by audio over one window.
    let fields = [("model", "whisper"), ("response_format", "verbose_json")];
    let (status, _, body) = send(&server, "/v1/audio/transcriptions", &fields, clip(&reference)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("no `no_timestamps_token_id`"), "{body}");
    let long = std::fs::read("models/speech/whisper/audio/long-16k.wav").unwrap();
    let fields = [("model", "whisper")];
    let (status, _, body) = send(&server, "/v1/audio/transcriptions", &fields, ("long.wav", long)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("30 s at most"), "{body}");
    server.stop().await;
}
