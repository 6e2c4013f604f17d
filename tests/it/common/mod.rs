//! Shared harness: a real server on 127.0.0.1:0 with real ONNX Runtime sessions, and what
//! only these tests ask of one. What benches share with them is in `vramguard::testing`.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;
use tokio::sync::oneshot;
use vramguard::http::{self, AppState};
use vramguard::serve::service::Service;
use vramguard::testing::Scratch;

/// The admin token test servers accept over TCP (the admin socket is not bound in tests).
pub const ADMIN_TOKEN: &str = "test-admin-token";

/// A running server; dropping it does not stop it, call [`TestServer::stop`].
pub struct TestServer {
    pub addr: SocketAddr,
    /// What its handlers share (the service, its batchers), for tests that place requests
    /// beside HTTP.
    pub state: Arc<AppState>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    /// The folder of its policy file, kept while it serves.
    _policy: Option<Scratch>,
}

impl TestServer {
    /// Start from YAML (model paths relative to the project root).
    pub async fn start(yaml: &str) -> TestServer {
        TestServer::start_with(vramguard::testing::config::validated(yaml)).await
    }

    /// Start from a validated config (for what YAML cannot say, such as `worker_exe`).
    pub async fn start_with(config: vramguard::config::Config) -> TestServer {
        TestServer::serve(config, Some(ADMIN_TOKEN)).await
    }

    /// Start from YAML with no admin token: admin over TCP is refused.
    pub async fn without_admin_token(yaml: &str) -> TestServer {
        TestServer::serve(vramguard::testing::config::validated(yaml), None).await
    }

    /// Start from YAML, or the service's refusal to start (a model it cannot serve).
    pub async fn try_start(yaml: &str) -> Result<TestServer, String> {
        let config = vramguard::testing::config::validated(yaml);
        let service = tokio::task::spawn_blocking(move || Service::start(config))
            .await
            .unwrap()
            .map_err(|e| e.to_string())?;
        Ok(TestServer::listen(service, Some(ADMIN_TOKEN)).await)
    }

    async fn serve(config: vramguard::config::Config, admin_token: Option<&str>) -> TestServer {
        let service = tokio::task::spawn_blocking(move || Service::start(config))
            .await
            .unwrap()
            .expect("service starts");
        TestServer::listen(service, admin_token).await
    }

    async fn listen(service: Service, admin_token: Option<&str>) -> TestServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = AppState::with_admin_token(Arc::new(service), admin_token.map(str::to_string));
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(http::serve(Arc::clone(&state), listener, async {
            let _ = stopped.await;
        }));
        TestServer {
            addr,
            state,
            stop: Some(stop),
            task,
            _policy: None,
        }
    }

    /// Start from YAML with the policy `source`, in a scratch folder of the server's own (a
    /// folder per server: tests in one process must not rewrite a file another is reading).
    pub async fn with_policy(yaml: &str, source: &str) -> TestServer {
        let scratch = Scratch::new();
        let server = TestServer::start(&format!("{yaml}{}", scratch.policy(source))).await;
        TestServer {
            _policy: Some(scratch),
            ..server
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap();
    }

    pub async fn metrics(&self) -> String {
        reqwest::get(self.url("/metrics")).await.unwrap().text().await.unwrap()
    }
}

/// The committed reference cases of a bundled model (`models/reference.json`).
pub fn reference_cases(model: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("models/reference.json")).unwrap();
    let all: Value = serde_json::from_str(&text).unwrap();
    all[model].as_array().unwrap().clone()
}

/// Build an infer request body from a reference case's inputs.
pub fn request_from_case(case: &Value) -> Value {
    let inputs: Vec<Value> = case["inputs"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, t)| serde_json::json!({"name": name, "shape": t["shape"], "datatype": t["datatype"], "data": t["data"]}))
        .collect();
    serde_json::json!({ "inputs": inputs })
}

/// Assert two float arrays agree within `tol`.
pub fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "{what}[{i}]: got {g}, want {w}");
    }
}

