//! The background sampler: every memory source read into one reading, processes attributed to
//! services, the pools' state added, one [`Snapshot`] published.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::config::{Provider, ServiceRule};
use crate::core::snapshot::{DeviceState, HostState, ModelOnPoolState, ModelState, PoolState, ProcessState, Snapshot};
use crate::device::simulated::SimulatedDevice;
use crate::device::{MemorySource, Reading};
use crate::pool::Pool;
use crate::pool::degraded::Degraded;
use crate::runtime::onnx::arena::ArenaStats;
use crate::telemetry::exporter::attribution::attribute;
use crate::telemetry::exporter::store::{Sample, SnapshotStore};
use crate::telemetry::metrics::{ProcessMetrics, SourceLabels};

/// Arena statistics of a pool as vramguard's share: simulated pools share the device's arena,
/// whose pressure hold is not theirs.
pub fn pool_arena(pool: &Pool, simulated: &[Arc<SimulatedDevice>]) -> Option<ArenaStats> {
    if *pool.provider() == Provider::Simulated {
        simulated
            .iter()
            .find(|d| d.name == pool.config.device)
            .and_then(|d| d.pool_stats().ok())
    } else {
        pool.arena_stats()
    }
}

/// Samples sources into snapshots.
pub struct Sampler {
    sources: Vec<Box<dyn MemorySource>>,
    rules: Vec<ServiceRule>,
    host_reserve: u64,
    pools: Vec<Arc<Pool>>,
    simulated: Vec<Arc<SimulatedDevice>>,
    metrics: ProcessMetrics,
    store: Arc<SnapshotStore>,
    degraded: Option<Arc<Degraded>>,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("sources", &self.sources.iter().map(|s| s.label()).collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Sampler {
    /// A sampler over `sources`, publishing into `store`.
    pub fn new(
        sources: Vec<Box<dyn MemorySource>>,
        rules: Vec<ServiceRule>,
        host_reserve: u64,
        metrics: ProcessMetrics,
        store: Arc<SnapshotStore>,
    ) -> Self {
        for source in &sources {
            metrics.sampling(source.label());
        }
        Self {
            sources,
            rules,
            host_reserve,
            pools: Vec::new(),
            simulated: Vec::new(),
            metrics,
            store,
            degraded: None,
        }
    }

    /// Put degraded mode into every snapshot (`state.degraded` for the policy).
    pub fn with_degraded(mut self, degraded: Arc<Degraded>) -> Self {
        self.degraded = Some(degraded);
        self
    }

    /// Include these pools (and the simulated devices they may run on) in every snapshot.
    pub fn with_pools(mut self, pools: Vec<Arc<Pool>>, simulated: Vec<Arc<SimulatedDevice>>) -> Self {
        self.pools = pools;
        self.simulated = simulated;
        self
    }

    /// Take one sample and publish it. Blocking: run it off the async runtime.
    pub fn sample(&mut self) {
        let started = Instant::now();
        let mut reading = Reading::default();
        for source in &mut self.sources {
            let t = Instant::now();
            let labels = SourceLabels {
                source: source.label().to_string(),
            };
            if let Err(e) = source.sample(&mut reading) {
                tracing::warn!(source = source.label(), error = %e, "memory source failed");
                self.metrics.exporter_errors.get_or_create(&labels).inc();
            }
            self.metrics
                .exporter_sample_duration
                .get_or_create(&labels)
                .observe(t.elapsed().as_secs_f64());
        }
        let self_resident_bytes = reading.host.map_or(0, |h| h.self_resident_bytes);
        let snapshot = self.build(reading);
        self.store.publish(Sample {
            snapshot: Arc::new(snapshot),
            self_resident_bytes,
            generation: 0,
            taken_at: Some(started),
        });
    }

    /// The snapshot of `reading` and the pools now.
    fn build(&self, reading: Reading) -> Snapshot {
        let mut devices: BTreeMap<String, DeviceState> = reading
            .devices
            .iter()
            .map(|(name, m)| {
                let used = m.used_bytes.min(m.total_bytes);
                (
                    name.clone(),
                    DeviceState {
                        kind: m.kind,
                        total_bytes: m.total_bytes,
                        used_bytes: used,
                        free_bytes: m.total_bytes - used,
                        ..DeviceState::default()
                    },
                )
            })
            .collect();
        let pools = self.pool_states(&mut devices);
        for device in devices.values_mut() {
            device.headroom_bytes = device.free_bytes + device.reserved_bytes.saturating_sub(device.active_bytes);
        }
        // A process-isolated pool's worker is vramguard's, listed with its pool (NVML names it
        // by its executable only).
        let workers: Vec<(u32, &str)> = self
            .pools
            .iter()
            .filter_map(|pool| Some((pool.supervisor().worker_pid()?, pool.name())))
            .collect();
        let processes = reading
            .processes
            .iter()
            .map(|p| match workers.iter().find(|(pid, _)| *pid == p.pid) {
                Some((_, pool)) => ProcessState {
                    pid: p.pid,
                    name: format!("vramguard worker {pool}"),
                    service: "vramguard".into(),
                    device: p.device.clone(),
                    used_bytes: p.used_bytes,
                },
                None => ProcessState {
                    pid: p.pid,
                    name: p.name.clone(),
                    service: attribute(&self.rules, p),
                    device: p.device.clone(),
                    used_bytes: p.used_bytes,
                },
            })
            .collect();
        let host = reading.host.map_or_else(
            || HostState {
                reserve_bytes: self.host_reserve,
                ..HostState::default()
            },
            |h| HostState {
                mem_available_bytes: h.available_bytes,
                mem_total_bytes: h.total_bytes,
                reserve_bytes: self.host_reserve,
            },
        );
        if host.mem_total_bytes > 0 && host.mem_available_bytes < host.reserve_bytes.saturating_mul(2) {
            // Host memory nears its reserve: pools that keep freed blocks for their next run
            // give them back now instead of after their idle time.
            for pool in &self.pools {
                pool.release_soon();
            }
        }
        Snapshot {
            devices,
            pools,
            host,
            processes,
            degraded: self.degraded.as_ref().is_some_and(|d| d.now().is_some()),
            models: self.model_states(),
            // The serving side adds what it accounts for (`Service::policy_view`).
            services: BTreeMap::new(),
        }
    }

    /// Every model the pools serve, and where it is loaded now.
    fn model_states(&self) -> BTreeMap<String, ModelState> {
        let mut models: BTreeMap<String, ModelState> = BTreeMap::new();
        for pool in &self.pools {
            for name in &pool.config.models {
                let now = pool.residency().model_state(name);
                let model = models.entry(name.clone()).or_default();
                model.priority = now.priority;
                model.residency = now.residency.label().to_string();
                model.pools.insert(
                    pool.name().to_string(),
                    ModelOnPoolState {
                        resident: now.resident,
                        busy: (now.running + now.queued) as u64,
                        idle_ms: now.since_request.as_millis() as u64,
                        loaded_ms_ago: now.since_load.unwrap_or_default().as_millis() as u64,
                        weights_bytes: now.weights_bytes,
                        host_tier: now.host_tier,
                        reload_ms: now.reload.map_or(0, |d| d.as_millis() as u64),
                    },
                );
            }
        }
        models
    }

    /// Each pool's state now, its arena statistics added to its device's.
    fn pool_states(&self, devices: &mut BTreeMap<String, DeviceState>) -> BTreeMap<String, PoolState> {
        let mut pools = BTreeMap::new();
        for pool in &self.pools {
            // Workers refresh their arena statistics after their next run (the next sample
            // shows them), instead of every run paying for the C API call.
            pool.want_arena_stats();
            let load = pool.load();
            let sequences = pool.sequences.now();
            if let Some(stats) = pool_arena(pool, &self.simulated)
                && let Some(device) = devices.get_mut(&pool.config.device)
            {
                if *pool.provider() == Provider::Simulated {
                    // Every simulated pool reports the one shared arena: count it once.
                    device.reserved_bytes = stats.reserved_bytes;
                    device.active_bytes = stats.active_bytes;
                } else {
                    device.reserved_bytes += stats.reserved_bytes;
                    device.active_bytes += stats.active_bytes;
                }
            }
            pools.insert(
                pool.name().to_string(),
                PoolState {
                    provider: pool.provider().kind(),
                    device: pool.config.device.clone(),
                    breaker: pool.breaker_view(),
                    queue_depth: load.queue_depth as u64,
                    queue_oldest_age_ms: load.oldest_age.as_millis() as u64,
                    inflight: load.inflight as u64,
                    concurrency: pool.config.workers as u64,
                    alloc_failures_recent: pool.health().alloc_failures_recent(),
                    est_delay_ms: load.estimated_delay.as_millis() as u64,
                    max_context: pool.config.max_context.unwrap_or(0),
                    sequences_waiting: sequences.waiting,
                    sequences_running: sequences.running,
                    kv_cache_bytes: sequences.kv_bytes,
                },
            );
        }
        pools
    }

    /// Sample every `interval`, and at once when `wake` is notified, until `cancel` fires; the
    /// sampling itself runs off the async runtime.
    pub async fn run(mut self, interval: Duration, cancel: CancellationToken, wake: Arc<tokio::sync::Notify>) {
        // The first tick of an interval fires at once; the owner sampled before serving.
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = ticker.tick() => {}
                _ = wake.notified() => {}
            }
            match tokio::task::spawn_blocking(move || {
                self.sample();
                self
            })
            .await
            {
                Ok(sampler) => self = sampler,
                Err(e) => {
                    tracing::error!(error = %e, "the sampler panicked; memory metrics stop updating");
                    return;
                }
            }
        }
    }
}
