//! The worker threads: each takes a queued job with an idle backend, skips what no longer needs
//! running, runs the rest with panics caught, and replaces a backend that panicked (or gives the
//! pool up once none is left).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use crate::core::backend::{Backend, BackendError, DecodeStep, RunMeta};
use crate::pool::arena::RunOf;
use crate::pool::job::{InferJob, JobResult, PoolError, RunOp};
use crate::pool::queue::{Next, Queued, Slot};

/// Where a job's answer goes.
type Reply = tokio::sync::oneshot::Sender<JobResult>;
use crate::pool::shared::{Availability, Pool};

/// Most prompts of one model run together as one batch.
pub const MAX_PROMPTS: usize = 8;

impl Pool {
    /// Start `count` worker threads, named after the pool.
    pub(super) fn spawn_workers(self: &Arc<Self>, count: usize) {
        let mut handles = Vec::new();
        for i in 0..count {
            let worker_pool = Arc::clone(self);
            let handle = std::thread::Builder::new()
                .name(format!("{}-worker-{i}", self.config.name))
                .spawn(move || {
                    // A thread-isolated pool's sessions run on its worker threads: placed on the
                    // pool's CPUs, not the server's, which the thread that started them has. A
                    // process-isolated pool's threads only pass frames to its worker process
                    // (placed on the pool's CPUs): they stay with the server's threads, so the
                    // worker has its CPUs to itself.
                    let runs_here = worker_pool.config.isolation == crate::config::Isolation::Thread;
                    if let Some(cpus) = worker_pool.config.cpus.as_ref().filter(|_| runs_here)
                        && let Err(why) = cpus.apply_to_this_thread()
                    {
                        tracing::warn!(pool = worker_pool.name(), %why, "worker thread left where it started");
                    }
                    worker_pool.work()
                })
                .expect("spawning a worker thread");
            handles.push(handle);
        }
        *self.workers.lock().unwrap_or_else(|e| e.into_inner()) = handles;
    }

    /// One worker thread's loop, until the queue closes: bring the backend up to the wanted
    /// models when it is behind, then run the job it came with, if any.
    fn work(&self) {
        // After a run, the next job is often on its way (a generation's next step, a client's
        // next request): look for it a while before sleeping (the queue's `Patience`).
        let mut ran = false;
        while let Some(Next {
            job,
            mut slot,
            stale,
            release,
        }) = self.queue.next_after(std::mem::take(&mut ran))
        {
            if release {
                self.release_memory(&mut slot);
                self.queue.finish(None, Ok(slot));
                continue;
            }
            let loads = stale.map(|(wanted, generation)| {
                let loads = self.residency.reconcile(&mut slot, &wanted, generation);
                // Allocator statistics after sessions came or went: what the weights now hold.
                self.refresh_stats(slot.id, slot.backend.as_mut());
                loads
            });
            let Some(queued) = job else {
                self.queue.finish(None, Ok(slot));
                continue;
            };
            ran = true;
            let model = queued.job.model.clone();
            match loads.as_ref().and_then(|loads| loads.get(&model)) {
                Some(Ok(took)) => self.residency.record_cold_start(&model, *took),
                Some(Err(reason)) => {
                    let error = BackendError::Runtime(format!("model `{model}` could not be loaded: {reason}"));
                    self.queue.finish(Some(&model), Ok(slot));
                    let _ = queued.reply.send(Err(PoolError::Backend(error)));
                    continue;
                }
                None => {}
            }
            let id = slot.id;
            if matches!(queued.job.op, RunOp::Prefill(_)) {
                let more = self.queue.take_prompts(&model, id, MAX_PROMPTS - 1);
                if !more.is_empty() {
                    let count = more.len();
                    let (kept, answers) = self.serve_prompts(queued, more, slot);
                    self.queue.finish_prompts(&model, count);
                    self.queue.finish(Some(&model), kept.ok_or(id));
                    for (reply, result) in answers {
                        let _ = reply.send(result);
                    }
                    continue;
                }
            }
            let Queued { job, enqueued, reply } = queued;
            let prefill = match job.op {
                RunOp::Prefill(seq) => Some(seq),
                _ => None,
            };
            let (mut kept, result) = self.serve(job, enqueued, reply.is_closed(), slot);
            // A prompt whose caller went away while it ran leaves no cache behind.
            if let (Some(seq), Some(slot), true) = (prefill, kept.as_mut(), reply.is_closed()) {
                let gone = DecodeStep {
                    rows: Vec::new(),
                    ended: vec![seq],
                    ..Default::default()
                };
                if let Some(caches) = slot.backend.generations() {
                    let _ = caches.decode(&model, &gone, &RunMeta::default());
                }
            }
            // The run is counted over before its answer goes out: a caller that reads the
            // pool's load after its answer sees it.
            self.queue.finish(Some(&model), kept.ok_or(id));
            if let Some(result) = result {
                let _ = reply.send(result);
            }
        }
    }

