//! The worker processes of the pools that run in one (`isolation: process`), as the simulated
//! device's fault knobs reach them (`POST /admin/sim/{device}`'s `kill_worker`, `hang_worker`).

use crate::serve::service::Service;

impl Service {
    /// Whether a pool on `device` runs its models in a worker process.
    pub fn has_worker_on(&self, device: &str) -> bool {
        self.pools
            .iter()
            .any(|p| p.config.device == device && p.supervisor().is_process_isolated())
    }

    /// Kill the worker process of the first pool on `device` that has one: its pid, or why
    /// not (none runs now, or there is no such pool).
    pub fn kill_worker_on(&self, device: &str) -> Result<u32, String> {
        let pool = self
            .pools
            .iter()
            .find(|p| p.config.device == device && p.supervisor().is_process_isolated())
            .ok_or_else(|| format!("no pool on `{device}` runs in a worker process"))?;
        pool.supervisor().kill_worker()
    }
}
