//! Decoder models in the layout Hugging Face Optimum exports (`optimum-cli export onnx` with
//! past key values): inputs `input_ids`, `attention_mask`, optionally `position_ids`, and
//! `past_key_values.{i}.key` / `.value` per layer; outputs `logits` and `present.{i}.key` /
//! `.value`, and the same names as ONNX Runtime GenAI's model builder writes them. Everything
//! admission needs about the KV cache is read from the graph: the number of layers, KV heads,
//! head size and element type, so no one configures it by hand; what the graph leaves open
//! (the builder's dynamic head size) and which side a batch's rows are padded on come as
//! [`CacheHints`], read from the model's folder and operators when it is loaded.

use serde::{Deserialize, Serialize};

use crate::core::signature::{ModelSignature, TensorSpec};
use crate::core::tensor::{DataType, Tensor, TensorData};

/// Which side of its sequence axis a batch's shorter rows are padded on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Padding {
    /// Before a row's first position, masked out by zeros in `attention_mask`: how Optimum's
    /// exports batch (their attention builds its mask from `attention_mask`).
    #[default]
    Left,
    /// After a row's last position: every row's positions start at 0 and its
    /// `attention_mask` row is its length in ones, then zeros. `GroupQueryAttention` (ONNX
    /// Runtime GenAI's builds) reads only each row's length from the mask and writes a row's
    /// new position at that length, so left padding would overwrite its real positions.
    Right,
}

impl Padding {
    /// The name [`CacheHints`] are carried by.
    pub fn name(self) -> &'static str {
        match self {
            Padding::Left => "left",
            Padding::Right => "right",
        }
    }
}

/// What a decoder's signature leaves open about its cache, said elsewhere: by the model
/// folder's `genai_config.json` and by the graph's operators. Carried in the model's own
/// metadata ([`CacheHints::METADATA`]) so every backend that builds a session from its bytes,
/// in this process or a worker, reads the same layout.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheHints {
    /// Elements per head, where the graph leaves them dynamic.
    pub head_size: Option<u64>,
    /// Key/value heads, where the graph leaves them dynamic.
    pub kv_heads: Option<u64>,
    /// Which side a batch's shorter rows are padded on.
    pub padding: Padding,
    /// The most positions the model takes (its rotary tables' length), when known.
    pub context: Option<u64>,
}

impl CacheHints {
    /// The model metadata keys the hints are carried under.
    pub const METADATA: [&'static str; 4] = [
        "vramguard.kv_head_size",
        "vramguard.kv_heads",
        "vramguard.cache_padding",
        "vramguard.context",
    ];

    /// The hints as metadata entries (only those that say something).
    pub fn to_metadata(&self) -> Vec<(&'static str, String)> {
        let [head_size, kv_heads, padding, context] = Self::METADATA;
        let mut entries = vec![(padding, self.padding.name().to_string())];
        let numbers = [
            (head_size, self.head_size),
            (kv_heads, self.kv_heads),
            (context, self.context),
        ];
        entries.extend(numbers.into_iter().filter_map(|(k, v)| Some((k, v?.to_string()))));
        entries
    }

    /// The hints carried in a model's metadata (`get` looks a key up); none when it has none.
    pub fn from_metadata(get: impl Fn(&str) -> Option<String>) -> Result<CacheHints, String> {
        let [head_size, kv_heads, padding, context] = Self::METADATA;
        let number = |key: &str| {
            get(key)
                .map(|v| {
                    v.parse::<u64>()
                        .map_err(|_| format!("model metadata `{key}` is `{v}`, not a count"))
                })
                .transpose()
        };
        let padding = match get(padding).as_deref() {
            None | Some("left") => Padding::Left,
            Some("right") => Padding::Right,
            Some(other) => {
                return Err(format!(
                    "model metadata `{padding}` is `{other}`, not `left` or `right`"
                ));
            }
        };
        Ok(CacheHints {
            head_size: number(head_size)?,
            kv_heads: number(kv_heads)?,
            padding,
            context: number(context)?,
        })
    }
}