    /// Run prompts of one model that waited together as one batch (a [`RunOp::PrefillMany`]
    /// job): each is checked as [`serve`](Self::serve) checks a job, those still wanted run,
    /// and each gets its own row of logits, or the batch's error. Returns the slot, unless its
    /// backend was lost, and the answers to send.
    fn serve_prompts(&self, first: Queued, more: Vec<Queued>, slot: Slot) -> (Option<Slot>, Vec<(Reply, JobResult)>) {
        let now = self.context.clock.now();
        let earliest = first.enqueued;
        let pool = || self.name().to_string();
        let (mut answers, mut running) = (Vec::new(), Vec::new());
        for (i, queued) in std::iter::once(first).chain(more).enumerate() {
            let waited = now.saturating_duration_since(queued.enqueued);
            // The first one's wait is observed with the batch's run.
            if i > 0 {
                self.context.metrics.queue_wait.observe(waited.as_secs_f64());
            }
            let job = &queued.job;
            if queued.reply.is_closed() {
                continue;
            } else if waited > self.config.max_wait {
                answers.push((queued.reply, Err(PoolError::QueueTimeout { pool: pool(), waited })));
            } else if job.meta.deadline.is_some_and(|d| now >= d) {
                answers.push((queued.reply, Err(PoolError::DeadlineExceeded { pool: pool() })));
            } else if job.cancel.start(None) {
                running.push(queued);
            }
        }
        if running.is_empty() {
            return (Some(slot), answers);
        }
        let seqs: Vec<u64> = running
            .iter()
            .filter_map(|q| match q.job.op {
                RunOp::Prefill(seq) => Some(seq),
                _ => None,
            })
            .collect();
        let batch = InferJob {
            meta: RunMeta {
                deadline: None,
                ..running[0].job.meta.clone()
            },
            model: running[0].job.model.clone(),
            inputs: running
                .iter_mut()
                .flat_map(|q| std::mem::take(&mut q.job.inputs).into_vec())
                .collect::<Vec<_>>()
                .into(),
            outputs: Vec::new(),
            op: RunOp::PrefillMany(seqs.clone()),
            estimate_bytes: Some(running.iter().filter_map(|q| q.job.estimate_bytes).sum()),
            memory: Default::default(),
            probe: false,
            cancel: Default::default(),
        };
        let model = batch.model.clone();
        let (mut kept, result) = self.serve(batch, earliest, false, slot);
        let rows = match result {
            Some(Ok(rows)) if rows.len() == running.len() => Ok(rows),
            Some(Ok(rows)) => Err(PoolError::Backend(BackendError::Runtime(format!(
                "{} rows of logits for {} prompts",
                rows.len(),
                running.len()
            )))),
            Some(Err(error)) => Err(error),
            None => Err(PoolError::ShuttingDown { pool: pool() }),
        };
        // Prompts whose callers went away while they ran leave no cache behind.
        let gone: Vec<u64> = running
            .iter()
            .zip(&seqs)
            .filter(|(q, _)| q.reply.is_closed())
            .map(|(_, seq)| *seq)
            .collect();
        if let (false, Some(caches)) = (
            gone.is_empty(),
            kept.as_mut().and_then(|slot| slot.backend.generations()),
        ) {
            let step = DecodeStep {
                rows: Vec::new(),
                ended: gone,
                ..Default::default()
            };
            let _ = caches.decode(&model, &step, &RunMeta::default());
        }
        let mut rows = rows.map(|rows| rows.into_iter());
        for queued in running {
            queued.job.cancel.end();
            let answer = match &mut rows {
                Ok(rows) => Ok(rows.next().into_iter().collect()),
                Err(error) => Err(error.clone()),
            };
            answers.push((queued.reply, answer));
        }
        (kept, answers)
    }

