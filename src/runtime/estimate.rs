//! Memory estimates: what a request will need before it runs. Each model gets a profile
//! `weights + workspace + batch × (per_token·n + per_token²·n²)`, measured at start-up from ONNX
//! Runtime's own arena peaks at a few context lengths (least-squares fit), or given in the
//! config. The fit is plain arithmetic, tested without ONNX Runtime.

use ort::memory::Allocator;
use ort::session::Session;
use serde::{Deserialize, Serialize};

use crate::config::ContextAxis;
use crate::core::snapshot::Estimate;
use crate::core::tensor::{Tensor, TensorData};
use crate::runtime::onnx::{self, ModelSignature, arena};

/// Where a profile came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "source")]
pub enum ProfileSource {
    /// Measured at start-up: `(context tokens or batch, peak bytes)` per run.
    Measured {
        /// The measured points.
        points: Vec<(u64, u64)>,
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
        /// Key and value bytes per token, every layer.
        kv_bytes_per_token: u64,
    },
    /// Could not be measured (the reason is logged); only weights are known.
    Unmeasured {
        /// Why.
        reason: String,
    },
}

/// A model's memory profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryProfile {
    /// Bytes of weights resident while the model is loaded.
    pub weights_bytes: u64,
    /// Fixed bytes per run.
    pub workspace_bytes: f64,
    /// Bytes per context token (per batch item), or per batch item for models without a
    /// context axis.
    pub per_token_bytes: f64,
    /// Bytes per squared context token (attention scores grow with n²).
    pub per_token_squared_bytes: f64,
    /// Where it came from.
    #[serde(flatten)]
    pub source: ProfileSource,
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

impl MemoryProfile {
    /// The estimate for a run of `context_tokens` (0 without a context axis) and `batch`.
    pub fn estimate(&self, context_tokens: u64, batch: u64) -> Estimate {
        let n = context_tokens as f64;
        let batch = batch.max(1) as f64;
        let per_item = if context_tokens == 0 {
            self.per_token_bytes
        } else {
            self.per_token_bytes * n + self.per_token_squared_bytes * n * n
        };
        let context_bytes = clamp_bytes(batch * per_item);
        let workspace_bytes = clamp_bytes(self.workspace_bytes);
        let weights_bytes = self.weights_bytes.min(ESTIMATE_CEILING);
        Estimate {
            weights_bytes,
            context_bytes,
            workspace_bytes,
            total_bytes: weights_bytes + context_bytes + workspace_bytes,
        }
    }
}

/// Context lengths measured at start-up for models with a context axis.
const MEASURE_TOKENS: [u64; 5] = [16, 32, 64, 128, 256];
/// Batch sizes measured for models without one.
const MEASURE_BATCHES: [u64; 2] = [1, 4];

