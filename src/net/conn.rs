//! Connections: the accept loop and the limits that keep slow, idle or greedy clients from
//! holding the server's sockets and memory.
//!
//! A connection is always in one of three phases, and each has its own clock:
//! - **head**: from the connection's start, or from the first byte of a later request, until the
//!   request headers are complete; `server.timeouts.header_read` closes it.
//! - **busy**: a request is being handled. Its body may stall (no byte arriving) for at most
//!   `server.timeouts.body_read` (then 408); the handler's own time is bounded by the lifecycle
//!   (queue bounds, deadlines), not here.
//! - **idle**: the response is out and no byte of another request has come; bytes of the
//!   response still being written count as activity. `server.timeouts.idle` closes it.
//!
//! hyper's own `header_read_timeout` is not used: its clock starts as soon as a connection is
//! idle, so it would close keep-alive connections at the header timeout and there could be no
//! longer idle timeout beside a short header one.
//!
//! At most `server.max_connections` connections are served at once. The next one is accepted
//! and waits, unserved, for a slot; the ones behind it wait in the kernel's listen backlog, as
//! with nginx, HAProxy and Go's `LimitListener`, and are served in order once a connection
//! closes. A burst then costs latency instead of errors, and vramguard's memory does not grow
//! with it.

use std::convert::Infallible;
use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::http::{HeaderName, HeaderValue, Request, Response, StatusCode, header};
use axum::response::IntoResponse;
use axum::serve::Listener;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower_service::Service as _;

use crate::config::{ServerConfig, Timeouts, format_duration, format_size};
use crate::protocol::headers::REQUEST_ID;
use crate::telemetry::metrics::{HttpLimit, HttpLimitLabels, Metrics};

/// The message of a 413 for a body over `server.body_limit` of `limit` bytes, the same whether
/// the connection layer refused its declared length or the router found it too long.
pub fn body_too_large(limit: u64) -> String {
    format!("request body exceeds the {limit} byte limit (server.body_limit)")
}

/// A request the connection layer answers itself, before any handler sees it: the API's error
/// body (`{"error": "..."}`), with `Retry-After` when waiting helps.
#[derive(Debug)]
struct Refusal {
    status: StatusCode,
    message: String,
    retry_after: Option<u64>,
}

