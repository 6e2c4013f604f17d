//! Memory estimates: what a request will need before it runs.
//!
//! A model's profile is `weights + workspace + Σ bytes·Π dimᵖ` over the dynamic axes of its
//! inputs (an image model's height and width, an audio model's samples, an encoder's batch and
//! sequence). It is measured at start-up from ONNX Runtime's own arena peaks at several input
//! sizes along every axis and fitted ([`fit`]), read from a decoder's KV-cache layout, or given
//! in the config. What runs really take is learned afterwards ([`learned`]). The arithmetic is
//! tested without ONNX Runtime.

pub mod fit;
pub mod learned;
pub mod measure;

use serde::{Deserialize, Serialize};

use crate::config::{ConfiguredProfile, ContextAxis};
use crate::core::snapshot::{Estimate, EstimateSource};
use crate::core::tensor::Tensor;
use crate::runtime::onnx::ModelSignature;

pub use measure::measure;

/// Where a profile came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "source")]
pub enum ProfileSource {
    /// Measured at start-up: the input's dimensions (in `axes` order) and the peak working
    /// bytes of each run.
    Measured {
        /// The measured points.
        points: Vec<(Vec<u64>, u64)>,
        /// How long measuring took, in milliseconds.
        measure_ms: u64,
    },
    /// Given in the config (`models[].memory_profile`).
    Config,
    /// A decoder's KV cache, read from its graph: bytes per token of context.
    KvCache {
        /// Transformer layers.
        layers: usize,
        /// Key/value heads per layer.
        kv_heads: u64,
        /// Elements per head.
        head_size: u64,
        /// Key and value bytes per token, every layer whose cache grows with the sequence.
        kv_bytes_per_token: u64,
        /// Key and value bytes per sequence of the layers whose cache is a window (a
        /// sliding-window model's local layers in the GenAI builder's graphs): their window's
        /// slots, whatever the sequence's length.
        #[serde(default, skip_serializing_if = "is_zero")]
        kv_window_bytes: u64,
        /// Which positions the prompt's run computes logits of: the last only once the graph
        /// was rewritten at load, so the logits count per sequence, not per token.
        prefill_logits: crate::runtime::decoder::PrefillLogits,
    },
    /// Could not be measured (the reason is logged); only weights are known.
    Unmeasured {
        /// Why.
        reason: String,
    },
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// What an axis is to the request: how many items, how long a context, or another size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AxisRole {
    /// Items in a batch.
    Batch,
    /// The configured context axis (or a decoder's attention mask): what `shrink_context` cuts.
    Context,
    /// Any other dynamic size (height, width, samples…).
    Size,
}

/// Where a request gives an axis' length: an input and its dimension.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AxisAt {
    /// Input name.
    pub input: String,
    /// Dimension index.
    pub axis: usize,
}

/// A dynamic dimension of a model's inputs. Dimensions that share a symbolic name are one axis.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Axis {
    /// Its symbolic name, or `input[axis]` when the model gives none.
    pub name: String,
    /// What it is to the request.
    pub role: AxisRole,
    /// Where it appears; the first present in a request is read.
    pub at: Vec<AxisAt>,
}

impl Axis {
    /// An axis that appears in one place: dimension `axis` of `input`.
    pub fn single(name: impl Into<String>, role: AxisRole, input: impl Into<String>, axis: usize) -> Axis {
        Axis {
            name: name.into(),
            role,
            at: vec![AxisAt {
                input: input.into(),
                axis,
            }],
        }
    }
}

/// One term of the working memory: `bytes × Π dims[i]^powers[i]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Term {
    /// Bytes per unit.
    pub bytes: f64,
    /// The power of each axis, in the profile's `axes` order.
    pub powers: Vec<u8>,
}

/// A model's memory profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryProfile {
    /// Bytes of weights resident while the model is loaded.
    pub weights_bytes: u64,
    /// Fixed bytes per run.
    pub workspace_bytes: f64,
    /// The dimensions working memory grows with.
    pub axes: Vec<Axis>,
    /// Working memory beyond the workspace.
    pub terms: Vec<Term>,
    /// Where it came from.
    #[serde(flatten)]
    pub source: ProfileSource,
}

/// The most axes a profile reads; a model with more keeps the rest at their measured size.
pub const MAX_AXES: usize = 8;

/// A request's size along each axis of a profile (in its `axes` order). `Copy` and fixed-size,
/// so estimating a request allocates nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Dims {
    values: [u64; MAX_AXES],
    len: u8,
}

