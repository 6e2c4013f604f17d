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

/// The local layers of a sliding-window model whose caches hold a window, not the sequence:
/// `GroupQueryAttention` with `sliding_window_cache` (ONNX Runtime GenAI's builds of Gemma 2
/// and 3, Mistral, Phi-3 small...). Such a layer's past and present are `[batch, kv_heads,
/// size, head_size]` from the prompt's run on (the operator refuses fewer slots than its
/// `local_window_size`), whatever the sequence's length: the operator keeps a row's latest
/// positions at its start, by the row's own length (`attention_mask`), and evicts the oldest
/// itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Positions each local layer attends to (`local_window_size`), and the slots its cache
    /// holds: CUDA's kernel takes no other capacity.
    pub size: u64,
    /// The local layers: bit `i` for layer `i`.
    pub layers: u128,
}

impl Window {
    /// The most layers a window's set names.
    pub const MAX_LAYERS: usize = 128;

    /// Whether layer `layer`'s cache is the window.
    pub fn holds(&self, layer: usize) -> bool {
        layer < Self::MAX_LAYERS && self.layers & (1 << layer) != 0
    }

    /// How many layers' caches are windows.
    pub fn count(&self) -> u64 {
        u64::from(self.layers.count_ones())
    }

    /// As carried in model metadata: `size:layer,layer,...`.
    fn to_text(self) -> String {
        let layers: Vec<String> = (0..Self::MAX_LAYERS)
            .filter(|&l| self.holds(l))
            .map(|l| l.to_string())
            .collect();
        format!("{}:{}", self.size, layers.join(","))
    }

    fn from_text(text: &str) -> Option<Window> {
        let (size, layers) = text.split_once(':')?;
        let mut window = Window {
            size: size.parse().ok().filter(|s| *s > 0)?,
            layers: 0,
        };
        for layer in layers.split(',') {
            let layer: usize = layer.parse().ok().filter(|l| *l < Self::MAX_LAYERS)?;
            window.layers |= 1 << layer;
        }
        Some(window)
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
    /// The layers whose caches are windows, read from the graph's operators.
    pub window: Option<Window>,
    /// The sliding window the model's folder names (`config.json`), when its caches are not
    /// windows: the graph's attention mask then applies it by cache slot.
    pub slot_window: Option<u64>,
}

impl CacheHints {
    /// The model metadata keys the hints are carried under.
    pub const METADATA: [&'static str; 6] = [
        "vramguard.kv_head_size",
        "vramguard.kv_heads",
        "vramguard.cache_padding",
        "vramguard.context",
        "vramguard.kv_window",
        "vramguard.slot_window",
    ];

    /// The hints as metadata entries (only those that say something).
    pub fn to_metadata(&self) -> Vec<(&'static str, String)> {
        let [head_size, kv_heads, padding, context, window, slot_window] = Self::METADATA;
        let mut entries = vec![(padding, self.padding.name().to_string())];
        let numbers = [
            (head_size, self.head_size),
            (kv_heads, self.kv_heads),
            (context, self.context),
            (slot_window, self.slot_window),
        ];
        entries.extend(numbers.into_iter().filter_map(|(k, v)| Some((k, v?.to_string()))));
        entries.extend(self.window.map(|w| (window, w.to_text())));
        entries
    }