    /// Give the free memory of `slot`'s allocator back: the pool has been idle for its
    /// `memory.idle_release` (or host memory is short). The arena keeps its blocks between runs,
    /// so a pool under load reuses them; only an idle one pays for returning them.
    fn release_memory(&self, slot: &mut Slot) {
        let started = Instant::now();
        let probe = |model: &str| self.residency.probe_of(model);
        if let Some(residency) = slot.backend.residency() {
            residency.release_memory(&probe);
        }
        slot.dirty = false;
        self.refresh_stats(slot.id, slot.backend.as_mut());
        tracing::debug!(
            pool = self.name(),
            took_us = started.elapsed().as_micros() as u64,
            "idle: allocator memory given back"
        );
    }

    /// Run one queued job on `slot`, unless it no longer needs running (its caller went away:
    /// `abandoned`); returns the slot unless its backend was lost, and the answer, if any.
    fn serve(
        &self,
        job: InferJob,
        enqueued: Instant,
        abandoned: bool,
        slot: Slot,
    ) -> (Option<Slot>, Option<JobResult>) {
        let Slot {
            mut backend,
            id,
            loaded,
            generation,
            ..
        } = slot;
        let waited = self.context.clock.now().saturating_duration_since(enqueued);
        // A health check is no request: it stays out of the queue's wait times.
        if !job.probe {
            self.context.metrics.queue_wait.observe(waited.as_secs_f64());
        }
        let skip = if abandoned {
            // The client went away while queued: do not spend the device on it.
            tracing::debug!(request_id = %job.meta.request_id, pool = self.name(), "client gone before start; skipped");
            Some(None)
        } else if waited > self.config.max_wait {
            Some(Some(Err(PoolError::QueueTimeout {
                pool: self.name().to_string(),
                waited,
            })))
        } else if job.meta.deadline.is_some_and(|d| self.context.clock.now() >= d) {
            Some(Some(Err(PoolError::DeadlineExceeded {
                pool: self.name().to_string(),
            })))
        } else if !{
            let handle = backend.interrupts().map(|interrupts| {
                interrupts.clear_interrupt();
                interrupts.interrupt_handle()
            });
            job.cancel.start(handle)
        } {
            // Cancelled while queued. Registered last, so only a job that runs holds the
            // backend's interrupt (and `run_one` always ends it).
            tracing::debug!(request_id = %job.meta.request_id, pool = self.name(), "cancelled before start; skipped");
            Some(None)
        } else {
            None
        };
        let Some(skipped) = skip else {
            let (result, kept) = self.run_one(id, backend, job);
            // The breaker opens at the first run that finds the worker gone, not when its
            // supervisor reaps the process: until then every request would reach it first.
            if let Some(how) = kept.as_ref().and_then(|backend| backend.liveness()?.worker_gone()) {
                self.health.worker_lost(how);
            }
            let panicked = matches!(result, Err(PoolError::Backend(BackendError::Panicked(_))));
            let kept = kept.map(|backend| match panicked {
                // A replacement holds the sessions the pool starts with; the worker brings it
                // up to the wanted models before its next job.
                true => self.queue.replace(id, Slot::fresh(backend, self.residency.start_set())),
                false if backend.liveness().is_some_and(|liveness| liveness.lost()) => match self.on_new_worker() {
                    Some(fresh) => self.queue.replace(id, Slot::fresh(fresh, self.residency.start_set())),
                    None => Slot::with(id, backend, loaded, generation),
                },
                false => Slot::with(id, backend, loaded, generation),
            });
            return (kept, Some(result));
        };
        (Some(Slot::with(id, backend, loaded, generation)), skipped)
    }