impl Refusal {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            retry_after: None,
        }
    }

    fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds.max(1));
        self
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> axum::response::Response {
        let body = serde_json::json!({ "error": self.message });
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// After refusing a body it did not read, the server closes its side and reads what the client
/// still sends, for at most this long, before closing the socket: closing with unread data makes
/// the kernel answer with a reset, which can destroy the response before the client reads it
/// (nginx's "lingering close").
const LINGER: Duration = Duration::from_secs(2);

/// Bodies being received are counted in KiB: `Semaphore::try_acquire_many` takes a `u32`.
const RECEIVING_UNIT: u64 = 1024;

/// The limits of one server and their metrics; shared by all its connections.
#[derive(Debug)]
pub struct Limits {
    timeouts: Timeouts,
    body_limit: u64,
    max_connections: usize,
    max_receiving_bytes: u64,
    /// One permit per connection served.
    slots: Arc<Semaphore>,
    /// Bytes of request bodies being received, in [`RECEIVING_UNIT`]s.
    receiving: Arc<Semaphore>,
    hits: [Counter; HttpLimit::ALL.len()],
    /// Whether each limit has been logged: the first hit is, later ones only counted.
    logged: [AtomicBool; HttpLimit::ALL.len()],
    connections: Gauge,
}

impl Limits {
    /// The limits of `server:`, counted in `metrics`.
    pub fn new(server: &ServerConfig, metrics: &Metrics) -> Arc<Limits> {
        warn_if_open_files_are_short(server.max_connections);
        let units = |bytes: u64| usize::try_from(bytes.div_ceil(RECEIVING_UNIT)).unwrap_or(usize::MAX);
        Arc::new(Limits {
            timeouts: server.timeouts,
            body_limit: server.body_limit as u64,
            max_connections: server.max_connections,
            max_receiving_bytes: server.max_receiving_bytes,
            slots: Arc::new(Semaphore::new(server.max_connections)),
            receiving: Arc::new(Semaphore::new(units(server.max_receiving_bytes))),
            hits: HttpLimit::ALL.map(|limit| metrics.http_limit_hits.get_or_create_owned(&HttpLimitLabels { limit })),
            logged: std::array::from_fn(|_| AtomicBool::new(false)),
            connections: metrics.http_connections.clone(),
        })
    }

    /// Count a hit of `limit` by `peer`; the first of each kind is logged, later ones only
    /// counted (a flood of slow clients must not become a flood of log lines). Returns whether
    /// this hit was logged.
    fn hit(&self, limit: HttpLimit, peer: &dyn Debug) -> bool {
        self.hits[limit as usize].inc();
        if self.logged[limit as usize].swap(true, Ordering::Relaxed) {
            tracing::debug!(?limit, ?peer, "HTTP limit hit");
            return false;
        }
        let what = self.explain(limit);
        let label = format!("{limit:?}");
        // An idle keep-alive connection closing is routine; the others mean a client was slow,
        // too big or one too many.
        if limit == HttpLimit::idle_timeout {
            tracing::info!(
                limit = label,
                ?peer,
                "{what}; later ones are counted in vramguard_http_limit_hits_total, not logged"
            );
        } else {
            tracing::warn!(
                limit = label,
                ?peer,
                "{what}; later ones are counted in vramguard_http_limit_hits_total, not logged"
            );
        }
        true
    }

    fn explain(&self, limit: HttpLimit) -> String {
        let t = &self.timeouts;
        match limit {
            HttpLimit::header_timeout => format!(
                "a client did not complete its request headers within server.timeouts.header_read ({}); its connection was closed",
                format_duration(t.header_read)
            ),
            HttpLimit::body_timeout => format!(
                "a request body brought no data for server.timeouts.body_read ({}); answered 408 and closed the connection",
                format_duration(t.body_read)
            ),
            HttpLimit::idle_timeout => format!(
                "closed a keep-alive connection idle for server.timeouts.idle ({})",
                format_duration(t.idle)
            ),
            HttpLimit::max_connections => format!(
                "server.max_connections ({}) connections are open; new ones wait for one to close",
                self.max_connections
            ),
            HttpLimit::body_bytes => format!(
                "request bodies being received reached server.max_receiving_bytes ({}); answered 503 with Retry-After",
                format_size(self.max_receiving_bytes)
            ),
            HttpLimit::body_limit => format!(
                "a request body is larger than server.body_limit ({}); answered 413",
                format_size(self.body_limit)
            ),
        }
    }

    /// The answer to a request whose body was refused by `limit`. The connection closes after
    /// it (the rest of the body is not read), lingering so the client can read it.
    fn refusal(&self, limit: HttpLimit, watch: &Watch) -> Response<Body> {
        let error = match limit {
            HttpLimit::body_limit => Refusal::new(StatusCode::PAYLOAD_TOO_LARGE, body_too_large(self.body_limit)),
            HttpLimit::body_bytes => Refusal::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "request bodies being received are at server.max_receiving_bytes ({}); retry shortly",
                    format_size(self.max_receiving_bytes)
                ),
            )
            .retry_after(1),
            // `body_timeout`; the other limits close a connection without an answer.
            _ => Refusal::new(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body brought no data for server.timeouts.body_read ({})",
                    format_duration(self.timeouts.body_read)
                ),
            ),
        };
        watch.linger.store(true, Ordering::Relaxed);
        let mut response = error.into_response();
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        response
    }

    /// Check a request's body against the limits before anything reads it: a declared length
    /// over `body_limit` is refused at once, and one that does not fit in what may be received
    /// now gets 503. Returns the bytes reserved for it.
    fn admit_body(&self, body: &Incoming, watch: &Watch) -> Result<Option<OwnedSemaphorePermit>, HttpLimit> {
        let Some(declared) = body.size_hint().exact() else {
            // Chunked: the body reserves as it arrives.
            return Ok(None);
        };
        if declared > self.body_limit {
            self.hit(HttpLimit::body_limit, &watch.peer);
            return Err(HttpLimit::body_limit);
        }
        if declared == 0 {
            return Ok(None);
        }
        match Arc::clone(&self.receiving).try_acquire_many_owned(units(declared)) {
            Ok(permit) => Ok(Some(permit)),
            Err(_) => {
                self.hit(HttpLimit::body_bytes, &watch.peer);
                Err(HttpLimit::body_bytes)
            }
        }
    }
}

