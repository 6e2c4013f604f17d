//! A dense model written here, with no ONNX library: input `x` FP32 `[batch, 64]`, one MatMul by
//! a constant `[64, N]` weight, then ReduceMean over the last axis, so the output `y` is FP32
//! `[batch, 1]`. Its weights dominate its memory, so a few of them of a chosen size make a device
//! that cannot hold them all: what `vramguard drill` evicts, with nothing to install. It is the
//! model `tests/it/evict_models.py` writes with the `onnx` package (opset 17, IR version 8), with
//! weights from a seeded generator of its own, so a seed and a size always give the same bytes.
//!
//! The protobuf is written by hand (the `proto` module next to this one).

#[cfg(test)]
use super::proto::varint;
use super::proto::{Dim, FLOAT, Graph, attribute_int, attribute_ints, model, node, tensor, value_info};

/// Rows of the weight: the input's width.
pub const ROWS: usize = 64;

/// The opset the model imports (opset 17's ReduceMean takes `axes` as an attribute).
const OPSET: u64 = 17;
/// The ONNX IR version it declares.
const IR_VERSION: u64 = 8;

/// One generated dense model: a seed and the size of its weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dense {
    /// Seeds the weights.
    pub seed: u64,
    /// Columns of the weight: `ROWS × columns × 4` bytes of it.
    pub columns: usize,
}

impl Dense {
    /// A model whose weight holds `mib` mebibytes (as `evict_models.py OUT MIB` sizes them).
    pub fn of_mib(seed: u64, mib: u64) -> Dense {
        Dense {
            seed,
            columns: (mib as usize) * (1 << 20) / (4 * ROWS),
        }
    }

    /// The weight, row-major `[ROWS, columns]`: uniform in [-0.25, 0.25), from a SplitMix64
    /// generator seeded with `seed`.
    pub fn weights(&self) -> Vec<f32> {
        let mut state = self.seed;
        (0..ROWS * self.columns)
            .map(|_| {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                // The top 24 bits, exactly representable in an f32.
                ((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.5
            })
            .collect()
    }

    /// The model's ONNX bytes.
    pub fn to_onnx(&self) -> Vec<u8> {
        let mut raw = Vec::with_capacity(ROWS * self.columns * 4);
        for w in self.weights() {
            raw.extend_from_slice(&w.to_le_bytes());
        }
        let weight = tensor("w", &[ROWS as u64, self.columns as u64], FLOAT, &raw);
        let matmul = node(&["x", "w"], "h", "MatMul", &[]);
        let reduce = node(
            &["h"],
            "y",
            "ReduceMean",
            &[attribute_ints("axes", &[1]), attribute_int("keepdims", 1)],
        );
        let mut graph = Graph::default();
        graph.node(matmul).node(reduce).initializer(weight);
        graph.input(value_info(
            "x",
            FLOAT,
            &[Dim::Symbolic("batch"), Dim::Fixed(ROWS as u64)],
        ));
        graph.output(value_info("y", FLOAT, &[Dim::Symbolic("batch"), Dim::Fixed(1)]));
        model(&graph.to_message("dense"), IR_VERSION, OPSET)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Provider;
    use crate::core::tensor::{Tensor, TensorData};
    use crate::runtime::onnx::{SessionOptions, build_session, run, runtime, signature};

    /// What the model computes, in plain Rust: `mean_j (x · w)[b, j]` for each row `b`.
    fn reference(x: &[f32], w: &[f32], columns: usize) -> Vec<f32> {
        x.chunks(ROWS)
            .map(|row| {
                let sum: f64 = (0..columns)
                    .map(|j| {
                        (0..ROWS)
                            .map(|i| row[i] as f64 * w[i * columns + j] as f64)
                            .sum::<f64>()
                    })
                    .sum();
                (sum / columns as f64) as f32
            })
            .collect()
    }

    #[test]
    fn varints_are_little_endian_base_128() {
        let mut out = Vec::new();
        for v in [0, 1, 127, 128, 300, u64::MAX] {
            varint(&mut out, v);
        }
        assert_eq!(
            out,
            [
                0, 1, 127, 0x80, 1, 0xAC, 2, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 1
            ]
        );
    }

    #[test]
    fn a_seed_and_a_size_always_give_the_same_bytes_and_seeds_differ() {
        let a = Dense::of_mib(41, 1);
        assert_eq!(a.columns, 4096);
        assert_eq!(a.to_onnx(), a.to_onnx());
        assert_ne!(a.to_onnx(), Dense::of_mib(42, 1).to_onnx());
        // The weight's raw data is all but a few hundred bytes of the file.
        let bytes = a.to_onnx().len();
        assert!((1 << 20..(1 << 20) + 512).contains(&bytes), "{bytes}");
        let w = a.weights();
        assert!(w.iter().all(|v| (-0.25..0.25).contains(v)));
        let mean = w.iter().map(|&v| v as f64).sum::<f64>() / w.len() as f64;
        assert!(mean.abs() < 0.01, "centred: {mean}");
    }

    #[test]
    fn onnx_runtime_loads_it_and_computes_the_reference() {
        let rt = runtime(None).expect("ONNX Runtime loads");
        let options = SessionOptions {
            provider: Provider::Cpu,
            device_index: 0,
            intra_threads: 1,
            arena_shrinkage: false,
            quiet: false,
        };
        let model = Dense { seed: 7, columns: 96 };
        let mut session = build_session(rt, &model.to_onnx()[..], &options).expect("it loads");
        let sig = signature(&session).unwrap();
        assert_eq!(sig.inputs.len(), 1);
        assert_eq!(
            (sig.inputs[0].name.as_str(), sig.inputs[0].shape.as_slice()),
            ("x", [-1, ROWS as i64].as_slice())
        );
        assert_eq!(sig.inputs[0].symbols[0], "batch");
        let batch = 3;
        let x: Vec<f32> = (0..batch * ROWS).map(|i| ((i * 7) % 19) as f32 * 0.1 - 0.9).collect();
        let input = Tensor {
            name: "x".into(),
            shape: vec![batch as i64, ROWS as i64],
            data: TensorData::Fp32(x.clone()),
        };
        let out = run(&mut session, vec![input], &[], None).expect("it runs");
        assert_eq!(
            (out[0].name.as_str(), out[0].shape.as_slice()),
            ("y", [3, 1].as_slice())
        );
        let TensorData::Fp32(y) = &out[0].data else {
            panic!("not FP32: {:?}", out[0]);
        };
        let expected = reference(&x, &model.weights(), model.columns);
        for (got, want) in y.iter().zip(&expected) {
            assert!(
                (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                "{y:?} against {expected:?}"
            );
        }
        assert!(
            expected.iter().any(|v| v.abs() > 1e-3),
            "not trivially zero: {expected:?}"
        );
    }
}
