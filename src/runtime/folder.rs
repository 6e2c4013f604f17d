//! What a decoder's folder says beside its graph, as the exporters write it: ONNX Runtime
//! GenAI's `genai_config.json` ([`GenaiConfig`]), and the Hugging Face `config.json` and
//! `generation_config.json` that Optimum copies: the most positions the model takes, the
//! tokens that end its answers, and the sampling its authors chose for it.

use std::path::Path;

use serde_json::Value;

use super::genai::{GenaiConfig, eos_ids};
use crate::core::model::BuiltinModel;

/// What vramguard reads from a model's folder.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelFolder {
    /// `genai_config.json`, when the folder has one.
    pub genai: Option<GenaiConfig>,
    /// The most positions the model takes: `genai_config.json`'s `model.context_length`, else
    /// `config.json`'s `max_position_embeddings` (`n_positions` in GPT-2's).
    pub context: Option<u64>,
    /// Token ids that end an answer: every `eos_token_id` (a number or a list) of
    /// `generation_config.json`, `genai_config.json` and `config.json`.
    pub eos: Vec<u32>,
    /// The sampling a request that says none gets.
    pub sampling: SamplingDefaults,
    /// `config.json`'s `sliding_window`, unless its `use_sliding_window` is false: the
    /// positions a local layer attends to (Gemma 2 and 3, Mistral...).
    pub sliding_window: Option<u64>,
}

/// `generation_config.json`'s `temperature`, `top_p`, `top_k` and `repetition_penalty`: what a
/// request that does not set them gets, as vLLM applies them (whatever its `do_sample`). `genai_config.json`'s
/// `search` section is not read for them: the builder writes `transformers`' own defaults
/// there (`top_k` 50) whether or not the model's authors chose any.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingDefaults {
    /// Softmax temperature.
    pub temperature: Option<f32>,
    /// Nucleus sampling's probability mass.
    pub top_p: Option<f32>,
    /// Only the most likely tokens (0: all).
    pub top_k: Option<u32>,
    /// `transformers`' repetition penalty (1: none).
    pub repetition_penalty: Option<f32>,
}

impl SamplingDefaults {
    /// The defaults of a `generation_config.json`, each checked as a request's would be.
    fn read(config: &Value) -> Result<SamplingDefaults, String> {
        let number = |key: &str, ok: &dyn Fn(f64) -> bool, range: &str| match &config[key] {
            Value::Null => Ok(None),
            v => v
                .as_f64()
                .filter(|x| ok(*x))
                .map(Some)
                .ok_or_else(|| format!("`{key}` is {v}, not a number {range}")),
        };
        Ok(SamplingDefaults {
            temperature: number("temperature", &|t| (0.0..=2.0).contains(&t), "from 0 to 2")?.map(|t| t as f32),
            top_p: number("top_p", &|p| p > 0.0 && p <= 1.0, "above 0 and at most 1")?.map(|p| p as f32),
            top_k: number(
                "top_k",
                &|k| k >= 0.0 && k.fract() == 0.0 && k <= f64::from(u32::MAX),
                "of tokens",
            )?
            .map(|k| k as u32),
            repetition_penalty: number("repetition_penalty", &|r| r > 0.0 && r.is_finite(), "above 0")?
                .map(|r| r as f32),
        })
    }
}

/// Tokens that end a turn, by the names model families give them.
const END_TOKENS: [&str; 7] = [
    "<|endoftext|>",
    "</s>",
    "<eos>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|end|>",
];

impl ModelFolder {
    /// The token ids that end an answer: what the folder names; the names families give end
    /// tokens are only a guess for a model whose folder says nothing (a shared tokenizer may
    /// hold another family's end token as an ordinary one).
    pub fn end_tokens(&self, tokenizer: &tokenizers::Tokenizer) -> Vec<u32> {
        match self.eos.is_empty() {
            true => END_TOKENS.iter().filter_map(|t| tokenizer.token_to_id(t)).collect(),
            false => self.eos.clone(),
        }
    }

    /// The files of `folder` (each optional); an error names the file and what is wrong in it.
    pub fn read(folder: &Path) -> Result<ModelFolder, String> {
        let genai = GenaiConfig::read(folder)?;
        let config = json(folder, "config.json")?;
        let generation = json(folder, "generation_config.json")?;
        ModelFolder::of(genai, config.as_ref(), generation.as_ref(), &|file| {
            folder.join(file).display().to_string()
        })
    }

