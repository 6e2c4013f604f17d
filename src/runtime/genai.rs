//! `genai_config.json`, which ONNX Runtime GenAI's model builder writes beside the decoder
//! (`python -m onnxruntime_genai.models.builder`): what its graph leaves open (the head size
//! is a dynamic `kv_cache_dim`), the positions its rotary tables hold, and the names of its
//! inputs and outputs, which must be the ones vramguard drives.

use std::path::Path;

use serde_json::Value;

/// The file's name, in the model's folder.
pub const FILE: &str = "genai_config.json";

/// What vramguard reads from a model folder's `genai_config.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenaiConfig {
    /// `model.decoder.head_size`.
    pub head_size: Option<u64>,
    /// `model.decoder.num_key_value_heads`.
    pub kv_heads: Option<u64>,
    /// `model.context_length`: the most positions the model takes.
    pub context_length: Option<u64>,
    /// `model.eos_token_id` (a number or a list).
    pub eos: Vec<u32>,
}

/// The input and output names the builder may set (`model.decoder.inputs` / `.outputs`), and
/// the one vramguard drives for each.
const NAMES: [(&str, &str); 8] = [
    ("input_ids", "input_ids"),
    ("attention_mask", "attention_mask"),
    ("position_ids", "position_ids"),
    ("past_key_names", "past_key_values.%d.key"),
    ("past_value_names", "past_key_values.%d.value"),
    ("logits", "logits"),
    ("present_key_names", "present.%d.key"),
    ("present_value_names", "present.%d.value"),
];

impl GenaiConfig {
    /// The `genai_config.json` in `folder`, or `None` when there is none; an error names the
    /// file and what in it vramguard cannot follow.
    pub fn read(folder: &Path) -> Result<Option<GenaiConfig>, String> {
        let path = folder.join(FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        Self::parse(&text)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The config in `text`.
    pub fn parse(text: &str) -> Result<GenaiConfig, String> {
        let root: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let model = &root["model"];
        let decoder = &model["decoder"];
        for (section, kind) in [(&decoder["inputs"], "inputs"), (&decoder["outputs"], "outputs")] {
            let Some(names) = section.as_object() else { continue };
            for (key, name) in names {
                let name = name.as_str().unwrap_or_default();
                match NAMES.iter().find(|(k, _)| k == key) {
                    Some((_, ours)) if name == *ours => {}
                    Some((_, ours)) => {
                        return Err(format!(
                            "`model.decoder.{kind}.{key}` is `{name}`; vramguard drives the decoder by the names the builder and Optimum write (`{ours}`)"
                        ));
                    }
                    None => {
                        return Err(format!(
                            "`model.decoder.{kind}.{key}` (`{name}`) is not part of the decoder layout vramguard drives (input_ids, attention_mask, position_ids, past key values; logits, present key values)"
                        ));
                    }
                }
            }
        }
        let count = |value: &Value, what: &str| match value {
            Value::Null => Ok(None),
            v => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| format!("`{what}` is {v}, not a count")),
        };
        let eos = match &model["eos_token_id"] {
            Value::Null => Vec::new(),
            Value::Array(ids) => ids
                .iter()
                .map(|id| count(id, "model.eos_token_id"))
                .collect::<Result<Vec<_>, _>>()?
                .into_iter()
                .flatten()
                .collect(),
            id => count(id, "model.eos_token_id")?.into_iter().collect(),
        };
        let eos = eos
            .into_iter()
            .map(|id| u32::try_from(id).map_err(|_| format!("`model.eos_token_id` {id} is not a token id")))
            .collect::<Result<_, _>>()?;
        Ok(GenaiConfig {
            head_size: count(&decoder["head_size"], "model.decoder.head_size")?,
            kv_heads: count(&decoder["num_key_value_heads"], "model.decoder.num_key_value_heads")?,
            context_length: count(&model["context_length"], "model.context_length")?,
            eos,
        })
    }
}

/// `eos_token_id` as Hugging Face writes it: absent, a number, or a list of numbers.
pub fn eos_ids(value: &Value) -> Result<Vec<u32>, String> {
    let id = |v: &Value| {
        v.as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(|| format!("`eos_token_id` {v} is not a token id"))
    };
    match value {
        Value::Null => Ok(Vec::new()),
        Value::Array(ids) => ids.iter().map(id).collect(),
        other => id(other).map(|id| vec![id]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As the builder wrote it for a 2-layer Llama (trimmed to what is read).
    const LLAMA: &str = r#"{"model": {"bos_token_id": 0, "context_length": 256, "eos_token_id": [1, 7],
        "decoder": {"head_size": 16, "num_key_value_heads": 2, "num_hidden_layers": 2,
          "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                     "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
          "outputs": {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}},
        "type": "llama"}, "search": {"past_present_share_buffer": true, "top_k": 50}}"#;

    #[test]
    fn the_builder_config_says_head_size_heads_context_and_eos() {
        let config = GenaiConfig::parse(LLAMA).unwrap();
        assert_eq!(
            config,
            GenaiConfig {
                head_size: Some(16),
                kv_heads: Some(2),
                context_length: Some(256),
                eos: vec![1, 7],
            }
        );
        let single = LLAMA.replace("[1, 7]", "2");
        assert_eq!(GenaiConfig::parse(&single).unwrap().eos, vec![2]);
    }

    #[test]
    fn names_vramguard_does_not_drive_are_refused_by_name() {
        let renamed = LLAMA.replace("\"past_key_values.%d.key\"", "\"past.%d.key\"");
        let err = GenaiConfig::parse(&renamed).unwrap_err();
        assert!(
            err.starts_with("`model.decoder.inputs.past_key_names` is `past.%d.key`"),
            "{err}"
        );
        let extra = LLAMA.replace(
            "\"input_ids\": \"input_ids\"",
            "\"input_ids\": \"input_ids\", \"total_sequence_length\": \"total_seq\"",
        );
        let err = GenaiConfig::parse(&extra).unwrap_err();
        assert!(
            err.starts_with("`model.decoder.inputs.total_sequence_length` (`total_seq`) is not part"),
            "{err}"
        );
        let err = GenaiConfig::parse(&LLAMA.replace("\"head_size\": 16", "\"head_size\": \"16\"")).unwrap_err();
        assert_eq!(err, "`model.decoder.head_size` is \"16\", not a count");
        assert!(GenaiConfig::parse("{").unwrap_err().starts_with("not JSON"));
    }
}
