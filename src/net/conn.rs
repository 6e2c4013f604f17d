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
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderName, HeaderValue, Request, Response};
use axum::serve::Listener;
use http_body::Body as HttpBody;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower_service::Service as _;

use super::body::Receiving;
use super::watch::{BUSY, IDLE, Watch, Watched};
use crate::protocol::headers::REQUEST_ID;
use crate::telemetry::metrics::HttpLimit;

// The connection layer's face: what servers are built with, wherever it is defined.
pub use super::body::refused_status;
pub use super::limits::{Limits, Refusals};
pub use super::refusal::body_too_large;

/// After refusing a body it did not read, the server closes its side and reads what the client
/// still sends, for at most this long, before closing the socket: closing with unread data makes
/// the kernel answer with a reset, which can destroy the response before the client reads it
/// (nginx's "lingering close").
const LINGER: Duration = Duration::from_secs(2);

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
        Err(limit) => with_id(limits.refuse(limit, request.uri().path(), &watch), id),
        Ok(reserved) => {
            // Kept for a refusal while the route reads the body (a shared handle, not a copy).
            let uri = request.uri().clone();
            let request = request.map(|body| {
                if body.is_end_stream() {
                    Body::new(body)
                } else {
                    Body::new(Receiving::new(body, Arc::clone(&limits), Arc::clone(&watch), reserved))
                }
            });
            let response = router.call(request).await.unwrap_or_else(|e| match e {});
            match watch.take_body_refusal() {
                // The handler saw only a failed read; the answer says which limit it was.
                Some(limit) => {
                    let id = response.headers().get(REQUEST_ID).cloned().or(id);
                    with_id(limits.refusal(limit, uri.path(), &watch), id)
                }
                None => {
                    let mut response = response;
                    if watch.take_body_unread() {
                        watch.close_after(&mut response);
                    }
                    response
                }
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
