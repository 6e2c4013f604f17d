//! Optimize once: a model's graph as ONNX Runtime optimized it for a provider, saved into a
//! cache folder, so a later load of the same model skips the work. An entry takes one of two
//! forms, by the pool's provider ([`Form`]):
//!
//! - **Mapped** (CPU pools): `<key>.onnx`, the optimized graph, and `<key>.bin`, its weights as
//!   external data with the pre-packed (kernel-layout) copies of its constant weights
//!   (`session.save_external_prepacked_constant_initializers`). A session loads the graph from
//!   its path without optimizing it again, and ONNX Runtime maps `<key>.bin` and uses both the
//!   weights and the pre-packed buffers where they lie: every session of the model, in every
//!   worker thread and worker process, shares one copy of those pages (the page cache's). A
//!   third file, `<key>.sum`, records both files' lengths and SHA-256s; it is written last.
//! - **ORT format** (simulated pools): `<key>.ort`, the ORT-format bytes (a flatbuffer loaded
//!   without parsing protobuf or optimizing), then a trailer of their SHA-256 and a magic. As on
//!   a GPU, a session copies the weights into the device's arena; it uses the bytes in place so
//!   that it copies them once (see `session::build_held`).
//!
//! The key hashes everything that changes the result: the graph's bytes (after vramguard's own
//! rewrites), its external data files' names, sizes and modification times, the ONNX Runtime
//! version, the form, the optimization level, this CPU (ONNX Runtime's level-3 rewrites and
//! pre-packed layouts are for its instruction set) and vramguard's version (its rewrites). An
//! entry whose record does not match its bytes is removed and rebuilt, never served; an entry
//! is written under temporary names and renamed into place (a mapped entry's record last), so
//! a reader never sees half of one. A mapped entry is verified (hashed whole, about 0.3 s for
//! 150 MB) the first time a process reads it from the folder, and again only if its weights
//! file is no longer the same file (inode, length, modification time); the small graph is
//! hashed at every read.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use super::mapping::Mapping;
use super::session::{SessionOptions, is_ort_format};
use super::{OnnxRuntime, external};
use crate::config::Provider;
use crate::core::model::ModelBytes;

/// What ends an ORT-format entry: its bytes' SHA-256, then this.
const MAGIC: &[u8; 8] = b"vgort\x00v1";
const TRAILER: usize = 32 + MAGIC.len();
/// The first line of a mapped entry's record.
const RECORD: &str = "vramguard mapped entry v1";
/// Initializers at least this large go to `<key>.bin` (smaller ones stay in the graph).
const EXTERNAL_FROM: &str = "1024";

/// The form of a pool's optimized cache entries (see the module's doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// `<key>.onnx` and the `<key>.bin` its sessions map: CPU pools.
    Mapped,
    /// `<key>.ort`, copied into the device's arena: simulated pools.
    Ort,
}

impl Form {
    fn name(self) -> &'static str {
        match self {
            Form::Mapped => "cpu mapped prepacked",
            Form::Ort => "cpu ort",
        }
    }
}

/// The form of the optimized graphs of a pool on `provider`, when they can be cached: CPU and
/// simulated pools. A simulated pool runs ONNX Runtime's CPU provider, so its graph is the CPU
/// pools', but as a GPU its device must hold its weights: it takes the ORT format. A CUDA pool's
/// graph would have to be optimized for the CUDA provider in its worker process (not yet); a
/// remote pool has none.
pub fn cache_form(provider: &Provider) -> Option<Form> {
    match provider {
        Provider::Cpu => Some(Form::Mapped),
        Provider::Simulated => Some(Form::Ort),
        Provider::Cuda(_) | Provider::Remote(_) => None,
    }
}

/// An entry as read or written: the bytes sessions are built from, and for a mapped entry the
/// mapping of its weights (what holding the entry keeps resident).
#[derive(Debug)]
pub struct Cached {
    /// The graph: ORT-format bytes, or the mapped entry's graph, read from its file.
    pub bytes: ModelBytes,
    /// A mapped entry's `<key>.bin`.
    pub weights: Option<Mapping>,
}

