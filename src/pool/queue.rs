//! The bounded queue in front of the worker threads, and the idle backends they take with each
//! job: one lock guards both, so a worker takes a job only together with a backend to run it on.
//! The same lock guards the models the pool wants loaded (see `residency/`), so an unload can
//! wait for the model's last job and take it out of the wanted set in one step.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::core::backend::{ArenaStats, Backend};
use crate::pool::job::{InferJob, JobResult, PoolError, RunOp};
use crate::pool::load::PoolLoad;
use crate::pool::patience::Patience;

/// A job waiting for a worker, stamped when it was queued.
pub(super) struct Queued {
    /// The work.
    pub(super) job: InferJob,
    /// When it was queued, for its age and its wait.
    pub(super) enqueued: Instant,
    /// Where its result goes; closed when the caller went away.
    pub(super) reply: oneshot::Sender<JobResult>,
}

/// A backend and the models it holds.
pub(super) struct Slot {
    /// Identifies it while it lives, for [`Queue::await_generation`].
    pub(super) id: usize,
    /// The sessions.
    pub(super) backend: Box<dyn Backend>,
    /// The models it has sessions of.
    pub(super) loaded: HashSet<String>,
    /// The wanted set's generation it last matched; 0 for a fresh backend.
    pub(super) generation: u64,
    /// It ran since its allocator's free memory was last given back.
    pub(super) dirty: bool,
}

impl Slot {
    /// A backend just built with the sessions of `loaded`, to be matched to the wanted set.
    pub(super) fn fresh(backend: Box<dyn Backend>, loaded: HashSet<String>) -> Slot {
        Slot {
            id: 0,
            backend,
            loaded,
            generation: 0,
            dirty: false,
        }
    }

    /// A slot put back together after its backend ran.
    pub(super) fn with(id: usize, backend: Box<dyn Backend>, loaded: HashSet<String>, generation: u64) -> Slot {
        Slot {
            id,
            backend,
            loaded,
            generation,
            dirty: true,
        }
    }
}

/// What a worker takes from the queue: a job to run (if any) on a backend, and, when that
/// backend is behind the wanted set, the set to bring it up to first.
pub(super) struct Next {
    /// The job, or none when the backend only needs bringing up to date.
    pub(super) job: Option<Queued>,
    /// The backend.
    pub(super) slot: Slot,
    /// The wanted models and their generation, when the backend is behind them.
    pub(super) stale: Option<(HashSet<String>, u64)>,
    /// Give the backend's free allocator memory back, and nothing else (no job comes with it).
    pub(super) release: bool,
}

#[derive(Default)]
struct QueueState {
    jobs: VecDeque<Queued>,
    closed: bool,
    inflight: usize,
    /// Backends no one is running: a worker thread takes one with each queued job.
    idle: Vec<Slot>,
    /// The models every backend should hold, and the generation of that set.
    wanted: HashSet<String>,
    generation: u64,
    /// Running jobs per model.
    running: HashMap<String, usize>,
    /// The generation each live backend last matched, by slot id.
    matched: HashMap<usize, u64>,
    next_id: usize,
    /// After how long without a run a backend that ran gives its free memory back.
    release_idle: Option<Duration>,
    /// When the last run ended.
    last_finish: Option<Instant>,
    /// How soon jobs came after the run before them lately: how long a worker that just ran
    /// looks for the next one before it sleeps. The pool's, not each worker's: with two
    /// workers and one request at a time, each worker's own gaps would be whole requests.
    patience: Patience,
    /// Give free memory back as soon as a backend that ran is idle (host memory is short).
    release_now: bool,
    /// The backend (slot id) that keeps each model's generation caches.
    homes: HashMap<String, usize>,
    /// What each backend holds in its allocators, as it last published, by slot id; only the
    /// live ones (in `matched`) count.
    held: HashMap<usize, ArenaStats>,
}

