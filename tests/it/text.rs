//! A generation's text over the wire when the answer is long: a 400-token answer sampled from
//! the decoder fixture, streamed, sends exactly the text of the whole answer, and a stop string
//! from late in it cuts both at the same place. (Multi-byte characters split across tokens,
//! which the fixture rarely samples, are checked on the tokenizer in `runtime::text`.)

use crate::common::TestServer;
use crate::generation::events;
use serde_json::{Value, json};

const CONFIG: &str = "\
models: [{name: tiny, path: 'builtin:decoder', tokenizer: 'builtin:decoder'}]
pools: [{name: cpu, provider: cpu, models: [tiny]}]
";

/// The whole answer's text and finish reason, and the streamed one's.
async fn both(server: &TestServer, request: &Value) -> ((String, Value), (String, Value)) {
    let whole: Value = server.post_json("/v1/completions", request).await.json().await.unwrap();
    let choice = &whole["choices"][0];
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let chunks = events(server.post_json("/v1/completions", &streamed).await).await;
    let text = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    let finish = chunks.last().unwrap()["choices"][0]["finish_reason"].clone();
    (
        (
            choice["text"].as_str().expect("a text").to_string(),
            choice["finish_reason"].clone(),
        ),
        (text, finish),
    )
}

#[tokio::test]
async fn a_long_sampled_answer_streams_exactly_its_whole_text_and_stops_at_the_same_place() {
    let server = TestServer::start(CONFIG).await;
    let request = json!({"model": "tiny", "prompt": "The GPU", "max_tokens": 400, "temperature": 1.0, "seed": 2});
    let (whole, streamed) = both(&server, &request).await;
    assert_eq!(whole.1, "length");
    assert_eq!(streamed, whole);
    assert!(whole.0.len() > 800, "{:?}", whole.0);

    // Four characters from late in it, as a stop string: both cut before its first
    // occurrence, which may be earlier than where it was taken from.
    let chars: Vec<(usize, char)> = whole.0.char_indices().collect();
    let (from, _) = chars[chars.len() * 3 / 5];
    let to = chars.get(chars.len() * 3 / 5 + 4).map_or(whole.0.len(), |c| c.0);
    let stop = &whole.0[from..to];
    let cut = whole.0.find(stop).unwrap();
    let mut request = request;
    request["stop"] = json!([stop]);
    let (whole_stopped, streamed_stopped) = both(&server, &request).await;
    assert_eq!(
        whole_stopped,
        (whole.0[..cut].to_string(), json!("stop")),
        "stop {stop:?}"
    );
    assert_eq!(streamed_stopped, whole_stopped);
    server.stop().await;
}
