//! Slow, idle and greedy clients against a real server: each connection limit closes or refuses
//! the client it is meant for, within its timeout, while other clients are served meanwhile.
//!
//! The misbehaving clients are raw TCP streams: an HTTP client library does not stall on
//! purpose. Time is bounded from below exactly (nothing closes before its timeout: a loaded
//! machine is late, never early) and from above with a generous margin.

use std::time::{Duration, Instant};

use crate::common::{TestServer, encoder_binary_request};
use reqwest::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How late a limit may act on a loaded machine and still pass.
const MARGIN: Duration = Duration::from_secs(20);

fn config(server: &str) -> String {
    format!(
        "server:\n{server}\
         models: [{{name: encoder, path: 'builtin:encoder', context: {{input: input, axis: 1}}}}]\n\
         pools: [{{name: cpu, provider: cpu, models: [encoder], workers: 1}}]\n"
    )
}

async fn connect(server: &TestServer) -> TcpStream {
    TcpStream::connect(server.addr).await.unwrap()
}

/// Everything the server sends until it closes the connection (a reset counts as closed), and
/// when it closed; fails if it is still open after `within`.
async fn read_until_closed(stream: &mut TcpStream, within: Duration) -> (String, Instant) {
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut chunk)).await {
            Err(_) => panic!(
                "still open after {within:?}; received: {}",
                String::from_utf8_lossy(&received)
            ),
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&received).into_owned(), Instant::now()),
            Ok(Ok(n)) => received.extend_from_slice(&chunk[..n]),
        }
    }
}

/// One response (head and `content-length` body), leaving the connection open.
async fn read_response(stream: &mut TcpStream) -> String {
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&received).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let length: usize = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if received.len() >= end + 4 + length {
                return text;
            }
        }
        let n = tokio::time::timeout(MARGIN, stream.read(&mut chunk))
            .await
            .expect("a response in time")
            .unwrap();
        assert!(n > 0, "closed mid-response: {text}");
        received.extend_from_slice(&chunk[..n]);
    }
}

fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: vramguard\r\n\r\n")
}