impl Dims {
    /// Dims from `values` (at most [`MAX_AXES`]; more are dropped).
    pub fn new(values: &[u64]) -> Dims {
        let mut dims = Dims::default();
        for &v in values.iter().take(MAX_AXES) {
            dims.values[dims.len as usize] = v;
            dims.len += 1;
        }
        dims
    }

    /// The values.
    pub fn as_slice(&self) -> &[u64] {
        &self.values[..self.len as usize]
    }

    /// Axis `i`'s value (0 past the end).
    pub fn get(&self, i: usize) -> u64 {
        self.as_slice().get(i).copied().unwrap_or(0)
    }

    /// The same with axis `i` set to `value` (unchanged past the end).
    pub fn with(mut self, i: usize, value: u64) -> Dims {
        if i < self.len as usize {
            self.values[i] = value;
        }
        self
    }

    /// Whether every axis is at most `other`'s.
    pub fn within(&self, other: &Dims) -> bool {
        self.len == other.len && self.as_slice().iter().zip(other.as_slice()).all(|(a, b)| a <= b)
    }

    /// The product of every axis (the input's elements per fixed element).
    pub fn product(&self) -> f64 {
        self.as_slice().iter().map(|&v| v as f64).product()
    }
}

/// No part of an estimate exceeds 8 PiB (2^53 bytes, also the largest integer an `f64` holds
/// exactly): no accelerator or host comes near it, and sums of a few parts stay far from the
/// 64-bit limits a policy script's integers have, so no script overflows on an absurd request.
pub const ESTIMATE_CEILING: u64 = 1 << 53;

/// Bytes from a fitted value: rounded up, never negative, at most [`ESTIMATE_CEILING`].
fn clamp_bytes(bytes: f64) -> u64 {
    if bytes.is_nan() {
        return ESTIMATE_CEILING;
    }
    (bytes.max(0.0).ceil() as u64).min(ESTIMATE_CEILING)
}

/// `Π dims[i]^powers[i]` in floating point (no overflow, infinity at worst).
pub fn monomial(dims: &Dims, powers: &[u8]) -> f64 {
    powers
        .iter()
        .enumerate()
        .filter(|(_, p)| **p > 0)
        .map(|(i, &p)| (dims.get(i) as f64).powi(i32::from(p)))
        .product()
}

impl MemoryProfile {
    /// A profile of weights only, for a model that could not be measured.
    pub fn weights_only(weights_bytes: u64, axes: Vec<Axis>, reason: String) -> MemoryProfile {
        MemoryProfile {
            weights_bytes,
            workspace_bytes: 0.0,
            axes,
            terms: Vec::new(),
            source: ProfileSource::Unmeasured { reason },
        }
    }

    /// A decoder's profile: `bytes_per_token` for every position of context and
    /// `bytes_per_sequence` once, per sequence. Context is the attention mask's length, batch
    /// the first axis of `input_ids`.
    pub fn per_token(
        weights_bytes: u64,
        bytes_per_token: f64,
        bytes_per_sequence: f64,
        source: ProfileSource,
    ) -> MemoryProfile {
        let terms = [(bytes_per_token, vec![1, 1]), (bytes_per_sequence, vec![1, 0])];
        MemoryProfile {
            weights_bytes,
            workspace_bytes: 0.0,
            axes: vec![
                Axis::single("batch", AxisRole::Batch, "input_ids", 0),
                Axis::single("context", AxisRole::Context, "attention_mask", 1),
            ],
            terms: terms
                .into_iter()
                .filter(|(bytes, _)| *bytes != 0.0)
                .map(|(bytes, powers)| Term { bytes, powers })
                .collect(),
            source,
        }
    }

