//! A pool's text generations: how many wait for their prompt's run, how many run (they hold a
//! KV cache between runs), and the bytes of those caches. The policy reads them as
//! `state.pools[name].sequences_waiting`, `sequences_running` and `kv_cache_bytes`, and they
//! are exported as `vramguard_sequences_waiting`, `vramguard_sequences_running` and
//! `vramguard_kv_cache_bytes`. Each count is held by a guard and given back when the guard
//! drops, so a generation that fails, is cancelled or whose client goes away frees its share
//! the moment its future is dropped.
//!
//! Each model's batch is kept here too, as admission needs it ([`Sequences::join_padding`]):
//! its shape as the backend last reported it, and the prompts on their way to join it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// One pool's generations.
#[derive(Debug, Default)]
pub struct Sequences {
    waiting: AtomicU64,
    running: AtomicU64,
    kv_bytes: AtomicU64,
    batches: Mutex<HashMap<String, BatchShape>>,
}

/// One model's batch on a pool, as admission sees it.
#[derive(Debug, Default)]
struct BatchShape {
    /// Rows whose caches the backend holds (those batched, and prompts run but not joined yet),
    /// as it last reported.
    rows: u64,
    /// The positions those rows share once together (left-padded to the longest).
    slots: u64,
    /// The prompts' lengths of generations whose prompt's run has not finished.
    joining: Vec<u64>,
}

impl BatchShape {
    fn is_empty(&self) -> bool {
        self.rows == 0 && self.joining.is_empty()
    }
}