/// What the graph (and its [`CacheHints`]) says about a decoder's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecoderLayout {
    /// Transformer layers (one key and one value tensor each).
    pub layers: usize,
    /// Key/value heads per layer (fewer than query heads with grouped-query attention).
    pub kv_heads: u64,
    /// Elements per head.
    pub head_size: u64,
    /// Element type of the cache.
    pub kv_datatype: DataType,
    /// Vocabulary size (the last axis of `logits`), when the graph fixes it.
    pub vocab: Option<u64>,
    /// Whether the graph takes `position_ids`.
    pub position_ids: bool,
    /// Which side a batch's shorter rows are padded on.
    pub padding: Padding,
    /// The most positions (prompt and generated tokens) the model takes, when known.
    pub context: Option<u64>,
    /// Which positions the prompt's run computes logits of.
    pub prefill_logits: PrefillLogits,
}

/// Which positions a decoder's prompt run computes logits of, as its `logits` output's
/// sequence axis says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillLogits {
    /// Every position's (`[batch, sequence, vocab]`): `prompt × vocab × 4` bytes of FP32.
    EveryPosition,
    /// The last position's only (`[batch, 1, vocab]`, as the graph is rewritten at load when
    /// its LM head is found): `vocab × 4` bytes a sequence, whatever the prompt's length.
    LastPosition,
}

impl DecoderLayout {
    /// Bytes the KV cache holds per token of one sequence: key and value, every layer.
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * self.layers as u64 * self.kv_heads * self.head_size * self.kv_datatype.size() as u64
    }

    /// Bytes of one position's logits (FP32), when the vocabulary is known.
    pub fn logits_bytes_per_position(&self) -> u64 {
        self.vocab.unwrap_or(0) * 4
    }

    /// The layout of `signature` with what `hints` add: `None` when it is not a decoder with
    /// past key values (no `past_key_values.0.key` input), an error naming the tensor when it
    /// looks like one but does not follow the layout.
    pub fn detect(signature: &ModelSignature, hints: &CacheHints) -> Option<Result<DecoderLayout, String>> {
        let input = |name: &str| signature.inputs.iter().find(|t| t.name == name);
        let output = |name: &str| signature.outputs.iter().find(|t| t.name == name);
        input("past_key_values.0.key")?;
        Some(Self::read(&input, &output, signature, hints))
    }

    fn read<'a>(
        input: &impl Fn(&str) -> Option<&'a TensorSpec>,
        output: &impl Fn(&str) -> Option<&'a TensorSpec>,
        signature: &ModelSignature,
        hints: &CacheHints,
    ) -> Result<DecoderLayout, String> {
        for name in ["input_ids", "attention_mask"] {
            let spec = input(name).ok_or_else(|| format!("a decoder with past key values needs input `{name}`"))?;
            if spec.datatype != DataType::Int64 || spec.shape.len() != 2 {
                return Err(format!(
                    "input `{name}` must be INT64 [batch, sequence], not {} {:?}",
                    spec.datatype, spec.shape
                ));
            }
        }
        let first = input("past_key_values.0.key").expect("detected");
        let (kv_heads, head_size) = cache_heads(first, hints)?;
        let kv_datatype = first.datatype;
        if !matches!(kv_datatype, DataType::Fp32 | DataType::Fp16) {
            return Err(format!(
                "input `past_key_values.0.key` is {kv_datatype}; the KV cache must be FP32 or FP16"
            ));
        }
        let mut layers = 0;
        loop {
            let names = [
                format!("past_key_values.{layers}.key"),
                format!("past_key_values.{layers}.value"),
            ];
            let found: Vec<Option<&TensorSpec>> = names.iter().map(|n| input(n)).collect();
            match (found[0], found[1]) {
                (None, None) => break,
                (Some(key), Some(value)) => {
                    for spec in [key, value] {
                        if spec.datatype != kv_datatype || spec.shape.len() != 4 {
                            return Err(format!(
                                "input `{}` is {} {:?}; every layer's cache must be {kv_datatype} like layer 0's",
                                spec.name, spec.datatype, spec.shape
                            ));
                        }
                        let agrees = |d: i64, want: u64| d <= 0 || d == want as i64;
                        if !agrees(spec.shape[1], kv_heads) || !agrees(spec.shape[3], head_size) {
                            return Err(format!(
                                "input `{}` has shape {:?}; layer 0's is [batch, {kv_heads}, past_sequence, {head_size}]",
                                spec.name, spec.shape
                            ));
                        }
                    }
                    for kind in ["key", "value"] {
                        let present = format!("present.{layers}.{kind}");
                        if output(&present).is_none() {
                            return Err(format!(
                                "output `{present}` is missing (layer {layers} has a past input)"
                            ));
                        }
                    }
                    layers += 1;
                }
                _ => {
                    return Err(format!(
                        "layer {layers} has only one of `{}` and `{}`",
                        names[0], names[1]
                    ));
                }
            }
        }
        let logits = output("logits").ok_or("a decoder needs output `logits`")?;
        let (vocab, prefill_logits) = match logits.shape.as_slice() {
            [_, positions, v] => (
                u64::try_from(*v).ok().filter(|v| *v > 0),
                match positions {
                    1 => PrefillLogits::LastPosition,
                    _ => PrefillLogits::EveryPosition,
                },
            ),
            shape => {
                return Err(format!(
                    "output `logits` must be [batch, sequence, vocab], not {shape:?}"
                ));
            }
        };
        // No input may be left over: a graph with more inputs than the layout needs cannot be
        // driven by a generation loop that only knows these.
        let known = |name: &str| {
            matches!(name, "input_ids" | "attention_mask" | "position_ids")
                || (name.starts_with("past_key_values.") && (name.ends_with(".key") || name.ends_with(".value")))
        };
        if let Some(other) = signature.inputs.iter().find(|t| !known(&t.name)) {
            return Err(format!("input `{}` is not part of the decoder layout", other.name));
        }
        Ok(DecoderLayout {
            layers,
            kv_heads,
            head_size,
            kv_datatype,
            vocab,
            position_ids: input("position_ids").is_some(),
            padding: hints.padding,
            context: hints.context,
            prefill_logits,
        })
    }
}

