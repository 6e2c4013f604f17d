//! Accelerator devices. For now: whether NVML sees an NVIDIA GPU. The memory sources of the
//! exporter (NVML, simulated, host) grow here.

use nvml_wrapper::Nvml;

/// Why no NVIDIA device can be used, or `Ok(count)` of devices NVML reports.
pub fn nvidia_device_count() -> Result<u32, String> {
    // `Nvml::init` fails cleanly when libnvidia-ml.so.1 is missing: that is the normal
    // "no NVIDIA driver" path on CPU-only machines, not a crash.
    let nvml = Nvml::init().map_err(|e| format!("NVML unavailable (no NVIDIA driver?): {e}"))?;
    nvml.device_count()
        .map_err(|e| format!("NVML device count failed: {e}"))
}

/// True when NVML finds at least one NVIDIA GPU.
pub fn nvidia_gpu_present() -> bool {
    matches!(nvidia_device_count(), Ok(n) if n > 0)
}