    /// What a bundled model says of itself: its `config.json`, read as a folder's (the bundled
    /// decoder's positions and end token); nothing for one that has none.
    pub fn bundled(model: BuiltinModel) -> Result<ModelFolder, String> {
        let Some(bytes) = model.config() else {
            return Ok(ModelFolder::default());
        };
        let config: Value = serde_json::from_slice(bytes)
            .map_err(|e| format!("builtin:{}'s config.json is not JSON: {e}", model.name()))?;
        ModelFolder::of(None, Some(&config), None, &|file| {
            format!("builtin:{}'s {file}", model.name())
        })
    }

    /// The folder made of its files, each optional; `named(file)` names a file for an error.
    fn of(
        genai: Option<GenaiConfig>,
        config: Option<&Value>,
        generation: Option<&Value>,
        named: &dyn Fn(&str) -> String,
    ) -> Result<ModelFolder, String> {
        let positions = ["max_position_embeddings", "n_positions"]
            .iter()
            .find_map(|key| config.and_then(|c| c[key].as_u64()));
        let mut eos = Vec::new();
        for (file, value) in [("generation_config.json", generation), ("config.json", config)] {
            if let Some(value) = value {
                eos.extend(eos_ids(&value["eos_token_id"]).map_err(|e| format!("{}: {e}", named(file)))?);
            }
        }
        eos.extend(genai.iter().flat_map(|g| g.eos.iter().copied()));
        let sampling = match generation {
            Some(config) => {
                SamplingDefaults::read(config).map_err(|e| format!("{}: {e}", named("generation_config.json")))?
            }
            None => SamplingDefaults::default(),
        };
        eos.sort_unstable();
        eos.dedup();
        let sliding_window = config
            .as_ref()
            .filter(|c| c["use_sliding_window"].as_bool() != Some(false))
            .and_then(|c| c["sliding_window"].as_u64());
        Ok(ModelFolder {
            sliding_window,
            context: genai.as_ref().and_then(|g| g.context_length).or(positions),
            genai,
            eos,
            sampling,
        })
    }
}

/// The JSON file `name` in `folder`, or `None` when there is none.
pub(super) fn json(folder: &Path, name: &str) -> Result<Option<Value>, String> {
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

    /// The bundled decoder says its positions and end token in its own config.json, as an
    /// exported folder does; a bundled graph without one says nothing.
    #[test]
    fn the_bundled_decoder_says_its_positions() {
        let decoder = ModelFolder::bundled(BuiltinModel::Decoder).unwrap();
        assert_eq!((decoder.context, decoder.eos.as_slice()), (Some(32768), &[0][..]));
        assert_eq!(
            ModelFolder::bundled(BuiltinModel::Encoder).unwrap(),
            ModelFolder::default()
        );
    }

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
    fn generation_config_s_sampling_is_the_default_and_checked_as_a_request_s() {
        let dir = folder(&[(
            "generation_config.json",
            r#"{"do_sample": true, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}"#,
        )]);
        let sampling = ModelFolder::read(dir.path()).unwrap().sampling;
        assert_eq!(
            sampling,
            SamplingDefaults {
                temperature: Some(0.6),
                top_p: Some(0.9),
                top_k: Some(20),
                repetition_penalty: Some(1.05),
            }
        );
        let hot = folder(&[("generation_config.json", r#"{"temperature": 3}"#)]);
        let err = ModelFolder::read(hot.path()).unwrap_err();
        assert!(
            err.ends_with("generation_config.json: `temperature` is 3, not a number from 0 to 2"),
            "{err}"
        );
        let half = folder(&[("generation_config.json", r#"{"top_k": 2.5}"#)]);
        assert!(
            ModelFolder::read(half.path())
                .unwrap_err()
                .ends_with("`top_k` is 2.5, not a number of tokens")
        );
        let none = folder(&[("generation_config.json", r#"{"repetition_penalty": 0}"#)]);
        assert!(
            ModelFolder::read(none.path())
                .unwrap_err()
                .ends_with("`repetition_penalty` is 0, not a number above 0")
        );
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
