//! Audio files whose headers lie, sent to `POST /v1/audio/transcriptions` over real HTTP
//! (issue 63): a WAV stating 0 Hz (Symphonia panicked, and the handler with it: the connection
//! closed with no answer), and WAVs stating rates whose prime factors made the FFT resampler
//! take gigabytes (4,294,967,295 Hz grew the server past 6 GB with no answer). Each is a 400
//! naming the rate, the server's peak memory hardly moves, and it serves the next request. A
//! WebM whose time-code scale is 0 (Symphonia's Matroska reader panics on it) is a 400 too. So
//! are MP4 files whose sample tables claim more entries than their boxes hold (Symphonia's MP4
//! reader reserves what they claim: 64 GiB for an `stsc` of 2^32-1 entries, and a refused
//! allocation aborts the whole server), whose boxes run past the file or are sized 0 or 1 where
//! that cannot be, or whose movie is nested 100,000 deep. And a long file, whose transcription
//! held its features whole and f64 copies of its samples besides (a two-hour file peaked at
//! 2.4 GB), then its samples (460 MB for two hours), holds its file and a window.

use reqwest::StatusCode;
use serde_json::Value;

use crate::common::TestServer;
use crate::transcriptions::{clip, cpu_server_yaml, form, send, sentences};

const PATH: &str = "/v1/audio/transcriptions";
const MIB: u64 = 1 << 20;

/// The resident memory of this process now, and the most it has held (since it started, or
/// since [`reset_peak`]): `VmRSS` and `VmHWM`. The test runs in a process of its own, so
/// they are the server's.
fn resident() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib = |key: &str| {
        let line = status.lines().find(|l| l.starts_with(key)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
    };
    (kib("VmRSS:"), kib("VmHWM:"))
}

/// Start this process' peak over from what it holds now (`clear_refs` 5): what the test made
/// and let go of before is not in the peak measured after.
fn reset_peak() {
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
}

/// A second of 16-bit mono silence (32 KB) whose `fmt` chunk states `rate`.
fn claiming(rate: u32) -> Vec<u8> {
    let mut file = vramguard::runtime::audio::wav(&vec![0; 16_000], 16_000, 1);
    file[24..28].copy_from_slice(&rate.to_le_bytes());
    file
}

