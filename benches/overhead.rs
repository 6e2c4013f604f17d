//! Server overhead: the bundled encoder (seq 128, batch 1) run in-process on ONNX Runtime versus
//! the same request sent to a real `vramguard serve` process over loopback HTTP, with binary
//! tensors (the Open Inference Protocol binary data extension, as Triton's client sends them).
//!
//! `cargo bench --bench overhead [-- --seconds N]` (`make bench` installs wrk first).
//!
//! The load generator is wrk, a separate process: the client shares neither the server's async
//! runtime nor its threads, the way Triton's perf_analyzer measures and users' clients run. The
//! server is the release binary with the embedded default policy, so every request is admitted by
//! the same policy evaluation as in production. One inference thread on both sides (one worker,
//! one intra-op thread), so the comparison is like for like. The in-process baseline runs before
//! the server starts, so the two never compete for cores.
//!
//! Only the bundled model and ONNX Runtime session functions of the library are used here
//! (`in_process`); the server is driven through its command line and HTTP API alone.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use vramguard::config::Provider;
use vramguard::model::BuiltinModel;
use vramguard::onnx::{self, SessionOptions};
use vramguard::tensor::{Tensor, TensorData};

const SEQ: usize = 128;
const DIM: usize = 64;
/// Connections of the saturated run: enough to keep the one worker's queue from ever running dry.
const SATURATING_CONNECTIONS: usize = 4;
const INFER_PATH: &str = "/v2/models/encoder/infer";

/// The server under test: one CPU pool with a single one-thread worker, the embedded default
/// policy with the params of the embedded default config, and a context axis on the encoder so
/// the policy sees the request's context length as it would in production.
const CONFIG: &str = "\
models:
  - name: encoder
    path: 'builtin:encoder'
    context: {input: input, axis: 1, keep: end}
pools:
  - name: cpu
    provider: cpu
    models: [encoder]
    workers: 1
    intra_threads: 1
    queue: {capacity: 256}
policy:
  path: 'builtin:default'
  params: {cpu_pool: cpu, reserve_bytes: 32MiB, min_context_tokens: 16, defer_ms: 25, defer_max_queue: 4}
";

fn input() -> Vec<f32> {
    (0..SEQ * DIM).map(|i| ((i % 13) as f32 - 6.0) * 0.05).collect()
}

/// Latency and throughput of one measurement.
struct Stats {
    median: Duration,
    p99: Duration,
    per_second: f64,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// In-process runs on one thread; `gap` idles between runs the way a server waits for its next
/// request (caches and the ONNX Runtime thread go cold), so the two baselines bracket the truth.
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
    let per_second = samples.len() as f64 / started.elapsed().as_secs_f64();
    samples.sort();
    Stats {
        median: percentile(&samples, 0.5),
        p99: percentile(&samples, 0.99),
        per_second,
    }
}

/// The request body of the binary data extension: the JSON header, then the tensor's bytes.
/// Returns the header's length (the `Inference-Header-Content-Length` value) and the body.
fn binary_body() -> (usize, Vec<u8>) {
    let header = json!({
        "inputs": [{"name": "input", "shape": [1, SEQ, DIM], "datatype": "FP32",
                    "parameters": {"binary_data_size": SEQ * DIM * 4}}],
        "outputs": [{"name": "pooled", "parameters": {"binary_data": true}}]
    })
    .to_string();
    let mut body = header.clone().into_bytes();
    input().iter().for_each(|v| body.extend_from_slice(&v.to_le_bytes()));
    (header.len(), body)
}