impl QueueState {
    /// Give `slot` an id and count it live.
    fn admit(&mut self, mut slot: Slot) -> Slot {
        slot.id = self.next_id;
        self.next_id += 1;
        self.matched.insert(slot.id, slot.generation);
        slot
    }

    /// The first queued job that can run now and the idle backend it runs on (their indexes).
    /// A generation's job runs where the model's generations ran before, since that backend
    /// keeps their caches: it waits for it while it is busy (later jobs go first meanwhile),
    /// and goes anywhere when it is gone. Other jobs take a backend already up to date, which
    /// spares them a load.
    fn pick(&self) -> Option<(usize, usize)> {
        if self.idle.is_empty() {
            return None;
        }
        let any = || {
            self.idle
                .iter()
                .position(|s| s.generation == self.generation)
                .unwrap_or(self.idle.len() - 1)
        };
        for (j, queued) in self.jobs.iter().enumerate() {
            let home = (queued.job.op != RunOp::Run)
                .then(|| self.homes.get(&queued.job.model))
                .flatten()
                .filter(|id| self.matched.contains_key(id));
            match home {
                Some(id) => {
                    if let Some(at) = self.idle.iter().position(|s| s.id == *id) {
                        return Some((j, at));
                    }
                }
                None => return Some((j, any())),
            }
        }
        None
    }

    /// An idle backend that ran and should give its free memory back now (`Ok`, its index),
    /// or how long until one should (`Err`; `None`: nothing to wait for). Due once the pool has
    /// had no run for its `release_idle`, or at once when host memory is short, and only while
    /// no job waits.
    fn release_due(&self) -> Result<usize, Option<Duration>> {
        let Some(at) = self.idle.iter().position(|s| s.dirty) else {
            return Err(None);
        };
        if !self.jobs.is_empty() {
            return Err(None);
        }
        if self.release_now {
            return Ok(at);
        }
        let Some(after) = self.release_idle else {
            return Err(None);
        };
        if self.inflight > 0 {
            // The last run to end starts the idle time; `finish` wakes a worker then.
            return Err(None);
        }
        let idle = self.last_finish.map_or(after, |t| t.elapsed());
        match after.checked_sub(idle) {
            None | Some(Duration::ZERO) => Ok(at),
            Some(left) => Err(Some(left)),
        }
    }

    /// Jobs of `model` queued or running.
    fn busy_with(&self, model: &str) -> usize {
        self.running.get(model).copied().unwrap_or(0) + self.jobs.iter().filter(|q| q.job.model == model).count()
    }
}

/// The queue, its idle backends, and the condition variable the workers wait on.
#[derive(Default)]
pub(super) struct Queue {
    state: Mutex<QueueState>,
    wake: Condvar,
    /// Woken whenever a run or a backend's update ends, for loads and unloads waiting on them.
    settled: Condvar,
    /// Backends still usable; when the last one is lost the pool becomes unavailable.
    live: AtomicUsize,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        // A worker that panicked mid-run must not take the queue down with it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The backends a pool starts with, all idle and holding `wanted`.
    pub(super) fn stock(&self, backends: Vec<Box<dyn Backend>>, wanted: HashSet<String>) {
        self.live.store(backends.len(), Ordering::SeqCst);
        let mut state = self.lock();
        state.generation = 1;
        for backend in backends {
            let slot = Slot {
                generation: 1,
                ..Slot::fresh(backend, wanted.clone())
            };
            let mut slot = state.admit(slot);
            if let Some(stats) = slot.backend.arenas().and_then(|arenas| arenas.held_arena_stats()) {
                state.held.insert(slot.id, stats);
            }
            state.idle.push(slot);
        }
        state.wanted = wanted;
    }

    /// Record what backend `id` holds in its allocators
    /// ([`Arenas::held_arena_stats`](crate::core::backend::Arenas::held_arena_stats)).
    pub(super) fn publish_held(&self, id: usize, stats: Option<ArenaStats>) {
        if let Some(stats) = stats {
            self.lock().held.insert(id, stats);
        }
    }

