//! The simulated accelerator: a capacity enforced by ONNX Runtime's capped arena (shared by every
//! simulated pool in the process), external pressure held as a real allocation in that arena,
//! and a memory source reporting both, labelled `simulated`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ort::memory::{AllocationDevice, Allocator, AllocatorType, MemoryInfo, MemoryType};
use ort::session::Session;

use super::procinfo::ProcessInspector;
use super::reading::{DeviceMemory, DeviceProcess, MemorySource, Reading};
use crate::config::Provider;
use crate::core::backend::{AllocFailureKind, BackendError};
use crate::core::model::BuiltinModel;
use crate::runtime::onnx::arena::{ArenaHold, ArenaStats};
use crate::runtime::onnx::{self, OnnxRuntime, SessionOptions};

/// Name of the pseudo-process that stands for external pressure in process listings.
pub const PRESSURE_PROCESS: &str = "simulated-pressure";

/// What a simulated device held in another process (a process-isolated pool's worker) reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceState {
    /// Bytes the external pressure holds.
    pub pressure: u64,
    /// Injected allocator failures still to come.
    pub fail_next: u64,
    /// Runs still to pass before them.
    pub pass_first: u64,
    /// A driver fault is in effect (in a worker process: until it is replaced).
    pub driver_reset: bool,
    /// The arena's statistics, pressure included.
    pub arena: Option<ArenaStats>,
}

/// A change to a simulated device held in another process: only what is given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceChange {
    /// External pressure to hold, bytes.
    pub pressure: Option<u64>,
    /// The next N runs fail with an allocator failure.
    pub fail_next: Option<u64>,
    /// Runs that pass before those fail.
    pub pass_first: Option<u64>,
    /// Set (or, here, clear) a driver fault; in a worker process it cannot be cleared: the
    /// process must be replaced.
    pub driver_reset: Option<bool>,
    /// The process stops answering (its heartbeat finds it hung).
    pub hang: bool,
}

/// The way to a simulated device whose arena lives in a worker process.
pub trait DeviceLink: Send + Sync + std::fmt::Debug {
    /// Its state now.
    fn state(&self) -> Result<DeviceState, String>;
    /// Change it.
    fn change(&self, change: DeviceChange) -> Result<DeviceState, String>;
    /// The process holding it: its pid and how it is listed.
    fn process(&self) -> Option<(u32, String)>;
}

/// A simulated device.
#[derive(Debug)]
pub struct SimulatedDevice {
    /// Device name.
    pub name: String,
    /// Capacity in bytes (the arena's cap).
    pub capacity: u64,
    /// The arena's hold, when the arena is in this process.
    hold: Option<Mutex<ArenaHold>>,
    /// The worker process holding the arena, when it is elsewhere.
    link: std::sync::RwLock<Option<Arc<dyn DeviceLink>>>,
    /// The pressure last asked of a linked device.
    wanted_pressure: AtomicU64,
    /// Our sessions' peak, tracked across pressure changes ([`SimulatedDevice::ours`]).
    peaks: Mutex<PeakTrack>,
    /// Injected faults: the next N runs fail with an allocator failure.
    fail_next: AtomicU64,
    /// Runs that pass before the `fail_next` ones fail (places a failure mid-generation).
    pass_first: AtomicU64,
    /// Injected fault: every run fails with a driver-class error until cleared (or restored).
    driver_reset: AtomicBool,
    // Keeps the allocator's session alive; the allocator belongs to it.
    _session: Option<Session>,
}

impl SimulatedDevice {
    /// Register the capped arena (once per process) and open a handle on it for pressure and
    /// statistics.
    pub fn open(rt: &OnnxRuntime, name: &str, capacity: u64) -> Result<SimulatedDevice, String> {
        rt.ensure_simulated_arena(capacity).map_err(|e| e.to_string())?;
        // Any session using the environment's allocators hands out the shared arena; the
        // smallest bundled model costs a few kilobytes of it.
        let options = SessionOptions {
            provider: Provider::Simulated,
            device_index: 0,
            intra_threads: 1,
            arena_shrinkage: false,
            quiet: false,
        };
        let session = onnx::build_session(rt, BuiltinModel::Classifier.bytes(), &options)?;
        let info = MemoryInfo::new(AllocationDevice::CPU, 0, AllocatorType::Arena, MemoryType::Default)
            .map_err(|e| e.to_string())?;
        let allocator = Allocator::new(&session, info).map_err(|e| e.to_string())?;
        Ok(SimulatedDevice {
            hold: Some(Mutex::new(ArenaHold::new(allocator))),
            _session: Some(session),
            ..SimulatedDevice::linked(name, capacity)
        })
    }

