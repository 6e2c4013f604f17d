//! Degraded mode: whether the service is serving below its normal level, and why. It is
//! degraded while an accelerator pool (`cuda` or `simulated`) is unavailable or its breaker is
//! not closed, or while work is being moved off an accelerator for memory (a policy redirect or
//! an allocator-failure retry within the last [`MEMORY_REDIRECT_WINDOW`]). Computed when asked,
//! from the pools themselves, so it clears as soon as its causes do.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use crate::core::clock::Clock;
use crate::core::snapshot::{BreakerState, ProviderKind};
use crate::pool::Pool;

/// How long after the last memory redirect the service still reads as degraded.
pub const MEMORY_REDIRECT_WINDOW: Duration = Duration::from_secs(30);

/// Why the service is degraded, as the `reason` label of `vramguard_degraded_info`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// An accelerator pool cannot take work at all.
    PoolUnavailable,
    /// An accelerator pool's circuit breaker is open or half-open.
    BreakerOpen,
    /// Work was recently moved off an accelerator because it did not fit.
    MemoryRedirect,
}

impl Cause {
    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Cause::PoolUnavailable => "pool_unavailable",
            Cause::BreakerOpen => "breaker_open",
            Cause::MemoryRedirect => "memory_redirect",
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

    /// Work moved off an accelerator pool for memory (`from` → `to`).
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
            match pool.breaker_state() {
                BreakerState::Closed => {}
                state => {
                    let why = pool.breaker_tripped().unwrap_or_default();
                    return Some((
                        Cause::BreakerOpen,
                        format!(
                            "pool `{}` circuit breaker is {} after {why}",
                            pool.name(),
                            state.label()
                        ),
                    ));
                }
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