/// A folder for this run's files (config, wrk script, body, server log), removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        let dir = std::env::temp_dir().join(format!("vramguard-overhead-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn write(&self, name: &str, contents: &[u8]) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `vramguard serve`. Dropping it, also while a panic unwinds, stops the process.
struct Server {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Server {
    /// Start the release binary on a free loopback port and wait until it reports ready.
    fn start(scratch: &Scratch) -> Server {
        let config = scratch.write("bench.yaml", CONFIG.as_bytes());
        let log = scratch.0.join("server.log");
        // Ask the kernel for a free port and release it for the server; nothing else on this
        // machine is expected to grab it in the moment between.
        let addr = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .unwrap();
        let out = File::create(&log).unwrap();
        let err = out.try_clone().unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_vramguard"))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .arg("--listen")
            .arg(addr.to_string())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("start target/release/vramguard");
        let mut server = Server { child, addr, log };
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("vramguard serve exited with {status}:\n{}", server.log_text());
            }
            if matches!(http(addr, "GET", "/v2/health/ready", &[], &[]), Ok((200, _, _))) {
                return server;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "vramguard serve not ready after 60 s:\n{}",
                server.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The histograms this bench reads, from `/metrics`.
    fn scrape(&self) -> ServerView {
        let (status, _, body) = http(self.addr, "GET", "/metrics", &[], &[]).unwrap();
        assert_eq!(status, 200, "/metrics");
        let text = String::from_utf8(body).unwrap();
        ServerView {
            policy_eval: Histogram::parse(&text, "vramguard_policy_eval_duration_seconds"),
            request: Histogram::parse(&text, "vramguard_request_duration_seconds"),
            queue_wait: Histogram::parse(&text, "vramguard_queue_wait_seconds"),
            threads: thread_cpu(self.child.id()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM lets it shut down as an operator's would; SIGKILL if it has not within 10 s.
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 exchange on its own connection, for the few requests the bench makes itself
/// (readiness, one checked inference, `/metrics`). Returns the status, the lower-cased response
/// headers and the body.
fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: &[u8],
) -> std::io::Result<(u16, String, Vec<u8>)> {
    let mut stream = TcpStream::connect(addr)?;
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes())?;
    stream.write_all(body)?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("no end of headers"))?;
    let head = String::from_utf8_lossy(&response[..split]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("no status"))?;
    if head.contains("transfer-encoding: chunked") {
        return Err(bad("chunked responses are not read by this client"));
    }
    Ok((status, head, response[split + 4..].to_vec()))
}

/// One header's value from the lower-cased head `http` returns.
fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

/// Run wrk against `url` with the request of `script`; panics on any non-2xx response or socket
/// error, since a figure that includes failures would not be the server's cost.
fn wrk(url: &str, script: &Path, connections: usize, seconds: u64) -> Stats {
    let output = Command::new("wrk")
        .arg("-t1")
        .arg(format!("-c{connections}"))
        .arg(format!("-d{seconds}s"))
        .arg("--latency")
        .arg("-s")
        .arg(script)
        .arg(url)
        .output()
        .expect("run wrk");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "wrk failed ({}):\n{text}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    parse_wrk(&text).unwrap_or_else(|e| panic!("{e}; wrk printed:\n{text}"))
}

/// Median, p99 and requests/s from wrk's `--latency` report.
fn parse_wrk(text: &str) -> Result<Stats, String> {
    for failure in ["Non-2xx or 3xx responses", "Socket errors"] {
        if let Some(line) = text.lines().find(|l| l.contains(failure)) {
            return Err(format!(
                "the server did not answer every request with success: {}",
                line.trim()
            ));
        }
    }
    let (mut median, mut p99, mut per_second) = (None, None, None);
    let mut in_distribution = false;
    for line in text.lines() {
        match line.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["Latency", "Distribution", ..] => in_distribution = true,
            ["50%", value] if in_distribution => median = Some(parse_wrk_time(value)?),
            ["99%", value] if in_distribution => p99 = Some(parse_wrk_time(value)?),
            ["Requests/sec:", value] => per_second = value.parse().ok(),
            _ => {}
        }
    }
    Ok(Stats {
        median: median.ok_or("no 50% line")?,
        p99: p99.ok_or("no 99% line")?,
        per_second: per_second.ok_or("no Requests/sec line")?,
    })
}

/// wrk's times: `512.00us`, `1.23ms`, `2.00s`.
fn parse_wrk_time(text: &str) -> Result<Duration, String> {
    let (number, scale) = if let Some(n) = text.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = text.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else {
        return Err(format!("unknown time `{text}`"));
    };
    let value: f64 = number.parse().map_err(|_| format!("unknown time `{text}`"))?;
    Ok(Duration::from_secs_f64(value * scale))
}

/// A histogram from `/metrics`, summed over its label sets: cumulative `(le, count)` buckets in
/// ascending order, sum and count.
#[derive(Clone, Default)]
struct Histogram {
    buckets: Vec<(f64, f64)>,
    sum: f64,
    count: f64,
}

impl Histogram {
    fn parse(text: &str, name: &str) -> Histogram {
        let mut h = Histogram::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            // `name{labels} value [# exemplar]`, or `name value` without labels.
            let (series, rest) = match line.find('}') {
                Some(end) => line.split_at(end + 1),
                None => line.split_once(' ').unwrap_or((line, "")),
            };
            let Some(value) = rest.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) else {
                continue;
            };
            let metric = series.split('{').next().unwrap_or(series);
            match metric.strip_prefix(name) {
                Some("_bucket") => {
                    let le = series
                        .split("le=\"")
                        .nth(1)
                        .and_then(|s| s.split('"').next())
                        .and_then(|s| s.parse::<f64>().ok())
                        .unwrap_or_else(|| panic!("bucket without le: {line}"));
                    match h.buckets.iter_mut().find(|(bound, _)| *bound == le) {
                        Some((_, count)) => *count += value,
                        None => h.buckets.push((le, value)),
                    }
                }
                Some("_sum") => h.sum += value,
                Some("_count") => h.count += value,
                _ => {}
            }
        }
        h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        h
    }

