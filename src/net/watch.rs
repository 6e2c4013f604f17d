//! What one connection is doing (its phase and since when), the watchdog that closes it when a
//! phase lasts too long, and the socket wrapper that tells the watch when bytes move.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, Response, header};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use crate::config::Timeouts;
use crate::telemetry::metrics::HttpLimit;

/// A connection's phase, as [`Watch::phase`] holds it.
const HEAD: u8 = 0;
pub(super) const BUSY: u8 = 1;
pub(super) const IDLE: u8 = 2;

/// What one connection is doing, shared by its socket, its service and its watchdog. All three
/// run in the connection's task, so relaxed atomics suffice; they are atomics only because the
/// service must be `Send`. A phase change does not wake the watchdog (see [`Watch::expired`]),
/// so a request costs it nothing.
#[derive(Debug)]
pub(super) struct Watch {
    /// The client, as logged.
    pub(super) peer: String,
    start: Instant,
    phase: AtomicU8,
    /// When the current phase's clock started, in nanoseconds since `start`.
    since: AtomicU64,
    /// A limit met while the handler read the body (0: none, else the limit's index + 1).
    body_refused: AtomicU8,
    /// The last response refused a body it did not read, or answered before its body was
    /// read: the connection closes after it, lingering.
    pub(super) linger: AtomicBool,
    /// The handler dropped the request's body before its end (it answered early).
    body_unread: AtomicBool,
}

impl Watch {
    pub(super) fn new(peer: String) -> Watch {
        Watch {
            peer,
            start: Instant::now(),
            phase: AtomicU8::new(HEAD),
            since: AtomicU64::new(0),
            body_refused: AtomicU8::new(0),
            linger: AtomicBool::new(false),
            body_unread: AtomicBool::new(false),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    pub(super) fn enter(&self, phase: u8) {
        self.since.store(self.now(), Ordering::Relaxed);
        self.phase.store(phase, Ordering::Relaxed);
    }

    /// Bytes came in: on an idle connection they start a request's head.
    pub(super) fn read_some(&self) {
        if self.phase.load(Ordering::Relaxed) == IDLE {
            self.enter(HEAD);
        }
    }

    /// Bytes went out: a response still being written is not idleness.
    pub(super) fn wrote_some(&self) {
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
    pub(super) async fn expired(&self, t: Timeouts) -> HttpLimit {
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

    /// The request's body was dropped before its end: what the client still sends of it would
    /// be read as the next request's head.
    pub(super) fn leave_body_unread(&self) {
        self.body_unread.store(true, Ordering::Relaxed);
    }

    /// Whether the last request's body was left unread, clearing it.
    pub(super) fn take_body_unread(&self) -> bool {
        self.body_unread.swap(false, Ordering::Relaxed)
    }

    /// Close the connection after `response`, lingering so the client reads it: the rest of a
    /// body nobody reads is still coming, and closing with unread bytes makes the kernel send
    /// a reset that can destroy the answer before the client reads it. `Connection: close`
    /// tells the client not to send its next request here.
    pub(super) fn close_after(&self, response: &mut Response<Body>) {
        self.linger.store(true, Ordering::Relaxed);
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }

    pub(super) fn refuse_body(&self, limit: HttpLimit) {
        self.body_refused.store(limit as u8 + 1, Ordering::Relaxed);
    }

    pub(super) fn take_body_refusal(&self) -> Option<HttpLimit> {
        match self.body_refused.swap(0, Ordering::Relaxed) {
            0 => None,
            n => HttpLimit::ALL.get(usize::from(n) - 1).copied(),
        }
    }
}

/// A connection's socket, telling its [`Watch`] when bytes move.
pub(super) struct Watched<I> {
    pub(super) io: I,
    pub(super) watch: Arc<Watch>,
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