fn units(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(RECEIVING_UNIT)).unwrap_or(u32::MAX)
}

/// Each connection holds a file descriptor: a cap above the process's open-file limit would be
/// met as accept errors instead of as the cap.
fn warn_if_open_files_are_short(max_connections: usize) {
    use procfs::process::{LimitValue, Process};
    let Ok(limits) = Process::myself().and_then(|p| p.limits()) else {
        return;
    };
    if let LimitValue::Value(open_files) = limits.max_open_files.soft_limit {
        // Model files, the ONNX Runtime library, logs, /proc reads and the listener need some.
        let spare = 64;
        if open_files < max_connections as u64 + spare {
            tracing::warn!(
                open_files,
                max_connections,
                "server.max_connections is close to or above the open-file limit (ulimit -n, systemd LimitNOFILE); \
                 connections beyond it fail to be accepted instead of waiting for a slot"
            );
        }
    }
}

/// A connection's phase, as [`Watch::phase`] holds it.
const HEAD: u8 = 0;
const BUSY: u8 = 1;
const IDLE: u8 = 2;

/// What one connection is doing, shared by its socket, its service and its watchdog. All three
/// run in the connection's task, so relaxed atomics suffice; they are atomics only because the
/// service must be `Send`. A phase change does not wake the watchdog (see [`Watch::expired`]),
/// so a request costs it nothing.
#[derive(Debug)]
struct Watch {
    peer: String,
    start: Instant,
    phase: AtomicU8,
    /// When the current phase's clock started, in nanoseconds since `start`.
    since: AtomicU64,
    /// A limit met while the handler read the body (0: none, else the limit's index + 1).
    body_refused: AtomicU8,
    /// The last response refused a body it did not read.
    linger: AtomicBool,
}