fn limit_hits(metrics: &str, limit: &str) -> u64 {
    let series = format!("vramguard_http_limit_hits_total{{limit=\"{limit}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&series))
        .unwrap_or_else(|| panic!("no {series}in:\n{metrics}"))
        .parse()
        .unwrap()
}

/// Other clients get their answers: an inference and a health check, each on a new connection.
async fn others_are_served(server: &TestServer) {
    let response = server.encoder(16).await;
    assert_eq!(response.status(), StatusCode::OK, "{:?}", response.text().await);
    let live = reqwest::get(server.url("/v2/health/live")).await.unwrap();
    assert_eq!(live.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_stalled_header_and_a_stalled_body_are_closed_while_others_are_served() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let timeout = Duration::from_secs(1);
    let server = TestServer::start(&config("  timeouts: {header_read: 1s, body_read: 1s, idle: 60s}\n")).await;

    let head_started = Instant::now();
    let mut head = connect(&server).await;
    head.write_all(b"POST /v2/models/encoder/infer HTTP/1.1\r\nHost: vramguard\r\nContent-Le")
        .await
        .unwrap();
    let mut body = connect(&server).await;
    body.write_all(
        b"POST /v2/models/encoder/infer HTTP/1.1\r\nHost: vramguard\r\nx-request-id: stalled-body\r\n\
          Content-Length: 1000\r\n\r\n{\"inputs\": [",
    )
    .await
    .unwrap();
    let body_stalled = Instant::now();

    for _ in 0..3 {
        others_are_served(&server).await;
    }

    let (answer, closed) = read_until_closed(&mut head, timeout + MARGIN).await;
    assert_eq!(answer, "", "a header that never completes gets no answer");
    assert!(
        closed - head_started >= timeout,
        "closed after {:?}",
        closed - head_started
    );

    let (answer, closed) = read_until_closed(&mut body, timeout + MARGIN).await;
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    assert!(answer.contains("\r\nconnection: close\r\n"), "{answer}");
    assert!(answer.contains("\r\nx-request-id: stalled-body\r\n"), "{answer}");
    assert!(answer.contains("server.timeouts.body_read (1s)"), "{answer}");
    assert!(
        closed - body_stalled >= timeout,
        "closed after {:?}",
        closed - body_stalled
    );

    others_are_served(&server).await;
    let metrics = server.metrics().await;
    assert_eq!(limit_hits(&metrics, "header_timeout"), 1);
    assert_eq!(limit_hits(&metrics, "body_timeout"), 1);
    assert_eq!(limit_hits(&metrics, "idle_timeout"), 0);
    server.stop().await;
}

#[tokio::test]
async fn an_idle_connection_outlives_the_header_timeout_and_closes_at_the_idle_timeout() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let idle = Duration::from_secs(6);
    let server = TestServer::start(&config("  timeouts: {header_read: 1s, idle: 6s}\n")).await;
    let mut client = connect(&server).await;
    client.write_all(get("/v2/health/live").as_bytes()).await.unwrap();
    assert!(read_response(&mut client).await.starts_with("HTTP/1.1 200 "));

    // Idle for longer than the header timeout: the header clock only starts with a request.
    tokio::time::sleep(Duration::from_secs(2)).await;
    client.write_all(get("/v2/health/live").as_bytes()).await.unwrap();
    assert!(read_response(&mut client).await.starts_with("HTTP/1.1 200 "));
    let answered = Instant::now();

    let (rest, closed) = read_until_closed(&mut client, idle + MARGIN).await;
    assert_eq!(rest, "", "an idle connection is closed without a word");
    // The server's idle clock starts as its answer leaves, a moment before it arrives here.
    assert!(closed - answered >= idle / 2, "closed after {:?}", closed - answered);

    let metrics = server.metrics().await;
    assert_eq!(limit_hits(&metrics, "idle_timeout"), 1);
    assert_eq!(limit_hits(&metrics, "header_timeout"), 0);
    server.stop().await;
}

#[tokio::test]
async fn connections_over_the_cap_wait_for_a_slot_and_are_served_once_one_closes() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(&config(
        "  max_connections: 2\n  timeouts: {header_read: 60s, idle: 60s}\n",
    ))
    .await;
    let mut first = connect(&server).await;
    let mut second = connect(&server).await;
    for client in [&mut first, &mut second] {
        client.write_all(get("/v2/health/live").as_bytes()).await.unwrap();
        assert!(read_response(client).await.starts_with("HTTP/1.1 200 "));
    }

    let mut third = connect(&server).await;
    third.write_all(get("/v2/health/live").as_bytes()).await.unwrap();
    let mut byte = [0u8; 1];
    assert!(
        tokio::time::timeout(Duration::from_millis(500), third.read(&mut byte))
            .await
            .is_err(),
        "a third connection is not served while two are open"
    );

    drop(first);
    assert!(read_response(&mut third).await.starts_with("HTTP/1.1 200 "));
    drop(third);

    let metrics = server.metrics().await;
    assert!(limit_hits(&metrics, "max_connections") >= 1, "{metrics}");
    // `second` and the scrape's own connection: the cap holds.
    assert_eq!(crate::common::gauge(&metrics, "vramguard_http_connections"), 2.0);
    drop(second);
    server.stop().await;
}

