//! Requests accepted and not yet answered, split by whether their work has started: what
//! `vramguard_requests_waiting` and `vramguard_requests_running` export for the Kubernetes
//! inference gateway's endpoint picker (and any load balancer that wants a replica's load).
//!
//! Counted per request, not per run: a generation is one request running from its first token
//! to its last, even while its next step waits for a worker, as an inference engine counts its
//! running sequences; the pools' `vramguard_queue_depth` and `vramguard_inflight_requests` count
//! runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

/// The counts of one service.
#[derive(Debug, Default)]
pub struct Activity {
    waiting: AtomicI64,
    running: AtomicI64,
}

impl Activity {
    /// A request was accepted: it waits (for the policy, a deferral or a queue) until its
    /// [`Progress`] says its first run started, and counts until the last clone is dropped.
    pub fn accept(self: &Arc<Self>) -> Progress {
        self.accept_also(None)
    }

    /// [`accept`](Activity::accept), counted in `also` too (the interactive requests among the
    /// service's, which a background service's requests give way to).
    pub fn accept_also(self: &Arc<Self>, also: Option<&Arc<Activity>>) -> Progress {
        let counts = std::iter::once(Arc::clone(self))
            .chain(also.cloned())
            .collect::<Vec<_>>();
        for activity in &counts {
            activity.waiting.fetch_add(1, Ordering::Relaxed);
        }
        Progress(Some(Arc::new(Tracked {
            counts,
            members: Vec::new(),
            started: AtomicBool::new(false),
            last_started: std::sync::Mutex::new(None),
            held: std::sync::Mutex::new(Vec::new()),
        })))
    }

    /// Requests accepted whose first run has not started.
    pub fn waiting(&self) -> u64 {
        // A request moving from waiting to running is subtracted from one before it is added to
        // the other; a reader in between may see one less, never a negative count.
        self.waiting.load(Ordering::Relaxed).max(0) as u64
    }

    /// Requests whose first run has started and that are not answered yet.
    pub fn running(&self) -> u64 {
        self.running.load(Ordering::Relaxed).max(0) as u64
    }
}

/// One accepted request's place in [`Activity`]; clones share it (the request, and the job a
/// worker holds). [`Progress::default`] is untracked, for requests no service counts.
#[derive(Debug, Clone, Default)]
pub struct Progress(Option<Arc<Tracked>>);

#[derive(Debug)]
struct Tracked {
    /// The counts it is in: the service's, and the interactive requests' when it is one.
    counts: Vec<Arc<Activity>>,
    /// A batch's members ([`Progress::batch`]): its runs are theirs.
    members: Vec<Progress>,
    started: AtomicBool,
    /// When a worker last started one of its runs (a retry's run on the fallback is the last).
    last_started: std::sync::Mutex<Option<std::time::Instant>>,
    /// What the request holds until it is answered (its place in its service's budgets).
    held: std::sync::Mutex<Vec<Box<dyn std::fmt::Debug + Send + Sync>>>,
}

impl Progress {
    /// The progress of a batch of requests run together (`serve::batching`): counted in nothing
    /// itself, its runs start each of `members`', and what it holds is held until the batch is
    /// over.
    pub fn batch(members: Vec<Progress>) -> Progress {
        Progress(Some(Arc::new(Tracked {
            counts: Vec::new(),
            members,
            started: AtomicBool::new(false),
            last_started: std::sync::Mutex::new(None),
            held: std::sync::Mutex::new(Vec::new()),
        })))
    }

    /// A worker started one of the request's runs: it is running from now on (later runs and a
    /// retry change nothing).
    pub fn started(&self) {
        let Some(tracked) = &self.0 else {
            return;
        };
        *tracked.last_started.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::time::Instant::now());
        for member in &tracked.members {
            member.started();
        }
        if !tracked.started.swap(true, Ordering::Relaxed) {
            for activity in &tracked.counts {
                activity.waiting.fetch_sub(1, Ordering::Relaxed);
                activity.running.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Keep `guard` until the request is answered (the last clone dropped): a generation holds
    /// it from admission to its last token. Untracked progress drops it at once.
    pub fn hold(&self, guard: Box<dyn std::fmt::Debug + Send + Sync>) {
        if let Some(tracked) = &self.0 {
            tracked.held.lock().unwrap_or_else(|e| e.into_inner()).push(guard);
        }
    }

    /// When a worker last started one of the request's runs (untracked: never).
    pub fn last_started(&self) -> Option<std::time::Instant> {
        let tracked = self.0.as_ref()?;
        *tracked.last_started.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let started = *self.started.get_mut();
        for activity in &self.counts {
            let count = if started { &activity.running } else { &activity.waiting };
            count.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_waits_until_its_first_run_and_runs_until_its_last_handle_goes() {
        let activity = Arc::new(Activity::default());
        let first = activity.accept();
        let second = activity.accept();
        assert_eq!((activity.waiting(), activity.running()), (2, 0));

        // The worker's copy starts the run; a second run (a generation's next step, a retry)
        // does not count the request twice.
        let worker_copy = first.clone();
        worker_copy.started();
        worker_copy.started();
        assert_eq!((activity.waiting(), activity.running()), (1, 1));

        // The run is over but the request is not answered: still running.
        drop(worker_copy);
        assert_eq!((activity.waiting(), activity.running()), (1, 1));
        drop(first);
        assert_eq!((activity.waiting(), activity.running()), (1, 0));

        // Refused or cancelled before any run: it leaves the waiting count.
        drop(second);
        assert_eq!((activity.waiting(), activity.running()), (0, 0));
    }

    #[test]
    fn a_request_counted_twice_moves_in_both_counts_and_keeps_what_it_holds() {
        let service = Arc::new(Activity::default());
        let interactive = Arc::new(Activity::default());
        let progress = service.accept_also(Some(&interactive));
        assert_eq!((interactive.waiting(), interactive.running()), (1, 0));
        progress.started();
        assert_eq!((service.waiting(), service.running()), (0, 1));
        assert_eq!((interactive.waiting(), interactive.running()), (0, 1));
        let held = Arc::new(());
        progress.hold(Box::new(Arc::clone(&held)));
        let copy = progress.clone();
        drop(progress);
        assert_eq!(Arc::strong_count(&held), 2, "held while a clone lives");
        drop(copy);
        assert_eq!(Arc::strong_count(&held), 1, "given back with the last clone");
        assert_eq!((interactive.waiting(), interactive.running()), (0, 0));
    }

    #[test]
    fn a_batch_starts_its_members_and_counts_nothing_itself() {
        let activity = Arc::new(Activity::default());
        let members = vec![activity.accept(), activity.accept()];
        let batch = Progress::batch(members.clone());
        assert_eq!((activity.waiting(), activity.running()), (2, 0));
        batch.started();
        assert_eq!((activity.waiting(), activity.running()), (0, 2));
        assert!(members[0].last_started().is_some());
        drop(batch);
        drop(members);
        assert_eq!((activity.waiting(), activity.running()), (0, 0));
    }

    #[test]
    fn untracked_progress_counts_nothing() {
        let progress = Progress::default();
        progress.started();
        drop(progress);
    }
}