pub fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// One simulated device of 128 MiB with the encoder on it.
pub const SIMULATED_CONFIG: &str = "
devices: [{name: gpu0, kind: simulated, capacity: 128MiB}]
models: [{name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}}]
pools: [{name: gpu, provider: simulated, device: gpu0, models: [encoder]}]
";

impl TestServer {
    /// `GET /v2/models/{model}`: the model's metadata.
    pub async fn model_metadata(&self, model: &str) -> Value {
        let url = self.url(&format!("/v2/models/{model}"));
        reqwest::get(url).await.unwrap().json().await.unwrap()
    }

    /// POST a JSON body (with the admin token, which non-admin endpoints ignore).
    pub async fn post_json(&self, path: &str, body: &Value) -> reqwest::Response {
        reqwest::Client::new()
            .post(self.url(path))
            .bearer_auth(ADMIN_TOKEN)
            .json(body)
            .send()
            .await
            .unwrap()
    }

    /// Send an encoder request of `seq` tokens as binary tensor data.
    pub async fn encoder(&self, seq: usize) -> reqwest::Response {
        self.encoder_with_headers(seq, &[]).await
    }

    /// [`TestServer::encoder`] with extra request headers.
    pub async fn encoder_with_headers(&self, seq: usize, headers: &[(&str, &str)]) -> reqwest::Response {
        let (header, body) = encoder_binary_request(seq);
        let mut request = reqwest::Client::new()
            .post(self.url("/v2/models/encoder/infer"))
            .header("Inference-Header-Content-Length", header.len());
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(body).send().await.unwrap()
    }
}

/// Send [`encoder_binary_request`]`(seq)` to `server`'s encoder from a task of its own; its
/// answer's status.
pub fn spawn_binary_encoder(server: &TestServer, seq: usize) -> tokio::task::JoinHandle<reqwest::StatusCode> {
    let url = server.url("/v2/models/encoder/infer");
    let (header, body) = encoder_binary_request(seq);
    tokio::spawn(async move {
        reqwest::Client::new()
            .post(url)
            .header("Inference-Header-Content-Length", header.len())
            .body(body)
            .send()
            .await
            .unwrap()
            .status()
    })
}

/// The ids in a `GET /v1/models` answer, in its order.
pub fn model_ids(models: &Value) -> Vec<&str> {
    models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect()
}

/// An encoder request of `seq` tokens as binary tensor data: `(json header, whole body)`.
pub fn encoder_binary_request(seq: usize) -> (String, Vec<u8>) {
    encoder_binary_request_with(seq, None)
}

/// [`encoder_binary_request`] with the request's `parameters`, when given.
pub fn encoder_binary_request_with(seq: usize, parameters: Option<Value>) -> (String, Vec<u8>) {
    let mut header = serde_json::json!({
        "inputs": [{"name": "input", "shape": [1, seq, 64], "datatype": "FP32",
                    "parameters": {"binary_data_size": seq * 64 * 4}}],
        "outputs": [{"name": "pooled"}]
    });
    if let Some(parameters) = parameters {
        header["parameters"] = parameters;
    }
    let header = header.to_string();
    let mut body = header.clone().into_bytes();
    for i in 0..seq * 64 {
        body.extend_from_slice(&((i % 7) as f32 * 0.01).to_le_bytes());
    }
    (header, body)
}

/// The binary under test, built by Cargo for these tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_vramguard");

/// [`BIN`] as a command, with the test cache ([`vramguard::testing::cache_home`]) as its cache
/// folder: what it optimizes never lands in the user's.
pub fn binary() -> std::process::Command {
    vramguard::testing::vramguard_command(BIN)
}

/// [`vramguard::testing::process::spawn_serving`] on [`BIN`].
pub fn spawn_serving(args: &[&str], env: &[(&str, &str)], message: &str) -> vramguard::testing::process::Serving {
    vramguard::testing::process::spawn_serving(BIN, args, env, message)
}

/// The sum of the samples in `metrics` (exposition text) on the lines `select` accepts.
pub fn sum_samples(metrics: &str, select: impl Fn(&str) -> bool) -> f64 {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#') && select(l))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The value of the first sample whose line starts with `series` (a name with its labels, as
/// exposed), or 0 when there is none yet (a counter not created before its first event).
pub fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0.0, |v| v.parse().expect("a sample's value is a number"))
}

