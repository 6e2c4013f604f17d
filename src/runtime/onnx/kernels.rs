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
use crate::runtime::decoder::Padding;

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

/// How [`Kernels::arrange`] treats the sequence axis: its number, the side each value's padding
/// goes on, and the positions kept once rows are joined and picked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Along {
    /// The axis (past the rows' axis 0).
    pub axis: usize,
    /// Which side the padding goes on.
    pub side: Padding,
    /// The positions kept, `start..end` (an `end` past the length keeps the rest).
    pub keep: std::ops::Range<i64>,
}

impl Along {
    /// Left padding along `axis`, positions `start..` kept.
    pub fn left(axis: usize, start: i64) -> Along {
        Along {
            axis,
            side: Padding::Left,
            keep: start..i64::MAX,
        }
    }

    /// Right padding along `axis`, positions `..end` kept.
    pub fn right(axis: usize, end: i64) -> Along {
        Along {
            axis,
            side: Padding::Right,
            keep: 0..end,
        }
    }

    /// Pad's `pads` input for a value of rank `rank` padded by `pad` on this side of the axis.
    fn pads(&self, rank: usize, pad: i64) -> Vec<i64> {
        let mut pads = vec![0; 2 * rank];
        pads[self.axis + if self.side == Padding::Right { rank } else { 0 }] = pad;
        pads
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
                graph.input(value_info("end", INT64, &[Dim::Fixed(1)]));
                graph.initializer(int64_tensor("axes", &[1], &[axis as i64]));
                let axis_0 = attribute_int("axis", 0);
                graph.node(node(&[gathered_from, "rows"], "taken", "Gather", &[axis_0]));
                graph.node(node(&["taken", "start", "end", "axes"], OUTPUT, "Slice", &[]));
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
                let session = build_session(self.rt, &key.graph()[..], &self.options)
                    .map_err(|e| format!("cannot build the {:?} kernel: {e}", key.kind))?;
                entry.insert(session)
            }
        })
    }

    /// Rows of `a` and `b` (both `[batch_i, d1, ..., axis.., ...]`, same element type and rank,
    /// equal in every dimension but 0 and `along.axis`), each padded with zeros on
    /// `along.side` of the axis by its own pad so both have equal length along it,
    /// concatenated along axis 0 (a's rows first), then rows `rows` (indices into that
    /// concatenation, any order, any subset) taken, then positions `along.keep` kept. `b` is
    /// optional (None: only `a`). Output bound to the device.
    pub fn arrange(
        &mut self,
        a: &DynValue,
        pad_a: i64,
        b: Option<(&DynValue, i64)>,
        rows: &[i64],
        along: Along,
    ) -> Result<DynValue, String> {
        let axis = along.axis;
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
        let (start, end) = (along.keep.start, along.keep.end);
        if !(0..=length).contains(&start) || end < start {
            return Err(format!(
                "arrange: positions {start}..{end} are outside the padded length {length} along axis {axis}"
            ));
        }
        let pads_a = host_int64(along.pads(rank, pad_a))?;
        let rows = host_int64(rows.to_vec())?;
        let start = host_int64(vec![start])?;
        let end = host_int64(vec![end])?;
        let key = Key {
            kind: Kind::Arrange { joined: b.is_some() },
            elem_type,
            rank,
            axis,
        };
        let pads_b = b.map(|(_, pad_b)| host_int64(along.pads(rank, pad_b))).transpose()?;
        let mut inputs = vec![
            ("a", a),
            ("pad_a", &pads_a),
            ("rows", &rows),
            ("start", &start),
            ("end", &end),
        ];
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
mod tests;
