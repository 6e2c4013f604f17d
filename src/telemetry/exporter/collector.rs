//! The scrape-time collector: the latest snapshot and the pools' live state encoded on every
//! scrape, one function per group of metrics.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::registry::Unit;

use crate::core::metrics::PoolLabels;
use crate::core::snapshot::{BreakerState, DeviceClass, DeviceState, ProviderKind, Snapshot};
use crate::device::simulated::SimulatedDevice;
use crate::pool::activity::Activity;
use crate::pool::batch::sequences::SequencesNow;
use crate::pool::degraded::{Cause, Degraded};
use crate::pool::{Pool, PoolLoad};
use crate::runtime::onnx::arena::ArenaStats;
use crate::telemetry::exporter::family::{NO_LABELS, family, gauge_family, saturating_i64};
use crate::telemetry::exporter::sampler::pool_arena;
use crate::telemetry::exporter::store::{Sample, SnapshotStore};

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

/// The unit of every byte-valued family.
const BYTES: Option<&Unit> = Some(&Unit::Bytes);

impl Collector for LiveCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sample = self.store.latest();
        encode_devices(&mut encoder, &sample.snapshot)?;
        self.encode_allocators(&mut encoder)?;
        self.encode_queues(&mut encoder)?;
        self.encode_sequences(&mut encoder)?;
        self.encode_breakers(&mut encoder)?;
        if let Some(serving) = &self.serving {
            self.encode_serving(&mut encoder, serving, &sample.snapshot)?;
        }
        encode_host(&mut encoder, &sample)
    }
}

/// Device totals and the processes holding device memory.
fn encode_devices(encoder: &mut DescriptorEncoder, snapshot: &Snapshot) -> Result<(), std::fmt::Error> {
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
    gauge_family(
        encoder,
        "device_memory_total",
        "Device memory capacity",
        BYTES,
        device_rows(|d| d.total_bytes),
    )?;
    gauge_family(
        encoder,
        "device_memory_used",
        "Device memory in use by every process",
        BYTES,
        device_rows(|d| d.used_bytes),
    )?;
    gauge_family(
        encoder,
        "device_memory_free",
        "Device memory not in use",
        BYTES,
        device_rows(|d| d.free_bytes),
    )?;
    gauge_family(
        encoder,
        "process_device_memory",
        "Device memory used by each process, attributed to a service",
        BYTES,
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
    )
}

