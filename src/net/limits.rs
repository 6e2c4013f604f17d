//! The limits one server puts on its connections: the caps on connections and on bodies being
//! received, the timeouts, how each hit is counted and logged, and the answer to a request whose
//! body a limit refused.

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::body::Body;
use axum::http::{Response, StatusCode};
use axum::response::IntoResponse;
use http_body::Body as HttpBody;
use hyper::body::Incoming;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::refusal::{ApiError, body_too_large};
use super::watch::Watch;
use crate::config::{ServerConfig, Timeouts, format_duration, format_size};
use crate::telemetry::metrics::{HttpLimit, HttpLimitLabels, ProcessMetrics};

/// Bodies being received are counted in KiB: `Semaphore::try_acquire_many` takes a `u32`.
const RECEIVING_UNIT: u64 = 1024;

/// The limits of one server and their metrics; shared by all its connections.
#[derive(Debug)]
pub struct Limits {
    pub(super) timeouts: Timeouts,
    pub(super) body_limit: u64,
    max_connections: usize,
    max_receiving_bytes: u64,
    /// One permit per connection served.
    pub(super) slots: Arc<Semaphore>,
    /// Bytes of request bodies being received, in [`RECEIVING_UNIT`]s.
    pub(super) receiving: Arc<Semaphore>,
    hits: [Counter; HttpLimit::ALL.len()],
    /// Whether each limit has been logged: the first hit is, later ones only counted.
    logged: [AtomicBool; HttpLimit::ALL.len()],
    /// Connections open now (`vramguard_http_connections`).
    pub(super) connections: Gauge,
    /// Told of every answer sent for a request whose body was refused before any route saw it.
    refusals: std::sync::OnceLock<Arc<dyn Refusals>>,
}

/// The server above the connection layer, told of each request whose body the connection layer
/// refused (a declared body over `server.body_limit` or one that does not fit in what may be
/// received now, before any route saw it; a body over a limit or stalled while a route read
/// it): it counts those answers to inference requests as the routes count theirs, and writes
/// each answer as the API of its path writes errors.
pub trait Refusals: Send + Sync + Debug {
    /// `status` was answered, before any route saw it, to a request for `path`.
    fn refused(&self, path: &str, status: StatusCode);

    /// The answer `error` to a request for `path`, in the error body of that path's API.
    fn write(&self, path: &str, error: ApiError) -> Response<Body>;
}

impl Limits {
    /// The limits of `server:`, counted in `metrics`.
    pub fn new(server: &ServerConfig, metrics: &ProcessMetrics) -> Arc<Limits> {
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
            refusals: std::sync::OnceLock::new(),
        })
    }

    /// Tell `refusals` of every request whose body was refused, from now on (once: a second
    /// call changes nothing).
    pub fn tell_refusals(&self, refusals: Arc<dyn Refusals>) {
        let _ = self.refusals.set(refusals);
    }

    /// The answer to a request for `path` refused by `limit` before a route saw it, told to
    /// whoever asked ([`Limits::tell_refusals`]).
    pub(super) fn refuse(&self, limit: HttpLimit, path: &str, watch: &Watch) -> Response<Body> {
        let response = self.refusal(limit, path, watch);
        if let Some(refusals) = self.refusals.get() {
            refusals.refused(path, response.status());
        }
        response
    }

    /// Count a hit of `limit` by `peer`; the first of each kind is logged, later ones only
    /// counted (a flood of slow clients must not become a flood of log lines). Returns whether
    /// this hit was logged.
    pub(super) fn hit(&self, limit: HttpLimit, peer: &dyn Debug) -> bool {
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

    /// The answer to a request for `path` whose body was refused by `limit`, written as
    /// [`Refusals::write`] says (as `{"error": "..."}` when no one was told). The connection
    /// closes after it (the rest of the body is not read), lingering so the client can read it.
    pub(super) fn refusal(&self, limit: HttpLimit, path: &str, watch: &Watch) -> Response<Body> {
        let status = refusal_status(limit);
        let error = match limit {
            HttpLimit::body_limit => ApiError::new(status, body_too_large(self.body_limit)),
            HttpLimit::body_bytes => ApiError::new(
                status,
                format!(
                    "request bodies being received are at server.max_receiving_bytes ({}); retry shortly",
                    format_size(self.max_receiving_bytes)
                ),
            )
            .retry_after(1),
            // `body_timeout`; the other limits close a connection without an answer.
            _ => ApiError::new(
                status,
                format!(
                    "the request body brought no data for server.timeouts.body_read ({})",
                    format_duration(self.timeouts.body_read)
                ),
            ),
        };
        let mut response = match self.refusals.get() {
            Some(refusals) => refusals.write(path, error),
            None => error.into_response(),
        };
        watch.close_after(&mut response);
        response
    }

    /// Check a request's body against the limits before anything reads it: a declared length
    /// over `body_limit` is refused at once, and one that does not fit in what may be received
    /// now gets 503. Returns the bytes reserved for it.
    pub(super) fn admit_body(&self, body: &Incoming, watch: &Watch) -> Result<Option<OwnedSemaphorePermit>, HttpLimit> {
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

/// The status of the answer to a request whose body `limit` refused: 413 over `body_limit`,
/// 503 (not now) over what may be received at once, 408 for a body that stopped coming.
pub(super) fn refusal_status(limit: HttpLimit) -> StatusCode {
    match limit {
        HttpLimit::body_limit => StatusCode::PAYLOAD_TOO_LARGE,
        HttpLimit::body_bytes => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::REQUEST_TIMEOUT,
    }
}

/// `bytes` in [`RECEIVING_UNIT`]s, rounded up.
pub(super) fn units(bytes: u64) -> u32 {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Arc<Limits> {
        let config = crate::config::Config::embedded(false);
        let (metrics, _) = ProcessMetrics::new("test");
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
}