    /// The profile given in the config: per item of the batch, `per_token_bytes·n +
    /// per_token_squared_bytes·n²` along the context axis (without one, `per_token_bytes` per
    /// item of the first input's first axis).
    pub fn configured(
        p: &ConfiguredProfile,
        file_bytes: u64,
        context: Option<&ContextAxis>,
        signature: &ModelSignature,
    ) -> MemoryProfile {
        let name_of = |input: &str, axis: usize| {
            signature
                .inputs
                .iter()
                .find(|s| s.name == input)
                .and_then(|s| s.symbols.get(axis))
                .filter(|s| !s.is_empty())
                .cloned()
                .unwrap_or_else(|| format!("{input}[{axis}]"))
        };
        let axis = |input: &str, axis: usize, role| Axis::single(name_of(input, axis), role, input, axis);
        let (axes, terms) = match context {
            Some(ctx) if ctx.axis != 0 => (
                vec![
                    axis(&ctx.input, 0, AxisRole::Batch),
                    axis(&ctx.input, ctx.axis, AxisRole::Context),
                ],
                vec![
                    Term {
                        bytes: p.per_token_bytes,
                        powers: vec![1, 1],
                    },
                    Term {
                        bytes: p.per_token_squared_bytes,
                        powers: vec![1, 2],
                    },
                ],
            ),
            Some(ctx) => (
                vec![axis(&ctx.input, ctx.axis, AxisRole::Context)],
                vec![
                    Term {
                        bytes: p.per_token_bytes,
                        powers: vec![1],
                    },
                    Term {
                        bytes: p.per_token_squared_bytes,
                        powers: vec![2],
                    },
                ],
            ),
            None => match signature.inputs.first() {
                Some(first) if !first.shape.is_empty() => (
                    vec![axis(&first.name, 0, AxisRole::Batch)],
                    vec![Term {
                        bytes: p.per_token_bytes,
                        powers: vec![1],
                    }],
                ),
                _ => (Vec::new(), Vec::new()),
            },
        };
        MemoryProfile {
            weights_bytes: p.weights_bytes.unwrap_or(file_bytes),
            workspace_bytes: p.workspace_bytes as f64,
            axes,
            terms: terms.into_iter().filter(|t| t.bytes != 0.0).collect(),
            source: ProfileSource::Config,
        }
    }

    /// Which estimate this profile gives.
    pub fn estimate_source(&self) -> EstimateSource {
        match self.source {
            ProfileSource::Measured { .. } => EstimateSource::Profile,
            ProfileSource::Config => EstimateSource::Config,
            ProfileSource::KvCache { .. } => EstimateSource::KvCache,
            ProfileSource::Unmeasured { .. } => EstimateSource::WeightsOnly,
        }
    }

    /// This profile with `weights_bytes` more resident and `bytes` more per item of the batch
    /// (its batch axis; without one, per run): what a run holds that the measured graph does
    /// not show (a speech model's decoder weights and caches, beside its measured encoder).
    pub fn with_extra(mut self, weights_bytes: u64, bytes: f64) -> MemoryProfile {
        self.weights_bytes = self.weights_bytes.saturating_add(weights_bytes);
        let powers: Vec<u8> = (0..self.axes.len())
            .map(|i| u8::from(self.axes[i].role == AxisRole::Batch))
            .collect();
        if powers.iter().all(|&p| p == 0) {
            self.workspace_bytes += bytes;
            return self;
        }
        match self.terms.iter_mut().find(|t| t.powers == powers) {
            Some(term) => term.bytes += bytes,
            None => self.terms.push(Term { bytes, powers }),
        }
        self
    }

    /// The index of the axis with `role`, if the profile has one.
    pub fn axis_with(&self, role: AxisRole) -> Option<usize> {
        self.axes.iter().position(|a| a.role == role)
    }

    /// Where `input` has the batch axis: where the estimate reads it, or the dimension
    /// `signature` names as it does; `None` when there is no batch axis or the input lacks it.
    pub fn batch_axis_of(&self, signature: &ModelSignature, input: &str) -> Option<usize> {
        let batch = &self.axes[self.axis_with(AxisRole::Batch)?];
        if let Some(at) = batch.at.iter().find(|a| a.input == input) {
            return Some(at.axis);
        }
        let spec = signature.inputs.iter().find(|s| s.name == input)?;
        spec.symbols.iter().position(|s| *s == batch.name)
    }

    /// A request's size along each axis: the first place each axis appears in `inputs` (1 when
    /// none does, so a missing optional input does not zero the estimate).
    pub fn dims_of(&self, inputs: &[Tensor]) -> Dims {
        let mut dims = Dims::default();
        for axis in self.axes.iter().take(MAX_AXES) {
            let value = axis
                .at
                .iter()
                .find_map(|at| inputs.iter().find(|t| t.name == at.input)?.shape.get(at.axis).copied())
                .map_or(1, |d| d.max(0) as u64);
            dims.values[dims.len as usize] = value;
            dims.len += 1;
        }
        dims
    }

    /// Dims for `context_tokens` of context and `batch` items, every other axis at 1: for
    /// requests sized in tokens (a generation's prompt and its new tokens).
    pub fn dims_for(&self, context_tokens: u64, batch: u64) -> Dims {
        let values: Vec<u64> = self
            .axes
            .iter()
            .map(|a| match a.role {
                AxisRole::Context => context_tokens,
                AxisRole::Batch => batch.max(1),
                AxisRole::Size => 1,
            })
            .collect();
        Dims::new(&values)
    }

