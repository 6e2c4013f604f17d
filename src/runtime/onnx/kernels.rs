//! Small graphs, written here, that a pool runs on its own execution provider to re-arrange a
//! generation's values (KV caches, attention masks) where they lie: padding, joining, picking
//! rows and trimming happen on the device, and the results are bound to the device's memory.
//! Only [`Kernels::last_position`] copies anything to the host, and only the logits it picks.
//!
//! One graph is built per kind, element type, rank and axis, on first use, and its session kept.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use ort::memory::{AllocationDevice, AllocatorType, MemoryInfo, MemoryType};
use ort::session::Session;
use ort::value::{DynValue, TensorElementType, ValueType};

use super::proto::{self, Dim, FLOAT, FLOAT16, Graph, INT64, attribute_int, int64_tensor, node, value_info};
use super::{OnnxRuntime, SessionOptions, build_session};
use crate::config::Provider;

/// The opset the graphs import (Pad takes `pads` as an input, Slice its bounds as inputs).
const OPSET: u64 = 17;
/// The ONNX IR version they declare.
const IR_VERSION: u64 = 8;
/// Every graph's one output.
const OUTPUT: &str = "out";

/// Which graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    /// Pad, (Concat), Gather rows, Slice; `joined` when there is a `b`.
    Arrange { joined: bool },
    /// Concat along an axis.
    Concat,
    /// Gather the last position of axis 1, Cast to FP32.
    LastPosition,
}

/// What a session is built for: a graph kind over one element type, rank and axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Key {
    kind: Kind,
    /// `TensorProto.DataType` of the inputs.
    elem_type: u64,
    rank: usize,
    axis: usize,
}

