use super::*;

/// A segment spanning `start` to `end` with `text`, its other numbers distinct so a field
/// written from the wrong one shows.
fn segment(id: usize, start: f64, end: f64, text: &str) -> Segment {
    Segment {
        id,
        seek: 3000 * id as u64,
        start,
        end,
        text: text.to_string(),
        tokens: vec![50364 + id as u32, 440, 7534, 50530],
        temperature: 0.2,
        avg_logprob: -0.25 - id as f64,
        compression_ratio: 1.25 + id as f64,
        no_speech_prob: 0.01 * (id + 1) as f64,
    }
}

fn transcript(segments: Vec<Segment>, duration: f64) -> Transcript {
    Transcript {
        text: segments.iter().map(|s| s.text.as_str()).collect(),
        language: "german".into(),
        duration,
        segments,
        task: Task::Transcribe,
    }
}

/// The three segments the subtitle tests write: one with a line break and an arrow, one with
/// no text (no cue), one past the hour.
fn three() -> Vec<Segment> {
    vec![
        segment(0, 0.0, 59.9996, " Hello --> there,\n\n  <world> & co."),
        segment(1, 59.9996, 61.0, "   "),
        segment(2, 3599.9995, 3600.02, " The end."),
    ]
}

async fn body_of(response: Response) -> (String, String) {
    let kind = response.headers()[header::CONTENT_TYPE].to_str().unwrap().to_string();
    let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
    (kind, String::from_utf8(body.to_vec()).unwrap())
}

/// Whisper's `format_timestamp` (Python's `round`, half to even) gives these, computed with it:
/// a time that rounds up carries into the minute and the hour.
#[test]
fn timestamps_round_to_the_millisecond_as_whisper_rounds_them() {
    let cases = [
        (0.0, "00:00:00,000"),
        (0.0005, "00:00:00,000"),
        (0.0015, "00:00:00,002"),
        (1.2345, "00:00:01,234"),
        (59.9994, "00:00:59,999"),
        (59.9995, "00:01:00,000"),
        (59.9996, "00:01:00,000"),
        (3599.9995, "01:00:00,000"),
        (3600.0, "01:00:00,000"),
        (3600.02, "01:00:00,020"),
        (36000.5, "10:00:00,500"),
        (-0.5, "00:00:00,000"),
    ];
    for (seconds, want) in cases {
        assert_eq!(timestamp(seconds, ','), want, "{seconds}");
    }
    assert_eq!(timestamp(3600.02, '.'), "01:00:00.020");
}

#[tokio::test]
async fn srt_numbers_its_cues_and_keeps_each_cue_whole() {
    let (kind, body) = body_of(answer(&transcript(three(), 3600.02), Format::Srt)).await;
    assert_eq!(kind, "text/plain; charset=utf-8");
    assert_eq!(
        body,
        "1\n00:00:00,000 --> 00:01:00,000\nHello -> there,\n<world> & co.\n\n\
         2\n01:00:00,000 --> 01:00:00,020\nThe end.\n\n"
    );
}

#[tokio::test]
async fn vtt_has_its_header_and_escapes_what_its_cue_text_may_not_hold() {
    let (kind, body) = body_of(answer(&transcript(three(), 3600.02), Format::Vtt)).await;
    assert_eq!(kind, "text/plain; charset=utf-8");
    assert_eq!(
        body,
        "WEBVTT\n\n\
         00:00:00.000 --> 00:01:00.000\nHello --&gt; there,\n&lt;world&gt; &amp; co.\n\n\
         01:00:00.000 --> 01:00:00.020\nThe end.\n\n"
    );
}

#[tokio::test]
async fn json_and_text_give_the_text_trimmed_and_json_the_seconds_rounded_up() {
    let t = transcript(
        vec![segment(0, 0.0, 8.0, " Hello."), segment(1, 8.0, 8.47, " Bye.")],
        8.47,
    );
    let (kind, body) = body_of(answer(&t, Format::Json)).await;
    assert_eq!(kind, "application/json");
    assert_eq!(
        body,
        r#"{"text":"Hello. Bye.","usage":{"type":"duration","seconds":9}}"#
    );
    let (kind, body) = body_of(answer(&t, Format::Text)).await;
    assert_eq!(
        (kind.as_str(), body.as_str()),
        ("text/plain; charset=utf-8", "Hello. Bye.\n")
    );
}

