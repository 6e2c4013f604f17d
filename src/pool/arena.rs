//! The allocator statistics a pool publishes for the sampler, read only when worth a C API call,
//! and the check of a run's admission estimate against what the arena really needed.

use std::sync::atomic::Ordering;

use crate::core::backend::{ArenaStats, Backend, BackendError};
use crate::core::tensor::Tensor;
use crate::pool::job::RunMemory;
use crate::pool::shared::Pool;
use crate::runtime::estimate::learned::Observation;

/// The parts of a finished job its statistics are checked against.
#[derive(Debug, Clone, Copy)]
pub(super) struct RunOf<'a> {
    /// The slot id of the backend it ran on.
    pub(super) slot: usize,
    pub(super) request_id: &'a str,
    pub(super) estimate_bytes: Option<u64>,
    pub(super) memory: &'a RunMemory,
    /// No other run used its arena meanwhile: a new peak is its own.
    pub(super) alone: bool,
}

impl Pool {
    /// Ask the workers to read their allocator statistics after their next run (the sampler
    /// calls this; reading them after every run would cost every request a C API call).
    pub fn want_arena_stats(&self) {
        self.stats_wanted.store(true, Ordering::Relaxed);
    }

    /// What the pool's backends hold in their allocators, summed over its workers and each
    /// worker's arenas (a CPU or CUDA session has its own), as each last published.
    pub fn arena_stats(&self) -> Option<ArenaStats> {
        self.queue.held()
    }

    /// Read `backend`'s allocator statistics again and publish what it holds as slot `slot`'s,
    /// when it has an arena; returns the arena its last run was measured in.
    pub(super) fn refresh_stats(&self, slot: usize, backend: &mut dyn Backend) -> Option<ArenaStats> {
        let arenas = backend.arenas()?;
        arenas.refresh_arena_stats();
        self.queue.publish_held(slot, arenas.held_arena_stats());
        arenas.arena_stats()
    }

    /// After `run`, which started with the arena at `before`: refresh and publish the
    /// statistics when they are worth reading, and record what the run took when it was
    /// measured or failed to allocate.
    pub(super) fn stats_after_run(
        &self,
        backend: &mut dyn Backend,
        job: RunOf<'_>,
        before: Option<ArenaStats>,
        result: &Result<Vec<Tensor>, BackendError>,
    ) {
        // Statistics cost a C API call: read them when the sampler asked, when the caller
        // measures the run, after a failure, or when this run may have set a new peak (its
        // estimate is the largest yet) so the estimate can be checked against it.
        let largest = job.estimate_bytes.unwrap_or(0);
        let new_largest = largest > self.largest_estimate.fetch_max(largest, Ordering::Relaxed);
        let measured = job.memory.is_wanted();
        if self.stats_wanted.swap(false, Ordering::Relaxed) || new_largest || measured || result.is_err() {
            let after = self.refresh_stats(job.slot, backend);
            // Only a run measured from just before it (or one that failed to allocate) tells
            // what it took: an unmeasured run's `before` is whatever was read last, maybe long
            // ago, and its peak since is not this run's.
            if let Some(observation) = observe(before, after, result).filter(|_| measured || result.is_err()) {
                let observation = match observation {
                    Observation::Exactly(bytes) if !job.alone => Observation::AtMost(bytes),
                    other => other,
                };
                job.memory.record(observation);
            }
            if new_largest {
                check_estimate(job.request_id, job.estimate_bytes, before, after, result);
            }
        }
    }
}

/// What a run took, from the arena before and after it: exactly its new peak less what was in
/// use before, when it raised the arena's all-time peak (the only time the statistics tell a
/// run's own peak), else at most that; more than the arena had free, when it failed to
/// allocate under a limit.
fn observe(
    before: Option<ArenaStats>,
    after: Option<ArenaStats>,
    result: &Result<Vec<Tensor>, BackendError>,
) -> Option<Observation> {
    let (before, after) = (before?, after?);
    match result {
        Err(BackendError::Allocation { .. }) => {
            let limit = after.limit_bytes?;
            Some(Observation::MoreThan(limit.saturating_sub(before.active_bytes)))
        }
        Ok(_) if after.peak_active_bytes > before.peak_active_bytes => Some(Observation::Exactly(
            after.peak_active_bytes.saturating_sub(before.active_bytes),
        )),
        Ok(_) => Some(Observation::AtMost(
            after.peak_active_bytes.saturating_sub(before.active_bytes),
        )),
        _ => None,
    }
}

