//! Memory sources behind one trait: NVML (NVIDIA GPUs and the processes on them), simulated
//! accelerators, and the host (procfs). The exporter's sampler asks each source for a
//! [`Reading`] and merges them into one [`Snapshot`](crate::core::snapshot::Snapshot). A
//! simulated pool's backend fails as the faults injected into its device say (`faults`).

pub mod faults;
pub mod host;
pub mod nvml;
pub mod procinfo;
mod reading;
pub mod simulated;

pub use reading::{DeviceMemory, DeviceProcess, HostMemory, MemorySource, Reading};

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
