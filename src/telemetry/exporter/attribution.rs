//! Which service a process on a device belongs to: the label `vramguard_process_device_memory_bytes`
//! carries, from the rules in the config.

use crate::config::{ServiceMatch, ServiceRule};
use crate::device::DeviceProcess;

/// The service label of processes no rule matches.
pub const UNMATCHED_SERVICE: &str = "other";

/// The service a process belongs to: what its source says (vramguard itself, simulated
/// pressure), else the first matching rule, else `other`.
pub fn attribute(rules: &[ServiceRule], process: &DeviceProcess) -> String {
    if let Some(service) = &process.service {
        return service.clone();
    }
    rules
        .iter()
        .find(|rule| match &rule.matcher {
            ServiceMatch::ProcessName(name) => &process.name == name,
            ServiceMatch::Cmdline(re) => re.is_match(&process.cmdline),
            ServiceMatch::Cgroup(re) => re.is_match(&process.cgroup),
        })
        .map_or_else(|| UNMATCHED_SERVICE.to_string(), |rule| rule.service.clone())
}
