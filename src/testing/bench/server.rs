//! Real servers in their own processes, and wrk, the load generator, in another: the client
//! shares neither a server's async runtime nor its threads, the way Triton's perf_analyzer
//! measures and users' clients run. The few requests a bench makes itself (readiness, a
//! checked inference, `/metrics`) go through reqwest's blocking client; none of them is timed.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::StatusCode;

use crate::testing::Scratch;

/// Latency and throughput of one wrk run.
#[derive(Debug, Clone, Copy)]
pub struct Stats {
    /// The median latency.
    pub median: Duration,
    /// The 99th percentile latency.
    pub p99: Duration,
    /// Requests answered per second.
    pub per_second: f64,
}

/// A wrk script in `scratch` that sends `body` (read from a file: Lua strings are byte strings,
/// so it goes out exactly as written) with `headers`, by POST.
pub fn wrk_script(scratch: &Scratch, name: &str, body: &[u8], headers: &[(&str, String)]) -> PathBuf {
    let body_file = scratch.write(&format!("{name}.body"), body);
    let mut script = format!(
        "local f = assert(io.open([==[{}]==], \"rb\"))\nwrk.body = f:read(\"*a\")\nf:close()\nwrk.method = \"POST\"\n",
        body_file.display()
    );
    for (header, value) in headers {
        script.push_str(&format!("wrk.headers[\"{header}\"] = \"{value}\"\n"));
    }
    scratch.write(&format!("{name}.lua"), script)
}

/// A server process. Dropping it, also while a panic unwinds, stops it.
pub struct Server {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
    log: PathBuf,
    client: reqwest::blocking::Client,
}

/// A free loopback port: the kernel picks one and it is released for the server; nothing else
/// on this machine is expected to grab it in the moment between.
fn free_addr() -> SocketAddr {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .unwrap()
}

impl Server {
    /// `bin`, the release binary (`cargo bench` builds it, `env!("CARGO_BIN_EXE_vramguard")`
    /// names it), serving `config` from the repository root.
    pub fn vramguard(bin: &str, scratch: &Scratch, name: &str, config: &str) -> Server {
        let path = scratch.write(&format!("{name}.yaml"), config);
        let addr = free_addr();
        let mut command = Command::new(bin);
        command
            .arg("serve")
            .arg("--config")
            .arg(&path)
            .arg("--listen")
            .arg(addr.to_string());
        Server::spawn(command, addr, scratch.path().join(format!("{name}.log")))
    }

    /// The Python peer (`benches/peer/server.py`) on the packages `make bench` installs.
    pub fn peer(scratch: &Scratch) -> Server {
        let addr = free_addr();
        let root = env!("CARGO_MANIFEST_DIR");
        let mut command = Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()));
        command
            .env("PYTHONPATH", format!("{root}/.deps/peer:{root}/.deps/onnxruntime"))
            .arg("benches/peer/server.py")
            .arg("--port")
            .arg(addr.port().to_string());
        Server::spawn(command, addr, scratch.path().join("peer.log"))
    }

    /// Start `command` from the repository root and wait until `/v2/health/ready` says 200.
    fn spawn(mut command: Command, addr: SocketAddr, log: PathBuf) -> Server {
        let out = File::create(&log).unwrap();
        let err = out.try_clone().unwrap();
        let child = command
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("start {command:?}: {e}"));
        let mut server = Server {
            child,
            addr,
            log,
            client: reqwest::blocking::Client::new(),
        };
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("{command:?} exited with {status}:\n{}", server.log_text());
            }
            let ready = server.client.get(server.url("/v2/health/ready")).send();
            if ready.is_ok_and(|r| r.status() == StatusCode::OK) {
                return server;
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "{command:?} not ready after 120 s:\n{}",
                server.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The URL of `path` on it.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// POST `body` as `content_type` to `path`, with `headers`; the response, whatever its
    /// status (the caller checks it, with the body in its message).
    pub fn post(
        &self,
        path: &str,
        content_type: &str,
        headers: &[(&str, String)],
        body: Vec<u8>,
    ) -> reqwest::blocking::Response {
        let mut request = self
            .client
            .post(self.url(path))
            .header(reqwest::header::CONTENT_TYPE, content_type);
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        request.body(body).send().unwrap_or_else(|e| panic!("POST {path}: {e}"))
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The histograms the overhead bench reads, from vramguard's `/metrics`.
    pub fn scrape(&self) -> ServerView {
        let response = self.client.get(self.url("/metrics")).send().expect("GET /metrics");
        assert_eq!(response.status(), StatusCode::OK, "/metrics");
        let text = response.text().expect("the /metrics text");
        ServerView {
            policy_eval: Histogram::parse(&text, "vramguard_policy_eval_duration_seconds"),
            request: Histogram::parse(&text, "vramguard_request_duration_seconds"),
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

/// wrk's version, or a message saying how to install it.
pub fn wrk_version() -> Result<String, String> {
    let output = Command::new("wrk").arg("--version").output().map_err(|_| {
        "this bench needs wrk, its load generator, on PATH; `make bench` installs it (apt-get install -y wrk)"
            .to_string()
    })?;
    let text = String::from_utf8_lossy(&output.stdout);
    Ok(text.split_whitespace().nth(1).unwrap_or("?").to_string())
}

/// Run wrk against `url` with the request of `script`; panics on any non-2xx response or socket
/// error, since a figure that includes failures would not be the server's cost.
pub fn wrk(url: &str, script: &Path, connections: usize, seconds: u64) -> Stats {
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
pub struct Histogram {
    /// Cumulative `(le, count)` buckets, ascending.
    pub buckets: Vec<(f64, f64)>,
    /// The sum of the observations.
    pub sum: f64,
    /// How many observations.
    pub count: f64,
}

impl Histogram {
    /// The histogram `name` in exposition `text`, summed over its label sets.
    pub fn parse(text: &str, name: &str) -> Histogram {
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
    pub fn since(&self, earlier: &Histogram) -> Histogram {
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

    /// The `q` quantile, interpolated linearly within its bucket as Prometheus'
    /// `histogram_quantile` does, with the bucket's bounds (its resolution).
    /// Returns the estimate and the bucket's lower and upper bounds; `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<(f64, f64, f64)> {
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
pub struct ServerView {
    /// `vramguard_policy_eval_duration_seconds`.
    pub policy_eval: Histogram,
    /// `vramguard_request_duration_seconds`.
    pub request: Histogram,
    /// CPU seconds by thread name, from /proc (empty where there is none).
    pub threads: BTreeMap<String, f64>,
}

impl ServerView {
    /// What happened since `earlier`.
    pub fn since(&self, earlier: &ServerView) -> ServerView {
        ServerView {
            policy_eval: self.policy_eval.since(&earlier.policy_eval),
            request: self.request.since(&earlier.request),
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
pub fn children_cpu() -> Option<f64> {
    cpu_seconds(Path::new("/proc/self/stat"), 16)
}