/// Positions of cache a generation of `prompt` tokens adds beyond its own when it joins a batch
/// of `rows` rows sharing `slots` positions, while prompts of `joining` tokens are on their way
/// to it: every row is left-padded to the longest, so it is padded up to the batch's length
/// when shorter, and every other row is padded up to it when it is longer.
pub fn padding_tokens(rows: u64, slots: u64, joining: &[u64], prompt: u64) -> u64 {
    let longest = joining.iter().copied().fold(slots, u64::max);
    let others = rows.saturating_add(joining.len() as u64);
    let own = longest.saturating_sub(prompt);
    let theirs = others.saturating_mul(prompt.saturating_sub(longest));
    own.saturating_add(theirs)
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

    /// Positions of cache a generation of `prompt` tokens adds to `model`'s batch here beyond
    /// its own prompt and new tokens ([`padding_tokens`]), from the batch's shape as its
    /// backend last reported it and the prompts on their way to it. A prompt that finished
    /// its run shows in the shape after the batch's next step (its first).
    pub fn join_padding(&self, model: &str, prompt: u64) -> u64 {
        let batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
        batches
            .get(model)
            .map_or(0, |b| padding_tokens(b.rows, b.slots, &b.joining, prompt))
    }

    /// Change what is kept of `model`'s batch; a batch with no rows and no prompts on their
    /// way is forgotten, so a model that stopped generating leaves nothing behind.
    fn with_batch(&self, model: &str, change: impl FnOnce(&mut BatchShape)) {
        let mut batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
        let batch = batches.entry(model.to_string()).or_default();
        change(batch);
        if batch.is_empty() {
            batches.remove(model);
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
pub struct Waiting {
    sequences: Arc<Sequences>,
    /// Its model and prompt's length, when its cache will join the model's batch there.
    joining: Option<(String, u64)>,
}

impl Waiting {
    /// Count one more waiting generation in `sequences` (a pool's).
    pub fn on(sequences: &Arc<Sequences>) -> Waiting {
        sequences.waiting.fetch_add(1, Ordering::Relaxed);
        Waiting {
            sequences: Arc::clone(sequences),
            joining: None,
        }
    }

    /// [`on`](Self::on), for a prompt of `prompt` tokens whose cache will join `model`'s batch
    /// there: until its run ends, admission counts the padding it brings to the batch.
    pub fn joining(sequences: &Arc<Sequences>, model: &str, prompt: u64) -> Waiting {
        sequences.with_batch(model, |b| b.joining.push(prompt));
        let mut waiting = Waiting::on(sequences);
        waiting.joining = Some((model.to_string(), prompt));
        waiting
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.sequences.waiting.fetch_sub(1, Ordering::Relaxed);
        if let Some((model, prompt)) = &self.joining {
            self.sequences.with_batch(model, |b| {
                if let Some(at) = b.joining.iter().position(|p| p == prompt) {
                    b.joining.swap_remove(at);
                }
            });
        }
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
/// `kv_cache_bytes` until dropped, so admission sees what the batch really holds; and the
/// batch's shape, for what a generation joining it adds ([`Sequences::join_padding`]).
#[derive(Debug)]
pub struct Padding {
    sequences: Arc<Sequences>,
    model: String,
    kv_bytes: u64,
}

impl Padding {
    /// None yet, in `sequences` (a pool's), for `model`'s batch.
    pub fn on(sequences: &Arc<Sequences>, model: &str) -> Padding {
        Padding {
            sequences: Arc::clone(sequences),
            model: model.to_string(),
            kv_bytes: 0,
        }
    }

    /// The batch's masked slots now hold `kv_bytes`.
    pub fn set(&mut self, kv_bytes: u64) {
        move_bytes(&self.sequences.kv_bytes, self.kv_bytes, kv_bytes);
        self.kv_bytes = kv_bytes;
    }

    /// The backend holds `rows` rows of the batch's caches, sharing `slots` positions.
    pub fn shape(&self, rows: u64, slots: u64) {
        self.sequences.with_batch(&self.model, |b| {
            b.rows = rows;
            b.slots = if rows == 0 { 0 } else { slots };
        });
    }
}

impl Drop for Padding {
    fn drop(&mut self) {
        self.set(0);
        self.shape(0, 0);
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

    #[test]
    fn a_joiner_pays_for_its_own_padding_and_for_the_padding_it_gives_the_others() {
        // Shorter than the batch: its row is padded up to the batch's 500 positions.
        assert_eq!(padding_tokens(3, 500, &[], 20), 480);
        // Longer: each of the 3 rows is padded by 100 more positions; its own row is not.
        assert_eq!(padding_tokens(3, 500, &[], 600), 300);
        // No batch: nothing beyond its own.
        assert_eq!(padding_tokens(0, 0, &[], 20), 0);
        // A prompt on its way counts as a row of its length: 2 rows, the longest 700.
        assert_eq!(padding_tokens(1, 500, &[700], 20), 680);
        assert_eq!(padding_tokens(1, 500, &[700], 800), 2 * 100);
    }

    #[test]
    fn the_batch_shape_and_the_prompts_joining_it_count_until_their_guards_drop() {
        let pool = Arc::new(Sequences::default());
        assert_eq!(pool.join_padding("lm", 20), 0);
        let padding = Padding::on(&pool, "lm");
        padding.shape(2, 300);
        assert_eq!(pool.join_padding("lm", 20), 280);
        assert_eq!(pool.join_padding("other", 20), 0, "another model's batch");
        let long = Waiting::joining(&pool, "lm", 400);
        let same = Waiting::joining(&pool, "lm", 400);
        assert_eq!(pool.now().waiting, 2);
        assert_eq!(pool.join_padding("lm", 20), 380);
        assert_eq!(
            pool.join_padding("lm", 500),
            4 * 100,
            "2 rows and 2 prompts padded by 100"
        );
        drop(long);
        assert_eq!(pool.join_padding("lm", 500), 3 * 100);
        drop(same);
        assert_eq!(pool.join_padding("lm", 20), 280);
        drop(padding);
        assert_eq!(pool.join_padding("lm", 20), 0);
        assert!(pool.batches.lock().unwrap().is_empty(), "nothing left behind");
    }
}
