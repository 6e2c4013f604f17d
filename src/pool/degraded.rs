//! Degraded mode: whether the service is serving below its normal level, and why. It is
//! degraded while an accelerator pool (`cuda` or `simulated`) is unavailable or its breaker is
//! not closed, or while work is being moved off an accelerator for memory (a policy redirect or
//! an out-of-memory retry within the last [`MEMORY_REDIRECT_WINDOW`]). Computed when asked,
//! from the pools themselves, so it clears as soon as its causes do: a breaker the health check
//! closes ends a driver fault at once, with nothing held over.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use crate::core::breaker::Tripped;
use crate::core::clock::Clock;
use crate::core::snapshot::{BreakerState, ProviderKind};
use crate::pool::Pool;

/// How long after the last memory redirect the service still reads as degraded. It does not
/// end early when the device reads free again: the run that failed released its memory, so the
/// device has headroom the moment after an out-of-memory failure, and the next request of the
/// same size would fail the same way (a free-memory reading alone misleads).
pub const MEMORY_REDIRECT_WINDOW: Duration = Duration::from_secs(30);

/// Why the service is degraded, as the `reason` label of `vramguard_degraded_info`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// An accelerator pool cannot take work at all.
    PoolUnavailable,
    /// An accelerator pool's breaker is open or half-open after a driver-class failure (a reset
    /// or lost device): until a restore and the health check's probe close it.
    DriverFault,
    /// An accelerator pool's breaker is open or half-open for another reason: repeated
    /// allocator failures, a remote server failing, a failed health check, or an operator's
    /// restore in progress.
    BreakerOpen,
    /// Work was recently moved off an accelerator because it did not fit.
    MemoryRedirect,
    /// An accelerator pool's worker process died or hung: until its replacement's probe
    /// closes the breaker.
    WorkerLost,
}

impl Cause {
    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Cause::PoolUnavailable => "pool_unavailable",
            Cause::DriverFault => "driver_fault",
            Cause::BreakerOpen => "breaker_open",
            Cause::MemoryRedirect => "memory_redirect",
            Cause::WorkerLost => "worker_lost",
        }
    }

    /// The cause a breaker that is not closed stands for, by what tripped it.
    pub fn of_breaker(tripped: &Tripped) -> Cause {
        match tripped {
            Tripped::Driver => Cause::DriverFault,
            Tripped::WorkerLost(_) => Cause::WorkerLost,
            Tripped::Failures(_) | Tripped::RemoteFailures(..) | Tripped::Restoring | Tripped::HealthCheck(_) => {
                Cause::BreakerOpen
            }
        }
    }
}

/// The degraded state now.
#[derive(Debug, Clone, PartialEq)]
pub struct Now {
    /// The first cause found (pools in config order).
    pub cause: Cause,
    /// For people: which pool and why.
    pub reason: String,
    /// When the service became degraded (it has been since, without a break).
    pub since: SystemTime,
}

/// Tracks degraded mode for one service.
#[derive(Debug)]
pub struct Degraded {
    pools: Vec<Arc<Pool>>,
    clock: Arc<dyn Clock>,
    last_memory_redirect: Mutex<Option<(Instant, String)>>,
    since: Mutex<Option<SystemTime>>,
}

impl Degraded {
    /// Watch `pools`.
    pub fn new(pools: Vec<Arc<Pool>>, clock: Arc<dyn Clock>) -> Self {
        Self {
            pools,
            clock,
            last_memory_redirect: Mutex::new(None),
            since: Mutex::new(None),
        }
    }

    /// Work moved off an accelerator pool for memory (`from` → `to`): a policy redirect or an
    /// out-of-memory retry. Starts or extends the [`MEMORY_REDIRECT_WINDOW`]; a retry after a
    /// driver failure is not one (its breaker says why).
    pub fn memory_redirect(&self, from: &str, to: &str) {
        let reason = format!("work moves from pool `{from}` to `{to}`: it does not fit in accelerator memory");
        *self.last_memory_redirect.lock().unwrap_or_else(PoisonError::into_inner) = Some((self.clock.now(), reason));
    }

    /// Degraded now, and why; `None` when serving normally.
    pub fn now(&self) -> Option<Now> {
        let found = self.cause();
        let mut since = self.since.lock().unwrap_or_else(PoisonError::into_inner);
        match found {
            None => {
                *since = None;
                None
            }
            Some((cause, reason)) => {
                let since = *since.get_or_insert_with(SystemTime::now);
                Some(Now { cause, reason, since })
            }
        }
    }

