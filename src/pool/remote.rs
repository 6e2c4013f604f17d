//! Remote pools: a pool whose workers forward each request over the Open Inference Protocol
//! (binary tensor extension) to another server (vramguard, Triton, KServe) instead of running
//! it. The pool around them is an ordinary one (queue, concurrency, breaker, metrics), so the
//! policy and the router treat it like any other.
//!
//! - [`RemoteBackend`]: one per worker, each with its own keep-alive connection and a
//!   single-threaded tokio runtime on the worker's thread, so a hop costs no thread switch.
//! - [`answer`]: what the remote's answer means (pure, tested without a socket): outputs, the
//!   client's mistake passed on, or a failure of the remote counted by the breaker.
//! - [`watch_health`]: polls the remote's `/v2/health/ready` and feeds the pool's breaker.
//! - `metrics`: the remote pools' metric family ([`RemoteFamily`]) and one pool's handles
//!   ([`RemoteMetrics`]).
//!
//! What travels with a request: the request id (`x-request-id` and the protocol's `id`), the
//! time left before the deadline (`x-vramguard-deadline-ms`), the `idempotency-key`, and the
//! priority, replayability and shrink permission vramguard's own headers carry.

mod metrics;

pub use metrics::{RemoteFamily, RemoteMetrics};

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, Request, StatusCode, header};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::sync::Notify;

use crate::config::RemoteOptions;
use crate::core::backend::{
    AllocFailureKind, Arenas, Backend, BackendError, Generations, Interrupt, Interrupts, Liveness, RemoteFailure,
    Residency, RunMeta,
};
use crate::core::tensor::Tensor;
use crate::pool::{CheckFailure, Pool};
use crate::protocol::headers::{
    ALLOW_SHRINK_HEADER, DEADLINE_HEADER, HEADER_LENGTH, IDEMPOTENCY_KEY, PRIORITY_HEADER, REPLAYABLE_HEADER,
    REQUEST_ID,
};

/// How long an idle connection is kept for the next request. Below the keep-alive of the
/// servers it talks to (uvicorn, under KServe, closes after 5 s; nginx and vramguard after
/// 75 s), so a request is rarely sent on a connection the server is closing; reconnecting on
/// loopback or a LAN costs a fraction of a millisecond.
const IDLE_CONNECTION: Duration = Duration::from_secs(4);

/// An HTTP client with keep-alive connections, for the runtime it is used on.
fn client(options: &RemoteOptions, idle_per_host: usize) -> Client<HttpConnector, Body> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(options.connect_timeout));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(IDLE_CONNECTION)
        .pool_max_idle_per_host(idle_per_host)
        .pool_timer(TokioTimer::new())
        .build(connector)
}

/// One worker's way to the remote server.
pub struct RemoteBackend {
    options: RemoteOptions,
    /// This worker's own runtime: the connection is driven on the worker's thread.
    runtime: Option<tokio::runtime::Runtime>,
    client: Client<HttpConnector, Body>,
    /// Notified to stop the request in flight (its client went away, its deadline passed).
    stop: Arc<Notify>,
    metrics: RemoteMetrics,
    /// Largest answer read (`server.max_response_bytes`): a remote cannot make us hold more.
    max_response_bytes: usize,
}

impl std::fmt::Debug for RemoteBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteBackend")
            .field("url", &self.options.url)
            .finish_non_exhaustive()
    }
}

