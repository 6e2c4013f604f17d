//! Optimize once: a model's graph as ONNX Runtime optimized it for a provider, saved in the ORT
//! format (a flatbuffer ONNX Runtime loads without parsing protobuf or optimizing again, and
//! whose initializers a CPU session can use where they lie) into a cache folder, so a later
//! load of the same model skips the work.
//!
//! An entry is `<key>.ort`: the ORT-format bytes, then a trailer of their SHA-256 and a magic.
//! The key hashes everything that changes the result: the graph's bytes (after vramguard's own
//! rewrites), its external data files' names, sizes and modification times, the ONNX Runtime
//! version, the execution provider, the optimization level, this CPU (ONNX Runtime's level-3
//! rewrites pick kernels for its instruction set) and vramguard's version (its rewrites). An
//! entry whose trailer does not match its bytes is removed and rebuilt, never served; an entry
//! is written under a temporary name and renamed into place, so a reader never sees half of it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use super::session::{SessionOptions, is_ort_format};
use super::{OnnxRuntime, external};
use crate::config::Provider;
use crate::core::model::ModelBytes;

/// What ends an entry: its bytes' SHA-256, then this.
const MAGIC: &[u8; 8] = b"vgort\x00v1";
const TRAILER: usize = 32 + MAGIC.len();

/// The execution provider a pool's optimized graphs are for, when they can be cached: CPU and
/// simulated pools. A simulated pool runs ONNX Runtime's CPU provider (only its allocator and
/// prepacking differ, which do not change the graph), so it shares the CPU pools' entries; its
/// sessions take the initializers from the bytes in place, so its device holds the weights once
/// (see `session::build_held`). A CUDA pool's graph would have to be optimized for the CUDA
/// provider in its worker process (not yet); a remote pool has none.
pub fn provider_key(provider: &Provider) -> Option<&'static str> {
    match provider {
        Provider::Cpu | Provider::Simulated => Some("cpu"),
        Provider::Cuda(_) | Provider::Remote(_) => None,
    }
}

/// The folder optimized graphs are kept in.
#[derive(Debug, Clone)]
pub struct OptimizedCache {
    dir: PathBuf,
}

impl OptimizedCache {
    /// A cache in `dir` (created when the first entry is written).
    pub fn new(dir: impl Into<PathBuf>) -> OptimizedCache {
        OptimizedCache { dir: dir.into() }
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The key of `model` optimized for `provider` (see [`provider_key`]) by `rt`.
    pub fn key(rt: &OnnxRuntime, model: &ModelBytes, provider: &str) -> Result<String, String> {
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
            provider,
            "level3",
            &cpu_signature(),
            env!("CARGO_PKG_VERSION"),
        ] {
            hash.update(part.as_bytes());
            hash.update(b"\n");
        }
        Ok(format!("{:x}", hash.finalize()))
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.ort"))
    }

    /// The entry for `key`, when there is a sound one: its ORT-format bytes. A corrupt or
    /// truncated entry is removed (and the caller builds it again).
    pub fn read(&self, key: &str) -> Option<Vec<u8>> {
        let path = self.path(key);
        let mut bytes = std::fs::read(&path).ok()?;
        match verified_len(&bytes) {
            Some(len) => {
                bytes.truncate(len);
                Some(bytes)
            }
            None => {
                tracing::warn!(entry = %path.display(), "optimized cache entry is corrupt: removed, to be built again");
                let _ = std::fs::remove_file(&path);
                None
            }
        }
    }

    /// Optimize `model` for the CPU provider, save it as the entry for `key`, and answer its
    /// ORT-format bytes. Takes as long as building one session and writing its graph.
    pub fn write(&self, rt: &OnnxRuntime, key: &str, model: &ModelBytes) -> Result<Vec<u8>, String> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("cannot create {}: {e}", self.dir.display()))?;
        let temp = self.dir.join(format!(
            ".{key}.{}.{}.tmp",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let written = self.optimize_into(rt, &temp, model).and_then(|()| {
            let mut bytes = std::fs::read(&temp).map_err(|e| format!("cannot read {}: {e}", temp.display()))?;
            if !is_ort_format(&bytes) {
                return Err("ONNX Runtime did not write an ORT-format graph".into());
            }
            let len = bytes.len();
            let digest: [u8; 32] = Sha256::digest(&bytes).into();
            bytes.extend_from_slice(&digest);
            bytes.extend_from_slice(MAGIC);
            std::fs::write(&temp, &bytes).map_err(|e| format!("cannot write {}: {e}", temp.display()))?;
            std::fs::rename(&temp, self.path(key)).map_err(|e| format!("cannot rename {}: {e}", temp.display()))?;
            bytes.truncate(len);
            Ok(bytes)
        });
        if written.is_err() {
            let _ = std::fs::remove_file(&temp);
        }
        written
    }

    /// Build a CPU session of `model` that saves its optimized graph, in the ORT format, to
    /// `path`.
    fn optimize_into(&self, rt: &OnnxRuntime, path: &Path, model: &ModelBytes) -> Result<(), String> {
        let options = SessionOptions::quiet_cpu();
        let saving = super::session::builder(rt, &options)?
            .with_optimized_model_path(path)
            .map_err(|e| e.to_string())?
            .with_config_entry("session.save_model_format", "ORT")
            .map_err(|e| e.to_string())?;
        super::session::build_with(saving, model.data()).map(drop)
    }
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
    use crate::runtime::onnx::{build_held, runtime, signature};

    /// The decoder optimized once reads as the same model: its inputs and outputs, and the
    /// metadata its cache hints are read from; on a CPU pool it uses the bytes in place.
    #[test]
    fn an_optimized_graph_keeps_the_signature_and_metadata_and_is_used_in_place() {
        let Ok(rt) = runtime(None) else { return };
        let dir = crate::testing::Scratch::new();
        let cache = OptimizedCache::new(dir.path().join("optimized"));
        let tagged = crate::runtime::onnx::facts::with_metadata(
            BuiltinModel::Decoder.bytes().to_vec(),
            &[("vramguard.cache_padding", "right".into())],
        );
        let onnx = ModelBytes::inline(tagged);
        let key = OptimizedCache::key(rt, &onnx, "cpu").unwrap();
        let written = cache.write(rt, &key, &onnx).unwrap();
        assert!(is_ort_format(&written));
        assert_eq!(cache.read(&key).as_deref(), Some(written.as_slice()));
        let optimized = ModelBytes::inline(written);
        let options = SessionOptions::quiet_cpu();
        let from_onnx = build_held(rt, onnx.data(), &options).unwrap();
        let from_ort = build_held(rt, optimized.data(), &options).unwrap();
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