#[tokio::test]
async fn a_wav_stating_a_rate_outside_the_served_range_is_a_400_naming_it() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(&cpu_server_yaml()).await;
    let model = [("model", "whisper")];
    // One transcription first: the model's sessions are part of the baseline.
    let (status, _, body) = send(&server, PATH, &model, clip("gpu-16k.wav")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let before = resident().1;
    for rate in [0, 4_294_967_295, 2_147_483_649, 4_294_967_291, 16_777_259] {
        let (status, _, body) = send(&server, PATH, &model, ("lies.wav", claiming(rate))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{rate} Hz: {body}");
        let error: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(error["error"]["param"], "file", "{body}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("sample rate is {rate} Hz")) && message.contains("8000 to 384000 Hz"),
            "{message}"
        );
    }
    // 16,777,259 Hz alone cost 1.9 GB; refused from the header, all of them cost nothing
    // measurable (a few MiB of noise from the test's own allocations).
    let grown = resident().1.saturating_sub(before);
    assert!(grown < 128 * MIB, "the peak grew by {} MiB", grown / MIB);
    let mut webm = clip("gpu.webm").1;
    let scale = webm.windows(4).position(|w| w == [0x2a, 0xd7, 0xb1, 0x83]).unwrap() + 4;
    webm[scale..scale + 3].copy_from_slice(&[0; 3]);
    let (status, _, body) = send(&server, PATH, &model, ("scale.webm", webm)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("the audio could not be decoded"), "{body}");
    let (status, _, body) = send(&server, PATH, &model, clip("gpu.webm")).await;
    assert_eq!(status, StatusCode::OK, "the server still serves: {body}");
    server.stop().await;
}

#[tokio::test]
async fn a_long_transcription_holds_its_file_and_a_window_not_its_samples_or_features() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(&cpu_server_yaml()).await;
    let fields = [("model", "whisper"), ("language", "en"), ("stream", "true")];
    let (status, _, body) = send(&server, PATH, &fields[..2], clip("gpu-16k.wav")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // 13 minutes, the longest 16 kHz WAV under the 25 MiB limit: 48 MiB of samples.
    let file = vramguard::runtime::audio::wav(&sentences(13 * 60), 16_000, 1);
    let (content_type, body) = form(&fields, ("long.wav", file));
    reset_peak();
    let (before, _) = resident();
    let mut response = reqwest::Client::new()
        .post(server.url(PATH))
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    // The features of every window come from the samples the same way: the memory is taken
    // by the time the second window is out (the whole transcription takes minutes in a debug
    // build; its windows hold nothing more).
    let mut events = String::new();
    while events.matches("transcript.text.delta").count() < 2 {
        let chunk = response.chunk().await.unwrap().expect("the stream goes on");
        events.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    drop(response);
    // Its file (24 MiB) and a window's samples and features (a few MiB) are held while it is
    // transcribed, beside the request's body on its way in and a window's run: the peak grew
    // by 114 MiB. The whole audio's features and the f64 copies of its samples they were
    // computed from grew it by 254 MiB; its samples (48 MiB) held whole, by 136 MiB.
    let grown = resident().1.saturating_sub(before);
    assert!(grown < 160 * MIB, "the peak grew by {} MiB", grown / MIB);
    server.stop().await;
}

/// The clip `name` with the 32-bit field `field` bytes into its first box of type `kind` set
/// to `value`.
fn forged(name: &str, kind: &[u8; 4], field: usize, value: u32) -> (&'static str, Vec<u8>) {
    let mut file = clip(name).1;
    let at = file.windows(4).position(|w| w == kind).unwrap() - 4;
    file[at + field..at + field + 4].copy_from_slice(&value.to_be_bytes());
    ("forged.m4a", file)
}

#[tokio::test]
async fn a_forged_mp4_is_a_400_naming_the_file_and_costs_nothing() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(&cpu_server_yaml()).await;
    let model = [("model", "whisper")];
    let (status, _, body) = send(&server, PATH, &model, clip("gpu.m4a")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    reset_peak();
    let (before, _) = resident();
    let ftyp = clip("gpu.m4a").1[..28].to_vec();
    let mut nested = ftyp.clone();
    for level in 0..100_000u32 {
        nested.extend_from_slice(&((100_000 - level) * 8).to_be_bytes());
        nested.extend_from_slice(b"moov");
    }
    let cases = [
        // Counts (after the size, type and version: at 12, or at 16 after `stsz`'s constant
        // packet size).
        (forged("gpu.m4a", b"stsz", 16, u32::MAX), "`stsz`"),
        (forged("gpu.m4a", b"stco", 12, 1 << 30), "`stco`"),
        (forged("gpu.m4a", b"stsc", 12, u32::MAX), "`stsc`"),
        (forged("gpu.m4a", b"stts", 12, u32::MAX), "`stts`"),
        // Sizes: past the file, 0 inside the movie, 1 (a 64-bit size follows, here 0).
        (forged("gpu.m4a", b"moov", 0, u32::MAX), "`moov`"),
        (forged("gpu.m4a", b"stsz", 0, 0), "`stsz`"),
        (forged("gpu.m4a", b"stsz", 0, 1), "`stsz`"),
        (("nested.m4a", nested), "has no track"),
        // A fragment's run, as Safari records: 2^32-1 packet sizes in 208 bytes.
        (forged("gpu.mp4", b"trun", 12, u32::MAX), "`trun`"),
    ];
    for ((name, file), names) in cases {
        let started = std::time::Instant::now();
        let (status, _, body) = send(&server, PATH, &model, (name, file)).await;
        println!("{names}: answered in {:?}", started.elapsed());
        assert_eq!(status, StatusCode::BAD_REQUEST, "{names}: {body}");
        let error: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(error["error"]["param"], "file", "{body}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("could not be decoded: its MP4") && message.contains(names),
            "{message}"
        );
    }
    // Refused from their boxes before Symphonia reserves anything.
    let grown = resident().1.saturating_sub(before);
    println!("the peak grew by {} MiB", grown / MIB);
    assert!(grown < 128 * MIB, "the peak grew by {} MiB", grown / MIB);
    let (status, _, body) = send(&server, PATH, &model, clip("gpu.m4a")).await;
    assert_eq!(status, StatusCode::OK, "the server still serves: {body}");
    server.stop().await;
}
