//! What a memory source reads (device totals, the processes holding device memory, host
//! memory) and the trait every source implements.

use std::collections::BTreeMap;

/// Device totals as a source reads them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// `nvml` or `simulated` (the metric label).
    pub kind: crate::core::snapshot::DeviceClass,
    /// Capacity in bytes.
    pub total_bytes: u64,
    /// Used by every process, in bytes.
    pub used_bytes: u64,
}

/// A process holding device memory, with what is known of its identity.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceProcess {
    /// Process id (0 for the simulated external workload).
    pub pid: u32,
    /// Device name.
    pub device: String,
    /// Device bytes it holds.
    pub used_bytes: u64,
    /// Executable name (`comm`).
    pub name: String,
    /// Full command line, space-joined.
    pub cmdline: String,
    /// cgroup path (the unified hierarchy's, or the first one listed).
    pub cgroup: String,
    /// Service forced by the source (e.g. vramguard itself); otherwise attribution rules decide.
    pub service: Option<String>,
}

/// Host memory as read from procfs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostMemory {
    /// `MemTotal`.
    pub total_bytes: u64,
    /// `MemAvailable`.
    pub available_bytes: u64,
    /// vramguard's own resident set.
    pub self_resident_bytes: u64,
}

/// What one source contributes to a sample.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reading {
    /// Devices by name.
    pub devices: BTreeMap<String, DeviceMemory>,
    /// Processes on those devices.
    pub processes: Vec<DeviceProcess>,
    /// Host memory, from the host source.
    pub host: Option<HostMemory>,
}

/// A source of memory readings. Sources may block (driver calls, procfs), so the sampler runs
/// them off the async runtime.
pub trait MemorySource: Send {
    /// Label for `vramguard_exporter_*{source}` (`nvml`, `simulated`, `host`).
    fn label(&self) -> &'static str;
    /// Add this source's view to `reading`.
    fn sample(&mut self, reading: &mut Reading) -> Result<(), String>;
}
