//! Scaffolding shared by the unit tests, the integration tests and the benches: scratch
//! folders, fakes at the hardware seams and config builders, written once. Compiled for tests
//! and with the `test-util` feature, never into a release binary.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A scratch folder holding `policy.rhai` and `tests/`, removed on drop.
pub struct Scratch(PathBuf);

impl Default for Scratch {
    fn default() -> Self {
        Self::new()
    }
}

impl Scratch {
    /// A new, empty folder (with an empty `tests/`).
    pub fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "vramguard-policy-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(dir.join("tests")).expect("scratch folder");
        Scratch(dir)
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Write `text` to `name` in the folder; its path.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("write scratch file");
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A policy that defers while the request's pool has more than `params.max_queue` queued.
pub const DEFER_WHEN_QUEUED: &str = "fn decide(req, state) { if state.pools[req.pool].queue_depth > state.params.max_queue { defer(10) } else { admit() } }";