    /// A device whose arena a worker process holds: it answers through the link
    /// [`attached`](SimulatedDevice::attach) once that process runs.
    pub fn linked(name: &str, capacity: u64) -> SimulatedDevice {
        SimulatedDevice {
            name: name.to_string(),
            capacity,
            hold: None,
            link: std::sync::RwLock::new(None),
            wanted_pressure: AtomicU64::new(0),
            peaks: Mutex::new(PeakTrack::default()),
            fail_next: AtomicU64::new(0),
            pass_first: AtomicU64::new(0),
            driver_reset: AtomicBool::new(false),
            _session: None,
        }
    }

    /// Reach a linked device's arena through `link`.
    pub fn attach(&self, link: Arc<dyn DeviceLink>) {
        *self.link.write().unwrap_or_else(|e| e.into_inner()) = Some(link);
    }

    /// Whether its arena is in another process.
    pub fn is_linked(&self) -> bool {
        self.hold.is_none()
    }

    fn linked_to(&self) -> Result<Arc<dyn DeviceLink>, String> {
        self.link
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| format!("simulated device `{}`: its worker process has not started", self.name))
    }

    /// The process that holds its arena and how it is listed (this one, when local).
    pub fn holder(&self) -> Option<(u32, String)> {
        match self.hold {
            Some(_) => None,
            None => self.linked_to().ok()?.process(),
        }
    }

    fn hold(&self) -> Result<std::sync::MutexGuard<'_, ArenaHold>, String> {
        let hold = self.hold.as_ref().ok_or_else(|| {
            format!(
                "simulated device `{}` is held by its pool's worker process, not here",
                self.name
            )
        })?;
        Ok(hold.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Bytes held by the simulated external workload.
    pub fn pressure(&self) -> u64 {
        match self.hold() {
            Ok(hold) => hold.bytes(),
            Err(_) => self.wanted_pressure.load(Ordering::Relaxed),
        }
    }

    /// Apply `change`: here, or in the worker process that holds the arena. A linked device's
    /// driver fault is sticky: only replacing its worker clears it.
    pub fn apply(&self, change: DeviceChange) -> Result<DeviceState, String> {
        if self.is_linked() {
            if change.driver_reset == Some(false) {
                return Err(format!(
                    "a driver fault in `{}`'s worker process is sticky, as a CUDA error is: POST /admin/pools/{{pool}}/restore replaces the worker",
                    self.name
                ));
            }
            if let Some(bytes) = change.pressure {
                self.check_pressure(bytes)?;
                self.wanted_pressure.store(bytes, Ordering::Relaxed);
            }
            return self.linked_to()?.change(change);
        }
        if let Some(bytes) = change.pressure {
            self.set_pressure(bytes)?;
        }
        if let Some(n) = change.pass_first {
            self.pass_first(n);
        }
        if let Some(n) = change.fail_next {
            self.fail_next(n);
        }
        if let Some(reset) = change.driver_reset {
            self.set_driver_reset(reset);
        }
        Ok(self.state())
    }

    /// Its state now (a linked device's, as its worker process reports it).
    pub fn state(&self) -> DeviceState {
        if self.is_linked() {
            return self.linked_to().and_then(|l| l.state()).unwrap_or(DeviceState {
                pressure: self.pressure(),
                ..DeviceState::default()
            });
        }
        DeviceState {
            pressure: self.pressure(),
            fail_next: self.fail_next.load(Ordering::SeqCst),
            pass_first: self.pass_first.load(Ordering::SeqCst),
            driver_reset: self.driver_reset.load(Ordering::SeqCst),
            arena: self.arena_stats().ok(),
        }
    }

    fn check_pressure(&self, bytes: u64) -> Result<(), String> {
        if bytes > self.capacity {
            return Err(format!(
                "pressure of {bytes} bytes exceeds the simulated capacity of {} bytes",
                self.capacity
            ));
        }
        Ok(())
    }

    /// Set the external workload's bytes (0 releases them).
    pub fn set_pressure(&self, bytes: u64) -> Result<(), String> {
        self.check_pressure(bytes)?;
        if self.is_linked() {
            return self
                .apply(DeviceChange {
                    pressure: Some(bytes),
                    ..DeviceChange::default()
                })
                .map(drop);
        }
        self.hold()?.set(bytes).map_err(|e| {
            format!(
                "the simulated arena cannot hold {bytes} bytes now (vramguard's arena keeps part of it reserved): {}",
                crate::runtime::onnx::concise(&e)
            )
        })
    }

    /// Make the next `n` runs on this device fail with an allocator failure (0 clears).
    pub fn fail_next(&self, n: u64) {
        self.fail_next.store(n, Ordering::SeqCst);
    }

    /// Let the next `n` runs pass before the [`SimulatedDevice::fail_next`] ones fail.
    pub fn pass_first(&self, n: u64) {
        self.pass_first.store(n, Ordering::SeqCst);
    }

    /// Runs still to pass before injected failures start.
    pub fn passes_pending(&self) -> u64 {
        self.pass_first.load(Ordering::SeqCst)
    }

    /// Runs still to fail from [`SimulatedDevice::fail_next`].
    pub fn failures_pending(&self) -> u64 {
        self.fail_next.load(Ordering::SeqCst)
    }

    /// Simulate a driver reset: every run fails with a driver-class error until cleared.
    pub fn set_driver_reset(&self, reset: bool) {
        self.driver_reset.store(reset, Ordering::SeqCst);
    }

    /// Whether a simulated driver reset is in effect.
    pub fn driver_reset(&self) -> bool {
        self.driver_reset.load(Ordering::SeqCst)
    }

    /// The injected failure the next run gets, if any (consumes one `fail_next`).
    pub(super) fn injected_failure(&self) -> Option<BackendError> {
        if self.driver_reset() {
            return Some(BackendError::Allocation {
                kind: AllocFailureKind::Driver,
                message: format!(
                    "simulated driver reset on device `{}` (fault injection; cleared by a restore)",
                    self.name
                ),
            });
        }
        if self.fail_next.load(Ordering::SeqCst) > 0
            && self
                .pass_first
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            return None;
        }
        let took = self
            .fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        took.then(|| BackendError::Allocation {
            kind: AllocFailureKind::Oom,
            message: format!(
                "simulated allocator failure on device `{}` (fault injection: fail_next)",
                self.name
            ),
        })
    }

    /// Refuse what made the arena hold more than the capacity. ONNX Runtime's arena places a
    /// session's weights with `Reserve`, which its cap does not check, so loading more weights
    /// than a device holds would succeed here where `cudaMalloc` fails on a GPU: `what` (a
    /// load) is checked after the fact and fails as a GPU's would.
    pub fn check_capacity(&self, what: &str) -> Result<(), String> {
        let stats = self.arena_stats()?;
        if stats.reserved_bytes <= self.capacity {
            return Ok(());
        }
        Err(format!(
            "simulated out of memory on device `{}`: {what} took its arena to {} bytes, over the capacity of {} bytes",
            self.name, stats.reserved_bytes, self.capacity
        ))
    }

    /// The shared arena's statistics (pressure included).
    pub fn arena_stats(&self) -> Result<ArenaStats, String> {
        if self.is_linked() {
            let state = self.linked_to()?.state()?;
            return state
                .arena
                .ok_or_else(|| format!("simulated device `{}`: its worker reports no arena", self.name));
        }
        self.hold()?.stats()
    }

    /// The arena's statistics with the pressure taken out: what vramguard's pools hold.
    pub fn pool_stats(&self) -> Result<ArenaStats, String> {
        if self.is_linked() {
            let state = self.linked_to()?.state()?;
            let stats = state
                .arena
                .ok_or_else(|| format!("simulated device `{}`: its worker reports no arena", self.name))?;
            return Ok(self.ours(stats, state.pressure));
        }
        let (stats, pressure) = {
            let hold = self.hold()?;
            (hold.stats()?, hold.bytes())
        };
        Ok(self.ours(stats, pressure))
    }

    /// `raw` statistics of the shared arena, read while the pressure held `pressure`, as what
    /// vramguard's sessions hold: the pressure taken out of what is reserved and in use, and
    /// the peak ours only. The arena's peak is all-time, pressure included, so with the
    /// pressure lowered since, "peak less pressure now" would credit our sessions with the old
    /// pressure (and a run measured across the change with needing it): our peak moves only
    /// when the arena's does under the same pressure.
    pub fn ours(&self, raw: ArenaStats, pressure: u64) -> ArenaStats {
        let mut track = self.peaks.lock().unwrap_or_else(|e| e.into_inner());
        let active = raw.active_bytes.saturating_sub(pressure);
        if track.pressure != Some(pressure) {
            track.pressure = Some(pressure);
            track.arena_peak = raw.peak_active_bytes;
            if track.ours == 0 {
                track.ours = raw.peak_active_bytes.saturating_sub(pressure);
            }
        } else if raw.peak_active_bytes > track.arena_peak {
            track.arena_peak = raw.peak_active_bytes;
            track.ours = track.ours.max(raw.peak_active_bytes.saturating_sub(pressure));
        }
        track.ours = track.ours.max(active);
        ArenaStats {
            peak_active_bytes: track.ours,
            ..without_pressure(raw, pressure)
        }
    }
}