#[tokio::test]
async fn a_declared_length_over_the_body_limit_gets_413_before_any_body_is_sent() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(&config("  body_limit: 64KiB\n  timeouts: {body_read: 60s}\n")).await;
    // With `Expect: 100-continue` (curl sends it for large bodies) the client learns it need
    // not send the body at all: no 100 comes first.
    for expect in ["", "Expect: 100-continue\r\n"] {
        let mut client = connect(&server).await;
        client
            .write_all(
                format!(
                    "POST /v2/models/encoder/infer HTTP/1.1\r\nHost: vramguard\r\n{expect}\
                     Content-Length: 10000000\r\n\r\n"
                )
                .as_bytes(),
            )
            .await
            .unwrap();
        // The body never comes and body_read is a minute: an answer now did not wait for it.
        let (answer, _) = read_until_closed(&mut client, MARGIN).await;
        assert!(answer.starts_with("HTTP/1.1 413 "), "{expect:?}: {answer}");
        assert!(answer.contains("\r\nconnection: close\r\n"), "{answer}");
        assert!(
            answer.contains("request body exceeds the 65536 byte limit (server.body_limit)"),
            "{answer}"
        );
    }
    let metrics = server.metrics().await;
    assert_eq!(limit_hits(&metrics, "body_limit"), 2);
    // Answers to inference requests, counted as every other answer is.
    assert_eq!(
        crate::common::sample(
            &metrics,
            "vramguard_requests_total{model=\"encoder\",pool=\"\",outcome=\"client_error\"}"
        ),
        2.0,
        "{metrics}"
    );
    server.stop().await;
}

/// A 38 KiB encoder request being received by a server that may receive 64 KiB at once: its
/// head sent (with `Expect: 100-continue`, whose 100 Continue says the server reads this body,
/// its bytes reserved) and half its body.
struct Held {
    slow: TcpStream,
    /// The request's head, to send the same request again.
    head: String,
    header: String,
    body: Vec<u8>,
}

async fn half_a_body_held() -> (TestServer, Held) {
    let server = TestServer::start(&config(
        "  body_limit: 64KiB\n  max_receiving_bytes: 64KiB\n  timeouts: {body_read: 60s}\n",
    ))
    .await;
    let (header, body) = encoder_binary_request(150);
    let head = format!(
        "POST /v2/models/encoder/infer HTTP/1.1\r\nHost: vramguard\r\nContent-Length: {}\r\n\
         Inference-Header-Content-Length: {}\r\nExpect: 100-continue\r\n\r\n",
        body.len(),
        header.len()
    );
    let mut slow = connect(&server).await;
    slow.write_all(head.as_bytes()).await.unwrap();
    assert!(read_response(&mut slow).await.starts_with("HTTP/1.1 100 "));
    slow.write_all(&body[..body.len() / 2]).await.unwrap();
    let held = Held {
        slow,
        head,
        header,
        body,
    };
    (server, held)
}