/// Measure a profile by running `session` (a CPU session with its own arena, read through
/// `allocator`) on zero inputs of growing size and fitting the arena's peaks. Context lengths
/// grow run by run, so the arena's all-time peak after each run is that run's peak.
pub fn measure(
    session: &mut Session,
    allocator: &Allocator,
    signature: &ModelSignature,
    context: Option<&ContextAxis>,
    model_size: u64,
) -> MemoryProfile {
    let baseline = arena::allocator_stats(allocator).map(|s| s.active_bytes).unwrap_or(0);
    // What the arena holds once the session is built, but never less than the serialized model:
    // initializers a provider keeps outside the arena (not copied into it, or pre-packed
    // elsewhere) do not show in its statistics, and counting only the arena took a 4.6 MB text
    // detector for 11 KiB of weights.
    let weights_bytes = baseline.max(model_size);
    let context_symbol = context.and_then(|ctx| {
        signature
            .inputs
            .iter()
            .find(|s| s.name == ctx.input)
            .and_then(|s| s.symbols.get(ctx.axis))
            .filter(|sym| !sym.is_empty())
            .cloned()
    });
    let xs: &[u64] = if context.is_some() {
        &MEASURE_TOKENS
    } else {
        &MEASURE_BATCHES
    };
    let mut points = Vec::new();
    for &x in xs {
        let inputs = signature
            .inputs
            .iter()
            .map(|spec| {
                let shape: Vec<i64> = spec
                    .shape
                    .iter()
                    .enumerate()
                    .map(|(axis, &dim)| {
                        let is_context = context.is_some_and(|c| c.input == spec.name && c.axis == axis)
                            || context_symbol
                                .as_ref()
                                .is_some_and(|sym| spec.symbols.get(axis) == Some(sym));
                        match (dim, is_context) {
                            (_, true) => x as i64,
                            (-1, false) if context.is_none() && axis == 0 => x as i64,
                            (-1, false) => 1,
                            (d, false) => d,
                        }
                    })
                    .collect();
                let len = Tensor::element_count(&shape).unwrap_or(0);
                Tensor {
                    name: spec.name.clone(),
                    shape,
                    data: TensorData::zeros(spec.datatype, len),
                }
            })
            .collect();
        if let Err(e) = onnx::run(session, inputs, &[], None) {
            return MemoryProfile {
                weights_bytes,
                workspace_bytes: 0.0,
                per_token_bytes: 0.0,
                per_token_squared_bytes: 0.0,
                source: ProfileSource::Unmeasured {
                    reason: format!("a measuring run at {x} failed: {e}"),
                },
            };
        }
        let peak = arena::allocator_stats(allocator)
            .map(|s| s.peak_active_bytes)
            .unwrap_or(0);
        points.push((x, peak.saturating_sub(baseline)));
    }
    let (a, b, c) = fit(&points, context.is_some());
    MemoryProfile {
        weights_bytes,
        // A fixed cost below zero is fitting noise, not memory handed back.
        workspace_bytes: a.max(0.0),
        per_token_bytes: b,
        per_token_squared_bytes: c,
        source: ProfileSource::Measured { points },
    }
}

/// Least-squares fit of `bytes ≈ a + b·x + c·x²` (or `a + b·x` when `quadratic` is false), with
/// negative growth terms refitted away: noise must never predict that longer contexts are
/// cheaper. Returns `(a, b, c)`.
pub fn fit(points: &[(u64, u64)], quadratic: bool) -> (f64, f64, f64) {
    let xs: Vec<f64> = points.iter().map(|p| p.0 as f64).collect();
    let ys: Vec<f64> = points.iter().map(|p| p.1 as f64).collect();
    if quadratic && points.len() >= 3 {
        if let Some((a, b, c)) = solve_least_squares(&xs, &ys, 3).map(|v| (v[0], v[1], v[2])) {
            if c >= 0.0 && b >= 0.0 {
                return (a, b, c);
            }
            if c >= 0.0 {
                // Pure quadratic growth: refit a + c·x².
                let squares: Vec<f64> = xs.iter().map(|x| x * x).collect();
                if let Some(v) = solve_least_squares(&squares, &ys, 2)
                    && v[1] >= 0.0
                {
                    return (v[0], 0.0, v[1]);
                }
            }
        }
    }
    if points.len() >= 2
        && let Some(v) = solve_least_squares(&xs, &ys, 2)
        && v[1] >= 0.0
    {
        return (v[0], v[1], 0.0);
    }
    let max = ys.iter().copied().fold(0.0, f64::max);
    (max, 0.0, 0.0)
}