impl Cached {
    /// What holding it takes: the graph's bytes and the mapped weights.
    pub fn size(&self) -> u64 {
        self.bytes.len() + self.weights.as_ref().map_or(0, Mapping::size)
    }
}

/// The folder optimized graphs are kept in.
#[derive(Debug, Clone)]
pub struct OptimizedCache {
    dir: PathBuf,
    /// The weights files this process hashed (or wrote), by key: the file as it was then, and
    /// its line of the record. Hashing 300 MB takes about 0.6 s; a file that is still the same
    /// one (inode, length, modification time) is not hashed again.
    verified: Arc<Mutex<HashMap<String, (Stamp, String)>>>,
}

/// A file's identity and version, as far as its metadata tells.
type Stamp = (u64, u64, u64, i64, i64);

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.dev(), meta.ino(), meta.len(), meta.mtime(), meta.mtime_nsec()))
}

impl OptimizedCache {
    /// A cache in `dir` (created when the first entry is written).
    pub fn new(dir: impl Into<PathBuf>) -> OptimizedCache {
        OptimizedCache {
            dir: dir.into(),
            verified: Arc::default(),
        }
    }

    /// `key`'s weights file's line of the record, hashed now unless this process hashed the
    /// same file before.
    fn weights_line(&self, key: &str, weights: &Mapping) -> (Option<Stamp>, String) {
        let stamp = stamp(&self.path(key, "bin"));
        let known = self
            .verified
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned();
        match known {
            Some((seen, line)) if Some(seen) == stamp => (stamp, line),
            _ => (stamp, line(&format!("{key}.bin"), weights.bytes())),
        }
    }

