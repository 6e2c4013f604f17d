//! The bounded queue in front of the worker threads, and the idle backends they take with each
//! job: one lock guards both, so a worker takes a job only together with a backend to run it on.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::core::backend::Backend;
use crate::pool::job::{InferJob, JobResult, PoolError};
use crate::pool::load::PoolLoad;

/// A job waiting for a worker, stamped when it was queued.
pub(super) struct Queued {
    /// The work.
    pub(super) job: InferJob,
    /// When it was queued, for its age and its wait.
    pub(super) enqueued: Instant,
    /// Where its result goes; closed when the caller went away.
    pub(super) reply: oneshot::Sender<JobResult>,
}

#[derive(Default)]
struct QueueState {
    jobs: VecDeque<Queued>,
    closed: bool,
    inflight: usize,
    /// Backends no one is running: a worker thread takes one with each queued job.
    idle: Vec<Box<dyn Backend>>,
}

/// The queue, its idle backends, and the condition variable the workers wait on.
#[derive(Default)]
pub(super) struct Queue {
    state: Mutex<QueueState>,
    wake: Condvar,
    /// Backends still usable; when the last one is lost the pool becomes unavailable.
    live: AtomicUsize,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        // A worker that panicked mid-run must not take the queue down with it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The backends a pool starts with, all idle.
    pub(super) fn stock(&self, backends: Vec<Box<dyn Backend>>) {
        self.live.store(backends.len(), Ordering::SeqCst);
        self.lock().idle = backends;
    }

    /// True once [`Queue::close`] was called.
    pub(super) fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Queue `job` for the pool `pool`; refused when closed or holding `capacity` jobs.
    pub(super) fn push(
        &self,
        job: InferJob,
        now: Instant,
        pool: &str,
        capacity: usize,
    ) -> Result<oneshot::Receiver<JobResult>, PoolError> {
        let (reply, rx) = oneshot::channel();
        let mut state = self.lock();
        if state.closed {
            return Err(PoolError::ShuttingDown { pool: pool.to_string() });
        }
        if state.jobs.len() >= capacity {
            return Err(PoolError::QueueFull {
                pool: pool.to_string(),
                capacity,
            });
        }
        state.jobs.push_back(Queued {
            job,
            enqueued: now,
            reply,
        });
        drop(state);
        self.wake.notify_one();
        Ok(rx)
    }

    /// Take no more jobs and wake every worker to see it; returns what was waiting, to be
    /// answered.
    pub(super) fn close(&self) -> Vec<Queued> {
        let drained = {
            let mut state = self.lock();
            state.closed = true;
            state.jobs.drain(..).collect()
        };
        self.wake.notify_all();
        drained
    }

    /// Everything waiting, taken out to be answered.
    pub(super) fn drain(&self) -> Vec<Queued> {
        self.lock().jobs.drain(..).collect()
    }

    /// The next queued job and an idle backend to run it on, waiting for both; `None` once
    /// closed.
    pub(super) fn next(&self) -> Option<(Queued, Box<dyn Backend>)> {
        let mut state = self.lock();
        loop {
            if !state.jobs.is_empty()
                && let Some(backend) = state.idle.pop()
            {
                let job = state.jobs.pop_front().expect("checked non-empty");
                state.inflight += 1;
                return Some((job, backend));
            }
            if state.closed {
                return None;
            }
            state = self.wake.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// A run is over: its backend (unless it was lost) is idle again, and a worker is woken if
    /// work is waiting for it.
    pub(super) fn finish(&self, backend: Option<Box<dyn Backend>>) {
        let mut state = self.lock();
        state.inflight -= 1;
        let waiting = !state.jobs.is_empty();
        if let Some(backend) = backend {
            state.idle.push(backend);
        }
        drop(state);
        if waiting {
            self.wake.notify_one();
        }
    }

    /// A backend is gone for good; true when it was the last one.
    pub(super) fn lose_backend(&self) -> bool {
        self.live.fetch_sub(1, Ordering::SeqCst) <= 1
    }

    /// Replace the idle backends by `fresh` ones, keeping `workers` in all: a backend still
    /// running counts, and is kept. The old ones are dropped outside the lock.
    pub(super) fn restock(&self, mut fresh: Vec<Box<dyn Backend>>, workers: usize) {
        let old = {
            let mut state = self.lock();
            fresh.truncate(workers.saturating_sub(state.inflight));
            self.live.store(fresh.len() + state.inflight, Ordering::SeqCst);
            std::mem::replace(&mut state.idle, fresh)
        };
        drop(old);
    }

    /// Wake every worker (the backends were restocked).
    pub(super) fn wake_all(&self) {
        self.wake.notify_all();
    }

    /// How many backends are idle.
    pub(super) fn idle(&self) -> usize {
        self.lock().idle.len()
    }

    /// Depth, oldest age and in-flight count read under one lock, with the delay estimate for
    /// runs of `mean_run` on `workers` workers.
    pub(super) fn load(&self, now: Instant, mean_run: Duration, workers: usize) -> PoolLoad {
        let state = self.lock();
        PoolLoad::new(
            state.jobs.len(),
            // Computed when asked, so a request stuck in the queue shows its growing age even
            // while nothing is dequeued.
            state
                .jobs
                .front()
                .map(|q| now.saturating_duration_since(q.enqueued))
                .unwrap_or_default(),
            state.inflight,
            mean_run,
            workers,
        )
    }
}