impl RemoteBackend {
    /// A backend forwarding to `options.url`. Nothing is connected yet: a remote that is down
    /// at start-up does not stop this server (its health checks open the breaker instead).
    pub fn new(options: RemoteOptions, metrics: RemoteMetrics, max_response_bytes: usize) -> Result<Self, String> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the remote pool's runtime: {e}"))?;
        let client = {
            let _entered = runtime.enter();
            client(&options, 1)
        };
        Ok(Self {
            options,
            runtime: Some(runtime),
            client,
            stop: Arc::new(Notify::new()),
            metrics,
            max_response_bytes,
        })
    }

    fn forward(
        &mut self,
        model: &str,
        inputs: Vec<Tensor>,
        outputs: &[String],
        meta: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        // The deadline bounds the hop when it is nearer than the pool's own timeout; the remote
        // is told the time left so that it gives up when the client does.
        let (limit, left) = match meta.deadline {
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(BackendError::DeadlineExceeded);
                }
                (left.min(self.options.timeout), Some(left))
            }
            None => (self.options.timeout, None),
        };
        let by_deadline = left.is_some_and(|left| left <= self.options.timeout);
        let (body, header_len) = crate::protocol::oip::encode_request(&meta.request_id, &inputs, outputs);
        drop(inputs);
        let request = build_request(&self.options.url, model, body, header_len, meta, left)?;
        let client = self.client.clone();
        let stop = Arc::clone(&self.stop);
        let max_bytes = self.max_response_bytes;
        let runtime = self.runtime.as_ref().expect("the runtime lives as long as the backend");
        let exchanged = runtime.block_on(async move {
            tokio::select! {
                biased;
                () = stop.notified() => None,
                result = tokio::time::timeout(limit, exchange(&client, request, max_bytes)) => Some(result),
            }
        });
        let reply = match exchanged {
            // Dropping the request closes its connection: the remote sees its client leave.
            None => return Err(BackendError::Cancelled),
            Some(Err(_)) if by_deadline => return Err(BackendError::DeadlineExceeded),
            Some(Err(_)) => {
                return Err(BackendError::Remote {
                    kind: RemoteFailure::Timeout,
                    message: format!("no answer within {}ms (remote.timeout)", limit.as_millis()),
                });
            }
            Some(Ok(reply)) => reply?,
        };
        answer(
            reply.status,
            reply.header_len.as_deref(),
            &reply.body,
            outputs,
            left.is_some(),
        )
    }
}

impl Drop for RemoteBackend {
    fn drop(&mut self) {
        // A backend may be dropped on an async thread (a service dropped in a test, a restore),
        // where dropping a runtime the ordinary way panics.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Backend for RemoteBackend {
    fn run(
        &mut self,
        model: &str,
        inputs: Vec<Tensor>,
        outputs: &[String],
        meta: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        let started = Instant::now();
        let result = self.forward(model, inputs, outputs, meta);
        self.metrics.duration.observe(started.elapsed().as_secs_f64());
        match &result {
            Err(BackendError::Remote { kind, message }) => {
                self.metrics.failed(*kind);
                tracing::warn!(request_id = %meta.request_id, url = %self.options.url, %kind, %message, "remote server failed");
            }
            Err(BackendError::Allocation { kind, .. }) => {
                tracing::info!(request_id = %meta.request_id, url = %self.options.url, %kind, "the remote server's allocator could not fit the request");
            }
            _ => {}
        }
        result
    }

    /// Its server loads its own models.
    fn residency(&mut self) -> Option<&mut dyn Residency> {
        None
    }

    /// Its server keeps its own caches: a generation carries its cache with each step.
    fn generations(&mut self) -> Option<&mut dyn Generations> {
        None
    }

    /// Its server's memory is its server's to report.
    fn arenas(&mut self) -> Option<&mut dyn Arenas> {
        None
    }

    /// A server that is gone fails its requests, counted by the pool's breaker: nothing here
    /// is replaced.
    fn liveness(&self) -> Option<&dyn Liveness> {
        None
    }

    fn interrupts(&mut self) -> Option<&mut dyn Interrupts> {
        Some(self)
    }
}

impl Interrupts for RemoteBackend {
    fn interrupt_handle(&self) -> Interrupt {
        let stop = Arc::clone(&self.stop);
        Arc::new(move || stop.notify_one())
    }

