//! A pool's load as routing and the policy read it, and the mean run time behind its delay
//! estimate.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A snapshot of a pool's load.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PoolLoad {
    /// Waiting requests.
    pub queue_depth: usize,
    /// Age of the oldest waiting request.
    pub oldest_age: Duration,
    /// Requests being run.
    pub inflight: usize,
    /// Estimated wait before a new request would finish: the queue ahead of it and the work in
    /// flight, spread over the workers, times the mean run time.
    pub estimated_delay: Duration,
}

impl PoolLoad {
    /// The load of a queue holding `queue_depth` jobs (the oldest `oldest_age` old) with
    /// `inflight` running on `workers` workers whose runs take `mean_run` on average.
    pub(super) fn new(
        queue_depth: usize,
        oldest_age: Duration,
        inflight: usize,
        mean_run: Duration,
        workers: usize,
    ) -> Self {
        let ahead = (queue_depth + inflight + 1) as u32;
        PoolLoad {
            estimated_delay: mean_run * ahead.div_ceil(workers.max(1) as u32),
            queue_depth,
            oldest_age,
            inflight,
        }
    }
}

/// Exponentially weighted mean run time, for the delay estimate: each run counts an eighth, so
/// the estimate follows a change in run times without one slow run swinging it.
#[derive(Debug, Default)]
pub(super) struct RunTimes {
    /// The mean in microseconds; 0 until the first run.
    mean_us: AtomicU64,
}

impl RunTimes {
    /// A run took `took`.
    pub(super) fn record(&self, took: Duration) {
        let sample = took.as_micros().min(u64::MAX as u128) as u64;
        let old = self.mean_us.load(Ordering::Relaxed);
        let new = if old == 0 { sample } else { (old * 7 + sample) / 8 };
        self.mean_us.store(new, Ordering::Relaxed);
    }

    /// The mean so far (zero before any run).
    pub(super) fn mean(&self) -> Duration {
        Duration::from_micros(self.mean_us.load(Ordering::Relaxed))
    }
}
