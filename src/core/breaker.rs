//! A pool's circuit breaker, as a pure state machine: failures and probe outcomes go in with the
//! time they happened, whether a request may run comes out. No clock of its own, no threads:
//! tested with plain instants.
//!
//! - **Closed**: requests flow. `failures` failures within `window` (allocator failures, or a
//!   remote pool's server failing to answer) open it; one driver-class failure opens it at once
//!   (a reset device fails everything after it).
//! - **Open**: no requests until `cooldown` has passed since it opened.
//! - **Half-open**: still no requests; the pool's own health check takes the one probe. Its
//!   success closes the breaker, its failure opens it again for another cooldown; a probe that
//!   never ran hands the turn on. No client's request is ever the test of a recovering pool.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::core::backend::AllocFailureKind;
use crate::core::snapshot::BreakerState;

/// When a breaker opens and how long it stays open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Allocator failures within `window` that open it.
    pub failures: u32,
    /// How far back failures count.
    pub window: Duration,
    /// How long it stays open before the health check's probe may go through.
    pub cooldown: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failures: 3,
            window: Duration::from_secs(60),
            cooldown: Duration::from_secs(30),
        }
    }
}

/// A failure that counts against a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// An allocator failure of this kind.
    Alloc(AllocFailureKind),
    /// A remote pool's server did not answer as it should (unreachable, 5xx, timeout, a failed
    /// health check); says how.
    Remote(String),
}

impl From<AllocFailureKind> for Failure {
    fn from(kind: AllocFailureKind) -> Self {
        Failure::Alloc(kind)
    }
}

/// Why the breaker is not closed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tripped {
    /// Too many allocator failures within the window.
    Failures(u32),
    /// Too many failures within the window, the last of them a remote server's (how it failed).
    RemoteFailures(u32, String),
    /// A driver-class failure.
    Driver,
    /// An operator opened it (a restore is rebuilding the pool).
    Restoring,
    /// The pool's worker process died or hung (how); it is being replaced.
    WorkerLost(String),
    /// A health check's run failed while the breaker was closed (how), in a way no other rule
    /// counts (not an allocator failure, not a lost worker).
    HealthCheck(String),
}

impl std::fmt::Display for Tripped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tripped::Failures(n) => write!(f, "{n} allocator failures"),
            Tripped::RemoteFailures(n, last) => write!(f, "{n} failures of the remote server (last: {last})"),
            Tripped::Driver => f.write_str("a driver-class failure"),
            Tripped::Restoring => f.write_str("restoring"),
            Tripped::WorkerLost(how) => write!(f, "its worker process was lost ({how})"),
            Tripped::HealthCheck(how) => write!(f, "its health check failed ({how})"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Closed,
    Open { since: Instant, why: Tripped },
    HalfOpen { probe_out: bool, why: Tripped },
}