impl LiveCollector {
    /// Each pool's ONNX Runtime arena, as vramguard's share.
    fn encode_allocators(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
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
            encoder,
            "allocator_reserved",
            "ONNX Runtime arena bytes reserved from the device (TotalAllocated)",
            BYTES,
            arenas
                .iter()
                .map(|(l, s)| (l.clone(), saturating_i64(s.reserved_bytes))),
        )?;
        gauge_family(
            encoder,
            "allocator_active",
            "ONNX Runtime arena bytes held by live tensors (InUse)",
            BYTES,
            arenas.iter().map(|(l, s)| (l.clone(), saturating_i64(s.active_bytes))),
        )?;
        gauge_family(
            encoder,
            "allocator_peak_active",
            "Peak of ONNX Runtime arena bytes in use (MaxInUse)",
            BYTES,
            arenas
                .iter()
                .map(|(l, s)| (l.clone(), saturating_i64(s.peak_active_bytes))),
        )?;
        family(
            encoder,
            "allocator_arena_extensions",
            "Times the ONNX Runtime arena grew (NumArenaExtensions)",
            None,
            arenas.iter().map(|(l, s)| (l.clone(), ConstCounter::new(s.extensions))),
        )?;
        family(
            encoder,
            "allocator_arena_shrinkages",
            "Times the ONNX Runtime arena returned memory to the device (NumArenaShrinkages)",
            None,
            arenas.iter().map(|(l, s)| (l.clone(), ConstCounter::new(s.shrinkages))),
        )
    }

    /// Each pool's queue and the work in flight, read live.
    fn encode_queues(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let loads: Vec<(PoolLabels, PoolLoad)> = self
            .pools
            .iter()
            .map(|p| (PoolLabels::of(p.name()), p.load()))
            .collect();
        gauge_family(
            encoder,
            "queue_depth",
            "Requests waiting in the pool's queue",
            None,
            loads.iter().map(|(l, load)| (l.clone(), load.queue_depth as i64)),
        )?;
        gauge_family(
            encoder,
            "queue_oldest_age",
            "Age of the oldest request waiting in the pool's queue",
            Some(&Unit::Seconds),
            loads.iter().map(|(l, load)| (l.clone(), load.oldest_age.as_secs_f64())),
        )?;
        gauge_family(
            encoder,
            "inflight_requests",
            "Requests being run by the pool's workers",
            None,
            loads.iter().map(|(l, load)| (l.clone(), load.inflight as i64)),
        )
    }

    /// Each pool's text generations and the KV cache they hold.
    fn encode_sequences(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sequences: Vec<(PoolLabels, SequencesNow)> = self
            .pools
            .iter()
            .map(|p| (PoolLabels::of(p.name()), p.sequences.now()))
            .collect();
        gauge_family(
            encoder,
            "sequences_waiting",
            "Text generations accepted for the pool whose prompt's run has not finished",
            None,
            sequences.iter().map(|(l, s)| (l.clone(), saturating_i64(s.waiting))),
        )?;
        gauge_family(
            encoder,
            "sequences_running",
            "Text generations past their prompt, holding a KV cache on the pool",
            None,
            sequences.iter().map(|(l, s)| (l.clone(), saturating_i64(s.running))),
        )?;
        gauge_family(
            encoder,
            "kv_cache",
            "Bytes of the KV caches the pool's running generations hold between runs",
            Some(&Unit::Bytes),
            sequences.iter().map(|(l, s)| (l.clone(), saturating_i64(s.kv_bytes))),
        )
    }

    /// Each pool's circuit breaker.
    fn encode_breakers(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        gauge_family(
            encoder,
            "breaker_state",
            "The pool's circuit breaker: 0 closed, 1 half-open, 2 open",
            None,
            self.pools.iter().map(|p| {
                let state = match p.health().breaker_state() {
                    BreakerState::Closed => 0,
                    BreakerState::HalfOpen => 1,
                    BreakerState::Open => 2,
                };
                (PoolLabels::of(p.name()), state)
            }),
        )
    }

    /// What only `vramguard serve` has: degraded mode, the requests it holds, and the endpoint
    /// picker's usage ratio.
    fn encode_serving(
        &self,
        encoder: &mut DescriptorEncoder,
        serving: &Serving,
        snapshot: &Snapshot,
    ) -> Result<(), std::fmt::Error> {
        let Serving { degraded, activity } = serving;
        let now = degraded.now();
        gauge_family(
            encoder,
            "degraded_mode",
            "1 while the service serves below its normal level (an accelerator pool unavailable, a driver fault, its breaker open, or work moved off it for memory)",
            None,
            std::iter::once((NoLabels {}, i64::from(now.is_some()))),
        )?;
        gauge_family(
            encoder,
            "degraded_info",
            "Why the service is degraded: 1 for the reason it is now, 0 for every other reason (all 0 while it is not)",
            None,
            every_cause().map(|cause| {
                (
                    ReasonLabels {
                        reason: cause.label().to_string(),
                    },
                    i64::from(now.as_ref().is_some_and(|n| n.cause == cause)),
                )
            }),
        )?;
        gauge_family(
            encoder,
            "requests_waiting",
            "Requests accepted whose first run has not started (deferred by the policy or queued, all pools)",
            None,
            [(NO_LABELS, saturating_i64(activity.waiting()))],
        )?;
        gauge_family(
            encoder,
            "requests_running",
            "Requests whose first run has started and that are not answered yet (all pools; a generation from its first step to its last)",
            None,
            [(NO_LABELS, saturating_i64(activity.running()))],
        )?;
        let saturated = now.is_some() || self.accelerators_closed();
        gauge_family(
            encoder,
            "accelerator_memory_usage_ratio",
            "Memory in use over capacity of the fullest accelerator, 0 to 1; 1 while degraded or no accelerator pool can take work",
            None,
            [(NO_LABELS, accelerator_usage_ratio(snapshot.devices.values(), saturated))],
        )
    }
}

/// Host memory and vramguard's own: the families always, their values once a sample has read
/// them (before, an empty family rather than a 0 that would read as "no memory").
fn encode_host(encoder: &mut DescriptorEncoder, sample: &Sample) -> Result<(), std::fmt::Error> {
    let host = &sample.snapshot.host;
    let sampled = sample.taken_at.is_some() && host.mem_total_bytes > 0;
    let value = |bytes: u64| sampled.then_some((NO_LABELS, saturating_i64(bytes)));
    gauge_family(
        encoder,
        "host_memory_available",
        "Host memory available for new work (MemAvailable)",
        BYTES,
        value(host.mem_available_bytes),
    )?;
    gauge_family(
        encoder,
        "host_memory_total",
        "Host memory (MemTotal)",
        BYTES,
        value(host.mem_total_bytes),
    )?;
    gauge_family(
        encoder,
        "host_memory_reserve",
        "Host memory the CPU path keeps free (host.reserve): work that would leave less available is not run",
        BYTES,
        value(host.reserve_bytes),
    )?;
    gauge_family(
        encoder,
        "process_resident_memory",
        "Resident memory of vramguard itself",
        BYTES,
        value(sample.self_resident_bytes),
    )
}
/// Every cause of degraded mode, each exported as a `reason` from the first scrape (a reason
/// that appeared only while it lasted would leave the dashboard and the alerts nothing to
/// start from). A cause added to [`Cause`] fails this match until it is listed here too.
fn every_cause() -> [Cause; 5] {
    let listed = |cause: Cause| match cause {
        Cause::PoolUnavailable
        | Cause::DriverFault
        | Cause::BreakerOpen
        | Cause::MemoryRedirect
        | Cause::WorkerLost => cause,
    };
    [
        Cause::PoolUnavailable,
        Cause::DriverFault,
        Cause::BreakerOpen,
        Cause::MemoryRedirect,
        Cause::WorkerLost,
    ]
    .map(listed)
}
