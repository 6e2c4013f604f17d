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
use crate::core::backend::{AllocFailureKind, Backend, BackendError, RunMeta};
use crate::core::model::BuiltinModel;
use crate::core::tensor::Tensor;
use crate::runtime::onnx::arena::{ArenaHold, ArenaStats};
use crate::runtime::onnx::{self, OnnxRuntime, SessionOptions};

/// Name of the pseudo-process that stands for external pressure in process listings.
pub const PRESSURE_PROCESS: &str = "simulated-pressure";

/// A simulated device.
#[derive(Debug)]
pub struct SimulatedDevice {
    /// Device name.
    pub name: String,
    /// Capacity in bytes (the arena's cap).
    pub capacity: u64,
    hold: Mutex<ArenaHold>,
    /// Injected faults: the next N runs fail with an allocator failure.
    fail_next: AtomicU64,
    /// Runs that pass before the `fail_next` ones fail (places a failure mid-generation).
    pass_first: AtomicU64,
    /// Injected fault: every run fails with a driver-class error until cleared (or restored).
    driver_reset: AtomicBool,
    // Keeps the allocator's session alive; the allocator belongs to it.
    _session: Session,
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
            name: name.to_string(),
            capacity,
            hold: Mutex::new(ArenaHold::new(allocator)),
            fail_next: AtomicU64::new(0),
            pass_first: AtomicU64::new(0),
            driver_reset: AtomicBool::new(false),
            _session: session,
        })
    }

    fn hold(&self) -> std::sync::MutexGuard<'_, ArenaHold> {
        self.hold.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes held by the simulated external workload.
    pub fn pressure(&self) -> u64 {
        self.hold().bytes()
    }

    /// Set the external workload's bytes (0 releases them).
    pub fn set_pressure(&self, bytes: u64) -> Result<(), String> {
        if bytes > self.capacity {
            return Err(format!(
                "pressure of {bytes} bytes exceeds the simulated capacity of {} bytes",
                self.capacity
            ));
        }
        self.hold().set(bytes).map_err(|e| {
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
    fn injected_failure(&self) -> Option<BackendError> {
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
        self.hold().stats()
    }

    /// The arena's statistics with the pressure taken out: what vramguard's pools hold.
    pub fn pool_stats(&self) -> Result<ArenaStats, String> {
        let hold = self.hold();
        let pressure = hold.bytes();
        let stats = hold.stats()?;
        Ok(without_pressure(stats, pressure))
    }
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

/// A simulated pool's backend: runs on the capped arena, and fails when a fault is injected
/// into its device (`POST /admin/sim/{device}` with `fail_next` or `driver_reset`).
pub struct FaultInjecting {
    inner: Box<dyn Backend>,
    device: Arc<SimulatedDevice>,
    /// The arena's statistics at the last refresh, the pressure of that moment taken out.
    stats: Option<ArenaStats>,
}

impl FaultInjecting {
    /// Wrap `inner`, which runs on `device`.
    pub fn new(inner: Box<dyn Backend>, device: Arc<SimulatedDevice>) -> Self {
        let stats = inner.arena_stats().map(|s| without_pressure(s, device.pressure()));
        Self { inner, device, stats }
    }

    fn keep_stats(&mut self) {
        self.stats = self
            .inner
            .arena_stats()
            .map(|s| without_pressure(s, self.device.pressure()));
    }
}

impl Backend for FaultInjecting {
    fn run(
        &mut self,
        model: &str,
        inputs: Vec<Tensor>,
        outputs: &[String],
        meta: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        match self.device.injected_failure() {
            Some(error) => Err(error),
            None => self.inner.run(model, inputs, outputs, meta),
        }
    }

    fn arena_stats(&self) -> Option<ArenaStats> {
        self.stats
    }

    fn refresh_arena_stats(&mut self) {
        self.inner.refresh_arena_stats();
        self.keep_stats();
    }

    fn refresh_arena_stats_for(&mut self, model: &str) {
        self.inner.refresh_arena_stats_for(model);
        self.keep_stats();
    }

    fn interrupt_handle(&self) -> Option<crate::core::backend::Interrupt> {
        self.inner.interrupt_handle()
    }

    fn clear_interrupt(&mut self) {
        self.inner.clear_interrupt();
    }

    fn load_model(&mut self, name: &str, bytes: &[u8]) -> Result<(), String> {
        self.inner.load_model(name, bytes)?;
        self.device
            .check_capacity(&format!("loading `{name}`"))
            .inspect_err(|_| {
                self.inner.unload_model(name);
            })
    }

    fn unload_model(&mut self, name: &str) {
        self.inner.unload_model(name);
    }

    fn release_memory(&mut self, probe: &dyn Fn(&str) -> Option<Vec<Tensor>>) {
        self.inner.release_memory(probe);
    }
}

/// Reports a simulated device: used = the arena's reserved bytes (ours and the pressure).
#[derive(Debug)]
pub struct SimulatedSource {
    device: Arc<SimulatedDevice>,
    inspector: ProcessInspector,
}

impl SimulatedSource {
    /// A source for `device`.
    pub fn new(device: Arc<SimulatedDevice>) -> Self {
        Self {
            device,
            inspector: ProcessInspector::default(),
        }
    }
}

impl MemorySource for SimulatedSource {
    fn label(&self) -> &'static str {
        "simulated"
    }

    fn sample(&mut self, reading: &mut Reading) -> Result<(), String> {
        let device = &self.device;
        let pressure = device.pressure();
        let stats = device.arena_stats()?;
        let used = stats.reserved_bytes.max(pressure).min(device.capacity);
        reading.devices.insert(
            device.name.clone(),
            DeviceMemory {
                kind: crate::core::snapshot::DeviceClass::Simulated,
                total_bytes: device.capacity,
                used_bytes: used,
            },
        );
        let me = std::process::id();
        let identity = self.inspector.identify(me).unwrap_or_default();
        reading.processes.push(DeviceProcess {
            pid: me,
            device: device.name.clone(),
            used_bytes: used.saturating_sub(pressure),
            name: identity.name,
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
