//! A process-isolated pool's supervisor ([`Supervisor`], which the pool owns): a thread that watches the pool's worker process (its
//! exit, and a heartbeat on its control connection), and when it is lost opens the breaker,
//! counts the restart and starts a new one in the background with backoff; the pool's idle
//! backends are then rebuilt on it and the health check's probe closes the breaker. Jobs the
//! lost worker held fail at once with [`WorkerLost`](crate::core::backend::BackendError),
//! which the request path retries once on the fallback when it may.

use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::health::Health;
use super::metrics::WorkerHandles;
use super::process::WorkerHost;

/// What the supervisor's thread needs of its pool (the pool, which owns the supervisor).
pub(super) trait Supervised: Send + Sync {
    /// The pool's name.
    fn name(&self) -> &str;
    /// True once the pool's shutdown has started: the thread stops its worker and ends.
    fn is_shutting_down(&self) -> bool;
    /// Build the pool's backends again, on the new worker process.
    fn rebuild(&self) -> Result<usize, String>;
    /// The pool's breaker, which a lost worker opens.
    fn health(&self) -> &Health;
    /// The supervisor itself.
    fn supervisor(&self) -> &Supervisor;
}

/// How often the supervisor looks at the worker.
const TICK: Duration = Duration::from_millis(20);
/// How often it asks the worker whether it is there (at most: half its timeout when shorter).
const HEARTBEAT: Duration = Duration::from_millis(250);
/// The first wait before a restart; it doubles after each failed one, to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A worker that lived this long before it was lost resets the backoff: one lost sooner is
/// taken for a crash loop, and the next start waits twice as long.
const STABLE: Duration = Duration::from_secs(5);

/// Why a worker process was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lost {
    /// It exited or was killed.
    Exited,
    /// It stopped answering its heartbeat.
    Hung,
}

/// A pool's worker process, when it is process-isolated, and what watches it.
#[derive(Debug)]
pub struct Supervisor {
    /// The pool's name, for logs, errors and the thread's name.
    pool: String,
    host: OnceLock<Arc<WorkerHost>>,
    metrics: Option<WorkerHandles>,
}

impl Supervisor {
    /// No worker process yet (a thread-isolated pool never has one).
    pub(super) fn new(pool: &str, metrics: Option<WorkerHandles>) -> Supervisor {
        Supervisor {
            pool: pool.to_string(),
            host: OnceLock::new(),
            metrics,
        }
    }

    /// Run `pool`'s backends in `host`'s worker processes: a thread watches them and replaces
    /// the lost, until the pool is gone or shuts down.
    pub(super) fn supervise(&self, pool: Weak<dyn Supervised>, host: Arc<WorkerHost>) {
        if self.host.set(Arc::clone(&host)).is_err() {
            return;
        }
        if let Some(worker) = &self.metrics {
            worker.up.set(i64::from(host.current().is_some()));
        }
        let spawned = std::thread::Builder::new()
            .name(format!("{}-supervisor", self.pool))
            .spawn(move || watch(&pool, &host));
        if let Err(e) = spawned {
            tracing::error!(pool = %self.pool, error = %e, "cannot start the worker's supervisor");
        }
    }

    /// Its worker processes, when it is process-isolated.
    pub(super) fn host(&self) -> Option<&Arc<WorkerHost>> {
        self.host.get()
    }
    /// The process id of its worker process, when it is process-isolated and one runs.
    pub fn worker_pid(&self) -> Option<u32> {
        self.host.get()?.pid()
    }

    /// Stop its worker process for good and remove its sockets' folder (at shutdown, once its
    /// runs are over or the grace period is).
    pub fn close_worker(&self) {
        if let Some(host) = self.host.get() {
            host.close();
        }
    }

    /// Whether it runs in a worker process.
    pub fn is_process_isolated(&self) -> bool {
        self.host.get().is_some()
    }

    /// Kill its worker process at once (`kill_worker`, a fault knob): mid-run if it has work.
    /// The supervisor finds it dead and replaces it. Its pid.
    pub fn kill_worker(&self) -> Result<u32, String> {
        let host = self
            .host
            .get()
            .ok_or_else(|| format!("pool `{}` has no worker process (isolation: thread)", self.pool))?;
        let worker = host
            .current()
            .ok_or_else(|| format!("pool `{}`'s worker process is being replaced", self.pool))?;
        worker.signal_kill();
        tracing::warn!(
            pool = %self.pool,
            pid = worker.pid,
            "kill_worker: worker process killed (fault injection)"
        );
        Ok(worker.pid)
    }

    /// The worker was lost (`how`): the breaker opens, the metrics say so. A loss `injected` by
    /// the `kill_worker` fault knob is the fault asked for, logged as a warning, not an error.
    fn worker_lost(&self, health: &super::Health, lost: Lost, how: &str, injected: bool) {
        if let Some(worker) = &self.metrics {
            worker.up.set(0);
            match lost {
                Lost::Exited => worker.exited.inc(),
                Lost::Hung => worker.hung.inc(),
            };
        }
        health.worker_lost(how.to_string());
        let what = "worker process lost: the breaker opens, new work goes to the fallback, and a new worker starts";
        if injected {
            tracing::warn!(pool = %self.pool, %how, "{what} (kill_worker: fault injection)");
        } else {
            tracing::error!(pool = %self.pool, %how, "{what}");
        }
    }

