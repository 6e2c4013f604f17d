//! A model as a pipeline of named components: each graph it runs, with its own weights. A
//! model of one graph is one component (`model`); a Whisper is its `encoder` and its `decoder`
//! (the graph or graphs its window job runs beside the encoder). `/status` lists them per model
//! and `vramguard_model_component_weights_bytes` gives each one's weights per pool; the model's
//! estimate (what admission reads) counts every component a request runs.
//!
//! The same files give the model's [`WeightsKey`]: the SHA-256 of what its sessions are built
//! from (the graph's bytes as served, every external data file and every other component's
//! file, each streamed once when the model loads). Two models with one key share one session
//! per pool (`pool::shares`).

use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::core::model::ModelBytes;
use crate::runtime::speech::SpeechModel;

/// One graph of a model, with its own weights.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Component {
    /// Its name: `model` for a model of one graph; `encoder` and `decoder` for a Whisper.
    pub name: &'static str,
    /// The files its weights are read from, as configured or found in the model's folder.
    pub files: Vec<String>,
    /// Its weights: what one session of it holds (the graph's bytes and its external data).
    pub weights_bytes: u64,
}

/// The SHA-256 of everything a model's sessions are built from: equal keys, identical weights.
pub type WeightsKey = [u8; 32];

/// The components of a model whose graph (`source`, as configured) holds `graph_weights` of
/// weights, and whose Whisper folder, when it is one, holds its decoder beside it.
pub(super) fn components_of(source: &str, graph_weights: u64, speech_folder: Option<&Path>) -> Vec<Component> {
    let Some(folder) = speech_folder else {
        return vec![Component {
            name: "model",
            files: vec![source.to_string()],
            weights_bytes: graph_weights,
        }];
    };
    let decoder = SpeechModel::decoder_files(folder);
    vec![
        Component {
            name: "encoder",
            files: vec![source.to_string()],
            weights_bytes: graph_weights,
        },
        Component {
            name: "decoder",
            files: decoder.iter().map(|f| file_name(f)).collect(),
            weights_bytes: SpeechModel::decoder_bytes(folder),
        },
    ]
}

/// The [`WeightsKey`] of `bytes` (the graph as its sessions are built), its `external` data
/// files and the files of its other components (`beside`), each streamed once.
pub(super) fn weights_key(bytes: &ModelBytes, external: &[PathBuf], beside: &[PathBuf]) -> Result<WeightsKey, String> {
    let mut hash = Sha256::new();
    hash.update(b"vramguard weights\n");
    hash.update(bytes.digest());
    for (what, files) in [("external", external), ("component", beside)] {
        for file in files {
            hash.update(format!("{what} {}\n", file_name(file)));
            hash.update(file_digest(file)?);
        }
    }
    Ok(hash.finalize().into())
}

/// The SHA-256 of `file`'s contents, read in blocks (a file of gigabytes is never held).
fn file_digest(file: &Path) -> Result<[u8; 32], String> {
    let mut hash = Sha256::new();
    let mut reader = std::fs::File::open(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let mut block = vec![0u8; 1 << 20];
    loop {
        let n = reader
            .read(&mut block)
            .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
        if n == 0 {
            return Ok(hash.finalize().into());
        }
        hash.update(&block[..n]);
    }
}

fn file_name(file: &Path) -> String {
    file.file_name()
        .map_or_else(|| file.display().to_string(), |n| n.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whisper_is_its_encoder_and_its_decoder_and_another_model_one_graph() {
        let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/speech/whisper");
        let merged = std::fs::metadata(folder.join("decoder_model_merged.onnx"))
            .unwrap()
            .len();
        let parts = components_of("whisper/encoder_model.onnx", 1000, Some(&folder));
        let names: Vec<_> = parts
            .iter()
            .map(|c| (c.name, c.files.clone(), c.weights_bytes))
            .collect();
        assert_eq!(
            names,
            [
                ("encoder", vec!["whisper/encoder_model.onnx".to_string()], 1000),
                ("decoder", vec!["decoder_model_merged.onnx".to_string()], merged),
            ]
        );
        let one = components_of("builtin:encoder", 68_474, None);
        assert_eq!((one.len(), one[0].name, one[0].weights_bytes), (1, "model", 68_474));
    }

    #[test]
    fn equal_files_give_one_key_and_a_byte_changed_anywhere_another() {
        let dir = crate::testing::Scratch::new();
        dir.write("a.bin", vec![7u8; (1 << 20) + 5]);
        dir.write("b.bin", vec![7u8; (1 << 20) + 5]);
        let mut other = vec![7u8; (1 << 20) + 5];
        other[(1 << 20) + 1] = 8;
        dir.write("c.bin", other);
        let graph = || ModelBytes::inline(vec![1, 2, 3]);
        let key = |files: &[&str], beside: &[&str]| {
            let paths = |names: &[&str]| names.iter().map(|n| dir.path().join(n)).collect::<Vec<_>>();
            weights_key(&graph(), &paths(files), &paths(beside)).unwrap()
        };
        assert_eq!(
            file_digest(&dir.path().join("a.bin")),
            file_digest(&dir.path().join("b.bin"))
        );
        assert_ne!(
            file_digest(&dir.path().join("a.bin")),
            file_digest(&dir.path().join("c.bin"))
        );
        assert_eq!(key(&["a.bin"], &[]), key(&["a.bin"], &[]));
        assert_ne!(
            key(&["a.bin"], &[]),
            key(&["c.bin"], &[]),
            "a byte past the first block"
        );
        assert_ne!(
            key(&["a.bin"], &[]),
            key(&[], &["a.bin"]),
            "an external file is not a component's"
        );
        let other_graph = weights_key(&ModelBytes::inline(vec![1, 2, 4]), &[], &[]).unwrap();
        assert_ne!(key(&[], &[]), other_graph);
        assert!(weights_key(&graph(), &[dir.path().join("missing")], &[]).is_err());
    }
}
