//! Server overhead: the bundled encoder (seq 128, batch 1) run in-process on ONNX Runtime versus
//! the same request through vramguard's HTTP API on 127.0.0.1, in one run.
//!
//! `cargo bench --bench overhead [-- --seconds N]` prints median/p99 latency and saturated
//! throughput for both, the added latency per request and the throughput ratio. One inference
//! thread on both sides (one worker, one intra-op thread), so the comparison is like for like
//! and the second core is left to the HTTP stack and the client.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use vramguard::config::{Config, Provider, RawConfig, parse_yaml};
use vramguard::http::{self, AppState};
use vramguard::model::BuiltinModel;
use vramguard::onnx::{self, SessionOptions};
use vramguard::service::Service;
use vramguard::tensor::{Tensor, TensorData};

const SEQ: usize = 128;
const DIM: usize = 64;

fn input() -> Vec<f32> {
    (0..SEQ * DIM).map(|i| ((i % 13) as f32 - 6.0) * 0.05).collect()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

struct Stats {
    median: Duration,
    p99: Duration,
    per_second: f64,
}

fn summarize(mut samples: Vec<Duration>, throughput: f64) -> Stats {
    samples.sort();
    Stats {
        median: percentile(&samples, 0.5),
        p99: percentile(&samples, 0.99),
        per_second: throughput,
    }
}

/// In-process runs; `gap` idles between runs the way a server waits for its next request
/// (caches and the ONNX Runtime thread go cold), so the two baselines bracket the truth.
fn in_process(seconds: f64, gap: Duration) -> Stats {
    let rt = onnx::runtime(None).expect("ONNX Runtime (run `make deps`)");
    let options = SessionOptions {
        provider: Provider::Cpu,
        device_index: 0,
        intra_threads: 1,
        arena_shrinkage: false,
    };
    let mut session = onnx::build_session(rt, BuiltinModel::Encoder.bytes(), &options).unwrap();
    let data = input();
    let make = || Tensor {
        name: "input".into(),
        shape: vec![1, SEQ as i64, DIM as i64],
        data: TensorData::Fp32(data.clone()),
    };
    let wanted = vec!["pooled".to_string()];
    for _ in 0..50 {
        onnx::run(&mut session, vec![make()], &wanted, None).unwrap();
    }
    let mut samples = Vec::new();
    let started = Instant::now();
    while started.elapsed().as_secs_f64() < seconds {
        if !gap.is_zero() {
            std::thread::sleep(gap);
        }
        let t = Instant::now();
        onnx::run(&mut session, vec![make()], &wanted, None).unwrap();
        samples.push(t.elapsed());
    }
    let throughput = samples.len() as f64 / started.elapsed().as_secs_f64();
    summarize(samples, throughput)
}

fn binary_body() -> (String, Vec<u8>) {
    let header = json!({
        "inputs": [{"name": "input", "shape": [1, SEQ, DIM], "datatype": "FP32",
                    "parameters": {"binary_data_size": SEQ * DIM * 4}}],
        "outputs": [{"name": "pooled", "parameters": {"binary_data": true}}]
    })
    .to_string();
    let mut body = header.clone().into_bytes();
    input().iter().for_each(|v| body.extend_from_slice(&v.to_le_bytes()));
    (header, body)
}

fn json_body() -> Vec<u8> {
    json!({"inputs": [{"name": "input", "shape": [1, SEQ, DIM], "datatype": "FP32", "data": input()}],
           "outputs": [{"name": "pooled"}]})
    .to_string()
    .into_bytes()
}

async fn send(client: reqwest::Client, url: Arc<str>, header_len: Option<usize>, body: bytes::Bytes) {
    let mut request = client.post(&*url).body(body);
    if let Some(len) = header_len {
        request = request.header("Inference-Header-Content-Length", len);
    }
    let response = request.send().await.unwrap();
    assert!(response.status().is_success(), "{}", response.status());
    response.bytes().await.unwrap();
}

async fn over_http(url: &str, header_len: Option<usize>, body: Vec<u8>, seconds: f64, concurrency: usize) -> Stats {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()
        .unwrap();
    let body = bytes::Bytes::from(body);
    let url: Arc<str> = Arc::from(url);
    for _ in 0..50 {
        send(client.clone(), url.clone(), header_len, body.clone()).await;
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            while started.elapsed().as_secs_f64() < seconds {
                let t = Instant::now();
                send(client.clone(), url.clone(), header_len, body.clone()).await;
                samples.push(t.elapsed());
            }
            samples
        }));
    }
    let mut samples = Vec::new();
    for task in tasks {
        samples.extend(task.await.unwrap());
    }
    let throughput = samples.len() as f64 / started.elapsed().as_secs_f64();
    summarize(samples, throughput)
}