    /// The working memory the fitted terms give for `dims`, in bytes (unclamped).
    pub fn working_bytes(&self, dims: &Dims) -> f64 {
        self.terms.iter().map(|t| t.bytes * monomial(dims, &t.powers)).sum()
    }

    /// The estimate for a run of `dims`.
    pub fn estimate(&self, dims: &Dims) -> Estimate {
        self.estimate_with(self.working_bytes(dims), self.estimate_source())
    }

    /// The estimate given a run's working memory (from the profile, or raised by what runs were
    /// seen to take).
    pub fn estimate_with(&self, working_bytes: f64, source: EstimateSource) -> Estimate {
        let context_bytes = clamp_bytes(working_bytes);
        let workspace_bytes = clamp_bytes(self.workspace_bytes);
        let weights_bytes = self.weights_bytes.min(ESTIMATE_CEILING);
        Estimate {
            weights_bytes,
            context_bytes,
            workspace_bytes,
            total_bytes: weights_bytes + context_bytes + workspace_bytes,
            source,
        }
    }

    /// [`estimate`](Self::estimate) for `context_tokens` and `batch` ([`dims_for`](Self::dims_for)).
    pub fn estimate_tokens(&self, context_tokens: u64, batch: u64) -> Estimate {
        self.estimate(&self.dims_for(context_tokens, batch))
    }

    /// The axes with their values, for logs and the policy (`name=value`).
    pub fn describe(&self, dims: &Dims) -> String {
        let parts: Vec<String> = self
            .axes
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{}={}", a.name, dims.get(i)))
            .collect();
        parts.join(" ")
    }

    /// The terms in words (`16·batch·seq²`), for the start-up log.
    pub fn formula(&self) -> String {
        let mut parts = vec![format!("{:.0}", self.workspace_bytes)];
        for t in &self.terms {
            let mut part = format!("{:.3}", t.bytes);
            for (i, &p) in t.powers.iter().enumerate() {
                let Some(axis) = self.axes.get(i) else { continue };
                match p {
                    0 => {}
                    1 => part.push_str(&format!("·{}", axis.name)),
                    p => part.push_str(&format!("·{}^{p}", axis.name)),
                }
            }
            parts.push(part);
        }
        parts.join(" + ")
    }
}

/// The dynamic axes of `signature`'s inputs, in input order; dimensions that share a symbolic
/// name are one axis (but not the placeholders exporters write for "unknown": `?`, `unk__3`).
/// The configured `context` axis (and any sharing its symbol) is the context; a dimension named
/// like a batch, or an anonymous first dimension of a tensor of rank two or more, is the batch;
/// the rest are sizes.
pub fn axes_of(signature: &ModelSignature, context: Option<&ContextAxis>) -> Vec<Axis> {
    let mut axes: Vec<Axis> = Vec::new();
    for spec in &signature.inputs {
        for (axis, &dim) in spec.shape.iter().enumerate() {
            if dim != -1 {
                continue;
            }
            let symbol = spec.symbols.get(axis).filter(|s| names_an_axis(s));
            let at = AxisAt {
                input: spec.name.clone(),
                axis,
            };
            let is_context = context.is_some_and(|c| c.input == spec.name && c.axis == axis);
            if let Some(existing) = symbol.and_then(|s| axes.iter_mut().find(|a| &a.name == s)) {
                existing.at.push(at);
                if is_context {
                    existing.role = AxisRole::Context;
                }
                continue;
            }
            let name = symbol.cloned().unwrap_or_else(|| format!("{}[{axis}]", spec.name));
            let lower = name.to_ascii_lowercase();
            // `p2o.DynamicDimension.0` names an axis without saying what it is.
            let anonymous = symbol.is_none() || lower.contains("dynamicdimension") || lower == "n";
            let role = if is_context {
                AxisRole::Context
            } else if lower.contains("batch") || (anonymous && axis == 0 && spec.shape.len() >= 2) {
                AxisRole::Batch
            } else {
                AxisRole::Size
            };
            axes.push(Axis {
                name,
                role,
                at: vec![at],
            });
        }
    }
    axes
}

/// Whether a dimension's symbol names one axis (dimensions that share it are the same one), or
/// is a placeholder for "unknown" that two unrelated dimensions may both carry.
fn names_an_axis(symbol: &str) -> bool {
    !(symbol.is_empty()
        || symbol == "?"
        || symbol.eq_ignore_ascii_case("none")
        || symbol.starts_with("unk__")
        || symbol.parse::<i64>().is_ok())
}

#[cfg(test)]
mod tests;
