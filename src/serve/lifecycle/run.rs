//! One run of a request on a pool: the breaker's permission, the host memory it is promised
//! while it runs, and the cancellation that stops it when its client goes away or its deadline
//! passes. The host-RAM guard lives here too, beside the promise it counts.

use std::sync::Arc;

use crate::core::snapshot::ProviderKind;
use crate::core::tensor::Tensor;
use crate::pool::{InferJob, Inputs, Pool, PoolError, RunCancel, RunMemory, RunOp};
use crate::serve::service::Service;

use super::Request;

/// Whether a pool runs off the host: on an accelerator (CUDA, the simulated device) or on a
/// remote server. Such a pool may have a fallback, and its runs take no host memory.
pub(super) fn is_accelerator(pool: &Pool) -> bool {
    pool.provider().kind() != ProviderKind::Cpu
}

/// The host-RAM guard: a run on a host (CPU) pool is admitted only if available host memory,
/// less what runs already admitted to host pools are expected to need, less this run's
/// estimate, stays above `host.reserve`, so CPU work cannot take the machine down.
pub(super) fn host_keeps_reserve(service: &Service, pool: &Pool, need_bytes: u64) -> Result<(), String> {
    if is_accelerator(pool) {
        return Ok(());
    }
    let host = service.store.latest().snapshot.host.clone();
    if host.mem_total_bytes == 0 {
        return Ok(()); // no host reading (no procfs): nothing to judge by
    }
    let committed = service.host_committed();
    let mut left = host
        .mem_available_bytes
        .saturating_sub(committed)
        .saturating_sub(need_bytes);
    // The host tier is a cache: it gives its bytes back before CPU work is refused.
    if left < host.reserve_bytes
        && let Some(tier) = &service.tier
    {
        left += tier.shed(host.reserve_bytes - left);
    }
    if left < host.reserve_bytes {
        return Err(format!(
            "the host would drop below its memory reserve ({} available, {} promised to running CPU work, {} needed, {} reserved)",
            crate::core::human::human_bytes(host.mem_available_bytes),
            crate::core::human::human_bytes(committed),
            crate::core::human::human_bytes(need_bytes),
            crate::core::human::human_bytes(host.reserve_bytes)
        ));
    }
    Ok(())
}

/// Queue one run of `request` with `inputs` on `pool` and wait for it (or the deadline). Takes
/// the breaker's permission first: only a closed breaker gives it.
pub(super) async fn run_on(
    service: &Service,
    pool: &Arc<Pool>,
    request: &Request,
    inputs: Inputs,
    estimate_bytes: u64,
) -> Result<Vec<Tensor>, PoolError> {
    pool.health().breaker_permit()?;
    run_permitted(service, pool, request, inputs, estimate_bytes).await
}

/// [`run_on`] with the breaker's permission already taken.
pub(super) async fn run_permitted(
    service: &Service,
    pool: &Arc<Pool>,
    request: &Request,
    inputs: Inputs,
    estimate_bytes: u64,
) -> Result<Vec<Tensor>, PoolError> {
    // What a host pool's run is expected to take stays promised until it ends (or the client
    // goes away), so concurrent admissions see each other before the next memory sample does.
    let _promised = (!is_accelerator(pool)).then(|| service.promise_host_memory(estimate_bytes));
    let cancel = RunCancel::for_request(request.progress.clone());
    // A run of a size no measured run covers is measured, and what it took refines the model's
    // later estimates.
    let entry = service.model(&request.model);
    let dims = entry.map(|e| e.dims_of(&inputs)).unwrap_or_default();
    let memory = match entry {
        Some(e) if e.learned.wants(&dims) => RunMemory::wanted(),
        _ => RunMemory::default(),
    };
    let job = InferJob {
        meta: request.meta.clone(),
        model: request.model.clone(),
        inputs,
        outputs: request.outputs.clone(),
        op: match request.sequence {
            Some(seq) if pool.keeps_caches() => RunOp::Prefill(seq),
            _ => RunOp::Run,
        },
        estimate_bytes: Some(estimate_bytes),
        memory: memory.clone(),
        probe: false,
        cancel: cancel.clone(),
    };
    // Until the answer is in: a client that goes away (this future dropped) or a deadline that
    // passes stops the job, queued or running, so the device is not spent on it.
    let mut stop = StopOnDrop(Some(cancel));
    let reply = pool.submit(job)?;
    let reply = match request.deadline() {
        Some(deadline) => match tokio::time::timeout_at(deadline, reply).await {
            Ok(reply) => reply,
            // The worker sees the closed reply and skips the job if it has not started.
            Err(_) => {
                return Err(PoolError::DeadlineExceeded {
                    pool: pool.name().to_string(),
                });
            }
        },
        None => reply.await,
    };
    stop.0 = None;
    if let (Some(entry), Some(observation)) = (entry, memory.take()) {
        service.observe_run(entry, pool, dims, estimate_bytes, observation);
    }
    reply.unwrap_or_else(|_| {
        Err(PoolError::ShuttingDown {
            pool: pool.name().to_string(),
        })
    })
}

/// Cancels its job when dropped while still armed.
struct StopOnDrop(Option<RunCancel>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Some(cancel) = self.0.take() {
            cancel.cancel();
        }
    }
}
