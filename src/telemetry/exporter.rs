//! The exporter: one background sampler asks every memory source for a reading, attributes
//! processes to services, adds the pools' state, and publishes one [`Snapshot`] that `/metrics`,
//! `/status` and the policy all read. A scrape never waits on a driver call: it encodes
//! the latest snapshot plus the pools' live queues through [`LiveCollector`].

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::TypedMetric;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;
use tokio_util::sync::CancellationToken;

use crate::config::{Provider, ServiceMatch, ServiceRule};
use crate::core::snapshot::{
    BreakerState, DeviceClass, DeviceState, HostState, PoolState, ProcessState, ProviderKind, Snapshot,
};
use crate::device::simulated::SimulatedDevice;
use crate::device::{DeviceProcess, MemorySource, Reading};
use crate::pool::Pool;
use crate::pool::activity::Activity;
use crate::pool::degraded::Degraded;
use crate::runtime::onnx::arena::ArenaStats;
use crate::telemetry::metrics::{Metrics, SourceLabels};

/// The service label of processes no rule matches.
pub const UNMATCHED_SERVICE: &str = "other";

/// The service a process belongs to: what its source says (vramguard itself, simulated
/// pressure), else the first matching rule, else `other`.
pub fn attribute(rules: &[ServiceRule], process: &DeviceProcess) -> String {
    if let Some(service) = &process.service {
        return service.clone();
    }
    rules
        .iter()
        .find(|rule| match &rule.matcher {
            ServiceMatch::ProcessName(name) => &process.name == name,
            ServiceMatch::Cmdline(re) => re.is_match(&process.cmdline),
            ServiceMatch::Cgroup(re) => re.is_match(&process.cgroup),
        })
        .map_or_else(|| UNMATCHED_SERVICE.to_string(), |rule| rule.service.clone())
}

/// The latest sample.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// Devices, pools, host and processes.
    pub snapshot: Arc<Snapshot>,
    /// vramguard's own resident memory.
    pub self_resident_bytes: u64,
    /// Increases with every sample (lets readers cache what they derive from a snapshot).
    pub generation: u64,
    /// When it was taken.
    pub taken_at: Option<Instant>,
}

/// Where the sampler publishes and everyone else reads.
#[derive(Debug, Default)]
pub struct SnapshotStore {
    current: RwLock<Sample>,
}

