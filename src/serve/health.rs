//! Health checks of a local pool: a probe inference of each of its models at its smallest valid
//! input, run by vramguard itself, never a client's request. A check runs when the breaker is
//! half-open (its cooldown passed, or a restore rebuilt the pool): every probe succeeding closes
//! it, one failing opens it again for another cooldown. It also runs once the pool has been idle
//! for `pools[].health.interval`, where an allocator or driver failure counts against the
//! breaker like a request's, and any other failure of a model's run (a runtime error, a panic)
//! opens it: the pool's requests would fail the same way. Checks are counted in
//! `vramguard_health_checks_total`, not as
//! requests; `vramguard_breaker_recovery_seconds` is then the time from opening to the probe
//! that closed it.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::core::backend::{BackendError, RunMeta};
use crate::pool::{CheckFailure, InferJob, Pool, PoolError, RunCancel, RunMemory};
use crate::serve::service::Service;

/// How often the breaker and the pool's load are looked at: a half-open breaker is probed
/// within this of its cooldown ending or its restore.
const TICK: Duration = Duration::from_millis(100);

/// Start the watchers of every pool on `tasks`, until `cancel`: a remote pool's health probe
/// of its server; a local pool's health checks ([`watch_pool`]) and idle unloads.
pub fn watch_pools(service: &Arc<Service>, tasks: &TaskTracker, cancel: &CancellationToken) {
    for pool in &service.pools {
        if let crate::config::Provider::Remote(options) = pool.provider() {
            tasks.spawn(crate::pool::remote::watch_health(
                Arc::clone(pool),
                options.clone(),
                service.metrics.remote.of_pool(pool.name()),
                cancel.clone(),
            ));
        } else {
            tasks.spawn(watch_pool(Arc::clone(service), Arc::clone(pool), cancel.clone()));
            tasks.spawn(crate::serve::idle::watch_idle(Arc::clone(pool), cancel.clone()));
        }
    }
}

/// Check `pool` (a local one) as its breaker and idleness say, until `cancel`.
pub async fn watch_pool(service: Arc<Service>, pool: Arc<Pool>, cancel: CancellationToken) {
    let health = pool.config.health;
    // Start-up ran every model already (sessions built, profiles measured): the first idle
    // check is one interval away.
    let mut quiet_since = tokio::time::Instant::now();
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(TICK) => {}
        }
        if pool.is_shutting_down() {
            return;
        }
        // A pool that could not start (or lost every backend) says why elsewhere; its restore
        // makes it ready, and half-open, again.
        if !pool.is_ready() {
            continue;
        }
        let load = pool.load();
        let idle = load.queue_depth == 0 && load.inflight == 0;
        if !idle {
            quiet_since = tokio::time::Instant::now();
        }
        // Half-open: the probe is ours now. Closed: only once idle for an interval.
        let probe = match pool.health().health_check_permit() {
            Some(true) => true,
            Some(false) if idle && quiet_since.elapsed() >= health.interval => false,
            Some(false) | None => continue,
        };
        let result = tokio::select! {
            () = cancel.cancelled() => {
                if probe {
                    pool.health().probe_unused();
                }
                return;
            }
            result = check(&service, &pool, health.timeout, probe) => result,
        };
        quiet_since = tokio::time::Instant::now();
        match result {
            Err(Failed::ShuttingDown) => {
                if probe {
                    pool.health().probe_unused();
                }
                return;
            }
            // No model is loaded and this is no probe: nothing was checked, so nothing counts.
            Ok(0) if !probe => {}
            Ok(_) => pool.health().health_checked(probe, Ok(())),
            Err(Failed::Check(failure)) => pool.health().health_checked(probe, Err(failure)),
        }
    }
}

/// Why a check ended without passing.
enum Failed {
    /// The pool is shutting down: the check says nothing.
    ShuttingDown,
    /// A probe failed.
    Check(CheckFailure),
}

/// One check: a probe run of every model of `pool` that is loaded, each within `timeout`; the
/// first failure ends it. How many models ran.
///
/// A check never loads a model (it is no request for one), but the breaker's probe (`probe`)
/// with none loaded loads the pool's first: closing the breaker on no run at all would send
/// requests to a pool nothing has shown to work.
async fn check(service: &Service, pool: &Arc<Pool>, timeout: Duration, probe: bool) -> Result<usize, Failed> {
    let served = || (pool.config.models.iter()).filter_map(|model| service.model(model).map(|entry| (model, entry)));
    let mut models: Vec<_> = served()
        .filter(|(model, _)| pool.residency().is_resident(model))
        .collect();
    if models.is_empty() && probe {
        models.extend(served().next());
    }
    for (model, entry) in &models {
        let inputs = entry
            .probe_inputs()
            .map_err(|why| broken(format!("no probe input for `{model}`: {why}")))?;
        let cancel = RunCancel::default();
        let job = InferJob {
            meta: RunMeta {
                request_id: format!("health-check-{}", pool.name()),
                deadline: Some(std::time::Instant::now() + timeout),
                ..RunMeta::default()
            },
            model: model.to_string(),
            inputs: inputs.into(),
            outputs: Vec::new(),
            op: Default::default(),
            estimate_bytes: None,
            memory: RunMemory::default(),
            probe: true,
            cancel: cancel.clone(),
        };
        let reply = pool.submit(job).map_err(|e| match e {
            PoolError::ShuttingDown { .. } => Failed::ShuttingDown,
            other => Failed::Check(CheckFailure::Other(other.to_string())),
        })?;
        match tokio::time::timeout(timeout, reply).await {
            Ok(Ok(result)) => result.map(drop).map_err(|e| match e {
                PoolError::ShuttingDown { .. } => Failed::ShuttingDown,
                // Counted already: by the run (an allocator failure) or by the pool's
                // supervisor (a lost worker).
                PoolError::Backend(e @ (BackendError::Allocation { .. } | BackendError::WorkerLost(_))) => {
                    Failed::Check(CheckFailure::Other(format!("`{model}`: {e}")))
                }
                PoolError::Backend(e) => broken(format!("`{model}`: {e}")),
                other => Failed::Check(CheckFailure::Other(format!("`{model}`: {other}"))),
            })?,
            Ok(Err(_)) => return Err(Failed::ShuttingDown),
            Err(_) => {
                // Stop the run if it is still going: the worker may be needed by requests.
                cancel.cancel();
                return Err(Failed::Check(CheckFailure::Other(format!(
                    "`{model}` did not answer within {}ms (health.timeout)",
                    timeout.as_millis()
                ))));
            }
        }
    }
    Ok(models.len())
}

fn broken(why: String) -> Failed {
    Failed::Check(CheckFailure::Broken(why))
}
