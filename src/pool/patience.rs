//! How long a worker looks for its next job on its core before it sleeps, from how soon jobs
//! came lately.
//!
//! Waking a sleeping thread costs tens of µs, and on a virtual machine whose idle core has
//! halted, more: on the 2-core VM the bench runs on, a process-isolated pool whose thread and
//! worker process both slept between the requests of a client that sends one at a time (two
//! wake-ups in a row) added ~200 µs to each seq-1024 request that looking longer takes away
//! (docs/isolation.md). A look that yields its core between tries takes nothing from threads
//! with work, but every µs of it is CPU spent waiting, so it should last about as long as the
//! next job usually takes to come, and no longer: a generation's next step comes tens of µs
//! after the last one ended, a client's next seq-128 request ~100 µs after its answer, a
//! seq-1024 one several hundred µs after (its 256 KiB body crosses loopback and is decoded
//! first).
//!
//! [`Patience`] keeps a running mean of those gaps and looks for twice it, at least
//! [`LOOK_MIN`]; when jobs come further apart than [`LOOK_MAX`] allows for, a long look would
//! only burn a core before the sleep it cannot avoid, so it looks [`LOOK_MIN`].

use std::time::Duration;

/// The shortest look, what every worker waited before its gaps were measured: enough for a
/// generation's next step and a seq-128 client's next request (on the 2-core VM, a seq-128
/// encoder request at concurrency 1 went from 543–610 µs median without a look to 346–432 µs
/// with this one, for 10–20 % more CPU per request).
pub const LOOK_MIN: Duration = Duration::from_micros(200);
/// The longest look.
pub const LOOK_MAX: Duration = Duration::from_millis(2);

/// The recent gaps between a worker's jobs: from the end of one (its answer sent) to the next
/// one's arrival.
#[derive(Debug, Clone, Copy)]
pub struct Patience {
    /// Exponentially weighted mean gap (weight 1/4), in ns, each gap counted at most twice
    /// [`LOOK_MAX`] so that one idle minute is forgotten after a few quick jobs.
    mean_ns: u64,
}

impl Default for Patience {
    fn default() -> Self {
        Patience {
            mean_ns: LOOK_MIN.as_nanos() as u64 / 2,
        }
    }
}

impl Patience {
    /// How long to look for the next job.
    pub fn look(&self) -> Duration {
        let twice = Duration::from_nanos(self.mean_ns.saturating_mul(2));
        if twice <= LOOK_MAX {
            twice.max(LOOK_MIN)
        } else {
            LOOK_MIN
        }
    }

    /// The next job came `gap` after the last one ended.
    pub fn saw(&mut self, gap: Duration) {
        let sample = gap.min(2 * LOOK_MAX).as_nanos() as u64;
        self.mean_ns = self.mean_ns - self.mean_ns / 4 + sample / 4;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn after(gaps: impl IntoIterator<Item = Duration>) -> Patience {
        let mut patience = Patience::default();
        for gap in gaps {
            patience.saw(gap);
        }
        patience
    }

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn looks_the_shortest_while_it_knows_nothing_or_jobs_come_at_once() {
        assert_eq!(Patience::default().look(), LOOK_MIN);
        assert_eq!(after([Duration::ZERO; 20]).look(), LOOK_MIN);
        assert_eq!(after([30 * US; 20]).look(), LOOK_MIN);
    }

    #[test]
    fn looks_twice_the_usual_gap_when_that_is_within_the_longest() {
        let look = after([400 * US; 30]).look();
        assert!((790 * US..=800 * US).contains(&look), "{look:?}");
        let look = after([900 * US; 30]).look();
        assert!((1790 * US..=1800 * US).contains(&look), "{look:?}");
    }

    #[test]
    fn does_not_look_long_for_jobs_that_come_further_apart_than_it_could_wait() {
        assert_eq!(after([1500 * US; 30]).look(), LOOK_MIN);
        assert_eq!(after([Duration::from_millis(50); 30]).look(), LOOK_MIN);
    }

    #[test]
    fn an_idle_spell_is_forgotten_after_a_few_quick_jobs() {
        let mut patience = after([400 * US; 30]);
        patience.saw(Duration::from_secs(60));
        assert_eq!(patience.look(), LOOK_MIN, "just after a minute's idleness");
        let mut quick = 0;
        while patience.look() < 700 * US {
            patience.saw(400 * US);
            quick += 1;
        }
        assert!(quick <= 8, "{quick} jobs to look long again");
    }
}
