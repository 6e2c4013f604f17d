//! What an answer tells its client about where it ran: the pool's name, provider and, while
//! degraded, why, its limits and the delay a new request there should expect. Read from the
//! pool once, as plain facts, so the protocol layers format them without reaching into the pool.

use std::time::Duration;

use crate::config::Provider;
use crate::core::snapshot::DeviceClass;
use crate::pool::Pool;
use crate::serve::service::Service;

/// Where an answer (or one part of it) ran, as its client is told.
#[derive(Debug, Clone, PartialEq)]
pub struct RanOn {
    /// The pool's name.
    pub pool: String,
    /// Its execution provider.
    pub provider: Provider,
    /// Its device as configured (`cpu`, `cuda:0`, `simulated:…`).
    pub device: String,
    /// Whether its device is the simulated one.
    pub simulated: bool,
    /// Degraded mode as this answer carries it ([`Service::ran_on`]): why, when it does.
    pub degraded: Option<String>,
    /// The pool's `max_context`, if it has one.
    pub max_context: Option<u64>,
    /// Its workers: how many requests run at once.
    pub concurrency: usize,
    /// How many requests may wait there.
    pub queue_capacity: usize,
    /// The delay a new request there should expect.
    pub estimated_delay: Duration,
}

impl Service {
    /// Where an answer for `model` that `pool` gave ran, degraded mode included when the
    /// answer is itself below the service's normal level ([`for_answer`]).
    ///
    /// [`for_answer`]: crate::pool::degraded::Degraded::for_answer
    pub fn ran_on(&self, pool: &Pool, model: &str) -> RanOn {
        self.ran_on_runs(pool, model, &[pool])
    }

    /// [`Service::ran_on`] for an answer made of several runs (a transcription's windows), the
    /// last one on `pool`: degraded when any run of `runs` was (a window moved to the
    /// fallback), though the last ran where it normally runs.
    pub fn ran_on_runs(&self, pool: &Pool, model: &str, runs: &[&Pool]) -> RanOn {
        let degraded = runs.iter().find_map(|ran| self.degraded.for_answer(ran, model));
        RanOn {
            pool: pool.name().to_string(),
            provider: pool.provider().clone(),
            device: pool.config.device.clone(),
            simulated: pool.device_kind == DeviceClass::Simulated,
            degraded: degraded.map(|d| d.reason),
            max_context: pool.config.max_context,
            concurrency: pool.config.workers,
            queue_capacity: pool.config.queue_capacity,
            estimated_delay: pool.load().estimated_delay,
        }
    }

    /// The facts of each pool serving `model`, in config order, as an answer from it would
    /// carry them.
    pub fn pools_serving(&self, model: &str) -> Vec<RanOn> {
        self.pools
            .iter()
            .filter(|p| p.serves(model))
            .map(|p| self.ran_on(p, model))
            .collect()
    }

    /// Why the service is degraded now, for a refusal's message; `None` when serving normally.
    pub fn degraded_reason(&self) -> Option<String> {
        self.degraded.now().map(|d| d.reason)
    }
}