/// One pool's breaker.
#[derive(Debug, Clone)]
pub struct Breaker {
    config: BreakerConfig,
    state: State,
    /// Allocator failures within the window (closed state only).
    recent: VecDeque<Instant>,
    /// When it last left the closed state (for the open-to-closed time).
    opened_at: Option<Instant>,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            state: State::Closed,
            recent: VecDeque::new(),
            opened_at: None,
        }
    }

    /// The state as of `now` (an open breaker whose cooldown passed reads half-open).
    pub fn state(&mut self, now: Instant) -> BreakerState {
        self.advance(now);
        match self.state {
            State::Closed => BreakerState::Closed,
            State::Open { .. } => BreakerState::Open,
            State::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// Why it is not closed, if it is not.
    pub fn tripped(&self) -> Option<&Tripped> {
        match &self.state {
            State::Closed => None,
            State::Open { why, .. } | State::HalfOpen { why, .. } => Some(why),
        }
    }

    /// Whether a request may run now: only while closed.
    pub fn allows(&mut self, now: Instant) -> bool {
        self.permit(now).is_ok()
    }

    /// A request's permission to run now: granted while closed, else refused with why the
    /// breaker is not (what a caller moving the request elsewhere says it moved for).
    pub fn permit(&mut self, now: Instant) -> Result<(), Tripped> {
        self.advance(now);
        match &self.state {
            State::Closed => Ok(()),
            State::Open { why, .. } | State::HalfOpen { why, .. } => Err(why.clone()),
        }
    }

    /// Take the half-open breaker's one probe for a health check: true when it is taken, and
    /// must then be settled with [`Breaker::probe_succeeded`], [`Breaker::probe_failed`] or
    /// [`Breaker::probe_unused`].
    pub fn take_probe(&mut self, now: Instant) -> bool {
        self.advance(now);
        match &mut self.state {
            State::HalfOpen { probe_out, .. } if !*probe_out => {
                *probe_out = true;
                true
            }
            _ => false,
        }
    }

    /// The probe succeeded: a half-open breaker closes. Returns how long it was not closed.
    pub fn probe_succeeded(&mut self, now: Instant) -> Option<Duration> {
        self.advance(now);
        if let State::HalfOpen { .. } = self.state {
            self.state = State::Closed;
            self.recent.clear();
            return self.opened_at.take().map(|at| now.saturating_duration_since(at));
        }
        None
    }

    /// The probe failed without a failure the breaker counts (the run was refused, timed out or
    /// the model failed): a half-open breaker opens again for another cooldown, with the same
    /// reason. Returns true when this opened it.
    pub fn probe_failed(&mut self, now: Instant) -> bool {
        self.advance(now);
        if let State::HalfOpen { why, .. } = &self.state {
            let why = why.clone();
            self.open(now, why);
            return true;
        }
        false
    }

    /// A run failed (`kind` says how). Returns true when this opened it.
    pub fn failure(&mut self, kind: impl Into<Failure>, now: Instant) -> bool {
        let kind = kind.into();
        self.advance(now);
        let driver = kind == Failure::Alloc(AllocFailureKind::Driver);
        match &self.state {
            State::HalfOpen { why, .. } => {
                let why = match kind {
                    _ if driver => Tripped::Driver,
                    Failure::Remote(last) => Tripped::RemoteFailures(1, last),
                    Failure::Alloc(_) => why.clone(),
                };
                self.open(now, why);
                true
            }
            State::Open { .. } => false,
            State::Closed if driver => {
                self.open(now, Tripped::Driver);
                true
            }
            State::Closed => {
                self.recent.push_back(now);
                self.forget_old(now);
                if self.recent.len() as u32 >= self.config.failures.max(1) {
                    let n = self.recent.len() as u32;
                    let why = match kind {
                        Failure::Remote(last) => Tripped::RemoteFailures(n, last),
                        Failure::Alloc(_) => Tripped::Failures(n),
                    };
                    self.open(now, why);
                    true
                } else {
                    false
                }
            }
        }
    }

    /// The probe did not run (the pool was shutting down): the next health check may take it.
    pub fn probe_unused(&mut self) {
        if let State::HalfOpen { probe_out, .. } = &mut self.state {
            *probe_out = false;
        }
    }

    /// Open it now for an operator's restore; the cooldown then lets a health check's probe
    /// through.
    pub fn force_open(&mut self, now: Instant) {
        self.open(now, Tripped::Restoring);
    }

    /// The pool's worker process was lost (`how`): open until its replacement's probe closes it.
    pub fn worker_lost(&mut self, how: String, now: Instant) {
        self.open(now, Tripped::WorkerLost(how));
    }

    /// A health check of the closed breaker's pool failed (`how`): open for a cooldown, after
    /// which the next check is the probe. Returns true when this opened it.
    pub fn check_failed(&mut self, how: String, now: Instant) -> bool {
        self.advance(now);
        if matches!(self.state, State::Closed) {
            self.open(now, Tripped::HealthCheck(how));
            return true;
        }
        false
    }

    /// A restore finished: the next health check is the probe (no cooldown wait).
    pub fn restored(&mut self) {
        let why = self.tripped().cloned().unwrap_or(Tripped::Restoring);
        self.state = State::HalfOpen { probe_out: false, why };
    }

    fn open(&mut self, now: Instant, why: Tripped) {
        self.recent.clear();
        if matches!(self.state, State::Closed) {
            self.opened_at = Some(now);
        }
        self.state = State::Open { since: now, why };
    }

    fn advance(&mut self, now: Instant) {
        if let State::Open { since, why } = &self.state
            && now.saturating_duration_since(*since) >= self.config.cooldown
        {
            self.state = State::HalfOpen {
                probe_out: false,
                why: why.clone(),
            };
        }
        if matches!(self.state, State::Closed) {
            self.forget_old(now);
        }
    }

    fn forget_old(&mut self, now: Instant) {
        while self
            .recent
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > self.config.window)
        {
            self.recent.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OOM: AllocFailureKind = AllocFailureKind::Oom;

    fn breaker() -> (Breaker, Instant) {
        let config = BreakerConfig {
            failures: 3,
            window: Duration::from_secs(60),
            cooldown: Duration::from_secs(30),
        };
        (Breaker::new(config), Instant::now())
    }

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    #[test]
    fn failures_within_the_window_open_it_and_old_ones_do_not_count() {
        let (mut b, t) = breaker();
        assert!(!b.failure(OOM, t));
        assert!(!b.failure(OOM, t + s(10)));
        // The first failure is 61 s old by now: two in the window, still closed.
        assert!(!b.failure(OOM, t + s(61)));
        assert_eq!(b.state(t + s(61)), BreakerState::Closed);
        assert!(b.failure(OOM, t + s(62)));
        assert_eq!(b.state(t + s(62)), BreakerState::Open);
        assert_eq!(b.tripped(), Some(&Tripped::Failures(3)));
        assert!(!b.allows(t + s(80)));
    }

    #[test]
    fn a_driver_failure_opens_it_at_once() {
        let (mut b, t) = breaker();
        assert!(b.failure(AllocFailureKind::Driver, t));
        assert_eq!(b.state(t), BreakerState::Open);
        assert_eq!(b.tripped(), Some(&Tripped::Driver));
    }

    #[test]
    fn a_failed_health_check_opens_a_closed_breaker_until_a_probe_closes_it() {
        let (mut b, t) = breaker();
        assert!(b.check_failed("`encoder`: runtime error".into(), t));
        assert_eq!(b.state(t), BreakerState::Open);
        assert_eq!(
            b.tripped(),
            Some(&Tripped::HealthCheck("`encoder`: runtime error".into()))
        );
        // Already open: it changes nothing, and keeps the first reason and its cooldown.
        assert!(!b.check_failed("again".into(), t + s(10)));
        assert_eq!(b.state(t + s(30)), BreakerState::HalfOpen);
        assert!(b.take_probe(t + s(30)));
        assert_eq!(b.probe_succeeded(t + s(31)), Some(s(31)));
        assert!(b.allows(t + s(31)));
    }

    #[test]
    fn after_the_cooldown_the_health_check_probes_and_its_success_closes_it() {
        let (mut b, t) = breaker();
        b.failure(AllocFailureKind::Driver, t);
        assert!(!b.take_probe(t + s(29)), "no probe before the cooldown");
        assert_eq!(b.state(t + s(30)), BreakerState::HalfOpen);
        assert!(!b.allows(t + s(30)), "a half-open breaker lets no request through");
        assert!(b.take_probe(t + s(30)));
        assert!(!b.take_probe(t + s(31)), "one probe at a time");
        assert_eq!(b.probe_succeeded(t + s(32)), Some(s(32)));
        assert_eq!(b.state(t + s(32)), BreakerState::Closed);
        assert!(b.allows(t + s(32)));
    }

    #[test]
    fn a_failed_probe_reopens_it_for_another_cooldown() {
        let (mut b, t) = breaker();
        b.failure(AllocFailureKind::Driver, t);
        assert!(b.take_probe(t + s(30)));
        assert!(b.failure(OOM, t + s(31)));
        assert!(!b.take_probe(t + s(60)));
        assert!(b.take_probe(t + s(61)));
        // A probe that failed without an allocator failure (a timeout, a model error) too.
        assert!(b.probe_failed(t + s(61)));
        assert!(!b.take_probe(t + s(90)));
        assert!(b.take_probe(t + s(91)));
        // Open-to-closed counts from the first opening.
        assert_eq!(b.probe_succeeded(t + s(92)), Some(s(92)));
    }

    #[test]
    fn an_unused_probe_hands_the_turn_on() {
        let (mut b, t) = breaker();
        b.failure(AllocFailureKind::Driver, t);
        assert!(b.take_probe(t + s(30)));
        b.probe_unused();
        assert!(b.take_probe(t + s(30)));
    }

    #[test]
    fn a_restore_opens_it_and_then_lets_a_probe_through_at_once() {
        let (mut b, t) = breaker();
        b.force_open(t);
        assert_eq!(b.tripped(), Some(&Tripped::Restoring));
        assert!(!b.take_probe(t + s(1)));
        b.restored();
        assert!(!b.allows(t + s(1)), "a restored pool waits for its probe");
        assert!(b.take_probe(t + s(1)));
        assert_eq!(b.probe_succeeded(t + s(2)), Some(s(2)));
    }

    #[test]
    fn remote_failures_count_in_the_same_window_and_name_the_last_one() {
        let (mut b, t) = breaker();
        let refused = || Failure::Remote("connect: connection refused".into());
        assert!(!b.failure(OOM, t));
        assert!(!b.failure(refused(), t + s(1)));
        assert!(b.failure(refused(), t + s(2)));
        assert_eq!(
            b.tripped().map(ToString::to_string).as_deref(),
            Some("3 failures of the remote server (last: connect: connection refused)")
        );
        // A failed probe (a health check after the cooldown) opens it again for another one.
        assert!(b.take_probe(t + s(32)));
        assert!(b.failure(refused(), t + s(32)));
        assert!(!b.take_probe(t + s(61)));
        assert!(b.take_probe(t + s(62)));
    }

    #[test]
    fn a_probe_success_while_closed_changes_nothing() {
        let (mut b, t) = breaker();
        b.failure(OOM, t);
        assert_eq!(b.probe_succeeded(t), None);
        b.failure(OOM, t + s(1));
        assert!(
            b.failure(OOM, t + s(2)),
            "a passing health check does not reset the window"
        );
    }
}
