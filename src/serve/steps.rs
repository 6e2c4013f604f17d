//! A generation's steps after its prompt's run, where its KV cache is. On a pool whose backends
//! keep caches, the cache stays in the pool's runtime (on its device) and the generation is a
//! row of the pool's batch for its model ([`crate::pool::batch`]): a step sends one token in
//! and one row of logits comes out. On a pool that keeps none (a remote one), each step carries
//! the cache as tensors, as a stateless server needs.
//!
//! A step that fails where the cache was kept does not carry it anywhere: the prompt and the
//! tokens so far are prefilled again ([`lifecycle::recompute`]), on the same pool when only
//! the cache was missing there, or on its fallback as any failed step moves.

use std::sync::Arc;

use crate::core::tensor::{Tensor, TensorData};
use crate::pool::Pool;
use crate::pool::batch::Member;
use crate::runtime::decoder::{DecoderLayout, step_inputs};
use crate::serve::lifecycle::{self, DeadlineMiss, Request, RequestError};
use crate::serve::service::Service;
use crate::telemetry::metrics::FailoverReason;

/// Where a generation's cache is between steps.
pub enum Cache {
    /// In the pool's runtime: the generation is this member of the pool's batch.
    Kept(Member),
    /// With the generation: the previous run's `present.*` outputs.
    Carried(Vec<Tensor>),
}

/// The last position's logits, and the cache to carry to the next run (none when the pool
/// kept it).
pub fn read_outputs(outputs: Vec<Tensor>) -> Result<(Vec<f32>, Vec<Tensor>), String> {
    let mut logits = None;
    let mut cache = Vec::new();
    for tensor in outputs {
        if tensor.name == "logits" {
            logits = Some(tensor);
        } else if tensor.name.starts_with("present.") {
            cache.push(tensor);
        }
    }
    let logits = logits.ok_or("the model gave no `logits`")?;
    let vocab = *logits.shape.last().ok_or("`logits` has no axes")? as usize;
    let last = match logits.data {
        TensorData::Fp32(v) if vocab > 0 && v.len() >= vocab => v[v.len() - vocab..].to_vec(),
        TensorData::Fp16(v) if vocab > 0 && v.len() >= vocab => {
            v[v.len() - vocab..].iter().map(|x| x.to_f32()).collect()
        }
        _ => return Err(format!("`logits` of shape {:?} has no last position", logits.shape)),
    };
    Ok((last, cache))
}

/// Where a generation is: its pool, where its cache is, and whether a run of it moved.
pub struct Place {
    /// The pool its steps run on.
    pub pool: Arc<Pool>,
    /// Its cache.
    pub cache: Cache,
    /// Set once a run moved to the fallback pool.
    pub retried: Option<FailoverReason>,
}

/// A step's failure: what the client is told, or the model's outputs not being a decoder's.
pub enum Failed {
    /// The request's error.
    Request(RequestError),
    /// The outputs were not what a decoder gives.
    Broken(String),
}

impl Place {
    /// After the prompt's run on `pool` gave `cache` (empty when the pool kept it, as
    /// `request`'s sequence).
    pub fn new(pool: Arc<Pool>, request: &Request, cache: Vec<Tensor>, retried: Option<FailoverReason>) -> Place {
        let cache = keep_or_carry(&pool, request, cache);
        Place { pool, cache, retried }
    }

    /// Run `token` at position `past`: the logits of the next position. `history` gives the
    /// prompt and every token so far (`token` included), for a prefill after a failure.
    pub async fn step(
        &mut self,
        service: &Service,
        request: &Request,
        layout: &DecoderLayout,
        (token, past): (u32, usize),
        history: impl FnOnce() -> Result<Vec<u32>, String>,
        estimate_bytes: u64,
    ) -> Result<Vec<f32>, Failed> {
        let failed = match &mut self.cache {
            Cache::Carried(cache) => {
                let inputs = step_inputs(layout, &[token], past, std::mem::take(cache));
                let stepped = lifecycle::step(service, &self.pool, request, inputs, estimate_bytes)
                    .await
                    .map_err(Failed::Request)?;
                return self.settle(request, stepped);
            }
            Cache::Kept(member) => {
                let stepped = member.step(token, past as u64);
                let result = match request.meta.deadline {
                    Some(deadline) => tokio::time::timeout_at(deadline.into(), stepped)
                        .await
                        .map_err(|_| Failed::Request(RequestError::Deadline(DeadlineMiss::InPool)))?,
                    None => stepped.await,
                };
                match result {
                    Ok(logits) => return Ok(logits),
                    Err(error) => error,
                }
            }
        };
        // The cache is gone with the step: leave the batch, and build it again.
        self.cache = Cache::Carried(Vec::new());
        tracing::info!(request_id = %request.meta.request_id, pool = self.pool.name(), error = %failed, "a generation's step failed: prefilling it again");
        let tokens = history().map_err(Failed::Broken)?;
        let inputs = step_inputs(layout, &tokens, 0, Vec::new());
        let ran = lifecycle::recompute(service, &self.pool, request, failed, inputs, estimate_bytes)
            .await
            .map_err(Failed::Request)?;
        self.settle(request, ran)
    }

    /// Take a run's outcome: its pool, and where the cache is now.
    fn settle(&mut self, request: &Request, ran: lifecycle::Ran) -> Result<Vec<f32>, Failed> {
        self.pool = ran.pool;
        self.retried = ran.retried.or(self.retried);
        let (logits, cache) = read_outputs(ran.outputs).map_err(Failed::Broken)?;
        self.cache = keep_or_carry(&self.pool, request, cache);
        Ok(logits)
    }
}

/// Where the cache is after a run on `pool` that gave `cache`: kept by the pool (as the
/// request's sequence) when it gave none, else carried.
fn keep_or_carry(pool: &Arc<Pool>, request: &Request, cache: Vec<Tensor>) -> Cache {
    match request.sequence {
        Some(seq) if cache.is_empty() && pool.keeps_caches() => {
            let mut member = pool.batch(&request.model).member(seq);
            member.join();
            Cache::Kept(member)
        }
        _ => Cache::Carried(cache),
    }
}