    /// An operator's restore: the current worker is killed and a new one started (the caller
    /// rebuilds the backends on it).
    pub(super) fn replace_worker(&self, host: &WorkerHost) -> Result<(), String> {
        let _lifecycle = host.lifecycle.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = host.take() {
            let ended = old.kill();
            tracing::info!(pool = %self.pool, pid = old.pid, %ended, "restore: worker process replaced");
        }
        if let Some(worker) = &self.metrics {
            worker.up.set(0);
            worker.restore.inc();
        }
        host.start()
            .map_err(|why| format!("{why}; the pool's supervisor keeps starting one in the background"))?;
        if let Some(worker) = &self.metrics {
            worker.up.set(1);
        }
        Ok(())
    }
}

/// The supervisor's loop, until the pool is gone or shuts down.
fn watch(pool: &Weak<dyn Supervised>, host: &WorkerHost) {
    let heartbeat = HEARTBEAT.min(host.timeout() / 2).max(TICK);
    let mut next_ping = Instant::now() + heartbeat;
    let mut last_answer = Instant::now();
    let mut backoff = FIRST_BACKOFF;
    let mut started = Instant::now();
    loop {
        std::thread::sleep(TICK);
        let Some(pool) = pool.upgrade() else {
            host.stop();
            return;
        };
        if pool.is_shutting_down() {
            host.stop();
            return;
        }
        let lifecycle = host.lifecycle.lock().unwrap_or_else(|e| e.into_inner());
        let Some(worker) = host.current() else {
            // A restore whose new worker could not start left none (it said so, and the
            // breaker is open): start one as after a loss, rather than never again.
            drop(lifecycle);
            tracing::warn!(
                pool = pool.name(),
                "no worker process runs after a failed start: starting one in the background"
            );
            if !restart(pool.as_ref(), host, &mut backoff) {
                return;
            }
            started = Instant::now();
            last_answer = Instant::now();
            next_ping = Instant::now() + heartbeat;
            continue;
        };
        let lost = if let Some(how) = worker.ended() {
            Some((Lost::Exited, format!("worker process {} {how}", worker.pid)))
        } else if Instant::now() >= next_ping {
            next_ping = Instant::now() + heartbeat;
            match host.ping() {
                Ok(_) => {
                    last_answer = Instant::now();
                    None
                }
                Err(_) if worker.ended().is_some() => None,
                Err(why) if last_answer.elapsed() >= host.timeout() => Some((
                    Lost::Hung,
                    format!(
                        "worker process {} did not answer its heartbeat within {} ms ({why})",
                        worker.pid,
                        host.timeout().as_millis()
                    ),
                )),
                Err(_) => None,
            }
        } else {
            None
        };
        let Some((lost, how)) = lost else {
            continue;
        };
        host.take();
        worker.kill();
        pool.supervisor()
            .worker_lost(pool.health(), lost, &how, worker.killed_on_purpose());
        drop(lifecycle);
        if started.elapsed() >= STABLE {
            backoff = FIRST_BACKOFF;
        }
        if !restart(pool.as_ref(), host, &mut backoff) {
            return;
        }
        started = Instant::now();
        last_answer = Instant::now();
        next_ping = Instant::now() + heartbeat;
    }
}

/// Start a new worker and rebuild the pool's backends on it, in the background of the request
/// path (requests meanwhile go to the fallback, as the open breaker says). Each try waits
/// `backoff` first, and a failed one doubles it (to [`MAX_BACKOFF`]); so does a successful
/// one, so that a worker lost again soon waits longer. `lifecycle` is free while it waits: an
/// operator's restore is never stuck behind a restart that keeps failing, and a worker it
/// starts ends the wait. False when the pool shuts down first.
fn restart(pool: &dyn Supervised, host: &WorkerHost, backoff: &mut Duration) -> bool {
    loop {
        std::thread::sleep(*backoff);
        if pool.is_shutting_down() {
            return false;
        }
        let _lifecycle = host.lifecycle.lock().unwrap_or_else(|e| e.into_inner());
        let done = if host.current().is_some() {
            // A restore started one meanwhile (and rebuilt the pool on it).
            Ok(())
        } else {
            host.start().and_then(|_| pool.rebuild()).map(|_| ())
        };
        let wait = (*backoff * 2).min(MAX_BACKOFF);
        match done {
            Ok(()) => {
                if let Some(worker) = &pool.supervisor().metrics {
                    worker.up.set(1);
                }
                *backoff = wait;
                return true;
            }
            Err(why) => {
                tracing::error!(pool = pool.name(), %why, retry_in_ms = wait.as_millis() as u64, "the new worker process could not start");
                if let Some(worker) = host.take() {
                    worker.kill();
                }
                *backoff = wait;
            }
        }
    }
}
