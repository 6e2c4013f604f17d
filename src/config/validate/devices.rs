//! `devices:`: the accelerators, each NVIDIA (found through NVML) or simulated.

use std::collections::HashSet;

use super::Checker;
use crate::config::error::ConfigError;
use crate::config::raw::{RawDevice, RawDeviceKind};
use crate::config::types::{DeviceConfig, DeviceKind, HOST_DEVICE};
use crate::config::units::ByteSize;

/// `devices:`, each named once and never `host`.
pub(super) fn devices(c: &Checker, raw: &[RawDevice]) -> Result<Vec<DeviceConfig>, ConfigError> {
    let mut names = HashSet::new();
    let mut devices = Vec::new();
    for (i, d) in raw.iter().enumerate() {
        let key = format!("devices[{i}]");
        c.unique_name(&mut names, &d.name, format!("{key}.name"))?;
        if d.name == HOST_DEVICE {
            return Err(c.err(format!("{key}.name"), "`host` is reserved for CPU pools"));
        }
        devices.push(DeviceConfig {
            name: d.name.clone(),
            kind: kind(c, &key, d)?,
        });
    }
    // ONNX Runtime allows one environment allocator per memory kind, and the simulated arena
    // is that allocator, so a process can host one simulated device.
    if devices
        .iter()
        .filter(|d| matches!(d.kind, DeviceKind::Simulated { .. }))
        .count()
        > 1
    {
        return Err(c.err(
            "devices",
            "at most one simulated device per process (it is ONNX Runtime's shared CPU arena)",
        ));
    }
    Ok(devices)
}

/// A device's kind with the parameters only that kind takes.
fn kind(c: &Checker, key: &str, d: &RawDevice) -> Result<DeviceKind, ConfigError> {
    match d.kind {
        RawDeviceKind::Nvidia => {
            if d.capacity.is_some() {
                return Err(c.err(
                    format!("{key}.capacity"),
                    "only simulated devices take a capacity; an NVIDIA device reports its own",
                ));
            }
            Ok(DeviceKind::Nvidia {
                index: d.index.unwrap_or(0),
            })
        }
        RawDeviceKind::Simulated => {
            if d.index.is_some() {
                return Err(c.err(format!("{key}.index"), "simulated devices take no index"));
            }
            let capacity = d.capacity.ok_or_else(|| {
                c.err(
                    format!("{key}.capacity"),
                    "a simulated device needs a capacity, e.g. `1GiB`",
                )
            })?;
            Ok(DeviceKind::Simulated {
                capacity: c.at_least(format!("{key}.capacity"), capacity, ByteSize(1 << 20))?,
            })
        }
    }
}