/// What [`SimulatedDevice::ours`] remembers: the pressure of the last reading, the arena's
/// peak then, and our sessions' peak so far.
#[derive(Debug, Default)]
struct PeakTrack {
    pressure: Option<u64>,
    arena_peak: u64,
    ours: u64,
}

/// `stats` of the shared arena with `pressure` (the simulated external workload, held in it)
/// taken out of what is reserved, in use and the peak: what vramguard's sessions hold. A run's
/// measured need is its new peak less what was in use before; with the pressure in both, a
/// run that set the peak would count the pressure too.
fn without_pressure(stats: ArenaStats, pressure: u64) -> ArenaStats {
    ArenaStats {
        reserved_bytes: stats.reserved_bytes.saturating_sub(pressure),
        active_bytes: stats.active_bytes.saturating_sub(pressure),
        peak_active_bytes: stats.peak_active_bytes.saturating_sub(pressure),
        ..stats
    }
}

/// Reports a simulated device: used = the arena's reserved bytes (ours and the pressure).
#[derive(Debug)]
pub struct SimulatedSource {
    device: Arc<SimulatedDevice>,
    inspector: ProcessInspector,
    /// A linked device's last reading: pressure and arena.
    last: Option<(u64, ArenaStats)>,
}

impl SimulatedSource {
    /// A source for `device`.
    pub fn new(device: Arc<SimulatedDevice>) -> Self {
        Self {
            device,
            inspector: ProcessInspector::default(),
            last: None,
        }
    }
}