    /// Run one job. A panicking backend is caught here: the request gets
    /// [`BackendError::Panicked`] and the backend is replaced by a fresh one, since the old one
    /// may hold half-updated state; `None` comes back when no replacement could be built.
    fn run_one(&self, slot: usize, mut backend: Box<dyn Backend>, job: InferJob) -> Ran {
        let started = Instant::now();
        // A measured run reads the arena of the model it runs just before it: the cached
        // statistics may be another model's session, or older than another pool's runs on a
        // shared device.
        let before = backend.arenas().and_then(|arenas| {
            if job.memory.is_wanted() {
                arenas.refresh_arena_stats_for(&job.model);
            }
            arenas.arena_stats()
        });
        let first = self.runs_started.fetch_add(1, Ordering::SeqCst) + 1;
        let mut alone = self.running.fetch_add(1, Ordering::SeqCst) == 0;
        let metrics = &self.context.metrics;
        let run = std::panic::catch_unwind(AssertUnwindSafe(|| {
            // With whether what came back from the runtime is counted already.
            let (result, counted) = match job.op {
                RunOp::Run | RunOp::Prefill(_) | RunOp::PrefillMany(_) => {
                    metrics
                        .to_pool
                        .inc_by(job.inputs.iter().map(|t| t.data.byte_len() as u64).sum());
                    let result = match job.op {
                        RunOp::Prefill(seq) => backend
                            .caches()
                            .and_then(|caches| caches.prefill(&job.model, seq, job.inputs.into_vec(), &job.meta)),
                        RunOp::PrefillMany(seqs) => backend.caches().and_then(|caches| {
                            caches.prefill_many(&job.model, &seqs, job.inputs.into_vec(), &job.meta)
                        }),
                        // Kept by the request for a retry: read where they are, not copied.
                        _ if job.inputs.is_shared() => {
                            backend.run_borrowed(&job.model, &job.inputs, &job.outputs, &job.meta)
                        }
                        _ => backend.run(&job.model, job.inputs.into_vec(), &job.outputs, &job.meta),
                    };
                    (result, false)
                }
                RunOp::Decode(step) => {
                    let result = backend
                        .caches()
                        .and_then(|caches| caches.decode(&job.model, &step, &job.meta));
                    // A backend that keeps caches reports what its step moved (a batch's
                    // masked rows cross too); one that does not moved its rows' tokens in.
                    let reported = result
                        .as_deref()
                        .ok()
                        .and_then(|outputs| DecodeStep::reported(outputs, DecodeStep::CROSSED));
                    let rows_in = step.rows.len() as u64 * DecodeStep::ROW_BYTES;
                    metrics.to_pool.inc_by(reported.map_or(rows_in, |[to, _]| to));
                    if let Some([_, from]) = reported {
                        metrics.from_pool.inc_by(from);
                    }
                    (result, reported.is_some())
                }
            };
            // What came from the runtime: a run's outputs, or the logits of a decode step its
            // backend did not report on (the batch's padding is counted on the host).
            if !counted && let Ok(outputs) = &result {
                let from_runtime = outputs
                    .iter()
                    .filter(|t| !DecodeStep::REPORTS.contains(&t.name.as_str()));
                metrics
                    .from_pool
                    .inc_by(from_runtime.map(|t| t.data.byte_len() as u64).sum());
            }
            result
        }));
        alone &= self.running.fetch_sub(1, Ordering::SeqCst) == 1;
        alone &= self.runs_started.load(Ordering::SeqCst) == first;
        job.cancel.end();
        // A health check runs the smallest input: it would skew the delay estimate low.
        if !job.probe {
            self.runs.record(started.elapsed());
        }
        let result = match run {
            Ok(result) => result,
            Err(panic) => {
                let message = crate::core::human::panic_message(panic.as_ref());
                tracing::error!(request_id = %job.meta.request_id, pool = self.name(), model = %job.model, panic = %message, "the backend panicked; replacing it");
                drop(backend);
                let replacement = match &self.respawn {
                    Some(respawn) => respawn(),
                    None => Err("this pool cannot rebuild a backend".into()),
                };
                let kept = match replacement {
                    Ok(fresh) => Some(fresh),
                    Err(reason) => {
                        self.lose_backend(reason);
                        None
                    }
                };
                return (Err(PoolError::Backend(BackendError::Panicked(message))), kept);
            }
        };
        let run = RunOf {
            slot,
            request_id: &job.meta.request_id,
            estimate_bytes: job.estimate_bytes,
            memory: &job.memory,
            // The simulated device's arena is one for every session: another run's peak
            // during this one would read as this one's.
            alone: alone || self.device_kind != crate::core::snapshot::DeviceClass::Simulated,
        };
        self.stats_after_run(backend.as_mut(), run, before, &result);
        match &result {
            Err(BackendError::Allocation { kind, .. }) => self.health.record_failure(*kind),
            Err(BackendError::Remote { kind, message }) => {
                self.health.record_remote_failure(&format!("{kind}: {message}"))
            }
            // A success closes nothing: only the health check's probe closes a half-open
            // breaker, and it settles its own outcome. Other failures (bad input, a model
            // error) are not the device's fault.
            Ok(_) | Err(_) => {}
        }
        self.log_failure(&job.meta.request_id, &job.model, &result);
        (result.map_err(PoolError::from), Some(backend))
    }