impl SnapshotStore {
    /// The latest sample (cheap: clones an `Arc`).
    pub fn latest(&self) -> Sample {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn publish(&self, mut sample: Sample) {
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        sample.generation = current.generation + 1;
        *current = sample;
    }
}

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

/// `/metrics`: OpenMetrics for clients that ask for it (Prometheus does), the Prometheus text
/// format 0.0.4 otherwise (curl, `promtool check metrics`).
pub fn metrics_response(
    registry: &prometheus_client::registry::Registry,
    headers: &axum::http::HeaderMap,
) -> axum::response::Response {
    use axum::http::header;
    use axum::response::IntoResponse;
    let wants_openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(accepts_openmetrics);
    if wants_openmetrics {
        (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            crate::telemetry::metrics::encode(registry),
        )
            .into_response()
    } else {
        (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
            crate::telemetry::metrics::encode_prometheus_text(registry),
        )
            .into_response()
    }
}

/// Whether one media range of an `Accept` header asks for OpenMetrics: the type matches and its
/// quality is not 0 (`q=0` means "not acceptable", RFC 9110 §12.4.2).
fn accepts_openmetrics(range: &str) -> bool {
    let mut parts = range.split(';').map(str::trim);
    if !parts
        .next()
        .is_some_and(|t| t.eq_ignore_ascii_case("application/openmetrics-text"))
    {
        return false;
    }
    parts
        .filter_map(|p| p.split_once('='))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
        .is_none_or(|(_, q)| q.trim().parse::<f32>().is_ok_and(|q| q > 0.0))
}

/// Samples sources into snapshots.
pub struct Sampler {
    sources: Vec<Box<dyn MemorySource>>,
    rules: Vec<ServiceRule>,
    host_reserve: u64,
    pools: Vec<Arc<Pool>>,
    simulated: Vec<Arc<SimulatedDevice>>,
    metrics: Arc<Metrics>,
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
        metrics: Arc<Metrics>,
        store: Arc<SnapshotStore>,
    ) -> Self {
        // Every source's error counter exists from the start, at 0, so a rate over it means
        // something before the first failure.
        for source in &sources {
            let _created = metrics.exporter_errors.get_or_create(&SourceLabels {
                source: source.label().to_string(),
            });
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
                    alloc_failures_recent: pool.alloc_failures_recent(),
                    est_delay_ms: load.estimated_delay.as_millis() as u64,
                    max_context: pool.config.max_context.unwrap_or(0),
                    sequences_waiting: sequences.waiting,
                    sequences_running: sequences.running,
                    kv_cache_bytes: sequences.kv_bytes,
                },
            );
        }
        for device in devices.values_mut() {
            device.headroom_bytes = device.free_bytes + device.reserved_bytes.saturating_sub(device.active_bytes);
        }
        let processes = reading
            .processes
            .iter()
            .map(|p| ProcessState {
                pid: p.pid,
                name: p.name.clone(),
                service: attribute(&self.rules, p),
                device: p.device.clone(),
                used_bytes: p.used_bytes,
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
        Snapshot {
            devices,
            pools,
            host,
            processes,
            degraded: self.degraded.as_ref().is_some_and(|d| d.now().is_some()),
        }
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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    device: String,
    kind: DeviceClass,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProcessLabels {
    device: String,
    pid: u32,
    process: String,
    service: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolDevice {
    pool: String,
    device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolOnly {
    pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NoLabels {}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

/// Encodes, on every scrape, the latest snapshot and the pools' live queues. Reading at scrape
/// time means an exited process or a drained queue can never leave a stale series behind.
pub struct LiveCollector {
    store: Arc<SnapshotStore>,
    pools: Vec<Arc<Pool>>,
    simulated: Vec<Arc<SimulatedDevice>>,
    serving: Option<Serving>,
}

/// What only `vramguard serve` has to export: degraded mode and the requests it holds.
struct Serving {
    degraded: Arc<Degraded>,
    activity: Arc<Activity>,
}

impl std::fmt::Debug for LiveCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveCollector").finish_non_exhaustive()
    }
}

impl LiveCollector {
    /// A collector over `store` and `pools`.
    pub fn new(store: Arc<SnapshotStore>, pools: Vec<Arc<Pool>>, simulated: Vec<Arc<SimulatedDevice>>) -> Self {
        Self {
            store,
            pools,
            simulated,
            serving: None,
        }
    }

    /// Also export degraded mode and the endpoint picker's gauges: requests waiting and
    /// running, accelerator memory usage (`vramguard serve`; the exporter alone serves nothing).
    pub fn serving(mut self, degraded: Arc<Degraded>, activity: Arc<Activity>) -> Self {
        self.serving = Some(Serving { degraded, activity });
        self
    }

    /// Whether no accelerator pool can take new work: there is at least one, and each is
    /// unavailable, shutting down or behind an open breaker.
    fn accelerators_closed(&self) -> bool {
        let mut accelerators = self
            .pools
            .iter()
            .filter(|p| p.provider().kind() != ProviderKind::Cpu)
            .peekable();
        accelerators.peek().is_some() && accelerators.all(|p| p.breaker_view() == BreakerState::Open)
    }
}

/// `vramguard_accelerator_memory_usage_ratio`: the fullest accelerator's memory in use (by every
/// process, vramguard's arena and external pressure alike, as NVML or the simulated device
/// reports it) over its capacity, 0 to 1; 0 with no accelerator. Exactly 1 while `saturated`
/// (degraded, or no accelerator pool can take work), so an endpoint picker that prefers emptier
/// replicas sends new work elsewhere while this one still serves what it has on its CPU path.
pub fn accelerator_usage_ratio<'a>(devices: impl IntoIterator<Item = &'a DeviceState>, saturated: bool) -> f64 {
    if saturated {
        return 1.0;
    }
    devices
        .into_iter()
        .filter(|d| d.kind != DeviceClass::Host && d.total_bytes > 0)
        .map(|d| (d.used_bytes as f64 / d.total_bytes as f64).clamp(0.0, 1.0))
        .fold(0.0, f64::max)
}

/// Encode one family of constant metrics; an empty family is left out entirely.
fn family<L: EncodeLabelSet, M: EncodeMetric + TypedMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    rows: impl IntoIterator<Item = (L, M)>,
) -> Result<(), std::fmt::Error> {
    let mut rows = rows.into_iter().peekable();
    if rows.peek().is_none() {
        return Ok(());
    }
    let mut family = encoder.encode_descriptor(name, help, unit, M::TYPE)?;
    for (labels, metric) in rows {
        metric.encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// [`family`] of gauges.
fn gauge_family<L: EncodeLabelSet, V: prometheus_client::encoding::EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    rows: impl IntoIterator<Item = (L, V)>,
) -> Result<(), std::fmt::Error> {
    family(
        encoder,
        name,
        help,
        unit,
        rows.into_iter().map(|(l, v)| (l, ConstGauge::new(v))),
    )
}

/// The label set of a metric without labels.
const NO_LABELS: [(&str, &str); 0] = [];

fn saturating_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Collector for LiveCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sample = self.store.latest();
        let snapshot = &sample.snapshot;
        let device_rows = |field: fn(&DeviceState) -> u64| {
            snapshot.devices.iter().map(move |(name, d)| {
                (
                    DeviceLabels {
                        device: name.clone(),
                        kind: d.kind,
                    },
                    saturating_i64(field(d)),
                )
            })
        };
        let bytes = Some(&Unit::Bytes);
        gauge_family(
            &mut encoder,
            "device_memory_total",
            "Device memory capacity",
            bytes,
            device_rows(|d| d.total_bytes),
        )?;
        gauge_family(
            &mut encoder,
            "device_memory_used",
            "Device memory in use by every process",
            bytes,
            device_rows(|d| d.used_bytes),
        )?;
        gauge_family(
            &mut encoder,
            "device_memory_free",
            "Device memory not in use",
            bytes,
            device_rows(|d| d.free_bytes),
        )?;
        gauge_family(
            &mut encoder,
            "process_device_memory",
            "Device memory used by each process, attributed to a service",
            bytes,
            snapshot.processes.iter().map(|p| {
                (
                    ProcessLabels {
                        device: p.device.clone(),
                        pid: p.pid,
                        process: p.name.clone(),
                        service: p.service.clone(),
                    },
                    saturating_i64(p.used_bytes),
                )
            }),
        )?;

        let arenas: Vec<(PoolDevice, ArenaStats)> = self
            .pools
            .iter()
            .filter_map(|p| {
                pool_arena(p, &self.simulated).map(|s| {
                    (
                        PoolDevice {
                            pool: p.name().to_string(),
                            device: p.config.device.clone(),
                        },
                        s,
                    )
                })
            })
            .collect();
        gauge_family(
            &mut encoder,
            "allocator_reserved",
            "ONNX Runtime arena bytes reserved from the device (TotalAllocated)",
            bytes,
            arenas
                .iter()
                .map(|(l, s)| (l.clone(), saturating_i64(s.reserved_bytes))),
        )?;
        gauge_family(
            &mut encoder,
            "allocator_active",
            "ONNX Runtime arena bytes held by live tensors (InUse)",
            bytes,
            arenas.iter().map(|(l, s)| (l.clone(), saturating_i64(s.active_bytes))),
        )?;
        gauge_family(
            &mut encoder,
            "allocator_peak_active",
            "Peak of ONNX Runtime arena bytes in use (MaxInUse)",
            bytes,
            arenas
                .iter()
                .map(|(l, s)| (l.clone(), saturating_i64(s.peak_active_bytes))),
        )?;
        family(
            &mut encoder,
            "allocator_arena_extensions",
            "Times the ONNX Runtime arena grew (NumArenaExtensions)",
            None,
            arenas.iter().map(|(l, s)| (l.clone(), ConstCounter::new(s.extensions))),
        )?;
        family(
            &mut encoder,
            "allocator_arena_shrinkages",
            "Times the ONNX Runtime arena returned memory to the device (NumArenaShrinkages)",
            None,
            arenas.iter().map(|(l, s)| (l.clone(), ConstCounter::new(s.shrinkages))),
        )?;

        let loads: Vec<(PoolOnly, crate::pool::PoolLoad)> = self
            .pools
            .iter()
            .map(|p| {
                (
                    PoolOnly {
                        pool: p.name().to_string(),
                    },
                    p.load(),
                )
            })
            .collect();
        gauge_family(
            &mut encoder,
            "queue_depth",
            "Requests waiting in the pool's queue",
            None,
            loads.iter().map(|(l, load)| (l.clone(), load.queue_depth as i64)),
        )?;
        gauge_family(
            &mut encoder,
            "queue_oldest_age",
            "Age of the oldest request waiting in the pool's queue",
            Some(&Unit::Seconds),
            loads.iter().map(|(l, load)| (l.clone(), load.oldest_age.as_secs_f64())),
        )?;
        gauge_family(
            &mut encoder,
            "inflight_requests",
            "Requests being run by the pool's workers",
            None,
            loads.iter().map(|(l, load)| (l.clone(), load.inflight as i64)),
        )?;
        let sequences: Vec<(PoolOnly, crate::pool::sequences::SequencesNow)> = self
            .pools
            .iter()
            .map(|p| {
                (
                    PoolOnly {
                        pool: p.name().to_string(),
                    },
                    p.sequences.now(),
                )
            })
            .collect();
        gauge_family(
            &mut encoder,
            "sequences_waiting",
            "Text generations accepted for the pool whose prompt's run has not finished",
            None,
            sequences.iter().map(|(l, s)| (l.clone(), saturating_i64(s.waiting))),
        )?;
        gauge_family(
            &mut encoder,
            "sequences_running",
            "Text generations past their prompt, holding a KV cache on the pool",
            None,
            sequences.iter().map(|(l, s)| (l.clone(), saturating_i64(s.running))),
        )?;
        gauge_family(
            &mut encoder,
            "kv_cache",
            "Bytes of the KV caches the pool's running generations hold between runs",
            Some(&Unit::Bytes),
            sequences.iter().map(|(l, s)| (l.clone(), saturating_i64(s.kv_bytes))),
        )?;
        gauge_family(
            &mut encoder,
            "breaker_state",
            "The pool's circuit breaker: 0 closed, 1 half-open, 2 open",
            None,
            self.pools.iter().map(|p| {
                let state = match p.breaker_state() {
                    BreakerState::Closed => 0,
                    BreakerState::HalfOpen => 1,
                    BreakerState::Open => 2,
                };
                (
                    PoolOnly {
                        pool: p.name().to_string(),
                    },
                    state,
                )
            }),
        )?;
        if let Some(Serving { degraded, activity }) = &self.serving {
            let now = degraded.now();
            gauge_family(
                &mut encoder,
                "degraded_mode",
                "1 while the service serves below its normal level (an accelerator pool unavailable or its breaker open, or work moved off it for memory)",
                None,
                std::iter::once((NoLabels {}, i64::from(now.is_some()))),
            )?;
            gauge_family(
                &mut encoder,
                "degraded_info",
                "Why the service is degraded (always 1; absent while it is not)",
                None,
                now.iter().map(|n| {
                    (
                        ReasonLabels {
                            reason: n.cause.label().to_string(),
                        },
                        1,
                    )
                }),
            )?;
            gauge_family(
                &mut encoder,
                "requests_waiting",
                "Requests accepted whose first run has not started (deferred by the policy or queued, all pools)",
                None,
                [(NO_LABELS, saturating_i64(activity.waiting()))],
            )?;
            gauge_family(
                &mut encoder,
                "requests_running",
                "Requests whose first run has started and that are not answered yet (all pools; a generation from its first step to its last)",
                None,
                [(NO_LABELS, saturating_i64(activity.running()))],
            )?;
            let saturated = now.is_some() || self.accelerators_closed();
            gauge_family(
                &mut encoder,
                "accelerator_memory_usage_ratio",
                "Memory in use over capacity of the fullest accelerator, 0 to 1; 1 while degraded or no accelerator pool can take work",
                None,
                [(NO_LABELS, accelerator_usage_ratio(snapshot.devices.values(), saturated))],
            )?;
        }

        if sample.taken_at.is_some() && snapshot.host.mem_total_bytes > 0 {
            let host = &snapshot.host;
            gauge_family(
                &mut encoder,
                "host_memory_available",
                "Host memory available for new work (MemAvailable)",
                bytes,
                [(NO_LABELS, saturating_i64(host.mem_available_bytes))],
            )?;
            gauge_family(
                &mut encoder,
                "host_memory_total",
                "Host memory (MemTotal)",
                bytes,
                [(NO_LABELS, saturating_i64(host.mem_total_bytes))],
            )?;
            gauge_family(
                &mut encoder,
                "host_memory_reserve",
                "Host memory the CPU path keeps free (host.reserve): work that would leave less available is not run",
                bytes,
                [(NO_LABELS, saturating_i64(host.reserve_bytes))],
            )?;
            gauge_family(
                &mut encoder,
                "process_resident_memory",
                "Resident memory of vramguard itself",
                bytes,
                [(NO_LABELS, saturating_i64(sample.self_resident_bytes))],
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{DeviceMemory, HostMemory};

    #[test]
    fn openmetrics_is_chosen_only_when_acceptable() {
        assert!(accepts_openmetrics("application/openmetrics-text;version=1.0.0"));
        assert!(accepts_openmetrics(
            " application/openmetrics-text; version=1.0.0; q=0.5"
        ));
        assert!(!accepts_openmetrics("application/openmetrics-text;q=0"));
        assert!(!accepts_openmetrics("application/openmetrics-text; q=0.0"));
        assert!(!accepts_openmetrics("text/plain;version=0.0.4"));
        assert!(!accepts_openmetrics("application/openmetrics-textile"));
    }

    /// An NVML-like source whose devices and processes the test sets.
    struct Fake(Arc<std::sync::Mutex<Reading>>);

    impl MemorySource for Fake {
        fn label(&self) -> &'static str {
            "nvml"
        }
        fn sample(&mut self, reading: &mut Reading) -> Result<(), String> {
            let fixed = self.0.lock().unwrap().clone();
            reading.devices.extend(fixed.devices);
            reading.processes.extend(fixed.processes);
            reading.host = fixed.host;
            Ok(())
        }
    }

    fn process(pid: u32, name: &str, cmdline: &str, cgroup: &str, used: u64) -> DeviceProcess {
        DeviceProcess {
            pid,
            device: "gpu0".into(),
            used_bytes: used,
            name: name.into(),
            cmdline: cmdline.into(),
            cgroup: cgroup.into(),
            service: None,
        }
    }

    fn rules() -> Vec<ServiceRule> {
        vec![
            ServiceRule {
                service: "ollama".into(),
                matcher: ServiceMatch::ProcessName("ollama".into()),
            },
            ServiceRule {
                service: "comfyui".into(),
                matcher: ServiceMatch::Cmdline(regex::Regex::new(r"ComfyUI/main\.py").unwrap()),
            },
            ServiceRule {
                service: "whisper".into(),
                matcher: ServiceMatch::Cgroup(regex::Regex::new(r"whisper\.service").unwrap()),
            },
        ]
    }

    #[test]
    fn fake_devices_and_processes_become_exact_exposition_lines() {
        let fixed = Arc::new(std::sync::Mutex::new(Reading {
            devices: BTreeMap::from([(
                "gpu0".to_string(),
                DeviceMemory {
                    kind: DeviceClass::Nvml,
                    total_bytes: 24 << 30,
                    used_bytes: 20 << 30,
                },
            )]),
            processes: vec![
                process(
                    101,
                    "ollama",
                    "/usr/bin/ollama serve",
                    "/system.slice/ollama.service",
                    12 << 30,
                ),
                process(
                    202,
                    "python3",
                    "python3 /opt/ComfyUI/main.py --listen",
                    "/user.slice",
                    6 << 30,
                ),
                process(
                    303,
                    "python3",
                    "python3 -m whisper_server",
                    "/system.slice/whisper.service",
                    1 << 30,
                ),
                process(404, "blender", "blender -b scene.blend", "/user.slice", 512 << 20),
            ],
            host: Some(HostMemory {
                total_bytes: 64 << 30,
                available_bytes: 40 << 30,
                self_resident_bytes: 100 << 20,
            }),
        }));
        let (metrics, mut registry) = Metrics::new("1.31.1");
        let metrics = Arc::new(metrics);
        let store = Arc::new(SnapshotStore::default());
        registry.register_collector(Box::new(LiveCollector::new(store.clone(), Vec::new(), Vec::new())));
        let mut sampler = Sampler::new(
            vec![Box::new(Fake(fixed.clone()))],
            rules(),
            2 << 30,
            metrics,
            store.clone(),
        );
        sampler.sample();
        let text = crate::telemetry::metrics::encode(&registry);
        for line in [
            "vramguard_device_memory_total_bytes{device=\"gpu0\",kind=\"nvml\"} 25769803776",
            "vramguard_device_memory_used_bytes{device=\"gpu0\",kind=\"nvml\"} 21474836480",
            "vramguard_device_memory_free_bytes{device=\"gpu0\",kind=\"nvml\"} 4294967296",
            "vramguard_process_device_memory_bytes{device=\"gpu0\",pid=\"101\",process=\"ollama\",service=\"ollama\"} 12884901888",
            "vramguard_process_device_memory_bytes{device=\"gpu0\",pid=\"202\",process=\"python3\",service=\"comfyui\"} 6442450944",
            "vramguard_process_device_memory_bytes{device=\"gpu0\",pid=\"303\",process=\"python3\",service=\"whisper\"} 1073741824",
            "vramguard_process_device_memory_bytes{device=\"gpu0\",pid=\"404\",process=\"blender\",service=\"other\"} 536870912",
            "vramguard_host_memory_available_bytes 42949672960",
            "vramguard_host_memory_total_bytes 68719476736",
            "vramguard_host_memory_reserve_bytes 2147483648",
            "vramguard_process_resident_memory_bytes 104857600",
            "# TYPE vramguard_process_device_memory_bytes gauge",
            "# UNIT vramguard_process_device_memory_bytes bytes",
        ] {
            assert!(text.contains(&format!("{line}\n")), "missing `{line}` in:\n{text}");
        }
        assert!(
            text.contains("vramguard_exporter_sample_duration_seconds_count{source=\"nvml\"} 1\n"),
            "{text}"
        );

        // Blender exits: its series is gone at the next sample, nothing stale remains.
        fixed.lock().unwrap().processes.retain(|p| p.pid != 404);
        sampler.sample();
        let text = crate::telemetry::metrics::encode(&registry);
        assert!(!text.contains("pid=\"404\""), "{text}");
        assert!(text.contains("pid=\"101\""));
        assert_eq!(store.latest().generation, 2);
        assert_eq!(store.latest().snapshot.processes.len(), 3);
    }

    #[test]
    fn headroom_counts_free_memory_plus_idle_arena_bytes() {
        let fixed = Arc::new(std::sync::Mutex::new(Reading {
            devices: BTreeMap::from([(
                "gpu0".to_string(),
                DeviceMemory {
                    kind: DeviceClass::Nvml,
                    total_bytes: 1000,
                    used_bytes: 1200,
                },
            )]),
            ..Reading::default()
        }));
        let (metrics, _registry) = Metrics::new("x");
        let store = Arc::new(SnapshotStore::default());
        let mut sampler = Sampler::new(
            vec![Box::new(Fake(fixed))],
            Vec::new(),
            0,
            Arc::new(metrics),
            store.clone(),
        );
        sampler.sample();
        let device = store.latest().snapshot.devices["gpu0"].clone();
        // A driver reading above capacity is clamped, never an underflow.
        assert_eq!(
            (device.used_bytes, device.free_bytes, device.headroom_bytes),
            (1000, 0, 0)
        );
    }

    #[test]
    fn usage_ratio_is_the_fullest_accelerator_and_full_while_saturated() {
        let device = |kind, total_bytes, used_bytes| DeviceState {
            kind,
            total_bytes,
            used_bytes,
            ..DeviceState::default()
        };
        let devices = [
            device(DeviceClass::Nvml, 1000, 250),
            device(DeviceClass::Simulated, 400, 300),
            // Host memory is not an accelerator's, however full.
            device(DeviceClass::Host, 100, 100),
            // A device that reports no capacity says nothing.
            device(DeviceClass::Nvml, 0, 10),
        ];
        assert_eq!(accelerator_usage_ratio(&devices, false), 0.75);
        assert_eq!(accelerator_usage_ratio(&devices, true), 1.0);
        assert_eq!(accelerator_usage_ratio(&devices[..1], false), 0.25);
        // Nothing to fill: a CPU-only replica.
        assert_eq!(accelerator_usage_ratio(&devices[2..], false), 0.0);
        assert_eq!(accelerator_usage_ratio([], true), 1.0);
        // A driver reading above capacity is clamped.
        assert_eq!(
            accelerator_usage_ratio(&[device(DeviceClass::Nvml, 10, 12)], false),
            1.0
        );
    }

    #[test]
    fn a_failing_source_is_counted_and_the_rest_still_sampled() {
        struct Broken;
        impl MemorySource for Broken {
            fn label(&self) -> &'static str {
                "nvml"
            }
            fn sample(&mut self, _: &mut Reading) -> Result<(), String> {
                Err("GPU is lost".into())
            }
        }
        let (metrics, registry) = Metrics::new("x");
        let store = Arc::new(SnapshotStore::default());
        let mut sampler = Sampler::new(
            vec![Box::new(Broken), Box::new(crate::device::host::HostSource)],
            Vec::new(),
            0,
            Arc::new(metrics),
            store.clone(),
        );
        sampler.sample();
        assert!(store.latest().snapshot.host.mem_total_bytes > 0);
        let text = crate::telemetry::metrics::encode(&registry);
        assert!(
            text.contains("vramguard_exporter_errors_total{source=\"nvml\"} 1\n"),
            "{text}"
        );
    }
}
