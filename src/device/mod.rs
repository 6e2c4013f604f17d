//! Memory sources behind one trait: NVML (NVIDIA GPUs and the processes on them), simulated
//! accelerators, and the host (procfs). The exporter's sampler asks each source for a
//! [`Reading`] and merges them into one [`Snapshot`](crate::snapshot::Snapshot).

pub mod host;
pub mod nvml;
pub mod procinfo;
pub mod simulated;

use std::collections::BTreeMap;

/// Device totals as a source reads them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// `nvml` or `simulated` (the metric label).
    pub kind: crate::snapshot::DeviceClass,
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

/// Why no NVIDIA device can be used, or `Ok(count)` of devices NVML reports.
pub fn nvidia_device_count() -> Result<u32, String> {
    // `Nvml::init` fails cleanly when libnvidia-ml.so.1 is missing: that is the normal
    // "no NVIDIA driver" path on CPU-only machines, not a crash.
    let nvml = nvml_wrapper::Nvml::init().map_err(|e| format!("NVML unavailable (no NVIDIA driver?): {e}"))?;
    nvml.device_count()
        .map_err(|e| format!("NVML device count failed: {e}"))
}

/// True when NVML finds at least one NVIDIA GPU.
pub fn nvidia_gpu_present() -> bool {
    matches!(nvidia_device_count(), Ok(n) if n > 0)
}

/// The names `config` gives NVIDIA devices, by NVML index (unnamed ones are `gpu{index}`).
pub fn nvidia_names(config: &crate::config::Config) -> std::collections::HashMap<u32, String> {
    config
        .devices
        .iter()
        .filter_map(|d| match d.kind {
            crate::config::DeviceKind::Nvidia { index } => Some((index, d.name.clone())),
            crate::config::DeviceKind::Simulated { .. } => None,
        })
        .collect()
}

/// The host source, plus NVML when an NVIDIA driver answers (devices named as `config` names
/// them). Without one, NVML is reported absent once here, not as an error on every sample.
pub fn sources(config: &crate::config::Config) -> Vec<Box<dyn MemorySource>> {
    let mut sources: Vec<Box<dyn MemorySource>> = vec![Box::new(host::HostSource)];
    match nvml::NvmlSource::open(nvidia_names(config)) {
        Ok(source) => sources.push(Box::new(source)),
        Err(reason) => tracing::info!(%reason, "no NVIDIA devices will be reported"),
    }
    sources
}