/// A minimal blocking HTTP/1.1 keep-alive client (the request bytes are built once), so the
/// figure is the server's and loopback's cost rather than a client library's.
fn raw_client(addr: std::net::SocketAddr, path: &str, header_len: usize, body: &[u8], seconds: f64) -> Stats {
    use std::io::{BufRead, BufReader, Read, Write};
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/octet-stream\r\n\
         inference-header-content-length: {header_len}\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    let stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_nodelay(true).unwrap();
    let mut writer = stream.try_clone().unwrap();
    let mut reader = BufReader::new(stream);
    let mut exchange = || {
        writer.write_all(&request).unwrap();
        let mut length = 0usize;
        let mut line = String::new();
        loop {
            line.clear();
            reader.read_line(&mut line).unwrap();
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap();
            }
            assert!(
                !line.starts_with("HTTP/1.1 ") || line.starts_with("HTTP/1.1 200"),
                "{line}"
            );
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).unwrap();
    };
    for _ in 0..50 {
        exchange();
    }
    let mut samples = Vec::new();
    let started = Instant::now();
    while started.elapsed().as_secs_f64() < seconds {
        let t = Instant::now();
        exchange();
        samples.push(t.elapsed());
    }
    let throughput = samples.len() as f64 / started.elapsed().as_secs_f64();
    summarize(samples, throughput)
}

fn print(label: &str, s: &Stats) {
    println!(
        "{label:<34} median {:>8.1} µs   p99 {:>8.1} µs   {:>8.0} req/s",
        s.median.as_secs_f64() * 1e6,
        s.p99.as_secs_f64() * 1e6,
        s.per_second
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seconds: f64 = args
        .iter()
        .position(|a| a == "--seconds")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0);
    println!("encoder seq {SEQ} batch 1, one inference thread each side, {seconds}s per measurement");

    let local = in_process(seconds, Duration::ZERO);
    print("in-process ONNX Runtime", &local);
    let idle = in_process(seconds.min(2.0), Duration::from_micros(200));
    print("in-process, 200 µs idle between runs", &idle);

    let raw: RawConfig = parse_yaml(
        "models: [{name: encoder, path: 'builtin:encoder'}]\n\
         pools: [{name: cpu, provider: cpu, models: [encoder], workers: 1, intra_threads: 1, queue: {capacity: 256}}]\n",
        "bench.yaml",
    )
    .unwrap();
    let config: Config = raw.validate("bench.yaml", Path::new(".")).unwrap();
    let service = Arc::new(Service::start(config).unwrap());
    // The server gets the runtime `vramguard serve` would have; the clients run on their own
    // single thread, so they do not borrow the server's workers.
    let server_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = server_runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let listener_addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = server_runtime.spawn(http::serve(AppState::new(service).unwrap(), listener, async {
        let _ = stopped.await;
    }));
    let client_runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    client_runtime.block_on(async {
        let url = format!("http://{listener_addr}/v2/models/encoder/infer");
        let health = url.replace("/v2/models/encoder/infer", "/v2/health/live");
        let client = reqwest::Client::new();
        let mut floor = Vec::new();
        for i in 0..3000 {
            let t = Instant::now();
            client.get(&health).send().await.unwrap().bytes().await.unwrap();
            if i >= 100 {
                floor.push(t.elapsed());
            }
        }
        let floor = summarize(floor, 0.0);
        println!(
            "{:<34} median {:>8.1} µs   (client + loopback TCP + routing, no work)",
            "reqwest floor: GET /v2/health/live",
            floor.median.as_secs_f64() * 1e6
        );
        let (header, body) = binary_body();
        let addr = listener_addr;
        let raw_body = body.clone();
        let header_length = header.len();
        let raw = tokio::task::spawn_blocking(move || {
            raw_client(addr, "/v2/models/encoder/infer", header_length, &raw_body, seconds)
        })
        .await
        .unwrap();
        print("HTTP, binary, raw keep-alive client", &raw);
        let binary = over_http(&url, Some(header.len()), body.clone(), seconds, 1).await;
        print("HTTP, binary tensors, reqwest", &binary);
        let json = over_http(&url, None, json_body(), seconds, 1).await;
        print("HTTP, JSON tensors, reqwest", &json);
        let saturated = over_http(&url, Some(header.len()), body, seconds, 4).await;
        print("HTTP, binary, reqwest, 4 clients", &saturated);

        let added = |s: &Stats| (s.median.as_secs_f64() - local.median.as_secs_f64()) * 1e6;
        println!();
        println!(
            "added median latency, binary, raw client: {:>7.1} µs (target ≤ 100 µs)",
            added(&raw)
        );
        println!("added median latency, binary, reqwest:    {:>7.1} µs", added(&binary));
        println!(
            "added median latency, binary, raw client, against the idle-gap baseline: {:>7.1} µs",
            (raw.median.as_secs_f64() - idle.median.as_secs_f64()) * 1e6
        );
        println!("added median latency, JSON, reqwest:      {:>7.1} µs", added(&json));
        println!(
            "saturated throughput: {:.0} req/s = {:.1}% of in-process {:.0} req/s (target ≥ 90%)",
            saturated.per_second,
            100.0 * saturated.per_second / local.per_second,
            local.per_second
        );
    });
    let _ = stop.send(());
    server_runtime.block_on(server).unwrap().unwrap();
}