    /// What was observed since `earlier`.
    fn since(&self, earlier: &Histogram) -> Histogram {
        let before = |le: f64| {
            earlier
                .buckets
                .iter()
                .find(|(bound, _)| *bound == le)
                .map_or(0.0, |(_, count)| *count)
        };
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|&(le, count)| (le, count - before(le)))
                .collect(),
            sum: self.sum - earlier.sum,
            count: self.count - earlier.count,
        }
    }

    fn mean(&self) -> f64 {
        self.sum / self.count
    }

    /// The `q` quantile, interpolated linearly within its bucket as Prometheus'
    /// `histogram_quantile` does, with the bucket's bounds (its resolution).
    fn quantile(&self, q: f64) -> Option<(f64, f64, f64)> {
        let rank = q * self.count;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(upper, count) in &self.buckets {
            if count >= rank && count > below {
                if upper.is_infinite() {
                    return Some((lower, lower, upper));
                }
                return Some((lower + (upper - lower) * (rank - below) / (count - below), lower, upper));
            }
            (lower, below) = (upper, count);
        }
        None
    }
}

/// The server's own view of one measurement.
struct ServerView {
    policy_eval: Histogram,
    request: Histogram,
    queue_wait: Histogram,
    /// CPU seconds by thread name, from /proc (empty where there is none).
    threads: BTreeMap<String, f64>,
}

impl ServerView {
    fn since(&self, earlier: &ServerView) -> ServerView {
        ServerView {
            policy_eval: self.policy_eval.since(&earlier.policy_eval),
            request: self.request.since(&earlier.request),
            queue_wait: self.queue_wait.since(&earlier.queue_wait),
            threads: self
                .threads
                .iter()
                .map(|(name, cpu)| (name.clone(), cpu - earlier.threads.get(name).unwrap_or(&0.0)))
                .collect(),
        }
    }
}

/// Linux reports CPU times in /proc in units of USER_HZ, 100 per second on every architecture.
const USER_HZ: f64 = 100.0;

/// CPU seconds from a /proc `stat` file: the user field numbered as in proc(5) plus the system
/// field after it (14 for the task's own, 16 for its waited-for children's). `None` without /proc.
fn cpu_seconds(stat: &Path, user_field: usize) -> Option<f64> {
    let text = std::fs::read_to_string(stat).ok()?;
    // The command name (field 2) is parenthesised and may hold spaces; field 3 follows it.
    let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |n: usize| fields.get(n - 3)?.parse::<i64>().ok();
    Some((ticks(user_field)? + ticks(user_field + 1)?) as f64 / USER_HZ)
}

