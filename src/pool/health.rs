//! The pool's circuit breaker and its recent allocator failures: what a run's outcome or a
//! remote health check does to them, and the permission a request or a check takes.

use std::sync::{MutexGuard, PoisonError};
use std::time::Duration;

use crate::core::backend::AllocFailureKind;
use crate::core::breaker::{Breaker, Failure, Permit};
use crate::core::snapshot::BreakerState;
use crate::pool::job::PoolError;
use crate::pool::shared::Pool;

/// How far back `alloc_failures_recent` looks.
pub const RECENT_FAILURE_WINDOW: Duration = Duration::from_secs(60);

impl Pool {
    /// Allocator failures within [`RECENT_FAILURE_WINDOW`].
    pub fn alloc_failures_recent(&self) -> u64 {
        let now = self.context.clock.now();
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
            AllocFailureKind::Oom => self.context.metrics.oom_failures.inc(),
            AllocFailureKind::Driver => self.context.metrics.driver_failures.inc(),
        };
        let now = self.context.clock.now();
        self.recent_failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(now);
        let mut breaker = self.breaker();
        if breaker.failure(kind, now) {
            let why = breaker.tripped().map(|w| w.to_string()).unwrap_or_default();
            tracing::warn!(pool = self.name(), %why, cooldown_s = self.config.breaker.cooldown.as_secs(), "circuit breaker opened: new work goes to other pools");
        }
    }

    /// A remote pool's server failed (`why`): it counts against the breaker like an allocator
    /// failure, but not as one (`alloc_failures_recent` is about memory).
    pub(super) fn record_remote_failure(&self, why: &str) {
        let mut breaker = self.breaker();
        if breaker.failure(Failure::Remote(why.to_string()), self.context.clock.now()) {
            let why = breaker.tripped().map(|w| w.to_string()).unwrap_or_default();
            tracing::warn!(pool = self.name(), %why, cooldown_s = self.config.breaker.cooldown.as_secs(), "circuit breaker opened: new work goes to other pools");
        }
    }

    /// Whether a health check of the remote server is worth making now, and whether it is the
    /// breaker's probe: `None` while the breaker is open (only its cooldown ends that) or its
    /// probe is out, `Some(true)` when the check is the probe, so a healthy remote closes the
    /// breaker without a client's request being the test.
    pub fn health_check_permit(&self) -> Option<bool> {
        match self.breaker().permit(self.context.clock.now()) {
            Permit::Run => Some(false),
            Permit::Probe => Some(true),
            Permit::Denied => None,
        }
    }

    /// The outcome of a health check taken with [`Pool::health_check_permit`]: a failure counts
    /// against the breaker (re-opening it when the check was the probe), a success as the
    /// probe closes it.
    pub fn health_checked(&self, result: Result<(), String>) {
        match result {
            Ok(()) => self.record_success(),
            Err(why) => self.record_remote_failure(&format!("health check: {why}")),
        }
    }

    pub(super) fn breaker(&self) -> MutexGuard<'_, Breaker> {
        self.breaker.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The circuit breaker's state now.
    pub fn breaker_state(&self) -> BreakerState {
        self.breaker().state(self.context.clock.now())
    }

    /// Why the breaker is not closed, when it is not.
    pub fn breaker_tripped(&self) -> Option<String> {
        let mut breaker = self.breaker();
        breaker.state(self.context.clock.now());
        breaker.tripped().map(|w| w.to_string())
    }

    /// Whether the breaker would let a request through now (without taking the probe).
    pub fn breaker_allows(&self) -> bool {
        self.breaker().would_permit(self.context.clock.now())
    }

    /// Take the breaker's permission for one request: `Ok(true)` when it is the half-open
    /// probe (mark the job so its outcome settles the breaker).
    pub fn breaker_permit(&self) -> Result<bool, PoolError> {
        let mut breaker = self.breaker();
        match breaker.permit(self.context.clock.now()) {
            Permit::Run => Ok(false),
            Permit::Probe => Ok(true),
            Permit::Denied => Err(PoolError::BreakerOpen {
                pool: self.name().to_string(),
                why: breaker.tripped().map(|w| w.to_string()).unwrap_or_default(),
            }),
        }
    }

    /// A probe that will not run after all (it was refused before reaching the queue).
    pub fn probe_unused(&self) {
        self.breaker().probe_unused();
    }

    /// A run finished without an allocator failure: a half-open breaker closes.
    pub(super) fn record_success(&self) {
        let recovered = self.breaker().success(self.context.clock.now());
        if let Some(took) = recovered {
            self.context.metrics.breaker_recovery.observe(took.as_secs_f64());
            tracing::info!(
                pool = self.name(),
                open_for_s = took.as_secs_f64(),
                "circuit breaker closed: the probe succeeded"
            );
        }
    }
}