/// Poll `/metrics` every 5 ms until `vramguard_requests_waiting` reads `count` (at most 10 s;
/// past that the test fails saying `what` never waited).
pub async fn until_waiting(server: &TestServer, count: f64, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while gauge(&server.metrics().await, "vramguard_requests_waiting") != count {
        assert!(std::time::Instant::now() < deadline, "{what} never waited");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// The value of the unlabelled gauge `name`, which must be exposed.
pub fn gauge(metrics: &str, name: &str) -> f64 {
    let prefix = format!("{name} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no `{name}` in:\n{metrics}"))
        .parse()
        .unwrap()
}

/// `vramguard_requests_total` summed over the outcomes `select` accepts.
pub fn requests_with(metrics: &str, select: impl Fn(&str) -> bool) -> f64 {
    sum_samples(metrics, |l| {
        l.starts_with("vramguard_requests_total{")
            && l.split("outcome=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
                .is_some_and(&select)
    })
}

/// Poll `/metrics` (no inference traffic) until `pool`'s breaker reads closed, for at most
/// `within`; the metrics last read, and whether it closed.
pub async fn breaker_closes(server: &TestServer, pool: &str, within: std::time::Duration) -> (bool, String) {
    let series = format!("vramguard_breaker_state{{pool=\"{pool}\"}}");
    let until = std::time::Instant::now() + within;
    loop {
        let metrics = server.metrics().await;
        if sample(&metrics, &series) == 0.0 {
            return (true, metrics);
        }
        if std::time::Instant::now() >= until {
            return (false, metrics);
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// A simulated `gpu` pool whose breaker opens at once on a driver reset (and after two
/// allocator failures), falling back on a `cpu` pool.
pub const FAILOVER_CONFIG: &str = "\
devices: [{name: gpu0, kind: simulated, capacity: 128MiB}]
models: [{name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}}]
pools:
- {name: gpu, provider: simulated, device: gpu0, models: [encoder], fallback: cpu,
   breaker: {failures: 2, window: 60s, cooldown: 1h}}
- {name: cpu, provider: cpu, models: [encoder]}
";

/// The variable that tells a child process of this binary which test it runs.
const OWN_PROCESS_TEST: &str = "VRAMGUARD_IT_OWN_PROCESS";

/// Run the calling test in a process of its own, once: `true` when it has already run there
/// (the caller returns at once), `false` in that process (the caller goes on).
///
/// ONNX Runtime allows one simulated arena per process, of one capacity, and its allocator
/// counts what every session in the process holds. Each test that serves from the simulated
/// accelerator in this process would otherwise see the others' memory and pressure. Under
/// `cargo nextest`, which starts every test in a process of its own, this is a no-op.
pub fn ran_in_own_process() -> bool {
    if std::env::var_os("NEXTEST").is_some() || std::env::var_os(OWN_PROCESS_TEST).is_some() {
        return false;
    }
    // libtest names each test's thread after the test; tokio's test runtimes poll the test's
    // body on that thread.
    let name = std::thread::current()
        .name()
        .expect("libtest names the thread of a test")
        .to_string();
    let exe = std::env::current_exe().expect("the test binary");
    let out = std::process::Command::new(exe)
        .args([name.as_str(), "--exact", "--test-threads=1", "--nocapture"])
        .env(OWN_PROCESS_TEST, &name)
        .output()
        .expect("the test binary starts again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name}, in a process of its own, failed:\n{stdout}\n{stderr}"
    );
    true
}

/// What a finished command left: its exit code, stdout and stderr, as text.
pub fn outcome(out: std::process::Output) -> (Option<i32>, String, String) {
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// What `promtool check metrics` says of an exposition in the Prometheus text format: empty when
/// it finds nothing (and exits 0).
pub fn promtool_findings(text: &str) -> String {
    use std::io::Write;
    let mut promtool = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool is needed for this test: run `make tools` (Debian package `prometheus`)");
    promtool.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = promtool.wait_with_output().unwrap();
    let findings = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        findings.trim().to_string()
    } else {
        format!("exit {}: {findings}", out.status)
    }
}
