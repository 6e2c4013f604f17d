//! Host memory from procfs: `MemTotal`, `MemAvailable` and vramguard's own resident set.

use procfs::Current;
use procfs::process::Process;

use super::reading::{HostMemory, MemorySource, Reading};

/// Reads `/proc/meminfo` and `/proc/self/statm`.
#[derive(Debug, Default)]
pub struct HostSource;

impl MemorySource for HostSource {
    fn label(&self) -> &'static str {
        "host"
    }

    fn sample(&mut self, reading: &mut Reading) -> Result<(), String> {
        let info = procfs::Meminfo::current().map_err(|e| format!("/proc/meminfo: {e}"))?;
        // MemAvailable exists since Linux 3.14; before it, free + page cache is the estimate.
        let available = info.mem_available.unwrap_or(info.mem_free + info.cached + info.buffers);
        let resident = Process::myself()
            .and_then(|p| p.statm())
            .map(|s| s.resident * procfs::page_size())
            .map_err(|e| format!("/proc/self/statm: {e}"))?;
        reading.host = Some(HostMemory {
            total_bytes: info.mem_total,
            available_bytes: available,
            self_resident_bytes: resident,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_plausible_host_memory() {
        let mut reading = Reading::default();
        HostSource.sample(&mut reading).unwrap();
        let host = reading.host.unwrap();
        assert!(host.total_bytes > 0);
        assert!(host.available_bytes <= host.total_bytes);
        assert!(host.self_resident_bytes > 0);
    }
}
