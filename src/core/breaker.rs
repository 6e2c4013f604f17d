//! A pool's circuit breaker, as a pure state machine: failures and successes go in with the time
//! they happened, a [`Permit`] comes out. No clock of its own, no threads: tested with plain
//! instants.
//!
//! - **Closed**: requests flow. `failures` failures within `window` (allocator failures, or a
//!   remote pool's server failing to answer) open it; one driver-class failure opens it at once
//!   (a reset device fails everything after it).
//! - **Open**: no requests until `cooldown` has passed since it opened.
//! - **Half-open**: exactly one request (the probe) goes through. Its success closes the breaker,
//!   its failure opens it again for another cooldown; a probe that never ran hands the turn on.

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
    /// How long it stays open before a probe may go through.
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

/// Whether a request may run on the pool now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Permit {
    /// Closed: run it.
    Run,
    /// Half-open: run it as the one probe; report how it went.
    Probe,
    /// Open (or a probe is already out): do not run it here.
    Denied,
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
}

impl std::fmt::Display for Tripped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tripped::Failures(n) => write!(f, "{n} allocator failures"),
            Tripped::RemoteFailures(n, last) => write!(f, "{n} failures of the remote server (last: {last})"),
            Tripped::Driver => f.write_str("a driver-class failure"),
            Tripped::Restoring => f.write_str("restoring"),
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

    /// Whether a request may run now; a `Probe` must be settled with [`Breaker::success`],
    /// [`Breaker::failure`] or [`Breaker::probe_unused`].
    pub fn permit(&mut self, now: Instant) -> Permit {
        self.advance(now);
        match &mut self.state {
            State::Closed => Permit::Run,
            State::Open { .. } => Permit::Denied,
            State::HalfOpen { probe_out, .. } if *probe_out => Permit::Denied,
            State::HalfOpen { probe_out, .. } => {
                *probe_out = true;
                Permit::Probe
            }
        }
    }

    /// Whether a request could run now, without taking the probe.
    pub fn would_permit(&mut self, now: Instant) -> bool {
        self.advance(now);
        match self.state {
            State::Closed => true,
            State::Open { .. } => false,
            State::HalfOpen { probe_out, .. } => !probe_out,
        }
    }

    /// A run succeeded. Returns how long the breaker was not closed when this closes it.
    pub fn success(&mut self, now: Instant) -> Option<Duration> {
        self.advance(now);
        if let State::HalfOpen { .. } = self.state {
            self.state = State::Closed;
            self.recent.clear();
            return self.opened_at.take().map(|at| now.saturating_duration_since(at));
        }
        None
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

    /// The probe did not run (refused, cancelled, timed out in the queue): the next request
    /// may probe instead.
    pub fn probe_unused(&mut self) {
        if let State::HalfOpen { probe_out, .. } = &mut self.state {
            *probe_out = false;
        }
    }

    /// Open it now for an operator's restore; the cooldown then lets a probe through.
    pub fn force_open(&mut self, now: Instant) {
        self.open(now, Tripped::Restoring);
    }

    /// A restore finished: the next request is a probe (no cooldown wait).
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
        assert_eq!(b.permit(t + s(80)), Permit::Denied);
    }

    #[test]
    fn a_driver_failure_opens_it_at_once() {
        let (mut b, t) = breaker();
        assert!(b.failure(AllocFailureKind::Driver, t));
        assert_eq!(b.state(t), BreakerState::Open);
        assert_eq!(b.tripped(), Some(&Tripped::Driver));
    }

    #[test]
    fn after_the_cooldown_one_probe_goes_and_its_success_closes_it() {
        let (mut b, t) = breaker();
        b.failure(AllocFailureKind::Driver, t);
        assert_eq!(b.permit(t + s(29)), Permit::Denied);
        assert_eq!(b.state(t + s(30)), BreakerState::HalfOpen);
        assert_eq!(b.permit(t + s(30)), Permit::Probe);
        assert_eq!(b.permit(t + s(31)), Permit::Denied, "one probe at a time");
        assert!(!b.would_permit(t + s(31)));
        assert_eq!(b.success(t + s(32)), Some(s(32)));
        assert_eq!(b.state(t + s(32)), BreakerState::Closed);
        assert_eq!(b.permit(t + s(32)), Permit::Run);
    }

    #[test]
    fn a_failed_probe_reopens_it_for_another_cooldown() {
        let (mut b, t) = breaker();
        b.failure(AllocFailureKind::Driver, t);
        assert_eq!(b.permit(t + s(30)), Permit::Probe);
        assert!(b.failure(OOM, t + s(31)));
        assert_eq!(b.permit(t + s(60)), Permit::Denied);
        assert_eq!(b.permit(t + s(61)), Permit::Probe);
        // Open-to-closed counts from the first opening.
        assert_eq!(b.success(t + s(62)), Some(s(62)));
    }

    #[test]
    fn an_unused_probe_hands_the_turn_on() {
        let (mut b, t) = breaker();
        b.failure(AllocFailureKind::Driver, t);
        assert_eq!(b.permit(t + s(30)), Permit::Probe);
        b.probe_unused();
        assert_eq!(b.permit(t + s(30)), Permit::Probe);
    }

    #[test]
    fn a_restore_opens_it_and_then_lets_a_probe_through_at_once() {
        let (mut b, t) = breaker();
        b.force_open(t);
        assert_eq!(b.tripped(), Some(&Tripped::Restoring));
        assert_eq!(b.permit(t + s(1)), Permit::Denied);
        b.restored();
        assert_eq!(b.permit(t + s(1)), Permit::Probe);
        assert_eq!(b.success(t + s(2)), Some(s(2)));
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
        assert_eq!(b.permit(t + s(32)), Permit::Probe);
        assert!(b.failure(refused(), t + s(32)));
        assert_eq!(b.permit(t + s(61)), Permit::Denied);
        assert_eq!(b.permit(t + s(62)), Permit::Probe);
    }

    #[test]
    fn successes_while_closed_change_nothing() {
        let (mut b, t) = breaker();
        b.failure(OOM, t);
        assert_eq!(b.success(t), None);
        b.failure(OOM, t + s(1));
        assert!(b.failure(OOM, t + s(2)), "successes do not reset the window");
    }
}
