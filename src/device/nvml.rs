//! NVIDIA GPUs through NVML: each device's total/used/free and every compute and graphics
//! process on it with its used memory; identities come from procfs.

use std::collections::HashMap;

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;

use super::procinfo::ProcessInspector;
use super::reading::{DeviceMemory, DeviceProcess, MemorySource, Reading};

/// Samples every NVIDIA device NVML reports.
pub struct NvmlSource {
    nvml: Nvml,
    /// Configured names by NVML index; unnamed devices are `gpu{index}`.
    names: HashMap<u32, String>,
    inspector: ProcessInspector,
}

impl std::fmt::Debug for NvmlSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlSource")
            .field("names", &self.names)
            .finish_non_exhaustive()
    }
}

impl NvmlSource {
    /// Open NVML. `Err` is the normal "no NVIDIA driver" answer on machines without a GPU; the
    /// caller logs it once and runs without this source.
    pub fn open(names: HashMap<u32, String>) -> Result<NvmlSource, String> {
        let nvml = Nvml::init().map_err(|e| format!("NVML unavailable (no NVIDIA driver?): {e}"))?;
        Ok(NvmlSource {
            nvml,
            names,
            inspector: ProcessInspector::default(),
        })
    }

    /// The device name for an NVML index.
    pub fn device_name(&self, index: u32) -> String {
        self.names.get(&index).cloned().unwrap_or_else(|| format!("gpu{index}"))
    }

    /// The driver version and every device NVML reports, for `vramguard doctor`.
    pub fn inventory(&self) -> Result<Inventory, String> {
        let driver_version = self
            .nvml
            .sys_driver_version()
            .map_err(|e| format!("driver version: {e}"))?;
        let count = self.nvml.device_count().map_err(|e| format!("device count: {e}"))?;
        let devices = (0..count)
            .map(|index| {
                let product = self
                    .nvml
                    .device_by_index(index)
                    .and_then(|d| d.name())
                    .map_err(|e| format!("device {index}: {e}"))?;
                Ok(NvidiaDevice {
                    index,
                    name: self.device_name(index),
                    product,
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(Inventory {
            driver_version,
            devices,
        })
    }
}

/// What NVML says is installed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inventory {
    /// The kernel driver's version, e.g. `550.54.15`.
    pub driver_version: String,
    /// Every device, by index.
    pub devices: Vec<NvidiaDevice>,
}

/// One NVIDIA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvidiaDevice {
    /// NVML index.
    pub index: u32,
    /// The name vramguard gives it (the config's, else `gpu{index}`).
    pub name: String,
    /// Product name, e.g. `NVIDIA H200`.
    pub product: String,
}

impl MemorySource for NvmlSource {
    fn label(&self) -> &'static str {
        "nvml"
    }

    fn sample(&mut self, reading: &mut Reading) -> Result<(), String> {
        let count = self.nvml.device_count().map_err(|e| format!("device count: {e}"))?;
        let mut alive = Vec::new();
        for index in 0..count {
            let name = self.device_name(index);
            let device = self
                .nvml
                .device_by_index(index)
                .map_err(|e| format!("device {index}: {e}"))?;
            let memory = device.memory_info().map_err(|e| format!("{name} memory: {e}"))?;
            reading.devices.insert(
                name.clone(),
                DeviceMemory {
                    kind: crate::core::snapshot::DeviceClass::Nvml,
                    total_bytes: memory.total,
                    used_bytes: memory.used,
                },
            );
            // A process with both compute and graphics contexts is listed twice; count it once.
            let mut seen: HashMap<u32, u64> = HashMap::new();
            let compute = device
                .running_compute_processes()
                .map_err(|e| format!("{name} compute processes: {e}"))?;
            let graphics = device.running_graphics_processes().unwrap_or_default();
            for p in compute.into_iter().chain(graphics) {
                let used = match p.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => bytes,
                    UsedGpuMemory::Unavailable => 0,
                };
                let entry = seen.entry(p.pid).or_insert(0);
                *entry = (*entry).max(used);
            }
            for (pid, used_bytes) in seen {
                alive.push(pid);
                let identity = self.inspector.identify(pid).unwrap_or_default();
                reading.processes.push(DeviceProcess {
                    pid,
                    device: name.clone(),
                    used_bytes,
                    name: identity.name,
                    cmdline: identity.cmdline,
                    cgroup: identity.cgroup,
                    service: None,
                });
            }
        }
        self.inspector.retain(&alive);
        Ok(())
    }
}