    /// Say why a run of `model` for `request_id` failed, when it did.
    fn log_failure<T>(&self, request_id: &str, model: &str, result: &Result<T, BackendError>) {
        match result {
            Err(BackendError::Cancelled) => {
                tracing::debug!(request_id, pool = self.name(), "run stopped: the client went away")
            }
            Err(e) => {
                tracing::warn!(request_id, pool = self.name(), model, error = %e, "inference failed")
            }
            Ok(_) => {}
        }
    }

    /// A backend for the worker process that replaced a lost one, when one runs (until then a
    /// lost backend stays: its runs fail at once, and the restart rebuilds the idle ones).
    fn on_new_worker(&self) -> Option<Box<dyn Backend>> {
        self.supervisor.host()?.current()?;
        let respawn = self.respawn.as_ref()?;
        respawn()
            .inspect_err(
                |why| tracing::warn!(pool = self.name(), %why, "cannot reopen sessions on the new worker process"),
            )
            .ok()
    }

    /// A backend could not be replaced. When the last one is gone the pool becomes unavailable
    /// and answers what is still queued, so nothing waits for a backend that will not come.
    fn lose_backend(&self, reason: String) {
        tracing::error!(pool = self.name(), %reason, "a backend is lost: it panicked and could not be rebuilt");
        if !self.queue.lose_backend() {
            return;
        }
        let reason = format!("every backend is lost: {reason}");
        *self.availability.write().unwrap_or_else(PoisonError::into_inner) = Availability::Unavailable(reason.clone());
        let drained: Vec<Queued> = self.queue.drain();
        for queued in drained {
            let _ = queued.reply.send(Err(PoolError::Unavailable {
                pool: self.name().to_string(),
                reason: reason.clone(),
            }));
        }
    }
}

/// A run's answer, and the backend to keep (`None` when it panicked and none could replace it).
type Ran = (JobResult, Option<Box<dyn Backend>>);
