//! A pool's health ([`Health`], which the pool owns): its circuit breaker and its recent
//! allocator failures, what a run's outcome or a health check does to them, and the permission
//! a request or a check takes.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::config::Provider;
use crate::core::backend::AllocFailureKind;
use crate::core::breaker::{Breaker, BreakerConfig, Failure, Tripped};
use crate::core::clock::Clock;
use crate::core::snapshot::BreakerState;
use crate::pool::job::PoolError;
use crate::pool::metrics::PoolMetrics;

/// How a health check failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckFailure {
    /// A model's probe run failed in a way no other rule counts (a runtime error, a panic): the
    /// pool does not run its models, and its requests would fail the same way.
    Broken(String),
    /// Anything else: an allocator failure (the run counted it against the breaker already), a
    /// lost worker (its supervisor opened the breaker), or no answer within the timeout, which
    /// requests queued ahead of the check can cause on a healthy pool.
    Other(String),
}

impl std::fmt::Display for CheckFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckFailure::Broken(why) | CheckFailure::Other(why) => f.write_str(why),
        }
    }
}

/// How far back `alloc_failures_recent` looks.
pub const RECENT_FAILURE_WINDOW: Duration = Duration::from_secs(60);

/// A pool's circuit breaker and its recent allocator failures.
pub struct Health {
    /// The pool's name, for logs and errors.
    pool: String,
    /// A remote pool's failed checks count against the breaker like an outage.
    remote: bool,
    cooldown: Duration,
    breaker: Mutex<Breaker>,
    recent_failures: Mutex<VecDeque<Instant>>,
    clock: Arc<dyn Clock>,
    metrics: PoolMetrics,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl Health {
    /// A closed breaker with no failures, for pool `pool`.
    pub(super) fn new(
        pool: &str,
        provider: &Provider,
        breaker: BreakerConfig,
        clock: Arc<dyn Clock>,
        metrics: PoolMetrics,
    ) -> Health {
        Health {
            pool: pool.to_string(),
            remote: matches!(provider, Provider::Remote(_)),
            cooldown: breaker.cooldown,
            breaker: Mutex::new(Breaker::new(breaker)),
            recent_failures: Mutex::new(VecDeque::new()),
            clock,
            metrics,
        }
    }

    /// Allocator failures within the last minute (`RECENT_FAILURE_WINDOW`).
    pub fn alloc_failures_recent(&self) -> u64 {
        let now = self.clock.now();
        let mut recent = self.recent_failures.lock().unwrap_or_else(|e| e.into_inner());
        while recent
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > RECENT_FAILURE_WINDOW)
        {
            recent.pop_front();
        }
        recent.len() as u64
    }

    pub(super) fn record_failure(&self, kind: AllocFailureKind) {
        match kind {
            AllocFailureKind::Oom => self.metrics.oom_failures.inc(),
            AllocFailureKind::Driver => self.metrics.driver_failures.inc(),
        };
        let now = self.clock.now();
        self.recent_failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(now);
        let mut breaker = self.breaker();
        if breaker.failure(kind, now) {
            let why = breaker.tripped().map(|w| w.to_string()).unwrap_or_default();
            tracing::warn!(pool = %self.pool, %why, cooldown_s = self.cooldown.as_secs(), "circuit breaker opened: new work goes to other pools");
        }
    }

    /// A remote pool's server failed (`why`): it counts against the breaker like an allocator
    /// failure, but not as one (`alloc_failures_recent` is about memory).
    pub(super) fn record_remote_failure(&self, why: &str) {
        let mut breaker = self.breaker();
        if breaker.failure(Failure::Remote(why.to_string()), self.clock.now()) {
            let why = breaker.tripped().map(|w| w.to_string()).unwrap_or_default();
            tracing::warn!(pool = %self.pool, %why, cooldown_s = self.cooldown.as_secs(), "circuit breaker opened: new work goes to other pools");
        }
    }

    /// Whether a health check is worth making now, and whether it is the breaker's probe:
    /// `None` while the breaker is open (only its cooldown or a restore ends that) or its probe
    /// is out, `Some(true)` when the check is the half-open breaker's probe (its outcome closes
    /// or re-opens it), `Some(false)` while closed. No client's request is ever the probe.
    pub fn health_check_permit(&self) -> Option<bool> {
        let now = self.clock.now();
        let mut breaker = self.breaker();
        if breaker.allows(now) {
            Some(false)
        } else {
            breaker.take_probe(now).then_some(true)
        }
    }