    /// What the live backends hold in their allocators, summed; `None` until one published.
    /// A backend gone (lost, replaced, restocked) no longer counts.
    pub(super) fn held(&self) -> Option<ArenaStats> {
        let mut state = self.lock();
        let QueueState { held, matched, .. } = &mut *state;
        held.retain(|id, _| matched.contains_key(id));
        held.values().copied().reduce(ArenaStats::plus)
    }

    /// True once [`Queue::close`] was called.
    pub(super) fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Queue `job` for the pool `pool`; refused when closed or holding `capacity` jobs. With
    /// `load`, a job for a model not wanted makes it wanted; the second value says it did.
    pub(super) fn push(
        &self,
        job: InferJob,
        now: Instant,
        pool: &str,
        capacity: usize,
        load: bool,
    ) -> Result<(oneshot::Receiver<JobResult>, bool), PoolError> {
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
        let loads = load && !state.wanted.contains(&job.model);
        if loads {
            state.wanted.insert(job.model.clone());
            state.generation += 1;
        }
        state.jobs.push_back(Queued {
            job,
            enqueued: now,
            reply,
        });
        drop(state);
        if loads {
            // Idle backends load it at once, not only the one that takes this job.
            self.wake.notify_all();
        } else {
            self.wake.notify_one();
        }
        Ok((rx, loads))
    }

    /// Make `model` wanted; its new generation, or `None` when it already was.
    pub(super) fn want(&self, model: &str) -> Option<u64> {
        let mut state = self.lock();
        if !state.wanted.insert(model.to_string()) {
            return None;
        }
        state.generation += 1;
        let generation = state.generation;
        drop(state);
        self.wake.notify_all();
        Some(generation)
    }