    /// Degraded mode as an answer that `pool` gave for `model` carries it: only when that
    /// answer is itself below the service's normal level, a host pool having answered for a
    /// model that a pool off the host serves (the request was redirected, retried or moved
    /// there). An answer that ran where it normally runs says nothing of degraded mode, even
    /// while the service is degraded: `/status` and the metrics say that.
    pub fn for_answer(&self, pool: &Pool, model: &str) -> Option<Now> {
        let off_host = |p: &Pool| p.provider().kind() != ProviderKind::Cpu;
        let moved = !off_host(pool) && self.pools.iter().any(|p| off_host(p) && p.serves(model));
        if moved { self.now() } else { None }
    }

    fn cause(&self) -> Option<(Cause, String)> {
        for pool in &self.pools {
            if pool.provider().kind() == ProviderKind::Cpu {
                continue;
            }
            if let Some(why) = pool.unready_reason()
                && !pool.is_shutting_down()
            {
                return Some((
                    Cause::PoolUnavailable,
                    format!("pool `{}` is unavailable: {why}", pool.name()),
                ));
            }
            let state = pool.health().breaker_state();
            if state == BreakerState::Closed {
                continue;
            }
            // Read apart from the state: a breaker closed in between has no cause left.
            if let Some(why) = pool.health().breaker_trip() {
                return Some((
                    Cause::of_breaker(&why),
                    format!(
                        "pool `{}` circuit breaker is {} after {why}",
                        pool.name(),
                        state.label()
                    ),
                ));
            }
        }
        let last = self.last_memory_redirect.lock().unwrap_or_else(PoisonError::into_inner);
        match &*last {
            Some((at, reason)) if self.clock.now().saturating_duration_since(*at) < MEMORY_REDIRECT_WINDOW => {
                Some((Cause::MemoryRedirect, reason.clone()))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{PoolConfig, Provider};
    use crate::core::backend::AllocFailureKind;
    use crate::core::breaker::BreakerConfig;
    use crate::core::clock::ManualClock;
    use crate::core::snapshot::DeviceClass;
    use crate::pool::{CheckFailure, PoolContext};

    const COOLDOWN: Duration = Duration::from_secs(60);

    /// A simulated pool `gpu` (no workers: only its breaker matters here), its degraded mode
    /// and the hand-moved clock both read.
    fn watched() -> (Arc<Pool>, Degraded, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::default());
        let config = PoolConfig {
            provider: Provider::Simulated,
            breaker: BreakerConfig {
                failures: 2,
                window: Duration::from_secs(60),
                cooldown: COOLDOWN,
            },
            ..crate::testing::config::pool("gpu", "gpu0", &["m"])
        };
        let context = PoolContext {
            clock: clock.clone(),
            ..PoolContext::default()
        };
        let pool = Pool::start(config, DeviceClass::Simulated, Vec::new(), None, context);
        let degraded = Degraded::new(vec![Arc::clone(&pool)], clock.clone());
        (pool, degraded, clock)
    }

    fn cause(degraded: &Degraded) -> Option<Cause> {
        degraded.now().map(|now| now.cause)
    }

    /// The cooldown passes and the health check's probe succeeds.
    fn health_check_closes(pool: &Pool, clock: &ManualClock) {
        clock.advance(COOLDOWN);
        assert_eq!(
            pool.health().health_check_permit(),
            Some(true),
            "the check is the probe"
        );
        pool.health().health_checked(true, Ok(()));
        assert_eq!(pool.health().breaker_state(), BreakerState::Closed);
    }

    #[test]
    fn an_idle_check_whose_run_broke_opens_the_breaker_and_one_without_an_answer_does_not() {
        let (pool, degraded, clock) = watched();
        assert_eq!(
            pool.health().health_check_permit(),
            Some(false),
            "closed: an idle check"
        );
        // No answer in time (requests queued ahead of the check can cause it): logged only.
        pool.health()
            .health_checked(false, Err(CheckFailure::Other("`m` did not answer".into())));
        assert_eq!(pool.health().breaker_state(), BreakerState::Closed);
        assert_eq!(cause(&degraded), None);
        // The model's run itself failed: the pool's requests would too.
        pool.health()
            .health_checked(false, Err(CheckFailure::Broken("`m`: runtime error: bad".into())));
        assert_eq!(pool.health().breaker_state(), BreakerState::Open);
        assert_eq!(
            pool.health().breaker_tripped().as_deref(),
            Some("its health check failed (`m`: runtime error: bad)")
        );
        assert_eq!(cause(&degraded), Some(Cause::BreakerOpen));
        assert_eq!(
            pool.health().health_check_permit(),
            None,
            "open: no check until the cooldown"
        );
        health_check_closes(&pool, &clock);
        assert_eq!(cause(&degraded), None);
    }

    #[test]
    fn a_driver_fault_lasts_while_its_breaker_is_open_and_ends_when_the_probe_closes_it() {
        let (pool, degraded, clock) = watched();
        assert_eq!(cause(&degraded), None);
        pool.health().record_failure(AllocFailureKind::Driver);
        let now = degraded.now().expect("degraded");
        assert_eq!(now.cause, Cause::DriverFault);
        assert_eq!(
            now.reason,
            "pool `gpu` circuit breaker is open after a driver-class failure"
        );
        // Half-open after the cooldown: still the driver fault, until the probe says otherwise.
        clock.advance(COOLDOWN);
        assert_eq!(cause(&degraded), Some(Cause::DriverFault));
        assert_eq!(pool.health().health_check_permit(), Some(true));
        pool.health().health_checked(true, Ok(()));
        // Nothing held over: the next reading is normal, with no time passing.
        assert_eq!(cause(&degraded), None);
    }

    #[test]
    fn a_restore_reads_as_breaker_open_until_its_probe_closes_it() {
        let (pool, degraded, clock) = watched();
        pool.health().record_failure(AllocFailureKind::Driver);
        pool.health().breaker().force_open(clock.now());
        assert_eq!(cause(&degraded), Some(Cause::BreakerOpen));
        pool.health().breaker().restored();
        let now = degraded.now().expect("degraded");
        assert_eq!(now.cause, Cause::BreakerOpen);
        assert!(now.reason.ends_with("is half_open after restoring"), "{}", now.reason);
        assert_eq!(pool.health().health_check_permit(), Some(true));
        pool.health().health_checked(true, Ok(()));
        assert_eq!(cause(&degraded), None);
    }

    #[test]
    fn allocator_failures_that_trip_the_breaker_read_as_breaker_open() {
        let (pool, degraded, clock) = watched();
        pool.health().record_failure(AllocFailureKind::Oom);
        assert_eq!(cause(&degraded), None, "one failure does not open it");
        pool.health().record_failure(AllocFailureKind::Oom);
        assert_eq!(cause(&degraded), Some(Cause::BreakerOpen));
        health_check_closes(&pool, &clock);
        assert_eq!(cause(&degraded), None);
    }

    #[test]
    fn a_memory_redirect_holds_for_its_window_and_is_extended_by_the_next() {
        let (_pool, degraded, clock) = watched();
        degraded.memory_redirect("gpu", "cpu");
        let now = degraded.now().expect("degraded");
        assert_eq!(now.cause, Cause::MemoryRedirect);
        assert_eq!(
            now.reason,
            "work moves from pool `gpu` to `cpu`: it does not fit in accelerator memory"
        );
        clock.advance(MEMORY_REDIRECT_WINDOW - Duration::from_secs(1));
        degraded.memory_redirect("gpu", "cpu");
        clock.advance(MEMORY_REDIRECT_WINDOW - Duration::from_secs(1));
        assert_eq!(
            cause(&degraded),
            Some(Cause::MemoryRedirect),
            "the second one extends it"
        );
        clock.advance(Duration::from_secs(1));
        assert_eq!(cause(&degraded), None);
    }

    #[test]
    fn a_breaker_outranks_a_memory_redirect_which_outlasts_it_within_its_window() {
        let (pool, degraded, clock) = watched();
        pool.health().record_failure(AllocFailureKind::Oom);
        pool.health().record_failure(AllocFailureKind::Oom);
        let since = degraded.now().expect("degraded").since;
        clock.advance(COOLDOWN);
        degraded.memory_redirect("gpu", "cpu");
        assert_eq!(cause(&degraded), Some(Cause::BreakerOpen));
        // The probe closes the breaker within the window: work did move for memory, so the
        // service still says so, without a break in `since`.
        assert_eq!(pool.health().health_check_permit(), Some(true));
        pool.health().health_checked(true, Ok(()));
        let now = degraded.now().expect("still degraded");
        assert_eq!(now.cause, Cause::MemoryRedirect);
        assert_eq!(now.since, since);
        clock.advance(MEMORY_REDIRECT_WINDOW);
        assert_eq!(cause(&degraded), None);
    }
}
