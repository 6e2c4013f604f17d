//! A pool's text generations: how many wait for their prompt's run, how many run (they hold a
//! KV cache between runs), and the bytes of those caches. The policy reads them as
//! `state.pools[name].sequences_waiting`, `sequences_running` and `kv_cache_bytes`, and they
//! are exported as `vramguard_sequences_waiting`, `vramguard_sequences_running` and
//! `vramguard_kv_cache_bytes`. Each count is held by a guard and given back when the guard
//! drops, so a generation that fails, is cancelled or whose client goes away frees its share
//! the moment its future is dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// Move `counter` by what a holder's bytes change from `from` to `to`.
fn move_bytes(counter: &AtomicU64, from: u64, to: u64) {
    if to >= from {
        counter.fetch_add(to - from, Ordering::Relaxed);
    } else {
        counter.fetch_sub(from - to, Ordering::Relaxed);
    }
}

/// A generation waiting for its prompt's run, counted in a pool's [`Sequences`] until dropped.
#[derive(Debug)]
pub struct Waiting(Arc<Sequences>);

impl Waiting {
    /// Count one more waiting generation in `sequences` (a pool's).
    pub fn on(sequences: &Arc<Sequences>) -> Waiting {
        sequences.waiting.fetch_add(1, Ordering::Relaxed);
        Waiting(Arc::clone(sequences))
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A running generation and the KV cache it holds on a pool, counted in that pool's
/// [`Sequences`] until dropped.
#[derive(Debug)]
pub struct Running {
    sequences: Arc<Sequences>,
    kv_bytes: u64,
}

impl Running {
    /// Count a generation running with `kv_bytes` of cache in `sequences` (a pool's).
    pub fn on(sequences: &Arc<Sequences>, kv_bytes: u64) -> Running {
        sequences.running.fetch_add(1, Ordering::Relaxed);
        sequences.kv_bytes.fetch_add(kv_bytes, Ordering::Relaxed);
        Running {
            sequences: Arc::clone(sequences),
            kv_bytes,
        }
    }

    /// Its cache is now `kv_bytes`, counted in `sequences` (the same pool's, or those of the
    /// pool it moved to).
    pub fn update(&mut self, sequences: &Arc<Sequences>, kv_bytes: u64) {
        if !Arc::ptr_eq(&self.sequences, sequences) {
            *self = Running::on(sequences, kv_bytes);
            return;
        }
        move_bytes(&self.sequences.kv_bytes, self.kv_bytes, kv_bytes);
        self.kv_bytes = kv_bytes;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let sequences = &self.sequences;
        sequences.running.fetch_sub(1, Ordering::Relaxed);
        sequences.kv_bytes.fetch_sub(self.kv_bytes, Ordering::Relaxed);
    }
}

/// The masked slots of a pool's batch for one model (left padding, and slots of generations
/// that were late with a token): cache bytes held by no generation, counted in the pool's
/// `kv_cache_bytes` until dropped, so admission sees what the batch really holds.
#[derive(Debug)]
pub struct Padding {
    sequences: Arc<Sequences>,
    kv_bytes: u64,
}

impl Padding {
    /// None yet, in `sequences` (a pool's).
    pub fn on(sequences: &Arc<Sequences>) -> Padding {
        Padding {
            sequences: Arc::clone(sequences),
            kv_bytes: 0,
        }
    }

    /// The batch's masked slots now hold `kv_bytes`.
    pub fn set(&mut self, kv_bytes: u64) {
        move_bytes(&self.sequences.kv_bytes, self.kv_bytes, kv_bytes);
        self.kv_bytes = kv_bytes;
    }
}

impl Drop for Padding {
    fn drop(&mut self) {
        self.set(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_give_back_what_they_hold_also_when_a_generation_moves() {
        let gpu = Arc::new(Sequences::default());
        let cpu = Arc::new(Sequences::default());
        let waiting = Waiting::on(&gpu);
        assert_eq!(gpu.now().waiting, 1);
        drop(waiting);
        let mut running = Running::on(&gpu, 100);
        running.update(&gpu, 160);
        assert_eq!(
            gpu.now(),
            SequencesNow {
                waiting: 0,
                running: 1,
                kv_bytes: 160
            }
        );
        running.update(&gpu, 120);
        assert_eq!(gpu.now().kv_bytes, 120);
        // A failover: the cache now lives on the CPU pool.
        running.update(&cpu, 180);
        assert_eq!(gpu.now(), SequencesNow::default());
        assert_eq!(cpu.now().running, 1);
        assert_eq!(cpu.now().kv_bytes, 180);
        drop(running);
        assert_eq!(cpu.now(), SequencesNow::default());
    }
}
