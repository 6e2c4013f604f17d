//! An embedder's pooling run inside its graph: the graph is rewritten at load so that it gives
//! one vector per input, `sentence_embedding` `[batch, hidden]` (sentence-transformers' name),
//! instead of every token's state, `last_hidden_state` `[batch, sequence, hidden]`. On an
//! accelerator only the vectors then cross back to the host (for 32 inputs of 512 tokens and a
//! hidden size of 1,024, 128 KB instead of 64 MB), and the memory estimate, measured on the
//! rewritten graph, sees the smaller output.
//!
//! The nodes added are the operations of sentence-transformers' `Pooling` and `Normalize`
//! modules, in their order: a masked mean (the mask cast to float, the states multiplied by it
//! and summed over the sequence, divided by the mask's sum clamped at 1e-9); the first token
//! (`Gather` of position 0); the last token the mask keeps (the states weighed by a mask that
//! is 1 at each kept token followed by padding or the end, and summed: the one state it keeps
//! plus zeros, exactly); then, when the folder normalizes, division by the L2 norm clamped at
//! 1e-12. A graph it cannot rewrite is kept as it is, with the reason, and pooled on the host.

use super::graph::{Edit, Field, Model, Value, all, first};
use super::proto::{Dim, FLOAT, Message, attribute_int, int64_tensor, node, tensor, value_info};
use crate::runtime::embedder::{EMBEDDING, HIDDEN_STATE, Pooling};

/// The graph input that says which tokens are padding.
const MASK: &str = "attention_mask";
/// Prefix of every value the rewrite adds.
const PREFIX: &str = "vramguard/pooling/";
/// ONNX's opset from which `Unsqueeze` and `ReduceSum` take their axes as an input.
const OPSET: u64 = 13;

/// `bytes` (an Optimum `feature-extraction` export) with `pooling`, and normalization when
/// `normalize`, computed in the graph into the output `sentence_embedding`, which replaces
/// `last_hidden_state`; or why the graph is better kept as it is.
pub fn pooled_embedding(bytes: &[u8], pooling: Pooling, normalize: bool) -> Result<Vec<u8>, String> {
    let model = Model::read(bytes)?;
    match model.opset {
        Some(v) if v >= OPSET => {}
        Some(v) => {
            return Err(format!(
                "it imports ONNX opset {v}; the pooling's Unsqueeze and ReduceSum take their axes as inputs from opset {OPSET}"
            ));
        }
        None => return Err("it imports no ONNX opset".into()),
    }
    if model.ir_version < 4 {
        // Before IR 4 an initializer must also be a graph input.
        return Err(format!("its IR version is {}, before 4", model.ir_version));
    }
    if !model.inputs.contains(&MASK) {
        return Err(format!("it has no input `{MASK}`"));
    }
    let taken = model.outputs.iter().map(|(name, _, _)| *name).chain(
        model
            .nodes
            .iter()
            .flat_map(|(_, n)| n.outputs.iter().copied())
            .chain(model.initializers.keys().copied()),
    );
    for name in taken {
        if name == EMBEDDING || name.starts_with(PREFIX) {
            return Err(format!("it already has a value named `{name}`"));
        }
    }
    let (_, hidden_at, hidden) = model
        .outputs
        .iter()
        .find(|(name, _, _)| *name == HIDDEN_STATE)
        .ok_or_else(|| format!("it has no output `{HIDDEN_STATE}`"))?;
    let mut edit = Edit::default();
    edit.drop_field(*hidden_at);
    edit.add_output(&embedding_info(hidden)?.0);
    let mut added = Added { edit, next: 0 };
    let pooled = added.pooling(pooling);
    if normalize {
        added.normalized(&pooled);
    } else {
        added.node(&[&pooled], Some(EMBEDDING), "Identity", &[]);
    }
    model.edited(&added.edit)
}

/// The nodes and initializers being added, each value named under [`PREFIX`].
struct Added {
    edit: Edit,
    /// The number of the next value to name.
    next: usize,
}

impl Added {
    /// Add `op` of `inputs` with `attributes`; its output is `output`, or a new name.
    fn node(&mut self, inputs: &[&str], output: Option<&str>, op: &str, attributes: &[Message]) -> String {
        let name = output.map_or_else(|| self.name(op), str::to_string);
        self.edit.add_node(&node(inputs, &name, op, attributes).0);
        name
    }

    /// A new value's name, after the operator that computes it.
    fn name(&mut self, what: &str) -> String {
        self.next += 1;
        format!("{PREFIX}{}_{what}", self.next)
    }

    /// An INT64 initializer of `values` (1-D), for axes, bounds and pads.
    fn ints(&mut self, values: &[i64]) -> String {
        let name = self.name("ints");
        self.edit
            .add_initializer(&int64_tensor(&name, &[values.len() as u64], values).0);
        name
    }

    /// A scalar initializer: float when `value` is, else INT64.
    fn scalar(&mut self, value: Scalar) -> String {
        let name = self.name("scalar");
        let bytes = match value {
            Scalar::Float(v) => tensor(&name, &[], FLOAT, &v.to_le_bytes()),
            Scalar::Int(v) => int64_tensor(&name, &[], &[v]),
        };
        self.edit.add_initializer(&bytes.0);
        name
    }

