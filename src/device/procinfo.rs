//! Process identity from procfs (name, command line, cgroup), cached by pid and start time so a
//! 1 Hz sampler does not re-read `/proc` for processes it already knows, and a recycled pid is
//! never mistaken for the process that had it before.

use std::collections::HashMap;

use procfs::process::Process;

/// Name, command line and cgroup path of a process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// `comm`.
    pub name: String,
    /// Command line, space-joined.
    pub cmdline: String,
    /// cgroup path.
    pub cgroup: String,
}

/// A pid → identity cache.
#[derive(Debug, Default)]
pub struct ProcessInspector {
    cache: HashMap<u32, (u64, Identity)>,
}

impl ProcessInspector {
    /// Look a process up; `None` when it is gone (or not visible from this pid namespace).
    pub fn identify(&mut self, pid: u32) -> Option<Identity> {
        let process = Process::new(i32::try_from(pid).ok()?).ok()?;
        let stat = process.stat().ok()?;
        if let Some((start, identity)) = self.cache.get(&pid)
            && *start == stat.starttime
        {
            return Some(identity.clone());
        }
        let cmdline = process.cmdline().map(|c| c.join(" ")).unwrap_or_default();
        let cgroup = process
            .cgroups()
            .ok()
            .and_then(|groups| {
                let groups: Vec<_> = groups.into_iter().collect();
                // Prefer the unified (v2) hierarchy, whose controllers list is empty.
                groups
                    .iter()
                    .find(|g| g.hierarchy == 0)
                    .or(groups.first())
                    .map(|g| g.pathname.clone())
            })
            .unwrap_or_default();
        let identity = Identity {
            name: stat.comm,
            cmdline,
            cgroup,
        };
        self.cache.insert(pid, (stat.starttime, identity.clone()));
        Some(identity)
    }

    /// Forget processes not in `alive` (called once per sample).
    pub fn retain(&mut self, alive: &[u32]) {
        self.cache.retain(|pid, _| alive.contains(pid));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifies_this_process_and_caches_it() {
        let mut inspector = ProcessInspector::default();
        let me = inspector.identify(std::process::id()).unwrap();
        assert!(!me.name.is_empty());
        assert!(!me.cmdline.is_empty());
        assert_eq!(inspector.identify(std::process::id()), Some(me));
        inspector.retain(&[]);
        assert!(inspector.cache.is_empty());
    }

    #[test]
    fn a_missing_process_is_none() {
        assert_eq!(ProcessInspector::default().identify(u32::MAX - 1), None);
    }
}