/// Log when an admission estimate turned out too low for a real run, with both numbers: a
/// warning when the run did not fit (its request failed here, to be retried elsewhere or
/// refused), information when it fit anyway, which is how the first requests of a new size find
/// what they need. The arena's all-time peak moves only when a run needs more than any before
/// it; that run's need is the new peak minus what was already in use.
fn check_estimate(
    request_id: &str,
    estimate: Option<u64>,
    before: Option<ArenaStats>,
    after: Option<ArenaStats>,
    result: &Result<Vec<Tensor>, BackendError>,
) {
    let Some(estimate) = estimate else { return };
    if let Err(BackendError::Allocation { message, .. }) = result {
        tracing::warn!(request_id, estimate_bytes = estimate, onnxruntime = %message, "memory estimate too low: the run did not fit");
        return;
    }
    if let (Some(before), Some(after)) = (before, after)
        && after.peak_active_bytes > before.peak_active_bytes
    {
        let needed = after.peak_active_bytes.saturating_sub(before.active_bytes);
        if needed > estimate {
            tracing::info!(
                request_id,
                estimate_bytes = estimate,
                measured_bytes = needed,
                "a run needed more memory than its estimate and fit"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::backend::AllocFailureKind;

    fn stats(active: u64, peak: u64, limit: Option<u64>) -> Option<ArenaStats> {
        Some(ArenaStats {
            active_bytes: active,
            peak_active_bytes: peak,
            limit_bytes: limit,
            ..ArenaStats::default()
        })
    }

    #[test]
    fn a_run_is_exact_when_it_raises_the_peak_and_a_bound_otherwise() {
        let ok: Result<Vec<Tensor>, BackendError> = Ok(Vec::new());
        // 1 MiB in use before, the peak rose from 5 to 9 MiB: the run took 8 MiB.
        assert_eq!(
            observe(stats(1 << 20, 5 << 20, None), stats(1 << 20, 9 << 20, None), &ok),
            Some(Observation::Exactly(8 << 20))
        );
        // The peak did not move: at most what the old peak leaves above what was in use.
        assert_eq!(
            observe(stats(1 << 20, 9 << 20, None), stats(1 << 20, 9 << 20, None), &ok),
            Some(Observation::AtMost(8 << 20))
        );
        let failed = Err(BackendError::Allocation {
            kind: AllocFailureKind::Oom,
            message: "BFCArena".into(),
        });
        // Under a 64 MiB cap with 16 MiB held, it needed more than the 48 MiB free.
        assert_eq!(
            observe(
                stats(16 << 20, 20 << 20, Some(64 << 20)),
                stats(16 << 20, 64 << 20, Some(64 << 20)),
                &failed
            ),
            Some(Observation::MoreThan(48 << 20))
        );
        // Without a cap a failure tells nothing, and without statistics nothing is known.
        assert_eq!(observe(stats(0, 0, None), stats(0, 0, None), &failed), None);
        assert_eq!(observe(None, stats(0, 1, None), &ok), None);
    }

    /// What [`check_estimate`] logs, as plain text lines.
    fn logged(result: &Result<Vec<Tensor>, BackendError>) -> String {
        #[derive(Clone, Default)]
        struct Lines(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Lines {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .without_time()
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            check_estimate(
                "req-1",
                Some(100 << 10),
                stats(0, 0, Some(1 << 20)),
                stats(0, 130 << 10, Some(1 << 20)),
                result,
            );
        });
        String::from_utf8(lines.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn an_estimate_too_low_warns_only_when_the_run_did_not_fit() {
        let fit = logged(&Ok(Vec::new()));
        assert!(fit.starts_with(" INFO "), "{fit}");
        assert!(fit.contains("estimate_bytes=102400 measured_bytes=133120"), "{fit}");
        let failed = logged(&Err(BackendError::Allocation {
            kind: AllocFailureKind::Oom,
            message: "BFCArena".into(),
        }));
        assert!(failed.starts_with(" WARN "), "{failed}");
        assert!(failed.contains("the run did not fit"), "{failed}");
    }
}