/// The KV heads and head size of the first layer's cache `first`: a dimension the graph leaves
/// dynamic is taken from `hints`; one both fix must agree.
fn cache_heads(first: &TensorSpec, hints: &CacheHints) -> Result<(u64, u64), String> {
    let resolve = |what: &str, fixed: i64, hinted: Option<u64>| match (
        u64::try_from(fixed).ok().filter(|d| *d > 0),
        hinted,
    ) {
        (Some(d), Some(h)) if d != h => Err(format!(
            "input `past_key_values.0.key` has {d} {what} but the model's folder says {h}"
        )),
        (Some(d), _) | (None, Some(d)) => Ok(d),
        (None, None) => Err(format!(
            "input `past_key_values.0.key` must be [batch, kv_heads, past_sequence, head_size] with fixed heads and head size, not {:?}, and the model's folder does not say its {what} (`genai_config.json`: `model.decoder.head_size`, `num_key_value_heads`)",
            first.shape
        )),
    };
    match first.shape.as_slice() {
        [_, heads, _, size] => Ok((
            resolve("KV heads", *heads, hints.kv_heads)?,
            resolve("head size", *size, hints.head_size)?,
        )),
        shape => Err(format!(
            "input `past_key_values.0.key` must be [batch, kv_heads, past_sequence, head_size], not {shape:?}"
        )),
    }
}