    /// The pooled vectors `[batch, hidden]`, as sentence-transformers' `Pooling` computes them.
    fn pooling(&mut self, pooling: Pooling) -> String {
        let keep_dims = |keep: bool| [attribute_int("keepdims", i64::from(keep))];
        if pooling == Pooling::Cls {
            let first = self.scalar(Scalar::Int(0));
            return self.node(&[HIDDEN_STATE, &first], None, "Gather", &[attribute_int("axis", 1)]);
        }
        let mask = self.node(&[MASK], None, "Cast", &[attribute_int("to", FLOAT as i64)]);
        let weights = match pooling {
            Pooling::Mean => mask.clone(),
            // 1 where the token is kept and the next is not (padding, or the end): the last
            // kept token of a right- or left-padded row.
            _ => {
                let (starts, ends, axes) = (self.ints(&[1]), self.ints(&[i64::MAX]), self.ints(&[1]));
                let after = self.node(&[&mask, &starts, &ends, &axes], None, "Slice", &[]);
                let pads = self.ints(&[0, 0, 0, 1]);
                let next = self.node(&[&after, &pads], None, "Pad", &[]);
                let one = self.scalar(Scalar::Float(1.0));
                let not_next = self.node(&[&one, &next], None, "Sub", &[]);
                self.node(&[&mask, &not_next], None, "Mul", &[])
            }
        };
        let last_axis = self.ints(&[-1]);
        let weights = self.node(&[&weights, &last_axis], None, "Unsqueeze", &[]);
        let weighed = self.node(&[HIDDEN_STATE, &weights], None, "Mul", &[]);
        let sequence = self.ints(&[1]);
        let sum = self.node(&[&weighed, &sequence], None, "ReduceSum", &keep_dims(false));
        if pooling == Pooling::LastToken {
            return sum;
        }
        let count = self.node(&[&weights, &sequence], None, "ReduceSum", &keep_dims(false));
        let least = self.scalar(Scalar::Float(1e-9));
        let count = self.node(&[&count, &least], None, "Max", &[]);
        self.node(&[&sum, &count], None, "Div", &[])
    }

    /// `pooled` divided by its L2 norm clamped at 1e-12 (`torch.nn.functional.normalize`),
    /// into `sentence_embedding`.
    fn normalized(&mut self, pooled: &str) {
        let squares = self.node(&[pooled, pooled], None, "Mul", &[]);
        let last_axis = self.ints(&[-1]);
        let sum = self.node(
            &[&squares, &last_axis],
            None,
            "ReduceSum",
            &[attribute_int("keepdims", 1)],
        );
        let norm = self.node(&[&sum], None, "Sqrt", &[]);
        let least = self.scalar(Scalar::Float(1e-12));
        let norm = self.node(&[&norm, &least], None, "Max", &[]);
        self.node(&[pooled, &norm], Some(EMBEDDING), "Div", &[]);
    }
}

/// An initializer's one value.
#[derive(Clone, Copy)]
enum Scalar {
    Float(f32),
    Int(i64),
}

/// The `ValueInfoProto` of `sentence_embedding`: FP32 `[batch, hidden]`, each dimension as
/// `last_hidden_state`'s `info` declares its first and last.
fn embedding_info<'a>(info: &'a [u8]) -> Result<Message, String> {
    let payload = |message: &'a [u8], number| -> Result<&'a [u8], String> {
        first(message, number)?
            .and_then(|f| f.bytes())
            .ok_or_else(|| format!("`{HIDDEN_STATE}` declares no tensor shape"))
    };
    // ValueInfoProto.type → TypeProto.tensor_type → Tensor.{elem_type, shape} → dim.
    let kind = payload(info, 2)?;
    let tensor = payload(kind, 1)?;
    if first(tensor, 1)?.map(|f| f.value) != Some(Value::Varint(FLOAT)) {
        return Err(format!("`{HIDDEN_STATE}` is not FP32"));
    }
    let shape = payload(tensor, 2)?;
    let dims: Vec<_> = all(shape, 1).collect::<Result<_, _>>()?;
    let [batch, _, hidden] = dims.as_slice() else {
        return Err(format!(
            "`{HIDDEN_STATE}` is declared with {} axes, not [batch, sequence, hidden]",
            dims.len()
        ));
    };
    // TensorShapeProto.Dimension: `dim_value` (1) or `dim_param` (2); neither is unknown.
    let dim = |field: &Field<'a>, unknown: &'static str| -> Result<Dim<'a>, String> {
        let dimension = field.bytes().ok_or("a dimension is not a message")?;
        Ok(match (first(dimension, 1)?.map(|f| f.value), first(dimension, 2)?) {
            (Some(Value::Varint(size)), _) => Dim::Fixed(size),
            (_, Some(param)) => Dim::Symbolic(param.text()?),
            _ => Dim::Symbolic(unknown),
        })
    };
    Ok(value_info(
        EMBEDDING,
        FLOAT,
        &[dim(batch, "batch")?, dim(hidden, "hidden")?],
    ))
}

#[cfg(test)]
mod tests;
