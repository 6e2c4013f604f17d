//! Continuous batching: the generations of one model on one pool take their steps together,
//! one run per step for all of them ([`Generations::decode`]), with sequences joining and leaving
//! between steps. A generation's prompt runs on its own first (a prefill job); it then joins
//! its pool's [`Batch`] and sends each token it picks to the batch as its [`Member`].
//! Generations that share a prompt's run go on from copies of its cache, made by the backend
//! with the next step ([`Batch::fork`]).
//!
//! The stepper (one tokio task per batch) runs a step once every member has sent its token,
//! or [`GRACE`] after the first did: a member that is late (its stream's reader is slow) gets
//! a masked slot in that step instead of holding the others back, and the steps after it do
//! not wait for it until its next token comes (a stalled reader would otherwise cost every
//! other member a grace per token). A step's failure reaches every row in it; rows whose
//! cache the backend did not hold get [`BackendError::CacheMissing`] and the others run again
//! at once.
//!
//! This file is a batch and its members; `stepper.rs` the task that steps each batch, and
//! `sequences.rs` the pool's generation counts and the batch shapes admission reads. The
//! machinery names nothing of the pool it runs on but [`StepPool`], which the pool implements.
//!
//! [`Generations::decode`]: crate::core::backend::Generations::decode

pub mod sequences;
mod stepper;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::core::backend::{BackendError, DecodeRow, Fork};
use crate::pool::job::{InferJob, JobResult, PoolError};
use sequences::Sequences;

/// How long a step waits for late members once one has sent its token.
pub const GRACE: Duration = Duration::from_millis(2);

/// Sequence numbers, unique in this process (a backend keys its caches by them).
static SEQUENCES: AtomicU64 = AtomicU64::new(1);

/// A new sequence number for a generation's cache.
pub fn next_sequence() -> u64 {
    SEQUENCES.fetch_add(1, Ordering::Relaxed)
}

/// A step's row logits, or why the step failed.
type Reply = oneshot::Sender<Result<Vec<f32>, PoolError>>;

/// What a member tells its batch's stepper.
enum Message {
    /// It takes steps from now on.
    Join(u64),
    /// Its next token.
    Step(DecodeRow, Reply),
    /// It is gone: its cache is dropped with the next step.
    Leave(u64),
    /// A prompt's cache is copied for other generations with the next step.
    Fork(Fork),
}

/// One model's generations on one pool.
#[derive(Debug)]
pub struct Batch {
    messages: mpsc::UnboundedSender<Message>,
}

/// What a batch's stepper asks of the pool it steps on. The pool implements it, so the batching
/// machinery depends on these four things only, not on the pool's own type.
pub trait StepPool: Send + Sync + 'static {
    /// The pool's name, for a step's errors.
    fn name(&self) -> &str;
    /// The pool's generations, where a batch's masked slots are counted.
    fn sequences(&self) -> &Arc<Sequences>;
    /// Whether the pool's breaker lets a step run now.
    fn breaker_permit(&self) -> Result<(), PoolError>;
    /// Queue a step's job on the pool: its outputs come on the receiver.
    fn submit(&self, job: InferJob) -> Result<oneshot::Receiver<JobResult>, PoolError>;
}

/// Each model's batch on one pool (made on first use).
#[derive(Debug, Default)]
pub struct Batches(Mutex<HashMap<String, Arc<Batch>>>);

impl Batches {
    /// `model`'s batch on `pool`, its stepper started on first use (on the caller's tokio
    /// runtime) or again after it stopped.
    pub fn of<P: StepPool>(&self, pool: &Arc<P>, model: &str) -> Arc<Batch> {
        let mut batches = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(batch) = batches.get(model).filter(|b| !b.messages.is_closed()) {
            return Arc::clone(batch);
        }
        let (messages, inbox) = mpsc::unbounded_channel();
        tokio::spawn(stepper::step_batch(Arc::downgrade(pool), model.to_string(), inbox));
        let batch = Arc::new(Batch { messages });
        batches.insert(model.to_string(), Arc::clone(&batch));
        batch
    }
}

/// A generation's place in its pool's batch. Dropping it (the generation ended, failed, moved,
/// or its client went away) drops its cache at the backend with the next step.
#[derive(Debug)]
pub struct Member {
    seq: u64,
    joined: bool,
    messages: mpsc::UnboundedSender<Message>,
}

impl Batch {
    /// Sequence `seq`, prefilled on this pool: its cache is dropped when the member is, and it
    /// takes steps once [`joined`](Member::join).
    pub fn member(&self, seq: u64) -> Member {
        Member {
            seq,
            joined: false,
            messages: self.messages.clone(),
        }
    }
}

impl Batch {
    /// Copy sequence `from`'s cache (prefilled on this pool) as each of `to`'s, where the
    /// backend keeps it, with the next step: generations that share a prompt's run. Sent
    /// before any of `to` takes a step, it reaches the backend first.
    pub fn fork(&self, from: u64, to: Vec<u64>) {
        let _ = self.messages.send(Message::Fork(Fork { from, to }));
    }
}

impl Member {
    /// Its sequence.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Take part in the batch's steps from the next one.
    pub fn join(&mut self) {
        if !self.joined {
            self.joined = true;
            let _ = self.messages.send(Message::Join(self.seq));
        }
    }

    /// Run `token` at position `past` in the batch's next step: the logits of the position
    /// after it.
    pub async fn step(&mut self, token: u32, past: u64) -> Result<Vec<f32>, PoolError> {
        self.join();
        let (reply, answer) = oneshot::channel();
        let row = DecodeRow {
            seq: self.seq,
            token,
            past,
        };
        if self.messages.send(Message::Step(row, reply)).is_err() {
            return Err(BackendError::Runtime("the batch's stepper is gone".into()).into());
        }
        answer
            .await
            .unwrap_or_else(|_| Err(BackendError::Runtime("the batch's stepper is gone".into()).into()))
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.messages.send(Message::Leave(self.seq));
    }
}