    fn clear_interrupt(&mut self) {
        // A stop stored for an earlier run stays with the old `Notify`.
        self.stop = Arc::new(Notify::new());
    }
}

/// The inference request to the remote, with what travels with it.
fn build_request(
    url: &str,
    model: &str,
    body: Vec<u8>,
    header_len: usize,
    meta: &RunMeta,
    left: Option<Duration>,
) -> Result<Request<Body>, BackendError> {
    let mut request = Request::post(format!("{url}/v2/models/{model}/infer"))
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(HEADER_LENGTH, header_len)
        .header(REQUEST_ID, meta.request_id.as_str());
    if let Some(left) = left {
        // Rounded down: the remote must not plan on time the client will not wait for.
        request = request.header(DEADLINE_HEADER, (left.as_millis() as u64).max(1));
    }
    if let Some(key) = &meta.idempotency_key {
        request = request.header(IDEMPOTENCY_KEY, key.as_str());
    }
    if meta.priority != 0 {
        request = request.header(PRIORITY_HEADER, meta.priority);
    }
    if !meta.replayable {
        request = request.header(REPLAYABLE_HEADER, HeaderValue::from_static("false"));
    }
    if meta.allow_shrink {
        request = request.header(ALLOW_SHRINK_HEADER, HeaderValue::from_static("true"));
    }
    request.body(Body::from(body)).map_err(|e| BackendError::Remote {
        kind: RemoteFailure::Protocol,
        message: format!("cannot build the request: {e}"),
    })
}

/// What came back over the wire.
struct Reply {
    status: u16,
    header_len: Option<String>,
    body: Bytes,
}

/// Send `request` and read the whole answer (at most `max_bytes` of it).
async fn exchange(
    client: &Client<HttpConnector, Body>,
    request: Request<Body>,
    max_bytes: usize,
) -> Result<Reply, BackendError> {
    let response = client.request(request).await.map_err(|e| {
        let kind = if e.is_connect() {
            RemoteFailure::Connect
        } else {
            RemoteFailure::ServerError
        };
        BackendError::Remote {
            kind,
            message: crate::core::human::error_chain(&e),
        }
    })?;
    let status = response.status().as_u16();
    let header_len = response
        .headers()
        .get(HEADER_LENGTH)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let body = axum::body::to_bytes(Body::new(response.into_body()), max_bytes)
        .await
        .map_err(|e| BackendError::Remote {
            kind: RemoteFailure::Protocol,
            message: format!(
                "the answer could not be read whole (over server.max_response_bytes, {max_bytes} bytes, or cut off): {}",
                crate::core::human::error_chain(&e)
            ),
        })?;
    Ok(Reply {
        status,
        header_len,
        body,
    })
}

/// What the remote's answer means for the request, as a demanding operator would read it:
///
/// | answer | meaning | breaker | retried on the fallback |
/// |---|---|---|---|
/// | 200 | the outputs (a malformed answer is a `protocol` failure) | success | — |
/// | 503 with vramguard's `allocator_failure_oom`/`_driver` reason | an allocator failure there, as if here | counts | yes (`oom_retry`) |
/// | 503 other, 429 | `overloaded`: refused before it ran | counts | yes |
/// | 504 when a deadline was sent | the client's deadline passed there | no | no |
/// | 404 | `server_error`: the remote does not serve the model this server says it does | counts | yes |
/// | other 4xx | the client's mistake: status and message passed on | no | no |
/// | 5xx, 408, anything else | `server_error` | counts | yes |
///
/// "Retried" holds for replayable requests on a pool with a `fallback`.
pub fn answer(
    status: u16,
    header_len: Option<&str>,
    body: &[u8],
    asked: &[String],
    deadline_sent: bool,
) -> Result<Vec<Tensor>, BackendError> {
    let failed = |kind, message: String| BackendError::Remote { kind, message };
    if status == 200 {
        let header_len = match header_len {
            None => None,
            Some(v) => Some(v.trim().parse::<usize>().map_err(|_| {
                failed(
                    RemoteFailure::Protocol,
                    format!("Inference-Header-Content-Length is `{v}`, not a number"),
                )
            })?),
        };
        return crate::protocol::oip::decode_response(body, header_len, asked)
            .map_err(|e| failed(RemoteFailure::Protocol, e));
    }
    let (message, reason) = error_body(body);
    let described = format!(
        "{status} {}: {message}",
        StatusCode::from_u16(status)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("")
    );
    match status {
        503 => match reason.as_deref() {
            Some("allocator_failure_oom") => Err(BackendError::Allocation {
                kind: AllocFailureKind::Oom,
                message: format!("on the remote server: {message}"),
            }),
            Some("allocator_failure_driver") => Err(BackendError::Allocation {
                kind: AllocFailureKind::Driver,
                message: format!("on the remote server: {message}"),
            }),
            _ => Err(failed(RemoteFailure::Overloaded, described)),
        },
        429 => Err(failed(RemoteFailure::Overloaded, described)),
        504 if deadline_sent => Err(BackendError::DeadlineExceeded),
        404 => Err(failed(
            RemoteFailure::ServerError,
            format!("the remote server does not serve this model ({described})"),
        )),
        408 => Err(failed(RemoteFailure::ServerError, described)),
        400..=499 => Err(BackendError::RemoteRefused { status, message }),
        _ => Err(failed(RemoteFailure::ServerError, described)),
    }
}

/// The message and (vramguard's) reason of an error answer: `{"error": "...", "reason": "..."}`
/// as the protocol says, else the start of whatever text it is.
fn error_body(body: &[u8]) -> (String, Option<String>) {
    #[derive(serde::Deserialize)]
    struct ErrorJson {
        error: String,
        #[serde(default)]
        reason: Option<String>,
    }
    match serde_json::from_slice::<ErrorJson>(body) {
        Ok(e) => (e.error, e.reason),
        Err(_) if body.is_empty() => ("(no message)".into(), None),
        Err(_) => (crate::core::human::clipped(&String::from_utf8_lossy(body), 200), None),
    }
}

/// Ask the remote's `/v2/health/ready` every `health_interval` and feed the answers to the
/// pool's breaker, until `cancel`: failures open it (no client request has to fail first), and
/// once its cooldown has passed a successful check is the probe that closes it. While it is
/// open nothing is asked: only the cooldown ends that.
pub async fn watch_health(
    pool: Arc<Pool>,
    options: RemoteOptions,
    metrics: RemoteMetrics,
    cancel: tokio_util::sync::CancellationToken,
) {
    let client = client(&options, 1);
    let url = format!("{}/v2/health/ready", options.url);
    let mut ticker = tokio::time::interval(options.health_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut healthy = true;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let Some(probe) = pool.health().health_check_permit() else {
            continue;
        };
        let result = tokio::select! {
            () = cancel.cancelled() => return,
            result = check(&client, &url, options.health_timeout) => result,
        };
        match (&result, healthy) {
            (Err(why), true) => {
                tracing::warn!(pool = pool.name(), url = %options.url, %why, "remote server not ready")
            }
            (Ok(()), false) => tracing::info!(pool = pool.name(), url = %options.url, "remote server ready again"),
            _ => {}
        }
        healthy = result.is_ok();
        if result.is_err() {
            metrics.failed(RemoteFailure::Health);
        }
        pool.health().health_checked(probe, result.map_err(CheckFailure::Other));
    }
}

/// One readiness check: 200 within `timeout`, or why not.
async fn check(client: &Client<HttpConnector, Body>, url: &str, timeout: Duration) -> Result<(), String> {
    let request = Request::get(url).body(Body::empty()).map_err(|e| e.to_string())?;
    match tokio::time::timeout(timeout, client.request(request)).await {
        Err(_) => Err(format!(
            "no answer within {}ms (remote.health_timeout)",
            timeout.as_millis()
        )),
        Ok(Err(e)) => Err(crate::core::human::error_chain(&e)),
        Ok(Ok(response)) if response.status() == StatusCode::OK => Ok(()),
        Ok(Ok(response)) => Err(format!("/v2/health/ready answered {}", response.status())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::tensor::TensorData;

    fn fails(status: u16, body: &str, deadline_sent: bool) -> BackendError {
        answer(status, None, body.as_bytes(), &[], deadline_sent).unwrap_err()
    }

    fn remote(kind: RemoteFailure, message: &str) -> BackendError {
        BackendError::Remote {
            kind,
            message: message.into(),
        }
    }

    #[test]
    fn outputs_come_back_from_a_binary_answer() {
        let header = r#"{"model_name":"m","outputs":[{"name":"y","shape":[2],"datatype":"FP32","parameters":{"binary_data_size":8}}]}"#;
        let mut body = header.as_bytes().to_vec();
        body.extend_from_slice(&1.5f32.to_le_bytes());
        body.extend_from_slice(&(-1f32).to_le_bytes());
        let len = header.len().to_string();
        let outputs = answer(200, Some(&len), &body, &["y".into()], false).unwrap();
        assert_eq!(outputs[0].data, TensorData::Fp32(vec![1.5, -1.0]));
        assert_eq!(
            answer(200, Some("lots"), &body, &[], false).unwrap_err(),
            remote(
                RemoteFailure::Protocol,
                "Inference-Header-Content-Length is `lots`, not a number"
            )
        );
        assert!(matches!(
            answer(200, None, b"<html>oops</html>", &[], false),
            Err(BackendError::Remote {
                kind: RemoteFailure::Protocol,
                ..
            })
        ));
    }

    #[test]
    fn a_remote_allocator_failure_is_one_here_so_the_request_moves_to_the_fallback() {
        let body =
            r#"{"error":"allocator failure (oom) on pool `gpu`...","reason":"allocator_failure_oom","retried":false}"#;
        assert_eq!(
            fails(503, body, false),
            BackendError::Allocation {
                kind: AllocFailureKind::Oom,
                message: "on the remote server: allocator failure (oom) on pool `gpu`...".into(),
            }
        );
        let driver = r#"{"error":"reset","reason":"allocator_failure_driver"}"#;
        assert!(matches!(
            fails(503, driver, false),
            BackendError::Allocation {
                kind: AllocFailureKind::Driver,
                ..
            }
        ));
    }

    #[test]
    fn refusals_and_server_errors_are_the_remotes_failures() {
        assert_eq!(
            fails(503, r#"{"error":"pool `cpu` queue is full (16 waiting)"}"#, false),
            remote(
                RemoteFailure::Overloaded,
                "503 Service Unavailable: pool `cpu` queue is full (16 waiting)"
            )
        );
        assert_eq!(
            fails(429, r#"{"error":"deferred"}"#, false),
            remote(RemoteFailure::Overloaded, "429 Too Many Requests: deferred")
        );
        assert_eq!(
            fails(500, "", false),
            remote(RemoteFailure::ServerError, "500 Internal Server Error: (no message)")
        );
        assert_eq!(
            fails(502, "<html>bad gateway</html>", false),
            remote(RemoteFailure::ServerError, "502 Bad Gateway: <html>bad gateway</html>")
        );
        // The model this server routes there is missing there: a configuration fault, not the
        // client's.
        assert_eq!(
            fails(404, r#"{"error":"unknown model `encoder`"}"#, false),
            remote(
                RemoteFailure::ServerError,
                "the remote server does not serve this model (404 Not Found: unknown model `encoder`)"
            )
        );
    }

    #[test]
    fn the_clients_mistakes_pass_through_and_its_deadline_is_its_own() {
        assert_eq!(
            fails(
                400,
                r#"{"error":"input `x`: dimension 1 is 3 but the model requires 2"}"#,
                false
            ),
            BackendError::RemoteRefused {
                status: 400,
                message: "input `x`: dimension 1 is 3 but the model requires 2".into()
            }
        );
        assert!(matches!(
            fails(413, r#"{"error":"too large"}"#, false),
            BackendError::RemoteRefused { status: 413, .. }
        ));
        assert_eq!(
            fails(504, r#"{"error":"deadline"}"#, true),
            BackendError::DeadlineExceeded
        );
        // Without a deadline of ours, a 504 is a gateway in front of the remote timing out.
        assert!(matches!(
            fails(504, "", false),
            BackendError::Remote {
                kind: RemoteFailure::ServerError,
                ..
            }
        ));
    }

    #[test]
    fn what_travels_with_a_request() {
        let meta = RunMeta {
            request_id: "req-9".into(),
            deadline: None,
            idempotency_key: Some("key-1".into()),
            priority: 3,
            replayable: false,
            allow_shrink: true,
        };
        let request = build_request(
            "http://10.0.0.2:8080/prefix",
            "encoder",
            vec![],
            12,
            &meta,
            Some(Duration::from_micros(1_500_900)),
        )
        .unwrap();
        assert_eq!(request.uri(), "http://10.0.0.2:8080/prefix/v2/models/encoder/infer");
        let h = |name: &str| request.headers().get(name).unwrap().to_str().unwrap().to_string();
        assert_eq!(h(REQUEST_ID), "req-9");
        assert_eq!(h(DEADLINE_HEADER), "1500");
        assert_eq!(h(IDEMPOTENCY_KEY), "key-1");
        assert_eq!(h(PRIORITY_HEADER), "3");
        assert_eq!(h(REPLAYABLE_HEADER), "false");
        assert_eq!(h(ALLOW_SHRINK_HEADER), "true");
        assert_eq!(h(HEADER_LENGTH), "12");
        let plain = build_request(
            "http://h:1",
            "m",
            vec![],
            2,
            &RunMeta {
                replayable: true,
                ..RunMeta::default()
            },
            None,
        )
        .unwrap();
        for absent in [
            DEADLINE_HEADER,
            IDEMPOTENCY_KEY,
            PRIORITY_HEADER,
            REPLAYABLE_HEADER,
            ALLOW_SHRINK_HEADER,
        ] {
            assert!(plain.headers().get(absent).is_none(), "{absent}");
        }
    }
}