    /// The outcome of a health check taken with [`Health::health_check_permit`] (`probe`: it was
    /// the breaker's probe), counted in `vramguard_health_checks_total`. A success as the probe
    /// closes the breaker. A remote server's failed check counts against the breaker like an
    /// outage. For a local pool, a probe that failed opens the breaker again for another
    /// cooldown; an idle check whose run broke ([`CheckFailure::Broken`]) opens a closed one,
    /// while its allocator failures were already counted by the run, like a request's.
    pub fn health_checked(&self, probe: bool, result: Result<(), CheckFailure>) {
        let counter = match &result {
            Ok(()) => &self.metrics.health_ok,
            Err(_) => &self.metrics.health_failed,
        };
        counter.inc();
        match result {
            Ok(()) if probe => self.probe_succeeded(),
            Ok(()) => {}
            Err(why) if self.remote => self.record_remote_failure(&format!("health check: {why}")),
            Err(why) if probe => {
                let reopened = self.breaker().probe_failed(self.clock.now());
                tracing::warn!(pool = %self.pool, %why, probe, reopened, "health check failed");
            }
            Err(CheckFailure::Broken(why)) => {
                let opened = self.breaker().check_failed(why.clone(), self.clock.now());
                tracing::warn!(pool = %self.pool, %why, probe, opened, "health check failed: circuit breaker opened, new work goes to other pools");
            }
            Err(CheckFailure::Other(why)) => {
                tracing::warn!(pool = %self.pool, %why, probe, "health check failed");
            }
        }
    }

    pub(crate) fn breaker(&self) -> MutexGuard<'_, Breaker> {
        self.breaker.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The circuit breaker's state now.
    pub fn breaker_state(&self) -> BreakerState {
        self.breaker().state(self.clock.now())
    }

    /// Why the breaker is not closed, when it is not, for people.
    pub fn breaker_tripped(&self) -> Option<String> {
        self.breaker_trip().map(|w| w.to_string())
    }

    /// What tripped the breaker, when it is not closed (degraded mode names its cause by it).
    pub fn breaker_trip(&self) -> Option<Tripped> {
        let mut breaker = self.breaker();
        breaker.state(self.clock.now());
        breaker.tripped().cloned()
    }

    /// Whether the breaker lets a request through now: only while closed.
    pub fn breaker_allows(&self) -> bool {
        self.breaker().allows(self.clock.now())
    }

    /// Take the breaker's permission for one request: refused unless the breaker is closed (a
    /// half-open breaker waits for its health check, and the request goes elsewhere).
    pub fn breaker_permit(&self) -> Result<(), PoolError> {
        let now = self.clock.now();
        self.breaker().permit(now).map_err(|why| PoolError::BreakerOpen {
            pool: self.pool.clone(),
            why,
        })
    }

    /// A health check's probe that could not run at all (the pool is shutting down): the next
    /// check may take it.
    pub fn probe_unused(&self) {
        self.breaker().probe_unused();
    }

    /// Its worker (process or backend) was lost (`how`): the breaker opens.
    pub(super) fn worker_lost(&self, how: String) {
        self.breaker().worker_lost(how, self.clock.now());
    }

    /// An operator's restore began: the breaker opens until the rebuilt pool's probe.
    pub(super) fn force_open(&self) {
        self.breaker().force_open(self.clock.now());
    }

    /// The restore rebuilt the pool's backends: the breaker goes half-open for its probe.
    pub(super) fn restored(&self) {
        self.breaker().restored();
    }

    /// The breaker's probe succeeded: a half-open breaker closes, and the time since it opened
    /// is `vramguard_breaker_recovery_seconds`.
    fn probe_succeeded(&self) {
        let recovered = self.breaker().probe_succeeded(self.clock.now());
        if let Some(took) = recovered {
            self.metrics.breaker_recovery.observe(took.as_secs_f64());
            tracing::info!(
                pool = %self.pool,
                open_for_s = took.as_secs_f64(),
                "circuit breaker closed: the health check's probe succeeded"
            );
        }
    }
}
