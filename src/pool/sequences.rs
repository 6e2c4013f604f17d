//! A pool's text generations: how many wait for their prompt's run, how many run (they hold a
//! KV cache between runs), and the bytes of those caches. The policy reads them as
//! `state.pools[name].sequences_waiting`, `sequences_running` and `kv_cache_bytes`, and they
//! are exported as `vramguard_sequences_waiting`, `vramguard_sequences_running` and
//! `vramguard_kv_cache_bytes`. Each count is held by a guard and given back when the guard
//! drops, so a generation that fails, is cancelled or whose client goes away frees its share
//! the moment its future is dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::pool::Pool;

/// One pool's generations.
#[derive(Debug, Default)]
pub struct Sequences {
    waiting: AtomicU64,
    running: AtomicU64,
    kv_bytes: AtomicU64,
}

/// The counts at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SequencesNow {
    /// Generations whose prompt's run has not finished.
    pub waiting: u64,
    /// Generations past their prompt, holding a KV cache.
    pub running: u64,
    /// Bytes of those KV caches.
    pub kv_bytes: u64,
}

impl Sequences {
    /// The counts now.
    pub fn now(&self) -> SequencesNow {
        SequencesNow {
            waiting: self.waiting.load(Ordering::Relaxed),
            running: self.running.load(Ordering::Relaxed),
            kv_bytes: self.kv_bytes.load(Ordering::Relaxed),
        }
    }
}

/// A generation waiting on `pool` for its prompt's run, until dropped.
#[derive(Debug)]
pub struct Waiting(Arc<Pool>);

impl Waiting {
    /// Count one more waiting generation on `pool`.
    pub fn on(pool: &Arc<Pool>) -> Waiting {
        pool.sequences.waiting.fetch_add(1, Ordering::Relaxed);
        Waiting(Arc::clone(pool))
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.sequences.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A running generation and the KV cache it holds on a pool, until dropped.
#[derive(Debug)]
pub struct Running {
    pool: Arc<Pool>,
    kv_bytes: u64,
}

impl Running {
    /// Count a generation running on `pool` with `kv_bytes` of cache.
    pub fn on(pool: &Arc<Pool>, kv_bytes: u64) -> Running {
        pool.sequences.running.fetch_add(1, Ordering::Relaxed);
        pool.sequences.kv_bytes.fetch_add(kv_bytes, Ordering::Relaxed);
        Running {
            pool: Arc::clone(pool),
            kv_bytes,
        }
    }

    /// Its cache is now `kv_bytes`, on `pool` (the same pool, or the one it moved to).
    pub fn update(&mut self, pool: &Arc<Pool>, kv_bytes: u64) {
        if !Arc::ptr_eq(&self.pool, pool) {
            *self = Running::on(pool, kv_bytes);
            return;
        }
        let counter = &self.pool.sequences.kv_bytes;
        if kv_bytes >= self.kv_bytes {
            counter.fetch_add(kv_bytes - self.kv_bytes, Ordering::Relaxed);
        } else {
            counter.fetch_sub(self.kv_bytes - kv_bytes, Ordering::Relaxed);
        }
        self.kv_bytes = kv_bytes;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let sequences = &self.pool.sequences;
        sequences.running.fetch_sub(1, Ordering::Relaxed);
        sequences.kv_bytes.fetch_sub(self.kv_bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{PoolConfig, Provider};
    use crate::pool::PoolContext;
    use crate::snapshot::DeviceClass;

    fn pool(name: &str) -> Arc<Pool> {
        let config = PoolConfig {
            name: name.into(),
            provider: Provider::Cpu,
            device: "host".into(),
            models: vec!["m".into()],
            workers: 1,
            intra_threads: 1,
            queue_capacity: 1,
            max_wait: std::time::Duration::from_secs(1),
            arena_shrinkage: false,
            max_context: None,
            breaker: crate::breaker::BreakerConfig::default(),
            fallback: None,
        };
        Pool::unavailable(config, DeviceClass::Host, "a test pool".into(), PoolContext::default())
    }

    #[test]
    fn guards_give_back_what_they_hold_also_when_a_generation_moves() {
        let gpu = pool("gpu");
        let cpu = pool("cpu");
        let waiting = Waiting::on(&gpu);
        assert_eq!(gpu.sequences.now().waiting, 1);
        drop(waiting);
        let mut running = Running::on(&gpu, 100);
        running.update(&gpu, 160);
        assert_eq!(
            gpu.sequences.now(),
            SequencesNow {
                waiting: 0,
                running: 1,
                kv_bytes: 160
            }
        );
        running.update(&gpu, 120);
        assert_eq!(gpu.sequences.now().kv_bytes, 120);
        // A failover: the cache now lives on the CPU pool.
        running.update(&cpu, 180);
        assert_eq!(gpu.sequences.now(), SequencesNow::default());
        assert_eq!(cpu.sequences.now().running, 1);
        assert_eq!(cpu.sequences.now().kv_bytes, 180);
        drop(running);
        assert_eq!(cpu.sequences.now(), SequencesNow::default());
    }
}
