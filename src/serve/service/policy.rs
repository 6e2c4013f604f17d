//! The service's admission policy: loaded and tried on the config before any port is bound,
//! shown the latest sample (converted once per sample, with the pools' load read live) and
//! reloaded on request.

use std::sync::Arc;

use crate::config::Config;
use crate::core::snapshot::Snapshot;
use crate::policy::PolicyStatus;
use crate::policy::{PolicyHandle, StateView};
use crate::pool::Pool;
use crate::serve::metrics::{ReloadResult, ResultLabels};

use super::{ModelEntry, Service, Services, StartError};

/// The policy's view of one sample: built once per sample, shared by every evaluation.
pub(super) struct PolicyState {
    generation: u64,
    view: Arc<StateView>,
}

/// The pools' load and the services' running requests and memory as the policy reads them,
/// live, when a script reads `state.pools[name]` or `state.services[name]`.
#[derive(Debug)]
struct PoolsNow(Vec<Arc<Pool>>, Arc<Services>);

impl crate::policy::LiveLoad for PoolsNow {
    fn service_now(&self, name: &str) -> Option<crate::policy::ServiceNow> {
        Some(crate::policy::ServiceNow {
            running: self.1.running(name),
            memory_bytes: self.1.memory(name)?,
        })
    }

    fn pool_load(&self, name: &str) -> Option<crate::policy::PoolLoadNow> {
        let pool = self.0.iter().find(|p| p.name() == name)?;
        let load = pool.load();
        let sequences = pool.sequences.now();
        Some(crate::policy::PoolLoadNow {
            queue_depth: load.queue_depth as u64,
            queue_oldest_age_ms: load.oldest_age.as_millis() as u64,
            inflight: load.inflight as u64,
            alloc_failures_recent: pool.health().alloc_failures_recent(),
            est_delay_ms: load.estimated_delay.as_millis() as u64,
            breaker: pool.breaker_view(),
            sequences_waiting: sequences.waiting,
            sequences_running: sequences.running,
            kv_cache_bytes: sequences.kv_bytes,
        })
    }
}

impl Service {
    /// The policy's view of the world: the latest sample, converted for the script once per
    /// sample, whose pools read their queue, in-flight count, recent failures and delay
    /// estimate live when the script looks at them.
    pub fn policy_view(&self) -> Arc<StateView> {
        let sample = self.store.latest();
        let mut cached = self.policy_state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(state) = cached.as_ref()
            && state.generation == sample.generation
        {
            return Arc::clone(&state.view);
        }
        let live: Arc<dyn crate::policy::LiveLoad> = Arc::new(PoolsNow(self.pools.clone(), Arc::clone(&self.services)));
        // The sampler knows nothing of services: their budgets join the sample here, once per
        // sample, and what they run and hold is read live.
        let mut snapshot = Snapshot::clone(&sample.snapshot);
        snapshot.services = self.services.states(&self.config, &sample.snapshot);
        let view = Arc::new(StateView::new(&snapshot).with_live_load(live));
        *cached = Some(PolicyState {
            generation: sample.generation,
            view: Arc::clone(&view),
        });
        view
    }

    /// Reload the policy (admin endpoint, file watcher) and account for it in the metrics.
    pub fn reload_policy(&self) -> Result<PolicyStatus, String> {
        let result = self.policy.reload();
        let label = if result.is_ok() {
            ReloadResult::ok
        } else {
            ReloadResult::error
        };
        self.metrics
            .policy
            .reloads
            .get_or_create(&ResultLabels { result: label })
            .inc();
        match result {
            Ok(_) => {
                let status = self.policy.status();
                self.metrics.policy.show(&status);
                Ok(status)
            }
            Err(e) => Err(e.to_string()),
        }
    }
}

/// Load the configured policy (a file, or a builtin one from the binary), then try it once per
/// model and ready pool on the first snapshot: a script that fails on this config's params is
/// refused before any port is bound.
pub(super) fn load_policy(
    config: &Config,
    models: &[ModelEntry],
    ready_pools: &[&str],
    snapshot: &Snapshot,
) -> Result<PolicyHandle, StartError> {
    let handle = PolicyHandle::load(config.policy.source.clone(), crate::policy::settings_for(config))
        .map_err(|e| StartError::Policy(e.to_string()))?;
    // Pools that could not start (no CUDA here) never reach the policy; they are not tried.
    let requests = crate::policy::smoke_requests(
        config,
        |pool| ready_pools.contains(&pool.name.as_str()),
        |model, tokens| {
            let entry = models.iter().find(|m| m.config.name == model.name);
            entry.map(|m| m.estimate_tokens(tokens, 1)).unwrap_or_default()
        },
    );
    crate::policy::smoke_test(&handle.current().script, &requests, snapshot).map_err(|e| {
        StartError::Policy(format!(
            "{}: policy `{}` fails with this config (check policy.params): {e}",
            config.source,
            handle.origin()
        ))
    })?;
    tracing::info!(policy = %handle.origin(), sha256 = %handle.status().sha256, "policy loaded");
    Ok(handle)
}