/// CPU seconds of the server's threads by name without its number (`cpu-worker-0` and
/// `cpu-worker-1` count as `cpu-worker`), so the reader sees where the server's time goes.
fn thread_cpu(pid: u32) -> BTreeMap<String, f64> {
    let mut by_name = BTreeMap::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let (Ok(comm), Some(cpu)) = (
            std::fs::read_to_string(task.path().join("comm")),
            cpu_seconds(&task.path().join("stat"), 14),
        ) else {
            continue;
        };
        let name = comm.trim().trim_end_matches(|c: char| c.is_ascii_digit() || c == '-');
        *by_name.entry(name.to_string()).or_insert(0.0) += cpu;
    }
    by_name
}

/// CPU seconds of this process's finished children: wrk's, once `wrk` has waited for it.
fn children_cpu() -> Option<f64> {
    cpu_seconds(Path::new("/proc/self/stat"), 16)
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn verdict(met: bool) -> &'static str {
    if met { "MET" } else { "MISSED" }
}

fn row(label: &str, s: &Stats) {
    println!(
        "  {label:<40} {:>9.1} µs {:>9.1} µs {:>9.0} /s",
        us(s.median),
        us(s.p99),
        s.per_second
    );
}

fn main() {
    // `cargo bench` passes `--bench`; other arguments than `--seconds N` are ignored.
    let args: Vec<String> = std::env::args().collect();
    let seconds: f64 = args
        .iter()
        .position(|a| a == "--seconds")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0);
    let wrk_seconds = seconds.ceil().max(1.0) as u64;
    let Ok(version) = Command::new("wrk").arg("--version").output() else {
        eprintln!(
            "error: the overhead bench needs wrk, its load generator, on PATH; `make bench` installs \
             it (apt-get install -y wrk)"
        );
        std::process::exit(2);
    };
    let version = String::from_utf8_lossy(&version.stdout);
    let version = version.split_whitespace().nth(1).unwrap_or("?").to_string();
    // Other work on the machine skews every figure here; the table says how busy it was.
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into());

    let local = in_process(seconds, Duration::ZERO);
    let idle = in_process(seconds.min(2.0), Duration::from_micros(200));

    let scratch = Scratch::new();
    let (header_length, body) = binary_body();
    let body_file = scratch.write("body.bin", &body);
    // Lua strings are byte strings: the script reads the body from its file, exactly as written.
    let script = scratch.write(
        "infer.lua",
        format!(
            "local f = assert(io.open([==[{}]==], \"rb\"))\n\
             wrk.body = f:read(\"*a\")\n\
             f:close()\n\
             wrk.method = \"POST\"\n\
             wrk.headers[\"Content-Type\"] = \"application/octet-stream\"\n\
             wrk.headers[\"Inference-Header-Content-Length\"] = \"{header_length}\"\n",
            body_file.display()
        )
        .as_bytes(),
    );

    let server = Server::start(&scratch);
    let (status, head, _) = http(
        server.addr,
        "POST",
        INFER_PATH,
        &[
            ("content-type", "application/octet-stream".into()),
            ("inference-header-content-length", header_length.to_string()),
        ],
        &body,
    )
    .unwrap();
    assert_eq!(status, 200, "a checked inference request:\n{head}");
    assert!(
        header(&head, "inference-header-content-length").is_some(),
        "the response is not in the binary data format:\n{head}"
    );
    let decision = format!(
        "{} on {}",
        header(&head, "x-vramguard-decision").unwrap_or("?"),
        header(&head, "x-vramguard-pool").unwrap_or("?")
    );
    let url = format!("http://{}{INFER_PATH}", server.addr);
    // Warm-up: connection, worker thread, allocator and policy caches.
    wrk(&url, &script, 1, 1);
    let (start, wrk_cpu_start) = (server.scrape(), children_cpu());
    let single = wrk(&url, &script, 1, wrk_seconds);
    let (after_single, wrk_cpu_single) = (server.scrape(), children_cpu());
    let saturated = wrk(&url, &script, SATURATING_CONNECTIONS, wrk_seconds);
    let (after_saturated, wrk_cpu_saturated) = (server.scrape(), children_cpu());
    let pid = server.child.id();
    drop(server);
    let single_view = after_single.since(&start);
    let saturated_view = after_saturated.since(&after_single);
    let wrk_cpu = |before: Option<f64>, after: Option<f64>| Some(after? - before?);
    let phases = [
        ("-c1", &single_view, wrk_cpu(wrk_cpu_start, wrk_cpu_single)),
        ("saturated", &saturated_view, wrk_cpu(wrk_cpu_single, wrk_cpu_saturated)),
    ];

    println!();
    println!(
        "vramguard overhead: bundled encoder, seq {SEQ}, batch 1, binary tensors, 1 worker × 1 \
         intra-op thread, {seconds} s per measurement"
    );
    println!(
        "server: {} serve (pid {pid}), policy builtin:default, decision: {decision}",
        env!("CARGO_BIN_EXE_vramguard")
    );
    println!("client: wrk {version}, 1 thread, a separate process");
    println!(
        "machine: {} cores, load average {load} when the bench started",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!();
    println!("  {:<40} {:>12} {:>12} {:>11}", "", "median", "p99", "throughput");
    row("in-process ONNX Runtime", &local);
    row("in-process, 200 µs idle between runs", &idle);
    row("HTTP, wrk -c1", &single);
    row(&format!("HTTP, wrk -c{SATURATING_CONNECTIONS} (saturated)"), &saturated);
    println!();

    let added = us(single.median) - us(local.median);
    println!(
        "  added median latency (HTTP -c1 − in-process)   {added:>8.1} µs   target ≤ 100 µs: {}",
        verdict(added <= 100.0)
    );
    println!(
        "    against the idle-gap baseline                {:>8.1} µs",
        us(single.median) - us(idle.median)
    );
    let ratio = 100.0 * saturated.per_second / local.per_second;
    println!(
        "  saturated throughput / in-process              {ratio:>8.1} %    target ≥ 90 %: {}",
        verdict(ratio >= 90.0)
    );
    match saturated_view.policy_eval.quantile(0.5) {
        Some((p50, lower, upper)) => println!(
            "  policy eval p50, saturated                     {:>8.2} µs   target ≤ 5 µs: {}   \
             (interpolated in bucket ({:.1}, {:.1}] µs of {:.0} evaluations)",
            p50 * 1e6,
            verdict(p50 * 1e6 <= 5.0),
            lower * 1e6,
            upper * 1e6,
            saturated_view.policy_eval.count
        ),
        None => println!("  policy eval p50, saturated: no evaluations recorded"),
    }
    println!(
        "  policy eval mean, saturated                    {:>8.2} µs",
        saturated_view.policy_eval.mean() * 1e6
    );
    for (label, view, _) in &phases {
        println!(
            "  server request duration mean, {label:<10}       {:>8.1} µs   (queue wait mean {:.1} µs)",
            view.request.mean() * 1e6,
            view.queue_wait.mean() * 1e6
        );
    }
    // Where the CPU goes, per request: the server's threads by name, and wrk's.
    for (label, view, wrk_cpu) in &phases {
        let per_request = |cpu: f64| cpu / view.request.count * 1e6;
        let mut parts: Vec<String> = view
            .threads
            .iter()
            .filter(|(_, cpu)| **cpu > 0.0)
            .map(|(name, cpu)| format!("{name} {:.0}", per_request(*cpu)))
            .collect();
        if let Some(cpu) = wrk_cpu {
            parts.push(format!("wrk {:.0}", per_request(*cpu)));
        }
        println!("  CPU µs per request, {label:<10} {}", parts.join(", "));
    }
}