/// A chunked body declares no length: it reserves as it arrives, and one that runs over what
/// may be received at once is refused part-way with 503, counted as the 503 it is answered with.
#[tokio::test]
async fn a_chunked_body_that_runs_over_the_receiving_budget_gets_503_counted_rejected() {
    if crate::common::ran_in_own_process() {
        return;
    }
    // 38 KiB of the 64 held by a body that is being received.
    let (
        server,
        Held {
            mut slow, header, body, ..
        },
    ) = half_a_body_held().await;

    // The same request chunked: its bytes do not fit beside the other's.
    let mut chunked = connect(&server).await;
    chunked
        .write_all(
            format!(
                "POST /v2/models/encoder/infer HTTP/1.1\r\nHost: vramguard\r\n\
                 Transfer-Encoding: chunked\r\nInference-Header-Content-Length: {}\r\n\r\n{:x}\r\n",
                header.len(),
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    chunked.write_all(&body).await.unwrap();
    chunked.write_all(b"\r\n0\r\n\r\n").await.unwrap();
    let (answer, _) = read_until_closed(&mut chunked, MARGIN).await;
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    assert!(answer.contains("server.max_receiving_bytes (64KiB)"), "{answer}");
    // An OpenAI request the same way: its model is in the body it never read.
    let prompt = format!("{{\"model\": \"tiny\", \"prompt\": \"{}\"}}", "a".repeat(40 << 10));
    let mut openai = connect(&server).await;
    openai
        .write_all(
            format!(
                "POST /v1/completions HTTP/1.1\r\nHost: vramguard\r\nContent-Type: application/json\r\n\
                 Transfer-Encoding: chunked\r\n\r\n{:x}\r\n{prompt}\r\n0\r\n\r\n",
                prompt.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let (answer, _) = read_until_closed(&mut openai, MARGIN).await;
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");

    slow.write_all(&body[body.len() / 2..]).await.unwrap();
    assert!(read_response(&mut slow).await.starts_with("HTTP/1.1 200 "));
    let metrics = server.metrics().await;
    assert_eq!(limit_hits(&metrics, "body_bytes"), 2);
    assert_eq!(
        crate::common::sample(
            &metrics,
            "vramguard_requests_total{model=\"\",pool=\"\",outcome=\"rejected\"}"
        ),
        1.0,
        "{metrics}"
    );
    let counted = |outcome: &str| {
        crate::common::sample(
            &metrics,
            &format!("vramguard_requests_total{{model=\"encoder\",pool=\"\",outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!((counted("rejected"), counted("client_error")), (1.0, 0.0), "{metrics}");
    server.stop().await;
}

#[tokio::test]
async fn bodies_beyond_the_receiving_budget_get_503_with_retry_after_until_it_frees() {
    if crate::common::ran_in_own_process() {
        return;
    }
    // 38 KiB each: one fits in the 64 KiB being received at once, two do not.
    let (
        server,
        Held {
            mut slow, head, body, ..
        },
    ) = half_a_body_held().await;

    let mut refused = connect(&server).await;
    refused.write_all(head.as_bytes()).await.unwrap();
    let (answer, _) = read_until_closed(&mut refused, MARGIN).await;
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    assert!(answer.contains("\r\nretry-after: 1\r\n"), "{answer}");
    assert!(answer.contains("server.max_receiving_bytes (64KiB)"), "{answer}");

    slow.write_all(&body[body.len() / 2..]).await.unwrap();
    assert!(read_response(&mut slow).await.starts_with("HTTP/1.1 200 "));
    // Received in full, its reservation is free again.
    let response = server.encoder(150).await;
    assert_eq!(response.status(), StatusCode::OK);

    let metrics = server.metrics().await;
    assert_eq!(limit_hits(&metrics, "body_bytes"), 1);
    assert_eq!(
        crate::common::sample(
            &metrics,
            "vramguard_requests_total{model=\"encoder\",pool=\"\",outcome=\"rejected\"}"
        ),
        1.0,
        "{metrics}"
    );
    server.stop().await;
}

/// A multipart request answered 400 before its file is read (a field refused by name comes
/// first), sent again and again on one keep-alive connection, as a client's loop sends it:
/// every answer reaches the client. The server closes such a connection cleanly (it says
/// `Connection: close`, then reads what is still coming before it closes the socket), so no
/// answer is lost to a reset and no next request goes out on a connection about to close.
#[tokio::test]
async fn an_early_answer_to_a_multipart_body_reaches_the_client_every_time() {
    let server = TestServer::start(&config("  timeouts: {body_read: 60s}\n")).await;
    // One connection at a time, reused while the server keeps it open.
    let client = reqwest::Client::builder().pool_max_idle_per_host(1).build().unwrap();
    let (kind, body) = crate::transcriptions::form(&[("include[]", "logprobs")], ("a.wav", vec![0; 4 << 20]));
    for i in 0..64 {
        let response = client
            .post(server.url("/v1/audio/transcriptions"))
            .header(reqwest::header::CONTENT_TYPE, &kind)
            .body(body.clone())
            .send()
            .await
            .unwrap_or_else(|e| panic!("request {i}: {e:?}"));
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "request {i}");
        assert_eq!(response.headers()[reqwest::header::CONNECTION], "close", "request {i}");
        let error: serde_json::Value = response.json().await.unwrap_or_else(|e| panic!("request {i}: {e:?}"));
        assert_eq!(error["error"]["param"], "include", "request {i}: {error}");
    }
    // A body read whole keeps its connection open.
    let (kind, body) = crate::transcriptions::form(&[("model", "absent")], ("a.wav", vec![0; 1 << 10]));
    let whole = client
        .post(server.url("/v1/audio/transcriptions"))
        .header(reqwest::header::CONTENT_TYPE, &kind)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(whole.status(), StatusCode::NOT_FOUND);
    assert!(whole.headers().get(reqwest::header::CONNECTION).is_none(), "{whole:?}");
    server.stop().await;
}
