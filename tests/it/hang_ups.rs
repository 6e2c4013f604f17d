//! A `/v1/rerank` or `/v1/embeddings` request whose client hangs up while its texts are being
//! tokenized stops being worked on (issue 63: 100 documents with a 1 MB query kept a core busy
//! for 60 s after the client left). The real `vramguard serve` binary takes a request costing
//! tens of seconds of CPU to tokenize; once it has spent a second on it, still unanswered, the
//! client closes the connection, and the server's CPU time (`/proc/<pid>/stat`, its own process:
//! the texts are tokenized there, not in a pool's worker) must fall back to idle having grown
//! by less than a bound far below what the rest of the request would have cost.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use vramguard::testing::Scratch;
use vramguard::testing::process::Serving;

/// Spent on the request before the client hangs up: the tokenizing is under way.
const BEFORE_HANG_UP: Duration = Duration::from_secs(1);

/// The most CPU time the server may spend once the client has gone: the texts between two
/// checks of the flag cost milliseconds, and the idle server a few more each second; the rest
/// of either request costs over 10 s (measured on a debug build, 2 cores).
const AFTER_HANG_UP: Duration = Duration::from_millis(1500);

/// The server is idle once a window this long adds less than [`IDLE_GROWTH`] of CPU time. A
/// thread still tokenizing gets far more than that of a core in 2 s, even on a loaded machine.
const IDLE_WINDOW: Duration = Duration::from_secs(2);
const IDLE_GROWTH: Duration = Duration::from_millis(150);

/// A `vramguard serve` process serving the cross-encoder and an embedder on the CPU, ready.
async fn server() -> (Serving, Scratch) {
    let dir = Scratch::new();
    let root = env!("CARGO_MANIFEST_DIR");
    let config = dir.write(
        "config.yaml",
        format!(
            "models:\n\
             \x20 - {{name: rerank, path: {root}/models/embed/bert-cross-encoder/model.onnx}}\n\
             \x20 - {{name: mean, path: {root}/models/embed/bert-mean-normalize/model.onnx}}\n\
             pools: [{{name: cpu, provider: cpu, models: [rerank, mean]}}]\n\
             server: {{admin_socket: 'off'}}\n"
        ),
    );
    let serving = crate::common::spawn_serving(
        &["serve", "--config", config.to_str().unwrap(), "--listen", "127.0.0.1:0"],
        &[],
        "vramguard serving",
    );
    let client = reqwest::Client::new();
    let url = |path: &str| format!("http://{}{path}", serving.addr);
    // Serving once its models are read (before the port is bound). One small request of each
    // kind: what is set up on the first (sessions, the blocking pool's threads) is not counted
    // against a hang-up.
    for (path, body) in [
        (
            "/v1/rerank",
            json!({"model": "rerank", "query": "a", "documents": ["b"]}),
        ),
        ("/v1/embeddings", json!({"model": "mean", "input": "a"})),
    ] {
        let response = client.post(url(path)).json(&body).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{path}");
    }
    (serving, dir)
}

/// The CPU time (user and system) process `pid` has used, from `/proc/<pid>/stat`, whose
/// fields count ticks of 10 ms (`USER_HZ`, 100 on every architecture Linux runs).
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command's name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

/// `count` words of a few tokens each, none alike in a row.
fn words(count: usize) -> String {
    (0..count)
        .map(|i| format!("word{}", i * 7919 % 10_000))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Send `body` to `path` and hang up once the server has spent [`BEFORE_HANG_UP`] on it with
/// no answer; then wait until it is idle, and give the CPU time it spent after the hang-up.
async fn hang_up(serving: &Serving, path: &str, body: &Value) -> Duration {
    let pid = serving.child.id();
    let body = body.to_string();
    let mut stream = TcpStream::connect(&serving.addr).await.unwrap();
    let start = cpu_time(pid);
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        serving.addr,
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body.as_bytes()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while cpu_time(pid) - start < BEFORE_HANG_UP {
        assert!(Instant::now() < deadline, "{path}: the server never got busy");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Still working on it: nothing has come back yet (an answer would leave nothing to stop).
    let mut answer = [0; 64];
    match stream.try_read(&mut answer) {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        other => panic!(
            "{path}: answered before the hang-up ({other:?}: {}); the request is too cheap to test",
            String::from_utf8_lossy(&answer)
        ),
    }
    drop(stream);
    let gone = cpu_time(pid);
    // Sample until a whole window adds less than the idle growth, failing as soon as the time
    // spent since the hang-up passes the bound.
    let mut samples = vec![(Instant::now(), gone)];
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = (Instant::now(), cpu_time(pid));
        let after = now.1 - gone;
        assert!(
            after < AFTER_HANG_UP,
            "{path}: {} ms of CPU time spent since the client hung up, and counting",
            after.as_millis()
        );
        samples.push(now);
        let windowed = samples.iter().rev().find(|(at, _)| now.0 - *at >= IDLE_WINDOW);
        if let Some((_, then)) = windowed
            && now.1 - *then < IDLE_GROWTH
        {
            return after;
        }
    }
}

#[tokio::test]
async fn a_rerank_whose_client_hangs_up_stops_being_tokenized() {
    let (serving, _dir) = server().await;
    // 100,000 pairs with a query past the model's 128 positions: each is the query's tokens
    // cut to make room for its document's, and the pair's special tokens added (a body of
    // 1.9 MB whose pairs cost over 10 s of CPU on a debug build).
    let documents: Vec<String> = (0..100_000).map(|i| format!("document{i}")).collect();
    let body = json!({"model": "rerank", "query": words(20_000), "documents": documents, "truncate": true});
    let after = hang_up(&serving, "/v1/rerank", &body).await;
    eprintln!("rerank: {} ms of CPU after the hang-up", after.as_millis());
}

#[tokio::test]
async fn embeddings_whose_client_hangs_up_stop_being_tokenized() {
    let (serving, _dir) = server().await;
    // 3,000 texts of 600 words (5 KB), each read as far as the embedder's 512 tokens (a body
    // of 16 MB whose texts cost over 10 s of CPU on a debug build).
    let input = vec![words(600); 3_000];
    let body = json!({"model": "mean", "input": input, "truncate": true});
    let after = hang_up(&serving, "/v1/embeddings", &body).await;
    eprintln!("embeddings: {} ms of CPU after the hang-up", after.as_millis());
}
