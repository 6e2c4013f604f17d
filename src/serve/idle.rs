//! Idle unloads: a pool drops a model that had no request there for its `models[].idle_unload`,
//! the way an admin unload does (counted `vramguard_model_unloads_total{reason="idle"}`); its
//! next request loads it again. The pool records each request's time in an atomic; this task
//! only looks at those times now and then.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::pool::Pool;

/// Unload `pool`'s idle models until `cancel`; returns at once when none has an `idle_unload`.
pub async fn watch_idle(pool: Arc<Pool>, cancel: CancellationToken) {
    let Some(every) = pool.residency().idle_check_interval() else {
        return;
    };
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        if pool.is_shutting_down() {
            return;
        }
        if !pool.is_ready() {
            continue;
        }
        let pool = Arc::clone(&pool);
        // An unload waits for the backends to drop the sessions: off the async runtime.
        if tokio::task::spawn_blocking(move || pool.residency().unload_idle())
            .await
            .is_err()
        {
            tracing::error!("the idle unload check panicked");
        }
    }
}
