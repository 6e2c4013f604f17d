//! Each model's answered requests, for Triton's statistics extension (`GET /v2/models/stats`):
//! how many succeeded and failed, how long they took from arrival to answer, and when the last
//! one was answered.
//!
//! They are counted where `vramguard_requests_total` is (`serve::lifecycle::count`), once per
//! answer. The Prometheus series cannot give these figures: the duration histogram is per model
//! *and pool*, mixes successes with failures, and leaves out requests refused before a pool was
//! chosen.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// One model's tallies; cheap to update from any request's task.
#[derive(Debug, Default)]
pub struct InferenceStats {
    success: Tally,
    fail: Tally,
    /// Milliseconds since the Unix epoch of the last answer; 0 before the first.
    last_ms: AtomicU64,
}

/// A count and the summed duration of what it counts.
#[derive(Debug, Default)]
struct Tally {
    count: AtomicU64,
    ns: AtomicU64,
}

impl Tally {
    fn add(&self, took: Duration) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.ns
            .fetch_add(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    fn read(&self) -> Totals {
        Totals {
            count: self.count.load(Ordering::Relaxed),
            ns: self.ns.load(Ordering::Relaxed),
        }
    }
}

/// A count of requests and their summed duration in nanoseconds, as Triton reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Totals {
    /// Requests.
    pub count: u64,
    /// Their durations, summed, in nanoseconds.
    pub ns: u64,
}

/// What [`InferenceStats`] holds, read at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatsView {
    /// Requests answered with a success.
    pub success: Totals,
    /// Requests answered with any other outcome.
    pub fail: Totals,
    /// When the last request was answered, in milliseconds since the Unix epoch (0: never).
    pub last_answer_ms: u64,
}

impl InferenceStats {
    /// Count one answer: a success (`ok`) or not, `took` from its arrival, given `at`.
    pub fn record(&self, ok: bool, took: Duration, at: SystemTime) {
        if ok {
            self.success.add(took);
        } else {
            self.fail.add(took);
        }
        let ms = at
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        self.last_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// The tallies now.
    pub fn view(&self) -> StatsView {
        StatsView {
            success: self.success.read(),
            fail: self.fail.read(),
            last_answer_ms: self.last_ms.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn successes_and_failures_are_tallied_apart_with_the_latest_answer_time() {
        let stats = InferenceStats::default();
        assert_eq!(stats.view(), StatsView::default());
        let at = SystemTime::UNIX_EPOCH + Duration::from_millis(5_000);
        stats.record(true, Duration::from_millis(2), at);
        stats.record(true, Duration::from_millis(3), at + Duration::from_millis(10));
        // An answer that took longer may finish its count after a later one: the time kept is
        // the latest.
        stats.record(false, Duration::from_micros(7), at);
        assert_eq!(
            stats.view(),
            StatsView {
                success: Totals {
                    count: 2,
                    ns: 5_000_000
                },
                fail: Totals { count: 1, ns: 7_000 },
                last_answer_ms: 5_010,
            }
        );
    }
}