impl Watch {
    fn new(peer: String) -> Watch {
        Watch {
            peer,
            start: Instant::now(),
            phase: AtomicU8::new(HEAD),
            since: AtomicU64::new(0),
            body_refused: AtomicU8::new(0),
            linger: AtomicBool::new(false),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn enter(&self, phase: u8) {
        self.since.store(self.now(), Ordering::Relaxed);
        self.phase.store(phase, Ordering::Relaxed);
    }

    /// Bytes came in: on an idle connection they start a request's head.
    fn read_some(&self) {
        if self.phase.load(Ordering::Relaxed) == IDLE {
            self.enter(HEAD);
        }
    }

    /// Bytes went out: a response still being written is not idleness.
    fn wrote_some(&self) {
        if self.phase.load(Ordering::Relaxed) == IDLE {
            self.since.store(self.now(), Ordering::Relaxed);
        }
    }

    /// When the current phase runs out, and which limit that is.
    fn deadline(&self, t: &Timeouts) -> Option<(Instant, HttpLimit)> {
        let (timeout, limit) = match self.phase.load(Ordering::Relaxed) {
            HEAD => (t.header_read, HttpLimit::header_timeout),
            IDLE => (t.idle, HttpLimit::idle_timeout),
            _ => return None,
        };
        let since = self.start + Duration::from_nanos(self.since.load(Ordering::Relaxed));
        Some((since + timeout, limit))
    }

    /// Resolves when the connection has spent too long in its current phase.
    ///
    /// It looks again at the phase's deadline or after the shorter of the header and idle
    /// timeouts, whichever comes first. Any phase that starts after a look ends no sooner than
    /// that (a clock that starts later and runs at least that long), so no deadline is missed
    /// and phase changes need not wake it: a busy connection costs one look per period.
    async fn expired(&self, t: Timeouts) -> HttpLimit {
        let period = t.header_read.min(t.idle);
        loop {
            let now = Instant::now();
            let next = match self.deadline(&t) {
                Some((at, limit)) if at <= now => return limit,
                Some((at, _)) => at.min(now + period),
                None => now + period,
            };
            tokio::time::sleep_until(next).await;
        }
    }

    fn refuse_body(&self, limit: HttpLimit) {
        self.body_refused.store(limit as u8 + 1, Ordering::Relaxed);
    }

    fn take_body_refusal(&self) -> Option<HttpLimit> {
        match self.body_refused.swap(0, Ordering::Relaxed) {
            0 => None,
            n => HttpLimit::ALL.get(usize::from(n) - 1).copied(),
        }
    }
}

/// Serve `router` on `listener` under `limits` until `cancel`, then stop accepting, let open
/// connections finish (idle ones close at once) and return when all have closed.
pub async fn serve<L>(mut listener: L, router: Router, limits: Arc<Limits>, cancel: CancellationToken)
where
    L: Listener,
    L::Addr: Clone + Debug + Send + Sync + Unpin + 'static,
{
    let connections = TaskTracker::new();
    loop {
        let (io, peer) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = cancel.cancelled() => break,
        };
        let slot = match Arc::clone(&limits.slots).try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                // Full: this client waits here unserved, the ones behind it in the backlog.
                limits.hit(HttpLimit::max_connections, &peer);
                tokio::select! {
                    slot = Arc::clone(&limits.slots).acquire_owned() => slot.expect("the slot semaphore is never closed"),
                    () = cancel.cancelled() => break,
                }
            }
        };
        connections.spawn(connection(
            io,
            peer,
            router.clone(),
            Arc::clone(&limits),
            slot,
            cancel.clone(),
        ));
    }
    // Closing the listener now refuses clients still in the backlog instead of leaving them
    // to time out.
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// Counts a connection in `vramguard_http_connections` while it lives.
struct Open<'a>(&'a Gauge);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