    /// Once no job of `model` is queued or running, make it unwanted; its new generation,
    /// `None` when it was not wanted, `Err` when its jobs were still there at `until`.
    pub(super) fn unwant(&self, model: &str, until: Instant) -> Result<Option<u64>, ()> {
        let mut state = self.lock();
        loop {
            if !state.wanted.contains(model) {
                return Ok(None);
            }
            if state.busy_with(model) == 0 {
                break;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(());
            }
            state = self
                .settled
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        state.wanted.remove(model);
        state.generation += 1;
        let generation = state.generation;
        drop(state);
        self.wake.notify_all();
        Ok(Some(generation))
    }

    /// Make `model` unwanted if it is wanted, no job of it is queued or running, and
    /// `still_idle` says so under the lock (a request recorded since the caller looked keeps
    /// it); its new generation, or `None` when it stays.
    pub(super) fn unwant_idle(&self, model: &str, still_idle: impl Fn() -> bool) -> Option<u64> {
        let mut state = self.lock();
        if !state.wanted.contains(model) || state.busy_with(model) > 0 || !still_idle() {
            return None;
        }
        state.wanted.remove(model);
        state.generation += 1;
        let generation = state.generation;
        drop(state);
        self.wake.notify_all();
        Some(generation)
    }

    /// A load of `model` failed: it is no longer wanted, unless jobs of it still wait (they
    /// will try again). True when it was taken out.
    pub(super) fn drop_failed(&self, model: &str) -> bool {
        let mut state = self.lock();
        if !state.wanted.contains(model) || state.jobs.iter().any(|q| q.job.model == model) {
            return false;
        }
        state.wanted.remove(model);
        state.generation += 1;
        true
    }

    /// Backends that ran give their free allocator memory back after `after` without a run.
    pub(super) fn release_when_idle(&self, after: Option<Duration>) {
        self.lock().release_idle = after;
    }

    /// Backends that ran give their free memory back as soon as they are idle, once each.
    pub(super) fn release_soon(&self) {
        let mut state = self.lock();
        if state.idle.iter().any(|s| s.dirty) || state.inflight > 0 {
            state.release_now = true;
            drop(state);
            self.wake.notify_one();
        }
    }

    /// Jobs of `model` queued or running now.
    pub(super) fn busy(&self, model: &str) -> usize {
        self.lock().busy_with(model)
    }

    /// Jobs of `model` running and queued now.
    pub(super) fn counts(&self, model: &str) -> (usize, usize) {
        let state = self.lock();
        let running = state.running.get(model).copied().unwrap_or(0);
        (running, state.jobs.iter().filter(|q| q.job.model == model).count())
    }

    /// Whether `model` is wanted now.
    pub(super) fn is_wanted(&self, model: &str) -> bool {
        self.lock().wanted.contains(model)
    }

    /// Wait until every live backend matched `generation` (or a later one); false at `until`.
    pub(super) fn await_generation(&self, generation: u64, until: Instant) -> bool {
        let mut state = self.lock();
        loop {
            if state.matched.values().all(|g| *g >= generation) {
                return true;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            state = self
                .settled
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
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
        // An unload waiting for the drained jobs need not wait for its bound.
        self.settled.notify_all();
        drained
    }

    /// Everything waiting, taken out to be answered.
    pub(super) fn drain(&self) -> Vec<Queued> {
        self.lock().jobs.drain(..).collect()
    }

    /// The next queued job and an idle backend to run it on, waiting for both, or an idle
    /// backend behind the wanted set; `None` once closed. After a run (`ran`), it looks again
    /// for as long as the pool's [`Patience`] says (yielding the core between looks) before it
    /// sleeps: a generation's next step comes a few tens of µs after the last one ended, a
    /// client's next request soon after its answer.
    pub(super) fn next_after(&self, ran: bool) -> Option<Next> {
        let mut state = self.lock();
        let mut spin_until = ran.then(|| Instant::now() + state.patience.look());
        loop {
            let generation = state.generation;
            let behind = state.idle.iter().position(|s| s.generation != generation);
            if let Some((j, at)) = state.pick() {
                let slot = state.idle.swap_remove(at);
                let job = state.jobs.remove(j).expect("picked from the queue");
                if let Some(finished) = state.last_finish {
                    state.patience.saw(job.enqueued.saturating_duration_since(finished));
                }
                if job.job.op != RunOp::Run {
                    state.homes.insert(job.job.model.clone(), slot.id);
                }
                state.inflight += 1;
                *state.running.entry(job.job.model.clone()).or_default() += 1;
                let stale = (slot.generation != generation).then(|| (state.wanted.clone(), generation));
                return Some(Next {
                    job: Some(job),
                    slot,
                    stale,
                    release: false,
                });
            }
            if let Some(at) = behind {
                let slot = state.idle.swap_remove(at);
                return Some(Next {
                    job: None,
                    slot,
                    stale: Some((state.wanted.clone(), generation)),
                    release: false,
                });
            }
            if state.closed {
                return None;
            }
            let wait = match state.release_due() {
                Ok(at) => {
                    let slot = state.idle.swap_remove(at);
                    state.release_now &= state.idle.iter().any(|s| s.dirty);
                    return Some(Next {
                        job: None,
                        slot,
                        stale: None,
                        release: true,
                    });
                }
                Err(wait) => wait,
            };
            if let Some(until) = spin_until {
                if Instant::now() < until {
                    drop(state);
                    std::thread::yield_now();
                    state = self.lock();
                    continue;
                }
                spin_until = None;
            }
            state = match wait {
                Some(wait) => self.wake.wait_timeout(state, wait).unwrap_or_else(|e| e.into_inner()).0,
                None => self.wake.wait(state).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }

    /// Up to `most` more prompts of `model`'s generations queued now for the backend `slot`
    /// keeps their caches in, taken out in their order and counted running: they run with
    /// the prompt it just took, as one batch.
    pub(super) fn take_prompts(&self, model: &str, slot: usize, most: usize) -> Vec<Queued> {
        let mut state = self.lock();
        let mut taken = Vec::new();
        let mut at = 0;
        while at < state.jobs.len() && taken.len() < most {
            let job = &state.jobs[at].job;
            if matches!(job.op, RunOp::Prefill(_)) && job.model == model && state.homes.get(model) == Some(&slot) {
                taken.push(state.jobs.remove(at).expect("in range"));
            } else {
                at += 1;
            }
        }
        state.inflight += taken.len();
        if !taken.is_empty() {
            *state.running.entry(model.to_string()).or_default() += taken.len();
        }
        taken
    }

    /// Runs of `model` taken by [`take_prompts`](Self::take_prompts) are over (their backend
    /// comes back with the prompt they ran beside, through [`finish`](Self::finish)).
    pub(super) fn finish_prompts(&self, model: &str, count: usize) {
        if count == 0 {
            return;
        }
        let mut state = self.lock();
        state.inflight -= count;
        if let Some(n) = state.running.get_mut(model) {
            *n -= count;
            if *n == 0 {
                state.running.remove(model);
            }
        }
    }

    /// A run of `model` (or a backend's update, with `None`) is over: its backend is idle
    /// again, or gone for good when `lost` (it keeps no id then), and a worker is woken if work
    /// is waiting for it.
    pub(super) fn finish(&self, model: Option<&str>, slot: Result<Slot, usize>) {
        let mut state = self.lock();
        if let Some(model) = model {
            state.last_finish = Some(Instant::now());
            state.inflight -= 1;
            if let Some(n) = state.running.get_mut(model) {
                *n -= 1;
                if *n == 0 {
                    state.running.remove(model);
                }
            }
        }
        // A backend that ran may give its memory back once the pool stays idle: a worker must
        // be awake to time that.
        let mut waiting = !state.jobs.is_empty() || (state.release_idle.is_some() && state.inflight == 0);
        match slot {
            Ok(slot) => {
                waiting |= slot.generation != state.generation;
                state.matched.insert(slot.id, slot.generation);
                state.idle.push(slot);
            }
            Err(id) => {
                state.matched.remove(&id);
            }
        }
        drop(state);
        if waiting {
            self.wake.notify_one();
        }
        self.settled.notify_all();
    }

    /// A backend is gone for good; true when it was the last one.
    pub(super) fn lose_backend(&self) -> bool {
        self.live.fetch_sub(1, Ordering::SeqCst) <= 1
    }

    /// Take the idle backends out (to be dropped, their memory freed, before replacements are
    /// built); the running ones stay and are kept.
    pub(super) fn take_idle(&self) -> Vec<Slot> {
        let mut state = self.lock();
        let old = std::mem::take(&mut state.idle);
        for slot in &old {
            state.matched.remove(&slot.id);
        }
        self.live.store(state.inflight, Ordering::SeqCst);
        old
    }

    /// Replace the idle backends by `fresh` ones, keeping `workers` in all: a backend still
    /// running counts, and is kept. The old ones are dropped outside the lock.
    /// Returns how many of `fresh` it kept.
    pub(super) fn restock(&self, mut fresh: Vec<Slot>, workers: usize) -> usize {
        let (old, kept) = {
            let mut state = self.lock();
            fresh.truncate(workers.saturating_sub(state.inflight));
            self.live.store(fresh.len() + state.inflight, Ordering::SeqCst);
            let kept = fresh.len();
            let fresh: Vec<Slot> = fresh.into_iter().map(|slot| state.admit(slot)).collect();
            let old = std::mem::replace(&mut state.idle, fresh);
            for slot in &old {
                state.matched.remove(&slot.id);
            }
            (old, kept)
        };
        drop(old);
        kept
    }

    /// Give a backend that replaced one that panicked its id, keeping the old one's place.
    pub(super) fn replace(&self, old: usize, slot: Slot) -> Slot {
        let mut state = self.lock();
        state.matched.remove(&old);
        state.admit(slot)
    }

    /// Wake every worker (the backends were restocked).
    pub(super) fn wake_all(&self) {
        self.wake.notify_all();
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
