//! Health checks of a local pool: a probe inference of each of its models at its smallest valid
//! input, run by vramguard itself, never a client's request. A check runs when the breaker is
//! half-open (its cooldown passed, or a restore rebuilt the pool): every probe succeeding closes
//! it, one failing opens it again for another cooldown. It also runs once the pool has been idle
//! for `pools[].health.interval`, where an allocator or driver failure counts against the
//! breaker like a request's. Checks are counted in `vramguard_health_checks_total`, not as
//! requests; `vramguard_breaker_recovery_seconds` is then the time from opening to the probe
//! that closed it.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::core::backend::RunMeta;
use crate::pool::{InferJob, Pool, PoolError, RunCancel, RunMemory};
use crate::serve::service::Service;

/// How often the breaker and the pool's load are looked at: a half-open breaker is probed
/// within this of its cooldown ending or its restore.
const TICK: Duration = Duration::from_millis(100);

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
        let probe = match pool.health_check_permit() {
            Some(true) => true,
            Some(false) if idle && quiet_since.elapsed() >= health.interval => false,
            Some(false) | None => continue,
        };
        let result = tokio::select! {
            () = cancel.cancelled() => {
                if probe {
                    pool.probe_unused();
                }
                return;
            }
            result = check(&service, &pool, health.timeout) => result,
        };
        quiet_since = tokio::time::Instant::now();
        match result {
            Err(PoolError::ShuttingDown { .. }) => {
                if probe {
                    pool.probe_unused();
                }
                return;
            }
            result => pool.health_checked(probe, result.map_err(|e| e.to_string())),
        }
    }
}

/// One check: a probe run of every model of `pool`, each within `timeout`; the first failure
/// ends it.
async fn check(service: &Service, pool: &Arc<Pool>, timeout: Duration) -> Result<(), PoolError> {
    for model in &pool.config.models {
        // A check never loads a model: it is no request for it.
        let Some(entry) = service.model(model).filter(|_| pool.is_resident(model)) else {
            continue;
        };
        let inputs = entry
            .probe_inputs()
            .map_err(|why| unavailable(pool, format!("no probe input for `{model}`: {why}")))?;
        let cancel = RunCancel::default();
        let job = InferJob {
            meta: RunMeta {
                request_id: format!("health-check-{}", pool.name()),
                deadline: Some(std::time::Instant::now() + timeout),
                ..RunMeta::default()
            },
            model: model.clone(),
            inputs: inputs.into(),
            outputs: Vec::new(),
            op: Default::default(),
            estimate_bytes: None,
            memory: RunMemory::default(),
            probe: true,
            cancel: cancel.clone(),
        };
        let reply = pool.submit(job)?;
        match tokio::time::timeout(timeout, reply).await {
            Ok(Ok(result)) => result.map(drop).map_err(|e| match e {
                PoolError::Backend(e) => unavailable(pool, format!("`{model}`: {e}")),
                other => other,
            })?,
            Ok(Err(_)) => {
                return Err(PoolError::ShuttingDown {
                    pool: pool.name().to_string(),
                });
            }
            Err(_) => {
                // Stop the run if it is still going: the worker may be needed by requests.
                cancel.cancel();
                return Err(unavailable(
                    pool,
                    format!(
                        "`{model}` did not answer within {}ms (health.timeout)",
                        timeout.as_millis()
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn unavailable(pool: &Pool, reason: String) -> PoolError {
    PoolError::Unavailable {
        pool: pool.name().to_string(),
        reason,
    }
}
