//! Decoder models in the layout Hugging Face Optimum exports (`optimum-cli export onnx` with
//! past key values): inputs `input_ids`, `attention_mask`, optionally `position_ids`, and
//! `past_key_values.{i}.key` / `.value` per layer; outputs `logits` and `present.{i}.key` /
//! `.value`. Everything admission needs about the KV cache is read from the graph: the number
//! of layers, KV heads, head size and element type, so no one configures it by hand.

use serde::{Deserialize, Serialize};

use crate::core::signature::{ModelSignature, TensorSpec};
use crate::core::tensor::{DataType, Tensor, TensorData};

/// What the graph says about a decoder's KV cache.
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

    /// The layout of `signature`: `None` when it is not a decoder with past key values (no
    /// `past_key_values.0.key` input), an error naming the tensor when it looks like one but
    /// does not follow the layout.
    pub fn detect(signature: &ModelSignature) -> Option<Result<DecoderLayout, String>> {
        let input = |name: &str| signature.inputs.iter().find(|t| t.name == name);
        let output = |name: &str| signature.outputs.iter().find(|t| t.name == name);
        input("past_key_values.0.key")?;
        Some(Self::read(&input, &output, signature))
    }

    fn read<'a>(
        input: &impl Fn(&str) -> Option<&'a TensorSpec>,
        output: &impl Fn(&str) -> Option<&'a TensorSpec>,
        signature: &ModelSignature,
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
        let (kv_heads, head_size) = match first.shape.as_slice() {
            [_, heads, _, size] if *heads > 0 && *size > 0 => (*heads as u64, *size as u64),
            shape => {
                return Err(format!(
                    "input `past_key_values.0.key` must be [batch, kv_heads, past_sequence, head_size] with fixed heads and head size, not {shape:?}"
                ));
            }
        };
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
                        if spec.shape[1] != kv_heads as i64 || spec.shape[3] != head_size as i64 {
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
            prefill_logits,
        })
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
        let layout = DecoderLayout::detect(&optimum(2, 2, 16)).unwrap().unwrap();
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
        let layout = DecoderLayout::detect(&rewritten).unwrap().unwrap();
        assert_eq!(layout.prefill_logits, PrefillLogits::LastPosition);
        // A Llama-2-7B-shaped cache: 32 layers, 32 heads of 128, FP16 = 512 KiB per token.
        let mut llama = optimum(32, 32, 128);
        for t in llama.inputs.iter_mut().filter(|t| t.name.starts_with("past_")) {
            t.datatype = DataType::Fp16;
        }
        assert_eq!(
            DecoderLayout::detect(&llama).unwrap().unwrap().kv_bytes_per_token(),
            512 << 10
        );
    }

    #[test]
    fn other_models_are_not_decoders_and_broken_layouts_say_why() {
        let encoder = ModelSignature {
            inputs: vec![spec("input", DataType::Fp32, &[-1, -1, 64])],
            outputs: vec![spec("hidden", DataType::Fp32, &[-1, -1, 64])],
        };
        assert!(DecoderLayout::detect(&encoder).is_none());

        let mut missing_value = optimum(2, 2, 16);
        missing_value.inputs.retain(|t| t.name != "past_key_values.1.value");
        let err = DecoderLayout::detect(&missing_value).unwrap().unwrap_err();
        assert!(err.contains("layer 1 has only one of"), "{err}");

        let mut dynamic_heads = optimum(1, 2, 16);
        dynamic_heads.inputs[3].shape = vec![-1, -1, -1, 16];
        let err = DecoderLayout::detect(&dynamic_heads).unwrap().unwrap_err();
        assert!(err.contains("fixed heads and head size"), "{err}");

        let mut no_present = optimum(2, 2, 16);
        no_present.outputs.retain(|t| t.name != "present.1.key");
        let err = DecoderLayout::detect(&no_present).unwrap().unwrap_err();
        assert_eq!(err, "output `present.1.key` is missing (layer 1 has a past input)");

        let mut extra = optimum(1, 2, 16);
        extra.inputs.push(spec("token_type_ids", DataType::Int64, &[-1, -1]));
        let err = DecoderLayout::detect(&extra).unwrap().unwrap_err();
        assert_eq!(err, "input `token_type_ids` is not part of the decoder layout");
    }
}