    fn remember(&self, key: &str, stamp: Option<Stamp>, weights_line: String) {
        let mut verified = self.verified.lock().unwrap_or_else(|e| e.into_inner());
        match stamp {
            Some(stamp) => verified.insert(key.to_string(), (stamp, weights_line)),
            None => verified.remove(key),
        };
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The key of `model` optimized into `form` by `rt`.
    pub fn key(rt: &OnnxRuntime, model: &ModelBytes, form: Form) -> Result<String, String> {
        let mut hash = Sha256::new();
        hash.update(b"vramguard optimized graph\n");
        hash.update(model.digest());
        let data = model.data();
        for file in external::external_data(data.graph, data.folder)?.files {
            let meta = std::fs::metadata(&file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
            let modified = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .unwrap_or_default();
            hash.update(format!("{}\n{}\n{}\n", file.display(), meta.len(), modified.as_nanos()));
        }
        for part in [
            rt.version.as_str(),
            form.name(),
            "level3",
            &cpu_signature(),
            env!("CARGO_PKG_VERSION"),
        ] {
            hash.update(part.as_bytes());
            hash.update(b"\n");
        }
        Ok(format!("{:x}", hash.finalize()))
    }

    fn path(&self, key: &str, extension: &str) -> PathBuf {
        self.dir.join(format!("{key}.{extension}"))
    }

    /// The entry for `key`, when there is a sound one, read as lying in the model's `folder`
    /// (see [`ModelBytes::in_folder`]). A corrupt or truncated entry is removed (and the caller
    /// builds it again).
    pub fn read(&self, key: &str, form: Form, folder: Option<&Path>) -> Option<Cached> {
        let (read, files) = match form {
            Form::Ort => (self.read_ort(key), vec![self.path(key, "ort")]),
            Form::Mapped => (
                self.read_mapped(key),
                ["sum", "onnx", "bin"].map(|e| self.path(key, e)).to_vec(),
            ),
        };
        match read {
            Read::Sound(mut cached) => {
                cached.bytes = cached.bytes.in_folder(folder);
                Some(cached)
            }
            Read::Missing => None,
            Read::Corrupt => {
                tracing::warn!(entry = %files[0].display(), "optimized cache entry is corrupt: removed, to be built again");
                for file in files {
                    let _ = std::fs::remove_file(file);
                }
                None
            }
        }
    }

    fn read_ort(&self, key: &str) -> Read {
        let Ok(mut bytes) = std::fs::read(self.path(key, "ort")) else {
            return Read::Missing;
        };
        match verified_len(&bytes) {
            Some(len) => {
                bytes.truncate(len);
                Read::Sound(Cached {
                    bytes: sealed(bytes),
                    weights: None,
                })
            }
            None => Read::Corrupt,
        }
    }

    fn read_mapped(&self, key: &str) -> Read {
        // The record is written last: without it there is no entry (files of a write that
        // did not finish are replaced by the next).
        let Ok(recorded) = std::fs::read_to_string(self.path(key, "sum")) else {
            return Read::Missing;
        };
        let graph_path = self.path(key, "onnx");
        let (Ok(graph), Ok(weights)) = (std::fs::read(&graph_path), Mapping::of(&self.path(key, "bin"))) else {
            return Read::Corrupt;
        };
        let (stamp, weights_line) = self.weights_line(key, &weights);
        if record(&line(&format!("{key}.onnx"), &graph), &weights_line) != recorded {
            self.remember(key, None, weights_line);
            return Read::Corrupt;
        }
        self.remember(key, stamp, weights_line);
        Read::Sound(mapped(graph, weights, &graph_path))
    }

    /// Optimize `model` for the CPU provider into `form`, save it as the entry for `key`, and
    /// answer it. Takes as long as building one session and writing its graph (and hashing it).
    pub fn write(&self, rt: &OnnxRuntime, key: &str, form: Form, model: &ModelBytes) -> Result<Cached, String> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("cannot create {}: {e}", self.dir.display()))?;
        let temp = self.dir.join(format!(
            ".{key}.{}.{}.tmp",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let written = match form {
            Form::Ort => self.write_ort(rt, key, &temp, model),
            Form::Mapped => self.write_mapped(rt, key, &temp, model),
        };
        // A file, or a folder of the mapped form's files, whatever is left of it.
        let _ = std::fs::remove_file(&temp);
        let _ = std::fs::remove_dir_all(&temp);
        written.map(|mut cached| {
            cached.bytes = cached.bytes.in_folder(model.data().folder);
            cached
        })
    }

    fn write_ort(&self, rt: &OnnxRuntime, key: &str, temp: &Path, model: &ModelBytes) -> Result<Cached, String> {
        let saving = saving_to(rt, temp)?
            .with_config_entry("session.save_model_format", "ORT")
            .map_err(|e| e.to_string())?;
        super::session::build_with(saving, model.data())?;
        let mut bytes = std::fs::read(temp).map_err(|e| format!("cannot read {}: {e}", temp.display()))?;
        if !is_ort_format(&bytes) {
            return Err("ONNX Runtime did not write an ORT-format graph".into());
        }
        let len = bytes.len();
        let digest: [u8; 32] = Sha256::digest(&bytes).into();
        bytes.extend_from_slice(&digest);
        bytes.extend_from_slice(MAGIC);
        std::fs::write(temp, &bytes).map_err(|e| format!("cannot write {}: {e}", temp.display()))?;
        rename(temp, &self.path(key, "ort"))?;
        bytes.truncate(len);
        Ok(Cached {
            bytes: sealed(bytes),
            weights: None,
        })
    }

    /// The mapped form, written in the folder `temp` and renamed into place: weights, graph,
    /// then the record that makes them an entry.
    fn write_mapped(&self, rt: &OnnxRuntime, key: &str, temp: &Path, model: &ModelBytes) -> Result<Cached, String> {
        std::fs::create_dir_all(temp).map_err(|e| format!("cannot create {}: {e}", temp.display()))?;
        let (graph_name, weights_name) = (format!("{key}.onnx"), format!("{key}.bin"));
        let saving = saving_to(rt, &temp.join(&graph_name))?;
        let mut saving = saving
            .with_config_entry("session.save_model_format", "ONNX")
            .map_err(|e| e.to_string())?;
        for (entry, value) in [
            (
                "session.optimized_model_external_initializers_file_name",
                weights_name.as_str(),
            ),
            (
                "session.optimized_model_external_initializers_min_size_in_bytes",
                EXTERNAL_FROM,
            ),
            ("session.save_external_prepacked_constant_initializers", "1"),
        ] {
            saving = saving.with_config_entry(entry, value).map_err(|e| e.to_string())?;
        }
        super::session::build_with(saving, model.data())?;
        let graph =
            std::fs::read(temp.join(&graph_name)).map_err(|e| format!("cannot read the optimized graph: {e}"))?;
        // ONNX Runtime writes no weights file for a graph whose initializers are all small.
        let weights_path = temp.join(&weights_name);
        if !weights_path.exists() {
            std::fs::write(&weights_path, []).map_err(|e| format!("cannot write {}: {e}", weights_path.display()))?;
        }
        let weights = Mapping::of(&weights_path)?;
        let record_path = temp.join(format!("{key}.sum"));
        let weights_line = line(&weights_name, weights.bytes());
        std::fs::write(&record_path, record(&line(&graph_name, &graph), &weights_line))
            .map_err(|e| format!("cannot write {}: {e}", record_path.display()))?;
        rename(&weights_path, &self.path(key, "bin"))?;
        rename(&temp.join(&graph_name), &self.path(key, "onnx"))?;
        rename(&record_path, &self.path(key, "sum"))?;
        self.remember(key, stamp(&self.path(key, "bin")), weights_line);
        Ok(mapped(graph, weights, &self.path(key, "onnx")))
    }
}

/// What reading an entry found.
enum Read {
    Sound(Cached),
    Missing,
    Corrupt,
}

/// A mapped entry: its graph, loaded by sessions from `graph_path`, and its weights.
fn mapped(graph: Vec<u8>, weights: Mapping, graph_path: &Path) -> Cached {
    Cached {
        bytes: ModelBytes::inline(graph)
            .with_external_bytes(weights.size())
            .from_file(graph_path),
        weights: Some(weights),
    }
}

/// An ORT-format entry's bytes in a sealed memfd, which a worker process maps instead of being
/// sent a copy (see `pool/process/wire.rs`); on the heap if the memfd cannot be made.
fn sealed(bytes: Vec<u8>) -> ModelBytes {
    match Mapping::sealed(&bytes) {
        Ok(mapping) => ModelBytes::shared(mapping),
        Err(reason) => {
            tracing::warn!(%reason, "the optimized graph stays on the heap: worker processes are sent a copy");
            ModelBytes::inline(bytes)
        }
    }
}

/// A CPU session builder that saves the graph it optimizes to `path`.
fn saving_to(rt: &OnnxRuntime, path: &Path) -> Result<ort::session::builder::SessionBuilder, String> {
    super::session::builder(rt, &SessionOptions::quiet_cpu())?
        .with_optimized_model_path(path)
        .map_err(|e| e.to_string())
}

fn rename(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::rename(from, to).map_err(|e| format!("cannot rename {} to {}: {e}", from.display(), to.display()))
}

/// A mapped entry's record: each file's line.
fn record(graph_line: &str, weights_line: &str) -> String {
    format!("{RECORD}\n{graph_line}{weights_line}")
}

/// A file's line of a record: its name, length and SHA-256.
fn line(name: &str, bytes: &[u8]) -> String {
    format!("{name} {} {:x}\n", bytes.len(), Sha256::digest(bytes))
}

/// The length of an entry's ORT-format bytes when its trailer matches them.
fn verified_len(entry: &[u8]) -> Option<usize> {
    let len = entry.len().checked_sub(TRAILER)?;
    let (body, trailer) = entry.split_at(len);
    let (digest, magic) = trailer.split_at(32);
    (magic == MAGIC && Sha256::digest(body).as_slice() == digest && is_ort_format(body)).then_some(len)
}

/// This CPU as `/proc/cpuinfo` names it and its instruction-set flags (empty where there is no
/// such file): an entry optimized for one CPU's kernels is not used on another.
fn cpu_signature() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_once(':'))
            .map_or("", |(_, v)| v.trim())
            .to_string()
    };
    format!(
        "{} {} [{}]",
        std::env::consts::ARCH,
        field("model name"),
        field("flags")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::model::BuiltinModel;
    use crate::core::tensor::{Tensor, TensorData};
    use crate::runtime::onnx::{build_held, build_session, run, runtime, signature};

    /// The decoder optimized once reads as the same model: its inputs and outputs, and the
    /// metadata its cache hints are read from; a session uses the bytes in place.
    #[test]
    fn an_optimized_graph_keeps_the_signature_and_metadata_and_is_used_in_place() {
        let rt = runtime(None).expect("ONNX Runtime loads");
        let dir = crate::testing::Scratch::new();
        let cache = OptimizedCache::new(dir.path().join("optimized"));
        let tagged = crate::runtime::onnx::facts::with_metadata(
            BuiltinModel::Decoder.bytes().to_vec(),
            &[("vramguard.cache_padding", "right".into())],
        );
        let onnx = ModelBytes::inline(tagged);
        let key = OptimizedCache::key(rt, &onnx, Form::Ort).unwrap();
        let written = cache.write(rt, &key, Form::Ort, &onnx).unwrap().bytes;
        assert!(is_ort_format(written.data().graph));
        let read = cache.read(&key, Form::Ort, None).unwrap().bytes;
        assert_eq!(read.data().graph, written.data().graph);
        let options = SessionOptions::quiet_cpu();
        let from_onnx = build_held(rt, onnx.data(), &options).unwrap();
        let from_ort = build_held(rt, written.data(), &options).unwrap();
        assert!(from_onnx.keeps.is_none());
        assert!(from_ort.keeps.is_some(), "initializers used in place");
        assert_eq!(signature(&from_onnx.session), signature(&from_ort.session));
        let (a, b) = (
            from_onnx.session.metadata().unwrap(),
            from_ort.session.metadata().unwrap(),
        );
        assert_eq!(a.custom("vramguard.cache_padding").as_deref(), Some("right"));
        assert_eq!(b.custom("vramguard.cache_padding").as_deref(), Some("right"));
    }

    /// The pages of `file` mapped in this process: how many mappings, and their proportional
    /// set size summed (a page mapped twice counts half in each), in bytes.
    fn mapped_pages(file: &Path) -> (usize, u64) {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let name = file.to_str().unwrap();
        let (mut mappings, mut pss, mut ours) = (0, 0, false);
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if first.contains('-') && !first.ends_with(':') {
                ours = line.ends_with(name);
                mappings += usize::from(ours);
            } else if ours && first == "Pss:" {
                pss += line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024;
            }
        }
        (mappings, pss)
    }

    /// A CPU pool's entry: the graph and the weights file its sessions map. Two sessions give
    /// the ONNX model's outputs, and each maps the same weights: their pages are held once (the
    /// proportional set size of every mapping of the file, the entry's own included, is the
    /// file's size, not a multiple of it).
    #[test]
    fn two_sessions_of_a_mapped_entry_answer_as_the_onnx_model_and_hold_its_weights_once() {
        let rt = runtime(None).expect("ONNX Runtime loads");
        let dir = crate::testing::Scratch::new();
        let cache = OptimizedCache::new(dir.path().join("optimized"));
        let onnx = ModelBytes::inline(BuiltinModel::Encoder.bytes());
        let key = OptimizedCache::key(rt, &onnx, Form::Mapped).unwrap();
        let written = cache.write(rt, &key, Form::Mapped, &onnx).unwrap();
        let cached = cache.read(&key, Form::Mapped, None).expect("a sound entry");
        drop(written);
        let weights = cache.path(&key, "bin");
        let size = std::fs::metadata(&weights).unwrap().len();
        assert!(size > 16 << 10, "the encoder's weights lie in the file: {size} bytes");
        assert_eq!(cached.size(), cached.bytes.len() + size);
        let input = Tensor {
            name: "input".into(),
            shape: vec![1, 16, 64],
            data: TensorData::Fp32((0..16 * 64).map(|i| (i % 13) as f32 * 0.2 - 1.0).collect()),
        };
        let options = SessionOptions::quiet_cpu();
        let outputs = |session: &mut ort::session::Session| run(session, vec![input.clone()], &[], None).unwrap();
        let expected = outputs(&mut build_session(rt, onnx.data(), &options).unwrap());
        let (before, _) = mapped_pages(&weights);
        let mut sessions: Vec<_> = (0..2)
            .map(|_| build_held(rt, cached.bytes.data(), &options).unwrap())
            .collect();
        for held in &mut sessions {
            assert!(held.keeps.is_none(), "loaded from the file, which ONNX Runtime maps");
            assert_eq!(outputs(&mut held.session), expected);
        }
        let (after, pss) = mapped_pages(&weights);
        assert!(
            after >= before + 2,
            "each session maps the weights: {before} then {after} mappings"
        );
        let page = 4096;
        assert!(
            pss <= size.next_multiple_of(page) + page * after as u64,
            "{pss} bytes of the file's pages held for a {size}-byte file"
        );
        assert!(
            build_held(
                rt,
                cached.bytes.data(),
                &SessionOptions {
                    provider: Provider::Simulated,
                    ..options
                }
            )
            .is_err(),
            "a device pool does not map host pages as its weights"
        );
    }

    /// A mapped entry whose graph, weights or record were changed is removed and built again:
    /// read by another process (a cache of its own), or by this one once the weights file is no
    /// longer the file it hashed (here: changed in place, with a later modification time).
    #[test]
    fn a_mapped_entry_with_a_changed_file_is_removed_not_served() {
        let rt = runtime(None).expect("ONNX Runtime loads");
        let dir = crate::testing::Scratch::new();
        let cache = OptimizedCache::new(dir.path().join("optimized"));
        let onnx = ModelBytes::inline(BuiltinModel::Encoder.bytes());
        let key = OptimizedCache::key(rt, &onnx, Form::Mapped).unwrap();
        for (extension, change, same_process) in [
            ("bin", 0, false),
            ("onnx", 0, false),
            ("bin", 1, false),
            ("sum", 2, false),
            ("bin", 0, true),
            ("onnx", 0, true),
        ] {
            cache.write(rt, &key, Form::Mapped, &onnx).unwrap();
            assert!(cache.read(&key, Form::Mapped, None).is_some());
            let path = cache.path(&key, extension);
            let mut bytes = std::fs::read(&path).unwrap();
            match change {
                0 => {
                    let at = bytes.len() / 2;
                    bytes[at] ^= 1;
                }
                1 => bytes.truncate(bytes.len() - 1),
                _ => bytes.extend_from_slice(b"x"),
            }
            std::fs::write(&path, bytes).unwrap();
            let later = std::time::SystemTime::now() + std::time::Duration::from_secs(1);
            std::fs::File::options()
                .write(true)
                .open(&path)
                .unwrap()
                .set_modified(later)
                .unwrap();
            let reader = match same_process {
                true => cache.clone(),
                false => OptimizedCache::new(cache.dir()),
            };
            let case = format!("{extension} changed ({change}), same process: {same_process}");
            assert!(reader.read(&key, Form::Mapped, None).is_none(), "{case}");
            for extension in ["sum", "onnx", "bin"] {
                assert!(!cache.path(&key, extension).exists(), "{extension} removed: {case}");
            }
        }
        assert!(
            cache.read(&key, Form::Mapped, None).is_none(),
            "no entry until it is built again"
        );
        cache.write(rt, &key, Form::Mapped, &onnx).unwrap();
        assert!(
            OptimizedCache::new(cache.dir())
                .read(&key, Form::Mapped, None)
                .is_some()
        );
        let leftovers = std::fs::read_dir(cache.dir()).unwrap().count();
        assert_eq!(leftovers, 3, "no temporary files left");
    }

    #[test]
    fn an_entry_whose_bytes_do_not_match_its_trailer_is_refused() {
        let mut body = vec![0u8; 64];
        body[4..8].copy_from_slice(b"ORTM");
        let mut entry = body.clone();
        entry.extend_from_slice(&Sha256::digest(&body));
        entry.extend_from_slice(MAGIC);
        assert_eq!(verified_len(&entry), Some(64));
        let mut flipped = entry.clone();
        flipped[20] ^= 1;
        assert_eq!(verified_len(&flipped), None);
        assert_eq!(verified_len(&entry[..entry.len() - 1]), None);
        assert_eq!(verified_len(b"short"), None);
    }
}
