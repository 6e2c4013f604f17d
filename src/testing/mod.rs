//! Scaffolding shared by the unit tests, the integration tests and the benches: scratch
//! folders, fakes at the hardware seams, config builders, server processes and the benches'
//! figures, written once. Compiled for tests and with the `test-util` feature (which the crate's
//! own dev-dependency on itself switches on), never into a release binary.

pub mod bench;
pub mod config;
pub mod fakes;
pub mod process;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::core::backend::RunMeta;
use crate::core::tensor::Tensor;
use crate::serve::lifecycle::Request;

/// A folder of its own under the temporary directory, removed with everything in it on drop.
/// Its own, because tests run in parallel threads and test binaries in parallel processes: two
/// tests sharing a folder would rewrite each other's files.
pub struct Scratch(PathBuf);

impl Default for Scratch {
    fn default() -> Self {
        Self::new()
    }
}

impl Scratch {
    /// A new, empty folder.
    pub fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "vramguard-scratch-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        // A folder left by an earlier process of the same id (one killed before its drop).
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch folder");
        Scratch(dir)
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Write `contents` to `name` in the folder (its parent folders made, so `tests/x.yaml`
    /// works); the file's path.
    pub fn write(&self, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
        let path = self.0.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("scratch subfolder");
        }
        std::fs::write(&path, contents).expect("write scratch file");
        path
    }

    /// Write `source` as `policy.rhai` in the folder; the `policy:` config section that uses
    /// it, read once (no watcher: a test that wants reloads says so itself).
    pub fn policy(&self, source: &str) -> String {
        let path = self.write("policy.rhai", source);
        format!("policy: {{path: '{}', watch_interval: 0s}}\n", path.display())
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The cache folder (`XDG_CACHE_HOME`) of every server this test process runs: the one a
/// test's config gets its `host.optimized_cache` under when it names none
/// ([`config::validated`]), and the one the `vramguard` processes it starts are given
/// ([`process::spawn_serving`], [`vramguard_command`]). A folder of this process's own, so no
/// test writes optimized models into the user's cache; the next test process removes it once
/// this one is gone (`core::scratch`).
pub fn cache_home() -> &'static Path {
    static HOME: std::sync::OnceLock<crate::core::scratch::OwnDir> = std::sync::OnceLock::new();
    HOME.get_or_init(|| crate::core::scratch::OwnDir::new("test-cache").expect("a test cache folder"))
        .path()
}

/// A command that runs the `vramguard` binary `bin` with [`cache_home`] as its cache folder.
pub fn vramguard_command(bin: impl AsRef<std::ffi::OsStr>) -> std::process::Command {
    let mut command = std::process::Command::new(bin);
    command.env("XDG_CACHE_HOME", cache_home());
    command
}

/// A request for `model` with `inputs`, as a client without any header sends it: id `req-1`,
/// priority 0, replayable, no shrink, no deadline, no idempotency key, received now (on
/// tokio's clock, so a test with paused time sees it at the paused instant).
pub fn request(model: &str, inputs: Vec<Tensor>) -> Request {
    Request {
        meta: RunMeta {
            request_id: "req-1".into(),
            replayable: true,
            ..RunMeta::default()
        },
        model: model.into(),
        inputs,
        outputs: vec![],
        max_new_tokens: 0,
        shrinker: None,
        received: tokio::time::Instant::now(),
        progress: Default::default(),
        allow_substitute: false,
        sequence: None,
        generations: 0,
        pads: false,
    }
}

/// A policy that admits everything, for tests and benches about what happens after admission.
pub const ADMIT_ALL: &str = "fn decide(req, state) { admit() }\n";

/// A policy that defers while the request's pool has more than `params.max_queue` queued.
pub const DEFER_WHEN_QUEUED: &str = "fn decide(req, state) { if state.pools[req.pool].queue_depth > state.params.max_queue { defer(10) } else { admit() } }";

/// A PNG chunk: its length, type, data and CRC-32 (of its type and data), for tests that make
/// a hostile file (a header that claims more pixels than it holds).
pub fn png_chunk(kind: &[u8; 4], data: &[u8]) -> Vec<u8> {
    let mut out = (data.len() as u32).to_be_bytes().to_vec();
    out.extend(kind);
    out.extend(data);
    let mut crc = !0u32;
    for &b in &out[4..] {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                0xEDB8_8320 ^ (crc >> 1)
            } else {
                crc >> 1
            };
        }
    }
    out.extend((!crc).to_be_bytes());
    out
}

/// A PNG whose header claims `width` x `height` pixels of 8-bit RGB and which holds none.
pub fn png_bomb(width: u32, height: u32) -> Vec<u8> {
    let mut header = width.to_be_bytes().to_vec();
    header.extend(height.to_be_bytes());
    header.extend([8, 2, 0, 0, 0]);
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    png.extend(png_chunk(b"IHDR", &header));
    png.extend(png_chunk(b"IDAT", &[0x78, 0x9c, 0x03, 0x00]));
    png.extend(png_chunk(b"IEND", &[]));
    png
}