#[tokio::test]
async fn verbose_json_has_every_field_the_sdk_reads_for_each_segment() {
    let t = transcript(
        vec![segment(0, 0.0, 3.32, " Hallo."), segment(1, 3.32, 5.0, " Welt.")],
        5.0,
    );
    let (kind, body) = body_of(answer(&t, Format::VerboseJson)).await;
    assert_eq!(kind, "application/json");
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        body,
        json!({
            "task": "transcribe", "language": "german", "duration": 5.0, "text": "Hallo. Welt.",
            "segments": [
                {"id": 0, "seek": 0, "start": 0.0, "end": 3.32, "text": " Hallo.",
                 "tokens": [50364, 440, 7534, 50530], "temperature": 0.2, "avg_logprob": -0.25,
                 "compression_ratio": 1.25, "no_speech_prob": 0.01},
                {"id": 1, "seek": 3000, "start": 3.32, "end": 5.0, "text": " Welt.",
                 "tokens": [50365, 440, 7534, 50530], "temperature": 0.2, "avg_logprob": -1.25,
                 "compression_ratio": 2.25, "no_speech_prob": 0.02},
            ],
            "usage": {"type": "duration", "seconds": 5},
        })
    );
}

#[tokio::test]
async fn a_translation_says_so_and_its_language_is_english() {
    let mut t = transcript(vec![segment(0, 0.0, 1.0, " Hello.")], 1.0);
    t.task = Task::Translate;
    let (_, body) = body_of(answer(&t, Format::VerboseJson)).await;
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (&body["task"], &body["language"]),
        (&json!("translate"), &json!("english"))
    );
}

/// Silence transcribes to nothing: every format still answers, and the subtitles have no cue.
#[tokio::test]
async fn an_empty_transcript_answers_in_every_format() {
    let t = transcript(Vec::new(), 0.0);
    let mut bodies = Vec::new();
    for format in Format::ALL {
        bodies.push(body_of(answer(&t, format)).await.1);
    }
    let verbose: Value = serde_json::from_str(&bodies[3]).unwrap();
    assert_eq!(
        bodies[..3],
        [r#"{"text":"","usage":{"type":"duration","seconds":0}}"#, "\n", ""]
    );
    assert_eq!((&verbose["text"], &verbose["segments"]), (&json!(""), &json!([])));
    assert_eq!(bodies[4], "WEBVTT\n\n");
}

#[test]
fn formats_are_named_as_response_format_names_them() {
    for format in Format::ALL {
        assert_eq!(Format::named(format.name()), Some(format));
    }
    assert_eq!(Format::named("diarized_json"), None);
    let timed: Vec<&str> = Format::ALL
        .into_iter()
        .filter(|f| f.timestamps())
        .map(Format::name)
        .collect();
    assert_eq!(timed, ["srt", "verbose_json", "vtt"]);
}

/// The events as the client reads them: `data:` lines of JSON with the `type` the SDK tells
/// them apart by.
#[tokio::test]
async fn the_stream_events_are_openais() {
    use axum::response::sse::Sse;
    let t = transcript(vec![segment(0, 0.0, 1.0, " Hi there.")], 1.0);
    let events = [
        delta_event(" Hi", None),
        delta_event(" there.", None),
        done_event(&t, None),
    ];
    let stream = futures_util::stream::iter(events.map(Ok::<_, std::convert::Infallible>));
    let (kind, body) = body_of(Sse::new(stream).into_response()).await;
    assert_eq!(kind, "text/event-stream");
    assert_eq!(
        body,
        "data: {\"type\":\"transcript.text.delta\",\"delta\":\" Hi\"}\n\n\
         data: {\"type\":\"transcript.text.delta\",\"delta\":\" there.\"}\n\n\
         data: {\"type\":\"transcript.text.done\",\"text\":\"Hi there.\"}\n\n"
    );
}
