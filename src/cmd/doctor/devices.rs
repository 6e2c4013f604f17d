//! `nvml` and `attribution`: the NVIDIA devices and who holds their memory, and the simulated
//! devices a running server reports.

use serde_json::{Value, json};

use super::server::ServerProbe;
use super::{Check, GIB, Status};
use crate::config::{Config, DeviceKind, ServiceRule};
use crate::core::human::human_bytes;
use crate::core::snapshot::{DeviceClass, ProcessState};
use crate::device::nvml::{Inventory, NvmlSource};
use crate::device::{MemorySource, Reading};

/// The driver's inventory and one reading of its devices.
pub(super) fn probe_nvml(config: Option<&Config>) -> Result<(Inventory, Reading), String> {
    let names = config.map(crate::device::nvidia_names).unwrap_or_default();
    let mut source = NvmlSource::open(names)?;
    let inventory = source.inventory()?;
    let mut reading = Reading::default();
    source.sample(&mut reading)?;
    Ok((inventory, reading))
}

/// `nvml`: the driver, its devices and the processes on them; simulated devices as such.
pub fn check_nvml(
    nvml: &Result<(Inventory, Reading), String>,
    config: Option<&Config>,
    rules: &[ServiceRule],
) -> Check {
    let configured_nvidia: Vec<(String, u32)> = config
        .map(|c| {
            c.devices
                .iter()
                .filter_map(|d| match d.kind {
                    DeviceKind::Nvidia { index } => Some((d.name.clone(), index)),
                    DeviceKind::Simulated { .. } => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let simulated: Vec<(String, u64)> = config
        .map(|c| {
            c.devices
                .iter()
                .filter_map(|d| match d.kind {
                    DeviceKind::Simulated { capacity } => Some((d.name.clone(), capacity)),
                    DeviceKind::Nvidia { .. } => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let simulated_lines: Vec<String> = simulated
        .iter()
        .map(|(name, capacity)| {
            format!(
                "{name}: SIMULATED accelerator of {} (from the config; no driver involved)",
                human_bytes(*capacity)
            )
        })
        .collect();
    let simulated_data: Vec<Value> = simulated
        .iter()
        .map(|(name, capacity)| json!({"name": name, "capacity_bytes": capacity}))
        .collect();
    let mut check = match nvml {
        Err(reason) if configured_nvidia.is_empty() => {
            Check::new("nvml", Status::Info, format!("no NVIDIA device: {reason}")).data(json!({
                "available": false, "reason": reason, "simulated": simulated_data}))
        }
        Err(reason) => Check::new(
            "nvml",
            Status::Fail,
            format!(
                "the config names NVIDIA devices ({}), none usable: {reason}",
                configured_nvidia.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ")
            ),
        )
        .fix("install the NVIDIA driver (libnvidia-ml.so.1 comes with it); in a container, start it with the NVIDIA Container Toolkit (`--gpus all`)")
        .data(json!({"available": false, "reason": reason, "simulated": simulated_data})),
        Ok((inventory, reading)) => nvml_found(inventory, reading, &configured_nvidia, rules)
            .data(json!({"available": true, "driver_version": inventory.driver_version,
                         "devices": nvml_devices(inventory, reading), "processes": processes(reading, rules),
                         "simulated": simulated_data})),
    };
    for line in simulated_lines {
        check = check.detail(line);
    }
    check
}

/// The devices NVML sees and the processes on them, against the NVIDIA devices the config names.
fn nvml_found(
    inventory: &Inventory,
    reading: &Reading,
    configured_nvidia: &[(String, u32)],
    rules: &[ServiceRule],
) -> Check {
    let count = inventory.devices.len() as u32;
    let missing: Vec<String> = configured_nvidia
        .iter()
        .filter(|(_, index)| *index >= count)
        .map(|(name, index)| format!("`{name}` (index {index})"))
        .collect();
    let mut check = if !missing.is_empty() {
        Check::new(
            "nvml",
            Status::Fail,
            format!(
                "the config names {} but NVML sees {count} device(s)",
                missing.join(", ")
            ),
        )
        .fix("correct `devices[].index` (indices count from 0, in `nvidia-smi -L` order)")
    } else if count == 0 {
        Check::new(
            "nvml",
            Status::Warn,
            format!("driver {} answers but reports no device", inventory.driver_version),
        )
        .fix("check `nvidia-smi`; in a container, pass the devices in (`--gpus all`)")
    } else {
        Check::new(
            "nvml",
            Status::Ok,
            format!("driver {}, {count} device(s)", inventory.driver_version),
        )
    };
    let usage = nvml_usage(reading, rules);
    for device in &inventory.devices {
        let Some(on_it) = usage.iter().find(|u| u.name == device.name) else {
            continue;
        };
        check = check.detail(format!(
            "{} (index {}, {}): {} of {} used, {} process(es)",
            device.name,
            device.index,
            device.product,
            human_bytes(on_it.used_bytes),
            human_bytes(on_it.total_bytes),
            on_it.processes.len()
        ));
        for p in &on_it.processes {
            let name = if p.name.is_empty() {
                "(not visible from here: another PID namespace?)"
            } else {
                p.name.as_str()
            };
            check = check.detail(format!(
                "  pid {} {name}: {} (service {})",
                p.pid,
                human_bytes(p.used_bytes),
                p.service
            ));
        }
    }
    check
}

/// What NVML reports of each device, for the check's data.
fn nvml_devices(inventory: &Inventory, reading: &Reading) -> Vec<Value> {
    inventory
        .devices
        .iter()
        .map(|d| {
            let memory = reading.devices.get(&d.name);
            json!({"name": d.name, "index": d.index, "product": d.product,
                   "total_bytes": memory.map(|m| m.total_bytes), "used_bytes": memory.map(|m| m.used_bytes)})
        })
        .collect()
}

/// Every process on an NVIDIA device, attributed to its service.
fn processes(reading: &Reading, rules: &[ServiceRule]) -> Vec<ProcessState> {
    nvml_usage(reading, rules)
        .into_iter()
        .flat_map(|u| u.processes)
        .collect()
}

/// One device's memory and the processes holding it, from NVML or a running server.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceUsage {
    /// Device name.
    pub name: String,
    /// NVIDIA or simulated.
    pub kind: DeviceClass,
    /// Where the figures come from: `NVML` or `the running server`.
    pub source: &'static str,
    /// Capacity.
    pub total_bytes: u64,
    /// Used, as the device (or the simulated arena) reports it.
    pub used_bytes: u64,
    /// Processes on it, attributed to services.
    pub processes: Vec<ProcessState>,
}

pub(super) fn nvml_usage(reading: &Reading, rules: &[ServiceRule]) -> Vec<DeviceUsage> {
    reading
        .devices
        .iter()
        .map(|(name, memory)| DeviceUsage {
            name: name.clone(),
            kind: memory.kind,
            source: "NVML",
            total_bytes: memory.total_bytes,
            used_bytes: memory.used_bytes,
            processes: reading
                .processes
                .iter()
                .filter(|p| &p.device == name)
                .map(|p| ProcessState {
                    pid: p.pid,
                    name: p.name.clone(),
                    service: crate::telemetry::exporter::attribute(rules, p),
                    device: p.device.clone(),
                    used_bytes: p.used_bytes,
                })
                .collect(),
        })
        .collect()
}

/// Devices the running server reports (its `/status`) that this process does not see itself:
/// simulated devices live only in the server.
pub(super) fn server_usage(server: &ServerProbe, seen: &[DeviceUsage]) -> Vec<DeviceUsage> {
    let Some(Ok(status)) = server.status() else {
        return Vec::new();
    };
    status
        .devices
        .iter()
        .filter(|(name, _)| !seen.iter().any(|d| &d.name == *name))
        .map(|(name, d)| DeviceUsage {
            name: name.clone(),
            kind: d.memory.kind,
            source: "the running server",
            total_bytes: d.memory.total_bytes,
            used_bytes: d.memory.used_bytes,
            processes: status.processes.iter().filter(|p| &p.device == name).cloned().collect(),
        })
        .collect()
}

/// `attribution`: on each device, what processes hold adds up to at most what is used; the
/// rest is unattributed (driver and context overhead, or processes NVML cannot name).
pub fn check_attribution(devices: &[DeviceUsage]) -> Check {
    if devices.is_empty() {
        return Check::new(
            "attribution",
            Status::Info,
            "nothing to attribute: no NVIDIA device here, and no running server reports a simulated one",
        )
        .data(json!({"devices": []}));
    }
    let mut status = Status::Ok;
    let mut fix = None;
    let mut lines = Vec::new();
    let mut data = Vec::new();
    for device in devices {
        let attributed: u64 = device.processes.iter().map(|p| p.used_bytes).sum();
        let mut by_service: std::collections::BTreeMap<&str, u64> = std::collections::BTreeMap::new();
        for p in &device.processes {
            *by_service.entry(p.service.as_str()).or_default() += p.used_bytes;
        }
        let services = by_service
            .iter()
            .map(|(s, b)| format!("{s} {}", human_bytes(*b)))
            .collect::<Vec<_>>()
            .join(", ");
        let kind = if device.kind == DeviceClass::Simulated {
            "SIMULATED"
        } else {
            "NVIDIA"
        };
        let unattributed = device.used_bytes.saturating_sub(attributed);
        if attributed > device.used_bytes {
            status = Status::Fail;
            fix = Some("report this output: the per-process figures exceed the device total, so they cannot be trusted (MIG or vGPU partitions are one known cause)".to_string());
            lines.push(format!(
                "{} ({kind}, from {}): processes hold {}, more than the {} the device has in use",
                device.name,
                device.source,
                human_bytes(attributed),
                human_bytes(device.used_bytes)
            ));
        } else {
            lines.push(format!(
                "{} ({kind}, from {}): {} used = {} held by {} process(es){} + {} unattributed",
                device.name,
                device.source,
                human_bytes(device.used_bytes),
                human_bytes(attributed),
                device.processes.len(),
                if services.is_empty() {
                    String::new()
                } else {
                    format!(" ({services})")
                },
                human_bytes(unattributed)
            ));
            if device.processes.is_empty() && device.used_bytes > GIB && status < Status::Warn {
                status = Status::Warn;
                fix = Some("NVML names no process although memory is in use: in a container, share the host's PID namespace (`--pid=host`) so vramguard can see who holds it".to_string());
            }
        }
        data.push(
            json!({"device": device.name, "kind": device.kind, "source": device.source,
                         "total_bytes": device.total_bytes, "used_bytes": device.used_bytes,
                         "attributed_bytes": attributed, "unattributed_bytes": unattributed,
                         "processes": device.processes, "by_service": by_service}),
        );
    }
    let summary = match status {
        Status::Fail => "per-process memory exceeds the device total".to_string(),
        Status::Warn => "memory in use that no process accounts for".to_string(),
        _ => format!(
            "per-process memory is within each device's total on {} device(s)",
            devices.len()
        ),
    };
    let mut check = Check::new("attribution", status, summary).data(json!({"devices": data}));
    check.details = lines;
    check.fix = fix;
    check
}