/// The inputs of one run: `new` tokens after `past` positions whose cache is `cache` (the
/// previous run's `present.*` outputs; empty for the prompt's run).
pub fn step_inputs(layout: &DecoderLayout, new: &[u32], past: usize, cache: Vec<Tensor>) -> Vec<Tensor> {
    let n = new.len();
    let mut inputs = vec![
        Tensor {
            name: "input_ids".into(),
            shape: vec![1, n as i64],
            data: TensorData::Int64(new.iter().map(|&t| i64::from(t)).collect()),
        },
        Tensor {
            name: "attention_mask".into(),
            shape: vec![1, (past + n) as i64],
            data: TensorData::Int64(vec![1; past + n]),
        },
    ];
    if layout.position_ids {
        inputs.push(Tensor {
            name: "position_ids".into(),
            shape: vec![1, n as i64],
            data: TensorData::Int64((past..past + n).map(|p| p as i64).collect()),
        });
    }
    if cache.is_empty() {
        let empty = match layout.kv_datatype {
            DataType::Fp16 => TensorData::Fp16(Vec::new()),
            _ => TensorData::Fp32(Vec::new()),
        };
        for layer in 0..layout.layers {
            for kind in ["key", "value"] {
                inputs.push(Tensor {
                    name: format!("past_key_values.{layer}.{kind}"),
                    shape: vec![1, layout.kv_heads as i64, 0, layout.head_size as i64],
                    data: empty.clone(),
                });
            }
        }
    } else {
        for mut tensor in cache {
            tensor.name = tensor.name.replacen("present.", "past_key_values.", 1);
            inputs.push(tensor);
        }
    }
    inputs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn none() -> CacheHints {
        CacheHints::default()
    }

    fn spec(name: &str, datatype: DataType, shape: &[i64]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            datatype,
            shape: shape.to_vec(),
            symbols: vec![],
        }
    }

    /// An Optimum-style signature with `layers` layers of `heads`×`size` FP32 caches.
    fn optimum(layers: usize, heads: i64, size: i64) -> ModelSignature {
        let mut inputs = vec![
            spec("input_ids", DataType::Int64, &[-1, -1]),
            spec("attention_mask", DataType::Int64, &[-1, -1]),
            spec("position_ids", DataType::Int64, &[-1, -1]),
        ];
        let mut outputs = vec![spec("logits", DataType::Fp32, &[-1, -1, 512])];
        for i in 0..layers {
            for kind in ["key", "value"] {
                inputs.push(spec(
                    &format!("past_key_values.{i}.{kind}"),
                    DataType::Fp32,
                    &[-1, heads, -1, size],
                ));
                outputs.push(spec(
                    &format!("present.{i}.{kind}"),
                    DataType::Fp32,
                    &[-1, heads, -1, size],
                ));
            }
        }
        ModelSignature { inputs, outputs }
    }

    #[test]
    fn the_kv_cache_size_comes_from_the_graph() {
        let layout = DecoderLayout::detect(&optimum(2, 2, 16), &none()).unwrap().unwrap();
        assert_eq!(layout.layers, 2);
        assert_eq!((layout.kv_heads, layout.head_size), (2, 16));
        assert_eq!(layout.vocab, Some(512));
        assert!(layout.position_ids);
        // key + value × 2 layers × 2 heads × 16 × 4 bytes.
        assert_eq!(layout.kv_bytes_per_token(), 512);
        assert_eq!(layout.logits_bytes_per_position(), 2048);
        assert_eq!(layout.prefill_logits, PrefillLogits::EveryPosition);
        // A graph rewritten to compute the last position's logits only says so.
        let mut rewritten = optimum(2, 2, 16);
        rewritten.outputs[0].shape = vec![-1, 1, 512];
        let layout = DecoderLayout::detect(&rewritten, &none()).unwrap().unwrap();
        assert_eq!(layout.prefill_logits, PrefillLogits::LastPosition);
        // A Llama-2-7B-shaped cache: 32 layers, 32 heads of 128, FP16 = 512 KiB per token.
        let mut llama = optimum(32, 32, 128);
        for t in llama.inputs.iter_mut().filter(|t| t.name.starts_with("past_")) {
            t.datatype = DataType::Fp16;
        }
        assert_eq!(
            DecoderLayout::detect(&llama, &none())
                .unwrap()
                .unwrap()
                .kv_bytes_per_token(),
            512 << 10
        );
    }

    #[test]
    fn other_models_are_not_decoders_and_broken_layouts_say_why() {
        let encoder = ModelSignature {
            inputs: vec![spec("input", DataType::Fp32, &[-1, -1, 64])],
            outputs: vec![spec("hidden", DataType::Fp32, &[-1, -1, 64])],
        };
        assert!(DecoderLayout::detect(&encoder, &none()).is_none());

        let mut missing_value = optimum(2, 2, 16);
        missing_value.inputs.retain(|t| t.name != "past_key_values.1.value");
        let err = DecoderLayout::detect(&missing_value, &none()).unwrap().unwrap_err();
        assert!(err.contains("layer 1 has only one of"), "{err}");

        let mut dynamic_heads = optimum(1, 2, 16);
        dynamic_heads.inputs[3].shape = vec![-1, -1, -1, 16];
        let err = DecoderLayout::detect(&dynamic_heads, &none()).unwrap().unwrap_err();
        assert!(err.contains("fixed heads and head size"), "{err}");

        let mut no_present = optimum(2, 2, 16);
        no_present.outputs.retain(|t| t.name != "present.1.key");
        let err = DecoderLayout::detect(&no_present, &none()).unwrap().unwrap_err();
        assert_eq!(err, "output `present.1.key` is missing (layer 1 has a past input)");

        let mut extra = optimum(1, 2, 16);
        extra.inputs.push(spec("token_type_ids", DataType::Int64, &[-1, -1]));
        let err = DecoderLayout::detect(&extra, &none()).unwrap().unwrap_err();
        assert_eq!(err, "input `token_type_ids` is not part of the decoder layout");
    }

    #[test]
    fn what_the_graph_leaves_open_comes_from_the_hints_and_must_agree_with_it() {
        // As ONNX Runtime GenAI's builder writes it: `[batch_size, 2, past_sequence_length, kv_cache_dim]`.
        let mut genai = optimum(2, 2, 16);
        for t in genai.inputs.iter_mut().chain(genai.outputs.iter_mut()) {
            if t.shape.len() == 4 {
                t.shape[3] = -1;
            }
        }
        genai.inputs.retain(|t| t.name != "position_ids");
        let err = DecoderLayout::detect(&genai, &none()).unwrap().unwrap_err();
        assert!(err.contains("does not say its head size"), "{err}");
        let hints = CacheHints {
            head_size: Some(16),
            padding: Padding::Right,
            context: Some(256),
            ..none()
        };
        let layout = DecoderLayout::detect(&genai, &hints).unwrap().unwrap();
        assert_eq!((layout.kv_heads, layout.head_size, layout.layers), (2, 16, 2));
        assert_eq!(
            (layout.padding, layout.context, layout.position_ids),
            (Padding::Right, Some(256), false)
        );
        let wrong = CacheHints {
            kv_heads: Some(4),
            ..hints
        };
        let err = DecoderLayout::detect(&genai, &wrong).unwrap().unwrap_err();
        assert_eq!(
            err,
            "input `past_key_values.0.key` has 2 KV heads but the model's folder says 4"
        );
    }

    #[test]
    fn hints_travel_in_model_metadata_and_bad_values_are_named() {
        let hints = CacheHints {
            head_size: Some(64),
            kv_heads: None,
            padding: Padding::Right,
            context: Some(4096),
        };
        let entries = hints.to_metadata();
        let get = |key: &str| entries.iter().find(|(k, _)| *k == key).map(|(_, v)| v.clone());
        assert_eq!(CacheHints::from_metadata(get).unwrap(), hints);
        assert_eq!(CacheHints::from_metadata(|_| None).unwrap(), none());
        let err =
            CacheHints::from_metadata(|k| (k == "vramguard.cache_padding").then(|| "middle".to_string())).unwrap_err();
        assert_eq!(
            err,
            "model metadata `vramguard.cache_padding` is `middle`, not `left` or `right`"
        );
        let err = CacheHints::from_metadata(|k| (k == "vramguard.context").then(|| "lots".to_string())).unwrap_err();
        assert_eq!(err, "model metadata `vramguard.context` is `lots`, not a count");
    }
}
