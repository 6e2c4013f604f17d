//! A model as a pipeline of named components: each graph it runs, with its own weights. A
//! model of one graph is one component (`model`); a Whisper is its `encoder` and its `decoder`
//! (the graph or graphs its window job runs beside the encoder). `/status` lists them per model
//! and `vramguard_model_component_weights_bytes` gives each one's weights per pool; the model's
//! estimate (what admission reads) counts every component a request runs.
//!
//! The same files give the model's [`WeightsKey`]: the SHA-256 of what its sessions are built
//! from (the graph's bytes as served, every external data file and every other component's
//! file, each streamed once when the models load). Two models with one key share one session
//! per pool (`pool::shares`). Only a model with a twin of the same sizes is hashed
//! ([`weights_keys`]): the others cannot share, and a large model costs no start-up time.

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
    /// The files on disk its sessions read beside the model's graph bytes (the graph's
    /// external data; another component's graphs), for its [`WeightsKey`].
    pub read: Vec<PathBuf>,
}

/// The SHA-256 of everything a model's sessions are built from: equal keys, identical weights.
pub type WeightsKey = [u8; 32];

/// The components of a model whose graph (`source`, as configured, with its `external` data
/// files) holds `graph_weights` of weights, and whose Whisper folder, when it is one, holds its
/// decoder beside it.
pub(super) fn components_of(
    source: &str,
    graph_weights: u64,
    external: &[PathBuf],
    speech_folder: Option<&Path>,
) -> Vec<Component> {
    let graph = |name| Component {
        name,
        files: vec![source.to_string()],
        weights_bytes: graph_weights,
        read: external.to_vec(),
    };
    let Some(folder) = speech_folder else {
        return vec![graph("model")];
    };
    let decoder = SpeechModel::decoder_files(folder);
    vec![
        graph("encoder"),
        Component {
            name: "decoder",
            files: decoder.iter().map(|f| file_name(f)).collect(),
            weights_bytes: SpeechModel::decoder_bytes(folder),
            read: decoder,
        },
    ]
}

/// Each model's [`WeightsKey`], in order, when another of them could have its weights: one of
/// the same graph length and the same components' weights (`None`: no twin, not hashed).
pub(super) fn weights_keys(models: &[(&ModelBytes, &[Component])]) -> Result<Vec<Option<WeightsKey>>, (usize, String)> {
    let size = |(bytes, components): &(&ModelBytes, &[Component])| {
        let weights: Vec<u64> = components.iter().map(|c| c.weights_bytes).collect();
        (bytes.len(), weights)
    };
    let sizes: Vec<_> = models.iter().map(size).collect();
    let mut keys = Vec::with_capacity(models.len());
    for (i, (bytes, components)) in models.iter().enumerate() {
        let twin = sizes.iter().enumerate().any(|(j, s)| j != i && *s == sizes[i]);
        keys.push(match twin {
            true => Some(weights_key(bytes, components).map_err(|e| (i, e))?),
            false => None,
        });
    }
    Ok(keys)
}

/// The [`WeightsKey`] of `bytes` (the graph as its sessions are built) and the files each
/// component reads, each streamed once.
fn weights_key(bytes: &ModelBytes, components: &[Component]) -> Result<WeightsKey, String> {
    let mut hash = Sha256::new();
    hash.update(b"vramguard weights\n");
    hash.update(bytes.digest());
    for component in components {
        for file in &component.read {
            // (Its name is the graph's to give: equal graphs name equal files.)
            hash.update(format!("{}\n", component.name));
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
        let parts = components_of("whisper/encoder_model.onnx", 1000, &[], Some(&folder));
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
        assert_eq!(parts[1].read, [folder.join("decoder_model_merged.onnx")]);
        let one = components_of("builtin:encoder", 68_474, &[], None);
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
        let (graph, other) = (ModelBytes::inline(vec![1, 2, 3]), ModelBytes::inline(vec![1, 2, 4]));
        let parts = |external: &str, decoder: &str| {
            let path = |name: &str| {
                (!name.is_empty())
                    .then(|| dir.path().join(name))
                    .into_iter()
                    .collect::<Vec<_>>()
            };
            let mut parts = components_of("m.onnx", 5, &path(external), None);
            if !decoder.is_empty() {
                parts.push(Component {
                    name: "decoder",
                    files: vec![decoder.into()],
                    weights_bytes: 7,
                    read: path(decoder),
                });
            }
            parts
        };
        let key =
            |bytes: &ModelBytes, external: &str, decoder: &str| weights_key(bytes, &parts(external, decoder)).unwrap();
        assert_eq!(
            file_digest(&dir.path().join("a.bin")),
            file_digest(&dir.path().join("b.bin"))
        );
        assert_ne!(
            file_digest(&dir.path().join("a.bin")),
            file_digest(&dir.path().join("c.bin"))
        );
        assert_eq!(
            key(&graph, "a.bin", ""),
            key(&graph, "b.bin", ""),
            "equal contents, other names"
        );
        assert_ne!(
            key(&graph, "a.bin", ""),
            key(&graph, "c.bin", ""),
            "a byte past the first block"
        );
        assert_ne!(
            key(&graph, "a.bin", ""),
            key(&graph, "", "a.bin"),
            "a graph's data is not a decoder's"
        );
        assert_ne!(key(&graph, "", ""), key(&other, "", ""));
        assert!(weights_key(&graph, &parts("missing", "")).is_err());
        // Only models with a twin of their sizes are hashed.
        let (a, c, lone) = (parts("a.bin", ""), parts("c.bin", ""), parts("", "b.bin"));
        let keys = weights_keys(&[(&graph, &a), (&graph, &c), (&other, &lone)]).unwrap();
        assert!(keys[0].is_some() && keys[1].is_some() && keys[0] != keys[1] && keys[2].is_none());
        let missing = parts("missing", "");
        assert_eq!(
            weights_keys(&[(&graph, &missing), (&graph, &missing)]).unwrap_err().0,
            0
        );
    }
}