    /// The hints carried in a model's metadata (`get` looks a key up); none when it has none.
    pub fn from_metadata(get: impl Fn(&str) -> Option<String>) -> Result<CacheHints, String> {
        let [head_size, kv_heads, padding, context, window, slot_window] = Self::METADATA;
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
        let window = get(window)
            .map(|v| {
                Window::from_text(&v)
                    .ok_or_else(|| format!("model metadata `{window}` is `{v}`, not `size:layer,layer,...`"))
            })
            .transpose()?;
        Ok(CacheHints {
            head_size: number(head_size)?,
            kv_heads: number(kv_heads)?,
            padding,
            context: number(context)?,
            window,
            slot_window: number(slot_window)?,
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
    /// The layers whose caches hold a window, not the sequence.
    pub window: Option<Window>,
    /// A sliding window the attention mask applies by cache slot (Optimum's exports): a row's
    /// slots must then be its positions, with no masked slot between them.
    pub slot_window: Option<u64>,
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
    /// Bytes one layer's key and value hold per position.
    fn layer_bytes_per_position(&self) -> u64 {
        2 * self.kv_heads * self.head_size * self.kv_datatype.size() as u64
    }

    /// Bytes the KV cache holds per token of one sequence: key and value of every layer whose
    /// cache grows with the sequence (a windowed layer's does not: [`Self::kv_window_bytes`]).
    pub fn kv_bytes_per_token(&self) -> u64 {
        let windowed = self.window.map_or(0, |w| w.count());
        (self.layers as u64).saturating_sub(windowed) * self.layer_bytes_per_position()
    }

    /// Bytes the windowed layers' caches hold per sequence, whatever its length: each its
    /// window's slots, allocated from the prompt's run on.
    pub fn kv_window_bytes(&self) -> u64 {
        self.window
            .map_or(0, |w| w.count() * w.size * self.layer_bytes_per_position())
    }

    /// Whether layer `layer`'s cache is a window.
    pub fn windowed(&self, layer: usize) -> bool {
        self.window.is_some_and(|w| w.holds(layer))
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
        if let Some(window) = hints.window
            && let Some(layer) = (layers..Window::MAX_LAYERS).find(|&l| window.holds(l))
        {
            return Err(format!(
                "the graph's attention keeps a window of layer {layer}'s cache, but it has {layers} layers"
            ));
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
            window: hints.window,
            slot_window: hints.slot_window.filter(|_| hints.window.is_none()),
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

/// `inputs` of a run with each windowed layer's empty past (a prompt's, as [`step_inputs`]
/// makes it) given its window's slots in zeros: the operator takes no fewer, and reads none of
/// them before the row's length. Zeros of FP32 come from the allocator untouched (pages the
/// system maps when written), so a cache of the window costs memory where it is filled.
pub fn open_windows(layout: &DecoderLayout, inputs: &mut [Tensor]) {
    let Some(window) = layout.window else { return };
    for tensor in inputs.iter_mut() {
        let layer = tensor
            .name
            .strip_prefix("past_key_values.")
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(layer, _)| layer.parse::<usize>().ok());
        let fresh = matches!(tensor.shape.as_slice(), [_, _, 0, _]);
        if !layer.is_some_and(|l| window.holds(l)) || !fresh {
            continue;
        }
        tensor.shape[2] = window.size as i64;
        let n = tensor.shape.iter().map(|&d| d.max(0) as usize).product();
        tensor.data = match tensor.data {
            TensorData::Fp16(_) => TensorData::Fp16(vec![half::f16::ZERO; n]),
            _ => TensorData::Fp32(vec![0.0; n]),
        };
    }
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
            window: Some(Window {
                size: 4096,
                layers: 0b101 | 1 << 127,
            }),
            slot_window: Some(512),
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
        for bad in ["8", "0:1", "8:128", "8:x", "8:"] {
            let err = CacheHints::from_metadata(|k| (k == "vramguard.kv_window").then(|| bad.to_string())).unwrap_err();
            assert_eq!(
                err,
                format!("model metadata `vramguard.kv_window` is `{bad}`, not `size:layer,layer,...`")
            );
        }
    }

    #[test]
    fn a_windowed_layer_holds_its_window_per_sequence_and_its_first_pass_opens_it() {
        // Gemma 2's pattern: layer 0 local (a window of 8), layer 1 global.
        let hints = CacheHints {
            padding: Padding::Right,
            window: Some(Window { size: 8, layers: 0b01 }),
            ..none()
        };
        let layout = DecoderLayout::detect(&optimum(2, 2, 16), &hints).unwrap().unwrap();
        assert!(layout.windowed(0) && !layout.windowed(1));
        // One layer grows, 2 × 2 heads × 16 × 4 bytes a position; the other is 8 of them.
        assert_eq!((layout.kv_bytes_per_token(), layout.kv_window_bytes()), (256, 8 * 256));
        let mut inputs = step_inputs(&layout, &[5, 6, 7], 0, Vec::new());
        open_windows(&layout, &mut inputs);
        let past = |name: &str| inputs.iter().find(|t| t.name == name).unwrap();
        for kind in ["key", "value"] {
            let local = past(&format!("past_key_values.0.{kind}"));
            assert_eq!(local.shape, vec![1, 2, 8, 16]);
            assert_eq!(local.data, TensorData::Fp32(vec![0.0; 2 * 8 * 16]));
            assert_eq!(past(&format!("past_key_values.1.{kind}")).shape, vec![1, 2, 0, 16]);
        }
        // A cache carried from the last run stays as it is.
        let carried = vec![Tensor {
            name: "present.0.key".into(),
            shape: vec![1, 2, 8, 16],
            data: TensorData::Fp32(vec![1.0; 2 * 8 * 16]),
        }];
        let mut inputs = step_inputs(&layout, &[5], 3, carried.clone());
        open_windows(&layout, &mut inputs);
        assert_eq!(inputs.last().unwrap().data, carried[0].data);
        // A window on a layer the graph does not have is refused.
        let beyond = CacheHints {
            window: Some(Window { size: 8, layers: 0b100 }),
            ..hints
        };
        let err = DecoderLayout::detect(&optimum(2, 2, 16), &beyond).unwrap().unwrap_err();
        assert_eq!(
            err,
            "the graph's attention keeps a window of layer 2's cache, but it has 2 layers"
        );
    }
}