async fn connection<I, A>(
    io: I,
    peer: A,
    router: Router,
    limits: Arc<Limits>,
    _slot: OwnedSemaphorePermit,
    cancel: CancellationToken,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    A: Clone + Debug + Send + Sync + Unpin + 'static,
{
    limits.connections.inc();
    let _open = Open(&limits.connections);
    let watch = Arc::new(Watch::new(format!("{peer:?}")));
    let service = {
        let (limits, watch) = (Arc::clone(&limits), Arc::clone(&watch));
        hyper::service::service_fn(move |request| {
            let served = handle(
                router.clone(),
                Arc::clone(&limits),
                Arc::clone(&watch),
                peer.clone(),
                request,
            );
            Box::pin(served) as Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>
        })
    };
    let io = TokioIo::new(Watched {
        io,
        watch: Arc::clone(&watch),
    });
    let mut conn = hyper::server::conn::http1::Builder::new().serve_connection(io, service);
    let expired = watch.expired(limits.timeouts);
    tokio::pin!(expired);
    let mut draining = false;
    let ended = loop {
        tokio::select! {
            // The connection first: bytes that arrived by the deadline count.
            biased;
            ended = std::future::poll_fn(|cx| conn.poll_without_shutdown(cx)) => break ended,
            limit = &mut expired => {
                limits.hit(limit, &watch.peer);
                return;
            }
            () = cancel.cancelled(), if !draining => {
                draining = true;
                Pin::new(&mut conn).graceful_shutdown();
            }
        }
    };
    if let Err(e) = ended {
        tracing::debug!(peer = %watch.peer, error = %e, "connection ended with an error");
    }
    if watch.linger.load(Ordering::Relaxed) {
        linger(conn.into_parts().io.into_inner().io).await;
    }
}

/// Close our side, then drain what the client still sends until it closes too or [`LINGER`]
/// passes.
async fn linger<I: AsyncRead + AsyncWrite + Unpin>(mut io: I) {
    let _ = io.shutdown().await;
    let deadline = Instant::now() + LINGER;
    let mut scratch = vec![0; 16 * 1024];
    while let Ok(Ok(n)) = tokio::time::timeout_at(deadline, io.read(&mut scratch)).await {
        if n == 0 {
            break;
        }
    }
}

/// One request: the body checked against the limits before the router sees it, and refused
/// with the limit's answer if one was met while the handler read it.
async fn handle<A>(
    mut router: Router,
    limits: Arc<Limits>,
    watch: Arc<Watch>,
    peer: A,
    mut request: Request<Incoming>,
) -> Result<Response<Body>, Infallible>
where
    A: Clone + Send + Sync + 'static,
{
    watch.enter(BUSY);
    request.extensions_mut().insert(ConnectInfo(peer));
    let id = request.headers().get(REQUEST_ID).cloned();
    let response = match limits.admit_body(request.body(), &watch) {
        Err(limit) => with_id(limits.refusal(limit, &watch), id),
        Ok(reserved) => {
            let request = request.map(|body| {
                if body.is_end_stream() {
                    Body::new(body)
                } else {
                    Body::new(Receiving {
                        body,
                        limits: Arc::clone(&limits),
                        watch: Arc::clone(&watch),
                        reserved,
                        received: 0,
                        stall: None,
                        waiting: false,
                    })
                }
            });
            let response = router.call(request).await.unwrap_or_else(|e| match e {});
            match watch.take_body_refusal() {
                // The handler saw only a failed read; the answer says which limit it was.
                Some(limit) => {
                    let id = response.headers().get(REQUEST_ID).cloned().or(id);
                    with_id(limits.refusal(limit, &watch), id)
                }
                None => response,
            }
        }
    };
    watch.enter(IDLE);
    Ok(response)
}

fn with_id(mut response: Response<Body>, id: Option<HeaderValue>) -> Response<Body> {
    if let Some(id) = id {
        response.headers_mut().insert(HeaderName::from_static(REQUEST_ID), id);
    }
    response
}

/// A request body being received: a stall longer than `body_read` fails it, and its bytes are
/// reserved in the server's receiving budget until it has been read (a body of unknown length
/// reserves as it arrives, and is held to `body_limit`).
struct Receiving {
    body: Incoming,
    limits: Arc<Limits>,
    watch: Arc<Watch>,
    reserved: Option<OwnedSemaphorePermit>,
    received: u64,
    /// The stall clock, created on the first wait.
    stall: Option<Pin<Box<Sleep>>>,
    /// Whether the stall clock runs (the body is waiting for bytes).
    waiting: bool,
}

/// Why a body read failed; the handler sees it as a failed read and [`handle`] answers for it.
#[derive(Debug, thiserror::Error)]
#[error("request body refused ({0:?})")]
struct Refused(HttpLimit);

impl Receiving {
    fn refuse(&mut self, limit: HttpLimit) -> axum::BoxError {
        self.limits.hit(limit, &self.watch.peer);
        self.watch.refuse_body(limit);
        self.reserved = None;
        Box::new(Refused(limit))
    }

    /// Reserve what has arrived beyond the reservation (bodies of unknown length).
    fn reserve(&mut self) -> Result<(), HttpLimit> {
        if self.received > self.limits.body_limit {
            return Err(HttpLimit::body_limit);
        }
        let needed = units(self.received);
        let held = self.reserved.as_ref().map_or(0, |p| p.num_permits() as u32);
        if needed <= held {
            return Ok(());
        }
        let more = Arc::clone(&self.limits.receiving)
            .try_acquire_many_owned(needed - held)
            .map_err(|_| HttpLimit::body_bytes)?;
        match &mut self.reserved {
            Some(permit) => permit.merge(more),
            None => self.reserved = Some(more),
        }
        Ok(())
    }
}

impl HttpBody for Receiving {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.waiting = false;
                if let Some(data) = frame.data_ref() {
                    this.received += data.len() as u64;
                    if let Err(limit) = this.reserve() {
                        return Poll::Ready(Some(Err(this.refuse(limit))));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                // Received in full: what it holds now is the handler's to account for.
                this.reserved = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Pending => {
                let timeout = this.limits.timeouts.body_read;
                if !this.waiting {
                    this.waiting = true;
                    let at = Instant::now() + timeout;
                    match &mut this.stall {
                        Some(stall) => stall.as_mut().reset(at),
                        None => this.stall = Some(Box::pin(tokio::time::sleep_until(at))),
                    }
                }
                let stalled = this.stall.as_mut().is_some_and(|s| s.as_mut().poll(cx).is_ready());
                if stalled {
                    return Poll::Ready(Some(Err(this.refuse(HttpLimit::body_timeout))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A connection's socket, telling its [`Watch`] when bytes move.
struct Watched<I> {
    io: I,
    watch: Arc<Watch>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.watch.read_some();
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.watch.wrote_some();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.watch.wrote_some();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Arc<Limits> {
        let config = crate::config::Config::embedded(false);
        let (metrics, _) = Metrics::new("test");
        Limits::new(&config.server, &metrics)
    }

    #[test]
    fn each_limit_is_logged_once_and_counted_every_time() {
        let limits = limits();
        for limit in HttpLimit::ALL {
            assert!(limits.hit(limit, &"peer"), "{limit:?}: the first hit is logged");
            assert!(!limits.hit(limit, &"peer"), "{limit:?}: later hits are not");
            assert_eq!(limits.hits[limit as usize].get(), 2);
        }
    }

    const T: Timeouts = Timeouts {
        header_read: Duration::from_secs(10),
        body_read: Duration::from_secs(30),
        idle: Duration::from_secs(75),
    };

    /// A watchdog on `watch`, watched from now on; resolves with the limit and when it hit.
    fn watchdog(watch: &Arc<Watch>) -> tokio::task::JoinHandle<(HttpLimit, Instant)> {
        let watch = Arc::clone(watch);
        tokio::spawn(async move { (watch.expired(T).await, Instant::now()) })
    }

    #[tokio::test(start_paused = true)]
    async fn the_header_clock_starts_at_the_first_byte_after_idle_not_at_idle() {
        let watch = Arc::new(Watch::new("peer".into()));
        let expired = watchdog(&watch);
        tokio::time::sleep(Duration::from_secs(5)).await;
        watch.enter(BUSY);
        // However long the request takes, the connection is not slow.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        watch.enter(IDLE);
        // Idle for longer than the header timeout: still only idle.
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert!(!expired.is_finished());
        // A byte of the next request starts its header clock, and the watchdog, never woken by
        // the phase changes, still acts on time.
        watch.read_some();
        let head_started = Instant::now();
        let (limit, at) = expired.await.unwrap();
        assert_eq!(limit, HttpLimit::header_timeout);
        assert_eq!(at, head_started + T.header_read);
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_expires_after_the_last_byte_it_wrote() {
        let watch = Arc::new(Watch::new("peer".into()));
        let expired = watchdog(&watch);
        watch.enter(BUSY);
        watch.enter(IDLE);
        // A large response still leaving is activity.
        tokio::time::sleep(Duration::from_secs(50)).await;
        watch.wrote_some();
        let last_write = Instant::now();
        let (limit, at) = expired.await.unwrap();
        assert_eq!(limit, HttpLimit::idle_timeout);
        assert_eq!(at, last_write + T.idle);
    }
}