/// Solve the normal equations for a polynomial of `terms` coefficients (Gaussian elimination).
fn solve_least_squares(xs: &[f64], ys: &[f64], terms: usize) -> Option<Vec<f64>> {
    let mut m = vec![vec![0.0; terms + 1]; terms];
    for (&x, &y) in xs.iter().zip(ys) {
        let powers: Vec<f64> = (0..terms).map(|k| x.powi(k as i32)).collect();
        for r in 0..terms {
            for c in 0..terms {
                m[r][c] += powers[r] * powers[c];
            }
            m[r][terms] += powers[r] * y;
        }
    }
    for col in 0..terms {
        let pivot = (col..terms).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
        if m[pivot][col].abs() < 1e-12 {
            return None;
        }
        m.swap(col, pivot);
        let pivot_row = m[col].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let factor = row[col] / pivot_row[col];
                for (value, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                    *value -= factor * p;
                }
            }
        }
    }
    Some((0..terms).map(|r| m[r][terms] / m[r][r]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `GET /v2/models/{model}` shows of a profile reads back as the same profile (the
    /// drill sizes its requests from it).
    #[test]
    fn a_profile_reads_back_from_what_the_server_shows() {
        let profile = MemoryProfile {
            weights_bytes: 4_745_517,
            workspace_bytes: 170.5,
            per_token_bytes: 1024.0,
            per_token_squared_bytes: 16.0,
            source: ProfileSource::Measured {
                points: vec![(1, 68_096), (4, 271_872)],
            },
        };
        let shown = serde_json::to_value(&profile).unwrap();
        assert_eq!(shown["source"], "measured");
        assert_eq!(serde_json::from_value::<MemoryProfile>(shown).unwrap(), profile);
    }

    #[test]
    fn an_exact_quadratic_is_recovered() {
        let points: Vec<(u64, u64)> = [16u64, 32, 64, 128, 256]
            .iter()
            .map(|&n| (n, 4096 + 512 * n + 16 * n * n))
            .collect();
        let (a, b, c) = fit(&points, true);
        assert!(
            (a - 4096.0).abs() < 1.0 && (b - 512.0).abs() < 0.01 && (c - 16.0).abs() < 1e-4,
            "{a} {b} {c}"
        );
    }

    #[test]
    fn noise_never_makes_longer_contexts_cheaper() {
        // A slightly concave measurement would fit c < 0; the refit keeps growth non-negative.
        let points = [(16, 10_000), (32, 19_000), (64, 36_000), (128, 68_000), (256, 130_000)];
        let (_, b, c) = fit(&points, true);
        assert!(b >= 0.0 && c >= 0.0, "{b} {c}");
        let profile = MemoryProfile {
            weights_bytes: 0,
            workspace_bytes: 0.0,
            per_token_bytes: b,
            per_token_squared_bytes: c,
            source: ProfileSource::Config,
        };
        assert!(profile.estimate(512, 1).total_bytes > profile.estimate(256, 1).total_bytes);
    }

    #[test]
    fn estimates_scale_with_batch_and_split_into_parts() {
        let profile = MemoryProfile {
            weights_bytes: 1000,
            workspace_bytes: 100.0,
            per_token_bytes: 10.0,
            per_token_squared_bytes: 1.0,
            source: ProfileSource::Config,
        };
        let e = profile.estimate(10, 2);
        assert_eq!(e.context_bytes, 2 * (100 + 100));
        assert_eq!(e.workspace_bytes, 100);
        assert_eq!(e.total_bytes, 1000 + 400 + 100);
        // Without a context axis the per-item term is per batch item.
        assert_eq!(profile.estimate(0, 3).context_bytes, 30);
    }

    #[test]
    fn absurd_contexts_saturate_at_the_ceiling_so_sums_cannot_overflow() {
        let profile = MemoryProfile {
            weights_bytes: u64::MAX,
            workspace_bytes: f64::INFINITY,
            per_token_bytes: 1e12,
            per_token_squared_bytes: 1e12,
            source: ProfileSource::Config,
        };
        let e = profile.estimate(u64::MAX, u64::MAX);
        assert_eq!(e.weights_bytes, ESTIMATE_CEILING);
        assert_eq!(e.context_bytes, ESTIMATE_CEILING);
        assert_eq!(e.workspace_bytes, ESTIMATE_CEILING);
        assert_eq!(e.total_bytes, 3 * ESTIMATE_CEILING);
        assert!(i64::try_from(e.total_bytes + e.context_bytes + e.workspace_bytes).is_ok());
    }

    #[test]
    fn a_single_point_is_a_constant() {
        assert_eq!(fit(&[(1, 5000)], false), (5000.0, 0.0, 0.0));
    }
}
