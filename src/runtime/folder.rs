//! What a decoder's folder says beside its graph, as the exporters write it: ONNX Runtime
//! GenAI's `genai_config.json` ([`GenaiConfig`]), and the Hugging Face `config.json` and
//! `generation_config.json` that Optimum copies: the most positions the model takes and the
//! tokens that end its answers.

use std::path::Path;

use serde_json::Value;

use super::genai::{GenaiConfig, eos_ids};

/// What vramguard reads from a model's folder.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelFolder {
    /// `genai_config.json`, when the folder has one.
    pub genai: Option<GenaiConfig>,
    /// The most positions the model takes: `genai_config.json`'s `model.context_length`, else
    /// `config.json`'s `max_position_embeddings` (`n_positions` in GPT-2's).
    pub context: Option<u64>,
    /// Token ids that end an answer: every `eos_token_id` (a number or a list) of
    /// `generation_config.json`, `genai_config.json` and `config.json`.
    pub eos: Vec<u32>,
}

impl ModelFolder {
    /// The files of `folder` (each optional); an error names the file and what is wrong in it.
    pub fn read(folder: &Path) -> Result<ModelFolder, String> {
        let genai = GenaiConfig::read(folder)?;
        let config = json(folder, "config.json")?;
        let generation = json(folder, "generation_config.json")?;
        let positions = ["max_position_embeddings", "n_positions"]
            .iter()
            .find_map(|key| config.as_ref().and_then(|c| c[key].as_u64()));
        let mut eos = Vec::new();
        for (file, value) in [("generation_config.json", &generation), ("config.json", &config)] {
            if let Some(value) = value {
                eos.extend(
                    eos_ids(&value["eos_token_id"]).map_err(|e| format!("{}: {e}", folder.join(file).display()))?,
                );
            }
        }
        eos.extend(genai.iter().flat_map(|g| g.eos.iter().copied()));
        eos.sort_unstable();
        eos.dedup();
        Ok(ModelFolder {
            context: genai.as_ref().and_then(|g| g.context_length).or(positions),
            genai,
            eos,
        })
    }
}

/// The JSON file `name` in `folder`, or `None` when there is none.
fn json(folder: &Path, name: &str) -> Result<Option<Value>, String> {
    let path = folder.join(name);
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| format!("{} is not JSON: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder of `files`, removed when dropped.
    struct Folder(std::path::PathBuf);

    impl Folder {
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Folder {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn folder(files: &[(&str, &str)]) -> Folder {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("vramguard-folder-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
        Folder(dir)
    }

    #[test]
    fn an_optimum_folder_gives_its_positions_and_every_eos_id() {
        let dir = folder(&[
            ("config.json", r#"{"max_position_embeddings": 4096, "eos_token_id": 2}"#),
            (
                "generation_config.json",
                r#"{"eos_token_id": [1, 106], "do_sample": true}"#,
            ),
        ]);
        let read = ModelFolder::read(dir.path()).unwrap();
        assert_eq!(
            (read.context, read.eos, read.genai),
            (Some(4096), vec![1, 2, 106], None)
        );
        let gpt2 = folder(&[("config.json", r#"{"n_positions": 1024}"#)]);
        assert_eq!(ModelFolder::read(gpt2.path()).unwrap().context, Some(1024));
        assert_eq!(ModelFolder::read(folder(&[]).path()).unwrap(), ModelFolder::default());
    }

    #[test]
    fn genai_config_s_context_length_wins_and_bad_files_are_named() {
        let dir = folder(&[
            ("config.json", r#"{"max_position_embeddings": 131072}"#),
            (
                "genai_config.json",
                r#"{"model": {"context_length": 2048, "eos_token_id": [7], "decoder": {"head_size": 16}}}"#,
            ),
        ]);
        let read = ModelFolder::read(dir.path()).unwrap();
        assert_eq!((read.context, read.eos), (Some(2048), vec![7]));
        let bad = folder(&[("generation_config.json", r#"{"eos_token_id": "</s>"}"#)]);
        let err = ModelFolder::read(bad.path()).unwrap_err();
        assert!(
            err.ends_with("generation_config.json: `eos_token_id` \"</s>\" is not a token id"),
            "{err}"
        );
        let broken = folder(&[("config.json", "{")]);
        assert!(
            ModelFolder::read(broken.path())
                .unwrap_err()
                .contains("config.json is not JSON")
        );
    }
}
