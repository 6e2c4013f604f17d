//! Folders vramguard makes for itself in the temp directory (a pool's worker sockets, the
//! drill's models), named `vramguard-<kind>-<pid>-<unique>` so that what is left of a process
//! that could not clean up (SIGKILL, a power cut) can be told from the living: the next process
//! that makes a folder of the same kind removes every one whose owner is gone.

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// A folder of our own, owner-only, removed when dropped or by [`OwnDir::remove`], whichever
/// comes first (an exit that skips destructors calls `remove` itself).
#[derive(Debug)]
pub struct OwnDir {
    path: PathBuf,
    /// Set once it is removed, so it is removed once.
    removed: AtomicBool,
}

impl OwnDir {
    /// A new folder of `kind` in the temp directory, after removing the folders of that kind
    /// that processes no longer running left there.
    pub fn new(kind: &str) -> io::Result<OwnDir> {
        Self::new_in(&std::env::temp_dir(), kind)
    }

    /// [`OwnDir::new`] in `parent`.
    pub fn new_in(parent: &Path, kind: &str) -> io::Result<OwnDir> {
        sweep(parent, &prefix(kind));
        let name = format!("{}{}-{}", prefix(kind), std::process::id(), uuid::Uuid::new_v4());
        let path = parent.join(name);
        std::fs::DirBuilder::new().mode(0o700).create(&path)?;
        Ok(OwnDir {
            path,
            removed: AtomicBool::new(false),
        })
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Remove it and all it holds, now (idempotent).
    pub fn remove(&self) {
        if !self.removed.swap(true, Ordering::AcqRel) {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

impl Drop for OwnDir {
    fn drop(&mut self) {
        self.remove();
    }
}

fn prefix(kind: &str) -> String {
    format!("vramguard-{kind}-")
}

/// Remove the worker sockets' folders that earlier builds named `vramguard-<pid>-<uuid>` (and
/// never removed) in the temp directory, whose process is gone: an upgrade finds dozens.
pub fn sweep_unkinded() {
    sweep(&std::env::temp_dir(), "vramguard-");
}

/// Remove the folders named `<prefix><pid>-<uuid>` in `parent` whose owning process is gone.
/// Only folders this user owns and named exactly so are touched; a pid that runs again (a
/// recycled one) keeps its folder until a later sweep.
fn sweep(parent: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    let me = std::fs::metadata("/proc/self").map(|m| m.uid()).ok();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| owner_pid(n, prefix)) else {
            continue;
        };
        let ours = entry.metadata().is_ok_and(|m| m.is_dir() && Some(m.uid()) == me);
        if ours && !runs(pid) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Whether process `pid` runs: it exists and is not a zombie waiting to be reaped (a process
/// killed by SIGKILL stays one until its parent waits for it, and will never clean up).
fn runs(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) state …`: the name may hold spaces and parentheses, so the state is read
    // after the last `)`.
    let state = stat
        .rfind(')')
        .and_then(|at| stat[at + 1..].trim_start().chars().next());
    !matches!(state, Some('Z' | 'X') | None)
}

/// The pid in a folder name `<prefix><pid>-<uuid>`, or `None` for any other name.
fn owner_pid(name: &str, prefix: &str) -> Option<u32> {
    let (pid, unique) = name.strip_prefix(prefix)?.split_once('-')?;
    let pid = pid.parse().ok().filter(|_| pid.bytes().all(|b| b.is_ascii_digit()))?;
    uuid::Uuid::parse_str(unique).ok().map(|_| pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pid no process has: above the kernel's limit (`pid_max` is at most 2^22).
    const GONE: u32 = 9_999_999;

    #[test]
    fn only_names_it_makes_are_read_as_owned() {
        let id = uuid::Uuid::new_v4();
        assert_eq!(
            owner_pid(&format!("vramguard-drill-12-{id}"), "vramguard-drill-"),
            Some(12)
        );
        for other in [
            format!("vramguard-drill-12-{id}x"),
            format!("vramguard-drill-+12-{id}"),
            "vramguard-drill-12-notauuid".to_string(),
            format!("vramguard-workers-12-{id}"),
            "vramguard-drill-".to_string(),
        ] {
            assert_eq!(owner_pid(&other, "vramguard-drill-"), None, "{other}");
        }
        // The names earlier versions gave worker folders: no kind, and nothing else read so.
        assert_eq!(owner_pid(&format!("vramguard-12-{id}"), "vramguard-"), Some(12));
        for other in [format!("vramguard-workers-12-{id}"), "vramguard-0".to_string()] {
            assert_eq!(owner_pid(&other, "vramguard-"), None, "{other}");
        }
    }

    #[test]
    fn a_zombie_does_not_run_and_this_process_does() {
        assert!(runs(std::process::id()));
        assert!(!runs(GONE));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Exited and not waited for: a zombie, as a SIGKILLed server is until it is reaped.
        while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z")) {
            std::thread::yield_now();
        }
        assert!(!runs(pid));
        child.wait().unwrap();
    }

    #[test]
    fn a_folder_is_removed_when_dropped_and_what_a_gone_process_left_by_the_next() {
        let parent = OwnDir::new("scratch-test").unwrap();
        let kind = "sweep-test";
        let made = OwnDir::new_in(parent.path(), kind).unwrap();
        std::fs::write(made.path().join("worker-1.sock"), b"").unwrap();
        let left = parent
            .path()
            .join(format!("vramguard-{kind}-{GONE}-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir(&left).unwrap();
        std::fs::write(left.join("worker-1.sock"), b"").unwrap();
        let unrelated = parent.path().join(format!("vramguard-{kind}-{GONE}-not-ours"));
        std::fs::create_dir(&unrelated).unwrap();
        // A living process's folder (this one's) stays; the gone one's goes.
        let second = OwnDir::new_in(parent.path(), kind).unwrap();
        assert!(made.path().exists() && second.path().exists());
        assert!(!left.exists(), "left by a process that is gone");
        assert!(unrelated.exists(), "not a name it makes");
        let path = made.path().to_path_buf();
        made.remove();
        assert!(!path.exists());
        drop(made);
        let path = second.path().to_path_buf();
        drop(second);
        assert!(!path.exists());
    }
}