/// Small graphs run on a pool's own execution provider to move a generation's values where they
/// lie (on the device), never through the host.
pub struct Kernels {
    rt: &'static OnnxRuntime,
    pub(super) options: SessionOptions,
    /// Where outputs are bound.
    device: MemoryInfo<'static>,
    /// Where [`Kernels::last_position`]'s output is bound.
    host: MemoryInfo<'static>,
    pub(super) sessions: HashMap<Key, Session>,
    /// Run the graphs even where the device is the host (tests: the path CUDA takes).
    graphs_only: bool,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels")
            .field("provider", &self.options.provider)
            .field("device_index", &self.options.device_index)
            .field("sessions", &self.sessions.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// `TensorProto.DataType` of an element type, for those the graphs take.
fn onnx_type(ty: TensorElementType) -> Option<u64> {
    Some(match ty {
        TensorElementType::Float32 => FLOAT,
        TensorElementType::Uint8 => 2,
        TensorElementType::Int8 => 3,
        TensorElementType::Int16 => 5,
        TensorElementType::Int32 => 6,
        TensorElementType::Int64 => INT64,
        TensorElementType::Bool => 9,
        TensorElementType::Float16 => FLOAT16,
        TensorElementType::Float64 => 11,
        TensorElementType::Bfloat16 => 16,
        _ => return None,
    })
}

/// A value's element type (as ONNX numbers it) and shape, or why it is not a tensor the graphs take.
fn tensor_info(what: &str, value: &DynValue) -> Result<(u64, Vec<i64>), String> {
    match value.dtype() {
        ValueType::Tensor { ty, shape, .. } => {
            let elem_type = onnx_type(*ty).ok_or_else(|| format!("{what} has unsupported element type {ty:?}"))?;
            Ok((elem_type, shape.iter().copied().collect()))
        }
        other => Err(format!("{what} is not a tensor ({other:?})")),
    }
}

/// Whether `a` and `b` agree in every dimension but 0 and `axis` (`keep_rows`: but `axis` only).
fn check_matching(a: &[i64], b: &[i64], axis: usize, keep_rows: bool) -> Result<(), String> {
    if a.len() != b.len() {
        return Err(format!(
            "rank mismatch: a is {a:?} (rank {}), b is {b:?} (rank {})",
            a.len(),
            b.len()
        ));
    }
    let differing = (0..a.len()).find(|&d| d != axis && (keep_rows || d != 0) && a[d] != b[d]);
    match differing {
        Some(d) => Err(format!("a {a:?} and b {b:?} differ in dimension {d}")),
        None => Ok(()),
    }
}

/// Symbolic dimensions `prefix0, prefix1, ...` for a value of rank `rank`.
fn symbols(prefix: &str, rank: usize) -> Vec<String> {
    (0..rank).map(|d| format!("{prefix}{d}")).collect()
}

/// A value_info whose every dimension is symbolic.
fn dynamic_info(name: &str, elem_type: u64, rank: usize) -> proto::Message {
    let names = symbols(&format!("{name}_"), rank);
    let dims: Vec<Dim<'_>> = names.iter().map(|s| Dim::Symbolic(s)).collect();
    value_info(name, elem_type, &dims)
}

impl Key {
    /// The graph's ONNX bytes.
    fn graph(&self) -> Vec<u8> {
        let Key {
            kind,
            elem_type,
            rank,
            axis,
        } = *self;
        let mut graph = Graph::default();
        match kind {
            Kind::Arrange { joined } => {
                graph.input(dynamic_info("a", elem_type, rank));
                graph.input(value_info("pad_a", INT64, &[Dim::Fixed(2 * rank as u64)]));
                graph.node(node(&["a", "pad_a"], "padded_a", "Pad", &[]));
                let mut gathered_from = "padded_a";
                if joined {
                    graph.input(dynamic_info("b", elem_type, rank));
                    graph.input(value_info("pad_b", INT64, &[Dim::Fixed(2 * rank as u64)]));
                    graph.node(node(&["b", "pad_b"], "padded_b", "Pad", &[]));
                    let axis_0 = attribute_int("axis", 0);
                    graph.node(node(&["padded_a", "padded_b"], "joined", "Concat", &[axis_0]));
                    gathered_from = "joined";
                }
                graph.input(value_info("rows", INT64, &[Dim::Symbolic("rows")]));
                graph.input(value_info("start", INT64, &[Dim::Fixed(1)]));
                graph.initializer(int64_tensor("ends", &[1], &[i64::MAX]));
                graph.initializer(int64_tensor("axes", &[1], &[axis as i64]));
                let axis_0 = attribute_int("axis", 0);
                graph.node(node(&[gathered_from, "rows"], "taken", "Gather", &[axis_0]));
                graph.node(node(&["taken", "start", "ends", "axes"], OUTPUT, "Slice", &[]));
                graph.output(dynamic_info(OUTPUT, elem_type, rank));
            }
            Kind::Concat => {
                graph.input(dynamic_info("a", elem_type, rank));
                graph.input(dynamic_info("b", elem_type, rank));
                let along = attribute_int("axis", axis as i64);
                graph.node(node(&["a", "b"], OUTPUT, "Concat", &[along]));
                graph.output(dynamic_info(OUTPUT, elem_type, rank));
            }
            Kind::LastPosition => {
                graph.input(dynamic_info("logits", elem_type, rank));
                graph.initializer(int64_tensor("last", &[], &[-1]));
                let along = attribute_int("axis", axis as i64);
                graph.node(node(&["logits", "last"], "position", "Gather", &[along]));
                let to = attribute_int("to", FLOAT as i64);
                graph.node(node(&["position"], OUTPUT, "Cast", &[to]));
                graph.output(dynamic_info(OUTPUT, FLOAT, rank - 1));
            }
        }
        proto::model(&graph.to_message("kernel"), IR_VERSION, OPSET)
    }
}

/// A small INT64 tensor on the host (ONNX Runtime copies it where the graph wants it).
fn host_int64(values: Vec<i64>) -> Result<DynValue, String> {
    let shape = vec![values.len() as i64];
    ort::value::Tensor::from_array((shape, values))
        .map(|t| t.into_dyn())
        .map_err(|e| e.to_string())
}

/// `pad` zeros before `axis` of a value of rank `rank`, as Pad's `pads` input says it.
fn left_pads(rank: usize, axis: usize, pad: i64) -> Vec<i64> {
    let mut pads = vec![0; 2 * rank];
    pads[axis] = pad;
    pads
}

/// Run `session` on `inputs` with its output bound to `output`.
fn run_bound(session: &mut Session, inputs: &[(&str, &DynValue)], output: &MemoryInfo<'_>) -> Result<DynValue, String> {
    let e = |e: ort::Error| e.to_string();
    let mut binding = session.create_binding().map_err(e)?;
    for (name, value) in inputs {
        binding.bind_input(*name, *value).map_err(e)?;
    }
    binding.bind_output_to_device(OUTPUT, output).map_err(e)?;
    // Host inputs are copied to the device asynchronously when bound.
    binding.synchronize_inputs().map_err(e)?;
    let mut outputs = session.run_binding(&binding).map_err(e)?;
    binding.synchronize_outputs().map_err(e)?;
    outputs
        .remove(OUTPUT)
        .ok_or_else(|| format!("the kernel produced no output `{OUTPUT}`"))
}

/// INT64 `[rows, n]` and `[rows, m]` side by side, built in host memory.
fn host_concat_columns(a: &DynValue, b: &DynValue, a_shape: &[i64], b_shape: &[i64]) -> Result<DynValue, String> {
    let e = |e: ort::Error| format!("concat: {e}");
    let (_, a_data) = a.try_extract_tensor::<i64>().map_err(e)?;
    let (_, b_data) = b.try_extract_tensor::<i64>().map_err(e)?;
    let (n, m) = (a_shape[1] as usize, b_shape[1] as usize);
    let mut out = Vec::with_capacity(a_data.len() + b_data.len());
    for row in 0..a_shape[0] as usize {
        out.extend_from_slice(&a_data[row * n..(row + 1) * n]);
        out.extend_from_slice(&b_data[row * m..(row + 1) * m]);
    }
    let shape = vec![a_shape[0], (n + m) as i64];
    Ok(ort::value::Tensor::from_array((shape, out)).map_err(e)?.into_dyn())
}

impl Kernels {
    /// Kernels for sessions built with `options` (its provider and device index decide where
    /// outputs are bound: CUDA device memory for `Provider::Cuda`, CPU otherwise).
    pub fn new(rt: &'static OnnxRuntime, options: &SessionOptions) -> Result<Kernels, String> {
        let e = |e: ort::Error| e.to_string();
        let host = MemoryInfo::new(AllocationDevice::CPU, 0, AllocatorType::Device, MemoryType::Default).map_err(e)?;
        let device = match &options.provider {
            Provider::Cuda(_) => MemoryInfo::new(
                AllocationDevice::CUDA,
                options.device_index as i32,
                AllocatorType::Device,
                MemoryType::Default,
            )
            .map_err(e)?,
            _ => host.clone(),
        };
        Ok(Kernels {
            rt,
            options: options.clone(),
            device,
            host,
            sessions: HashMap::new(),
            graphs_only: false,
        })
    }

    /// Where outputs are bound (the device's memory info), for callers binding their own runs' outputs.
    pub fn device(&self) -> &MemoryInfo<'static> {
        &self.device
    }

    /// Whether the device is the host (every provider but CUDA): values there are read and
    /// built in place, with no run.
    fn on_host(&self) -> bool {
        !self.graphs_only && !matches!(self.options.provider, Provider::Cuda(_))
    }

    /// The session for `key`, built on first use.
    fn session(&mut self, key: Key) -> Result<&mut Session, String> {
        Ok(match self.sessions.entry(key) {
            Entry::Occupied(entry) => entry.into_mut(),
            Entry::Vacant(entry) => {
                let session = build_session(self.rt, &key.graph(), &self.options)
                    .map_err(|e| format!("cannot build the {:?} kernel: {e}", key.kind))?;
                entry.insert(session)
            }
        })
    }

    /// Rows of `a` and `b` (both `[batch_i, d1, ..., axis.., ...]`, same element type and rank,
    /// equal in every dimension but 0 and `axis`), each left-padded with zeros along `axis` by
    /// its own pad so both have equal length along `axis`, concatenated along axis 0 (a's rows
    /// first), then rows `rows` (indices into that concatenation, any order, any subset) taken,
    /// then positions `start..` along `axis` kept. `b` is optional (None: only `a`). Output
    /// bound to the device.
    pub fn arrange(
        &mut self,
        a: &DynValue,
        pad_a: i64,
        b: Option<(&DynValue, i64)>,
        rows: &[i64],
        axis: usize,
        start: i64,
    ) -> Result<DynValue, String> {
        let (elem_type, a_shape) = tensor_info("a", a)?;
        let rank = a_shape.len();
        if axis == 0 || axis >= rank {
            return Err(format!(
                "arrange: axis {axis} must be past the rows' axis and within a's rank {rank} ({a_shape:?})"
            ));
        }
        if pad_a < 0 {
            return Err(format!("arrange: a's pad {pad_a} is negative"));
        }
        let length = a_shape[axis] + pad_a;
        let mut available = a_shape[0];
        if let Some((b, pad_b)) = b {
            let (b_type, b_shape) = tensor_info("b", b)?;
            if b_type != elem_type {
                return Err(format!(
                    "arrange: a and b differ in element type ({:?} and {:?})",
                    a.dtype(),
                    b.dtype()
                ));
            }
            check_matching(&a_shape, &b_shape, axis, false).map_err(|e| format!("arrange: {e}"))?;
            if pad_b < 0 {
                return Err(format!("arrange: b's pad {pad_b} is negative"));
            }
            if b_shape[axis] + pad_b != length {
                return Err(format!(
                    "arrange: padded lengths along axis {axis} differ: a {} + {pad_a}, b {} + {pad_b}",
                    a_shape[axis], b_shape[axis]
                ));
            }
            available += b_shape[0];
        }
        if let Some(row) = rows.iter().find(|&&r| !(0..available).contains(&r)) {
            return Err(format!(
                "arrange: row {row} is out of range: a and b have {available} rows"
            ));
        }
        if !(0..=length).contains(&start) {
            return Err(format!(
                "arrange: start {start} is outside the padded length {length} along axis {axis}"
            ));
        }
        let pads_a = host_int64(left_pads(rank, axis, pad_a))?;
        let rows = host_int64(rows.to_vec())?;
        let start = host_int64(vec![start])?;
        let key = Key {
            kind: Kind::Arrange { joined: b.is_some() },
            elem_type,
            rank,
            axis,
        };
        let pads_b = b
            .map(|(_, pad_b)| host_int64(left_pads(rank, axis, pad_b)))
            .transpose()?;
        let mut inputs = vec![("a", a), ("pad_a", &pads_a), ("rows", &rows), ("start", &start)];
        if let (Some((b, _)), Some(pads_b)) = (b, &pads_b) {
            inputs.extend([("b", b), ("pad_b", pads_b)]);
        }
        let device = self.device.clone();
        let session = self.session(key)?;
        run_bound(session, &inputs, &device).map_err(|e| format!("arrange: {e}"))
    }

    /// `a` and `b` concatenated along `axis` (e.g. a mask `[B, P]` INT64 and its new column
    /// `[B, 1]`). Output on the device.
    pub fn concat(&mut self, a: &DynValue, b: &DynValue, axis: usize) -> Result<DynValue, String> {
        let (elem_type, a_shape) = tensor_info("a", a)?;
        let (b_type, b_shape) = tensor_info("b", b)?;
        if b_type != elem_type {
            return Err(format!(
                "concat: a and b differ in element type ({:?} and {:?})",
                a.dtype(),
                b.dtype()
            ));
        }
        check_matching(&a_shape, &b_shape, axis, true).map_err(|e| format!("concat: {e}"))?;
        let rank = a_shape.len();
        if axis >= rank {
            return Err(format!("concat: axis {axis} is outside a's rank {rank} ({a_shape:?})"));
        }
        if self.on_host() && elem_type == INT64 && rank == 2 && axis == 1 {
            return host_concat_columns(a, b, &a_shape, &b_shape);
        }
        let key = Key {
            kind: Kind::Concat,
            elem_type,
            rank,
            axis,
        };
        let device = self.device.clone();
        let session = self.session(key)?;
        run_bound(session, &[("a", a), ("b", b)], &device).map_err(|e| format!("concat: {e}"))
    }

    /// The last position of logits `[batch, seq, vocab]` (FP32 or FP16; `seq` is 1 once the graph is rewritten at
    /// load), as FP32 `[batch, vocab]`, copied to the host, row-major: only these bytes leave the device.
    pub fn last_position(&mut self, logits: &DynValue) -> Result<Vec<f32>, String> {
        let (elem_type, shape) = tensor_info("logits", logits)?;
        if shape.len() != 3 {
            return Err(format!(
                "last_position: logits must be [batch, seq, vocab], not rank {} ({shape:?})",
                shape.len()
            ));
        }
        if elem_type != FLOAT && elem_type != FLOAT16 {
            return Err(format!(
                "last_position: logits must be FP32 or FP16, not {:?}",
                logits.dtype()
            ));
        }
        if shape[1] == 0 {
            return Err(format!("last_position: logits {shape:?} have no positions"));
        }
        if self.on_host() && elem_type == FLOAT {
            // Host memory already: the rows are read where they lie, with no run.
            let (_, data) = logits
                .try_extract_tensor::<f32>()
                .map_err(|e| format!("last_position: {e}"))?;
            let (positions, vocab) = (shape[1] as usize, shape[2] as usize);
            let mut rows = Vec::with_capacity(shape[0] as usize * vocab);
            for row in data.chunks(positions * vocab.max(1)) {
                rows.extend_from_slice(&row[(positions - 1) * vocab..]);
            }
            return Ok(rows);
        }
        let key = Key {
            kind: Kind::LastPosition,
            elem_type,
            rank: 3,
            axis: 1,
        };
        let host = self.host.clone();
        let session = self.session(key)?;
        let out = run_bound(session, &[("logits", logits)], &host).map_err(|e| format!("last_position: {e}"))?;
        let (_, data) = out
            .try_extract_tensor::<f32>()
            .map_err(|e| format!("last_position: {e}"))?;
        Ok(data.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::onnx::runtime;
    use half::f16;

    /// Kernels that run their graphs, as on a CUDA pool.
    fn kernels() -> Kernels {
        Kernels {
            graphs_only: true,
            ..on_host()
        }
    }

    /// Kernels as a CPU pool has them: values on the host are read and built in place.
    fn on_host() -> Kernels {
        let rt = runtime(None).expect("ONNX Runtime loads");
        Kernels::new(rt, &SessionOptions::quiet_cpu()).expect("kernels")
    }

    #[test]
    fn on_the_host_masks_and_last_positions_are_the_graphs_answers() {
        let (mut graphs, mut host) = (kernels(), on_host());
        let mask = value(&[3, 5], (0..15).map(|i| i64::from(i % 4 != 0)).collect());
        let column = value(&[3, 1], vec![1i64, 0, 1]);
        let by_graph = read::<i64>(&graphs.concat(&mask, &column, 1).unwrap());
        assert_eq!(read::<i64>(&host.concat(&mask, &column, 1).unwrap()), by_graph);
        assert_eq!(by_graph.0, vec![3, 6]);
        let logits = value(&[2, 3, 4], (0..24).map(|i| i as f32 * 0.5).collect());
        let rows = graphs.last_position(&logits).unwrap();
        assert_eq!(host.last_position(&logits).unwrap(), rows);
        assert_eq!(rows, vec![4.0, 4.5, 5.0, 5.5, 10.0, 10.5, 11.0, 11.5]);
    }

    fn value<T>(shape: &[i64], data: Vec<T>) -> DynValue
    where
        T: ort::value::PrimitiveTensorElementType + std::fmt::Debug + Clone + 'static,
    {
        ort::value::Tensor::from_array((shape.to_vec(), data))
            .expect("a tensor")
            .into_dyn()
    }

    fn read<T: ort::value::PrimitiveTensorElementType + Clone>(value: &DynValue) -> (Vec<i64>, Vec<T>) {
        let (shape, data) = value.try_extract_tensor::<T>().expect("extracts");
        (shape.iter().copied().collect(), data.to_vec())
    }

    /// Every multi-index of `shape`, row-major.
    fn indices(shape: &[i64]) -> Vec<Vec<i64>> {
        let mut all = vec![vec![]];
        for &size in shape {
            all = all
                .into_iter()
                .flat_map(|prefix: Vec<i64>| {
                    (0..size).map(move |i| {
                        let mut next = prefix.clone();
                        next.push(i);
                        next
                    })
                })
                .collect();
        }
        all
    }

    fn offset(shape: &[i64], index: &[i64]) -> usize {
        index
            .iter()
            .zip(shape)
            .fold(0, |acc, (&i, &n)| acc * n as usize + i as usize)
    }

    /// What `arrange` computes, in plain Rust: each part `(shape, data, pad)` left-padded with
    /// zeros along `axis`, rows joined, `rows` taken, positions `start..` along `axis` kept.
    fn reference<T: Copy + Default>(
        parts: &[(&[i64], &[T], i64)],
        rows: &[i64],
        axis: usize,
        start: i64,
    ) -> (Vec<i64>, Vec<T>) {
        let (first, _, first_pad) = parts[0];
        let length = first[axis] + first_pad;
        let mut row_shape = first[1..].to_vec();
        row_shape[axis - 1] = length;
        let mut joined: Vec<Vec<T>> = Vec::new();
        for &(shape, data, pad) in parts {
            for row in 0..shape[0] {
                let padded = indices(&row_shape)
                    .iter()
                    .map(|index| {
                        let mut source = vec![row];
                        source.extend_from_slice(index);
                        source[axis] -= pad;
                        if source[axis] < 0 {
                            T::default()
                        } else {
                            data[offset(shape, &source)]
                        }
                    })
                    .collect();
                joined.push(padded);
            }
        }
        let mut kept_shape = row_shape.clone();
        kept_shape[axis - 1] = length - start;
        let mut out = Vec::new();
        for &row in rows {
            for index in indices(&kept_shape) {
                let mut source = index.clone();
                source[axis - 1] += start;
                out.push(joined[row as usize][offset(&row_shape, &source)]);
            }
        }
        let mut shape = vec![rows.len() as i64];
        shape.extend(kept_shape);
        (shape, out)
    }

    fn counting(n: i64, from: f32) -> Vec<f32> {
        (0..n).map(|i| from + i as f32).collect()
    }

    #[test]
    fn arrange_pads_joins_picks_and_trims_fp32_caches() {
        let mut kernels = kernels();
        let (a_shape, b_shape) = ([2, 2, 3, 2], [3, 2, 4, 2]);
        let a_data = counting(24, 1.0);
        let b_data = counting(48, 101.0);
        let (a, b) = (value(&a_shape, a_data.clone()), value(&b_shape, b_data.clone()));
        for (rows, start) in [(vec![4, 0, 2], 1), (vec![0, 1, 2, 3, 4], 0), (vec![3], 4)] {
            let out = kernels
                .arrange(&a, 1, Some((&b, 0)), &rows, 2, start)
                .expect("arranges");
            assert_eq!(out.dtype().tensor_type(), Some(TensorElementType::Float32));
            let expected = reference(&[(&a_shape, &a_data, 1), (&b_shape, &b_data, 0)], &rows, 2, start);
            assert_eq!(read::<f32>(&out), expected, "rows {rows:?}, start {start}");
        }
        // The reference itself pads on the left: a's first row, first head, starts with zeros.
        let (_, padded) = reference(&[(&a_shape, &a_data, 1), (&b_shape, &b_data, 0)], &[0], 2, 0);
        assert_eq!(&padded[..4], &[0.0, 0.0, 1.0, 2.0]);
    }

    #[test]
    fn arrange_without_b_pads_and_picks_a_alone() {
        let mut kernels = kernels();
        let shape = [3, 2, 3, 2];
        let data = counting(36, 1.0);
        let a = value(&shape, data.clone());
        for (rows, start) in [(vec![2, 0], 0), (vec![1], 3), (vec![0, 1, 2], 5), (vec![2, 2], 2)] {
            let out = kernels.arrange(&a, 2, None, &rows, 2, start).expect("arranges");
            let expected = reference(&[(&shape, &data, 2)], &rows, 2, start);
            assert_eq!(read::<f32>(&out), expected, "rows {rows:?}, start {start}");
        }
    }

    #[test]
    fn arrange_takes_int64_masks_on_axis_1_and_fp16_caches() {
        let mut kernels = kernels();
        let (a_data, b_data) = (vec![1i64, 1, 1, 0, 1, 1], vec![1i64, 1, 1, 1, 1]);
        let (a, b) = (value(&[2, 3], a_data.clone()), value(&[1, 5], b_data.clone()));
        let out = kernels
            .arrange(&a, 2, Some((&b, 0)), &[2, 1, 0], 1, 1)
            .expect("arranges");
        assert_eq!(out.dtype().tensor_type(), Some(TensorElementType::Int64));
        let expected = reference(&[(&[2, 3], &a_data, 2), (&[1, 5], &b_data, 0)], &[2, 1, 0], 1, 1);
        assert_eq!(read::<i64>(&out), expected);
        assert_eq!(expected.1, [1, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1]);

        let (a_shape, b_shape) = ([1, 2, 2, 4], [2, 2, 3, 4]);
        let a_data: Vec<f16> = counting(16, 0.5).into_iter().map(f16::from_f32).collect();
        let b_data: Vec<f16> = counting(48, -20.0).into_iter().map(f16::from_f32).collect();
        let (a, b) = (value(&a_shape, a_data.clone()), value(&b_shape, b_data.clone()));
        let out = kernels.arrange(&a, 1, Some((&b, 0)), &[1, 0], 2, 1).expect("arranges");
        assert_eq!(out.dtype().tensor_type(), Some(TensorElementType::Float16));
        let expected = reference(&[(&a_shape, &a_data, 1), (&b_shape, &b_data, 0)], &[1, 0], 2, 1);
        assert_eq!(read::<f16>(&out), expected);
    }

    #[test]
    fn arrange_takes_empty_row_sets_and_zero_row_inputs() {
        let mut kernels = kernels();
        let a_data = counting(12, 1.0);
        let a = value(&[2, 1, 3, 2], a_data.clone());
        let none = value(&[0, 1, 4, 2], Vec::<f32>::new());
        let out = kernels.arrange(&a, 0, None, &[], 2, 1).expect("no rows");
        assert_eq!(read::<f32>(&out), (vec![0, 1, 2, 2], vec![]));
        // An empty b: only a's rows exist.
        let out = kernels.arrange(&a, 1, Some((&none, 0)), &[1], 2, 0).expect("empty b");
        let expected = reference(&[(&[2, 1, 3, 2], &a_data, 1)], &[1], 2, 0);
        assert_eq!(read::<f32>(&out), expected);
        // An empty a: b's rows start at 0.
        let out = kernels
            .arrange(&none, 0, Some((&a, 1)), &[0, 1], 2, 0)
            .expect("empty a");
        let expected = reference(&[(&[2, 1, 3, 2], &a_data, 1)], &[0, 1], 2, 0);
        assert_eq!(read::<f32>(&out), expected);
        // Trimming every position leaves an empty axis.
        let out = kernels.arrange(&a, 1, None, &[0], 2, 4).expect("all trimmed");
        assert_eq!(read::<f32>(&out), (vec![1, 1, 0, 2], vec![]));
        // Both empty.
        let out = kernels.arrange(&none, 0, Some((&none, 0)), &[], 2, 0).expect("nothing");
        assert_eq!(read::<f32>(&out), (vec![0, 1, 4, 2], vec![]));
    }

    #[test]
    fn kernels_can_move_to_a_pool_worker_thread() {
        fn sendable<T: Send>() {}
        sendable::<Kernels>();
    }

    #[test]
    fn concat_joins_along_an_axis() {
        let mut kernels = kernels();
        let mask = value(&[2, 3], vec![0i64, 1, 1, 1, 1, 1]);
        let column = value(&[2, 1], vec![1i64, 1]);
        let out = kernels.concat(&mask, &column, 1).expect("concatenates");
        assert_eq!(read::<i64>(&out), (vec![2, 4], vec![0, 1, 1, 1, 1, 1, 1, 1]));
        let past = value(&[1, 2, 2, 1], vec![1.0f32, 2.0, 3.0, 4.0]);
        let new = value(&[1, 2, 1, 1], vec![5.0f32, 6.0]);
        let out = kernels.concat(&past, &new, 2).expect("concatenates");
        assert_eq!(
            read::<f32>(&out),
            (vec![1, 2, 3, 1], vec![1.0, 2.0, 5.0, 3.0, 4.0, 6.0])
        );
    }

    #[test]
    fn last_position_picks_the_last_logits_as_fp32() {
        let mut kernels = kernels();
        let data = counting(24, 0.0);
        let logits = value(&[2, 3, 4], data.clone());
        let expected: Vec<f32> = [&data[8..12], &data[20..24]].concat();
        assert_eq!(kernels.last_position(&logits).expect("picks"), expected);
        let halves: Vec<f16> = data.iter().map(|&v| f16::from_f32(v * 0.5)).collect();
        let logits = value(&[2, 3, 4], halves);
        let halved: Vec<f32> = expected.iter().map(|v| v * 0.5).collect();
        assert_eq!(kernels.last_position(&logits).expect("picks"), halved);
    }

    #[test]
    fn bad_inputs_are_errors_that_say_what_is_wrong() {
        let mut kernels = kernels();
        let a = value(&[1, 2, 3, 2], counting(12, 0.0));
        let flat = value(&[1, 3], counting(3, 0.0));
        let err = kernels.arrange(&a, 0, Some((&flat, 0)), &[0], 2, 0).unwrap_err();
        assert!(err.contains("rank mismatch"), "{err}");
        let err = kernels.concat(&a, &flat, 1).unwrap_err();
        assert!(err.contains("rank mismatch"), "{err}");
        let err = kernels.arrange(&a, 0, Some((&a, 1)), &[0], 2, 0).unwrap_err();
        assert!(err.contains("padded lengths"), "{err}");
        let err = kernels.arrange(&a, 0, None, &[1], 2, 0).unwrap_err();
        assert!(err.contains("row 1 is out of range"), "{err}");
        let err = kernels.arrange(&a, 0, None, &[0], 4, 0).unwrap_err();
        assert!(err.contains("axis 4"), "{err}");
        let err = kernels.arrange(&a, 0, None, &[0], 2, 4).unwrap_err();
        assert!(err.contains("start 4"), "{err}");
        let ints = value(&[1, 2, 3, 2], vec![0i64; 12]);
        let err = kernels.arrange(&a, 0, Some((&ints, 0)), &[0], 2, 0).unwrap_err();
        assert!(err.contains("element type"), "{err}");
        let err = kernels.last_position(&a).unwrap_err();
        assert!(err.contains("rank 4"), "{err}");
        let err = kernels.last_position(&value(&[1, 2, 2], vec![0i64; 4])).unwrap_err();
        assert!(err.contains("FP32 or FP16"), "{err}");
        assert!(kernels.device().is_cpu_accessible());
    }
}