impl MemorySource for SimulatedSource {
    fn label(&self) -> &'static str {
        "simulated"
    }

    fn sample(&mut self, reading: &mut Reading) -> Result<(), String> {
        let device = &self.device;
        let (pressure, stats) = if device.is_linked() {
            // While its worker is replaced the device is still there: its last reading stands
            // (a device missing from the snapshot would fail every policy that reads it).
            let state = device.state();
            match (state.arena, self.last) {
                (Some(stats), _) => {
                    self.last = Some((state.pressure, stats));
                    (state.pressure, stats)
                }
                (None, Some(last)) => last,
                (None, None) => {
                    return Err(format!(
                        "simulated device `{}`: its worker process does not answer",
                        device.name
                    ));
                }
            }
        } else {
            (device.pressure(), device.arena_stats()?)
        };
        let used = stats.reserved_bytes.max(pressure).min(device.capacity);
        reading.devices.insert(
            device.name.clone(),
            DeviceMemory {
                kind: crate::core::snapshot::DeviceClass::Simulated,
                total_bytes: device.capacity,
                used_bytes: used,
            },
        );
        // The process whose sessions hold the arena: ours, or the pool's worker process.
        let (pid, listed) = device
            .holder()
            .map_or((std::process::id(), None), |(pid, name)| (pid, Some(name)));
        let identity = self.inspector.identify(pid).unwrap_or_default();
        reading.processes.push(DeviceProcess {
            pid,
            device: device.name.clone(),
            used_bytes: used.saturating_sub(pressure),
            name: listed.unwrap_or(identity.name),
            cmdline: identity.cmdline,
            cgroup: identity.cgroup,
            service: Some("vramguard".into()),
        });
        if pressure > 0 {
            reading.processes.push(DeviceProcess {
                pid: 0,
                device: device.name.clone(),
                used_bytes: pressure,
                name: PRESSURE_PROCESS.into(),
                service: Some("simulated".into()),
                ..DeviceProcess::default()
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(peak: u64, active: u64) -> ArenaStats {
        ArenaStats {
            reserved_bytes: peak,
            active_bytes: active,
            peak_active_bytes: peak,
            ..ArenaStats::default()
        }
    }

    #[test]
    fn our_peak_moves_only_when_the_arenas_does_under_the_same_pressure() {
        let device = SimulatedDevice::linked("sim0", 100 << 20);
        assert_eq!(device.ours(raw(10, 5), 0).peak_active_bytes, 10);
        // Pressure of 80 comes and goes; the arena's all-time peak keeps it.
        assert_eq!(device.ours(raw(90, 85), 80).peak_active_bytes, 10);
        let after = device.ours(raw(90, 6), 0);
        assert_eq!(
            (after.peak_active_bytes, after.active_bytes),
            (10, 6),
            "not the old pressure"
        );
        // A run of ours that takes the arena past its peak sets ours.
        assert_eq!(device.ours(raw(95, 6), 0).peak_active_bytes, 95);
        // Under pressure, a new arena peak is ours less the pressure.
        assert_eq!(device.ours(raw(95, 40), 30).peak_active_bytes, 95);
        assert_eq!(device.ours(raw(140, 40), 30).peak_active_bytes, 110);
    }
}
