//! A request body as the handler reads it: held to `server.timeouts.body_read` between bytes,
//! and its bytes reserved in the server's receiving budget until it has been read.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Bytes;
use axum::http::StatusCode;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{Instant, Sleep};

use super::limits::{Limits, refusal_status, units};
use super::watch::Watch;
use crate::telemetry::metrics::HttpLimit;

/// A request body being received: a stall longer than `body_read` fails it, and its bytes are
/// reserved in the server's receiving budget until it has been read (a body of unknown length
/// reserves as it arrives, and is held to `body_limit`).
pub(super) struct Receiving {
    body: Incoming,
    limits: Arc<Limits>,
    watch: Arc<Watch>,
    reserved: Option<OwnedSemaphorePermit>,
    received: u64,
    /// The stall clock, created on the first wait.
    stall: Option<Pin<Box<Sleep>>>,
    /// Whether the stall clock runs (the body is waiting for bytes).
    waiting: bool,
    /// Read to its end, or refused (the refusal closes the connection itself).
    done: bool,
}

/// Why a body read failed. The handler sees only a failed read; the connection, told by the
/// [`Watch`], answers with the limit's refusal.
#[derive(Debug, thiserror::Error)]
#[error("request body refused ({0:?})")]
struct Refused(HttpLimit);

/// The status the connection answers with when a limit refused a body whose read failed with
/// `err` (found among the errors it wraps: the router's rejection wraps the body's), if one
/// did. The connection's refusal replaces the handler's answer, so a handler counts its answer
/// by this.
pub fn refused_status(err: &(dyn std::error::Error + 'static)) -> Option<StatusCode> {
    let mut err = Some(err);
    while let Some(e) = err {
        if let Some(Refused(limit)) = e.downcast_ref::<Refused>() {
            return Some(refusal_status(*limit));
        }
        err = e.source();
    }
    None
}

impl Receiving {
    /// `body`, under `limits`, holding the bytes `reserved` for it when its length was declared.
    pub(super) fn new(
        body: Incoming,
        limits: Arc<Limits>,
        watch: Arc<Watch>,
        reserved: Option<OwnedSemaphorePermit>,
    ) -> Receiving {
        Receiving {
            body,
            limits,
            watch,
            reserved,
            received: 0,
            stall: None,
            waiting: false,
            done: false,
        }
    }

    fn refuse(&mut self, limit: HttpLimit) -> axum::BoxError {
        self.limits.hit(limit, &self.watch.peer);
        self.watch.refuse_body(limit);
        self.reserved = None;
        self.done = true;
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

impl Drop for Receiving {
    /// A handler that answers before it has read the whole body (a multipart form refused at
    /// its first field) drops the rest: the connection must not carry another request.
    fn drop(&mut self) {
        if !self.done && !self.body.is_end_stream() {
            self.watch.leave_body_unread();
        }
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
                this.done = true;
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
