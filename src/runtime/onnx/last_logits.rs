//! A decoder's prompt run computes only the logits it uses: the graph is rewritten at load so
//! that its LM head sees the last position alone, and `logits` is `[batch, 1, vocab]` whatever
//! the prompt's length (without it, a 4,096-token prompt of a 151,936-token vocabulary is
//! 2.5 GB of FP32 logits and as much LM-head compute as a few layers).
//!
//! The LM head is found by walking back from the output `logits` through what exporters put
//! after it, each acting on every position on its own (a `Cast`, a bias `Add`, Gemma 2's
//! soft-capping `Div`, `Tanh`, `Mul`), to a `MatMul` (or ONNX Runtime's `MatMulNBits`) whose
//! other input is a weight: an initializer, or one seen through a `Transpose` or `Cast` (the
//! tied embedding of Optimum's exports). A `Slice` of the last position along the sequence
//! axis is inserted before it. Each last-position logit is the same dot product as before, of
//! the same row and weight, so the answer is bit for bit the one the whole graph gave. Any
//! graph this walk does not fully understand is kept as it is, with the reason.

use std::collections::HashMap;

use super::graph::{Edit, Model, Node, all, first, ints, replace_nth};
use super::proto::{Message, int64_tensor, node};

/// The output the rewrite shortens.
const LOGITS: &str = "logits";
/// The last position(s) of the LM head's input, which the rewrite inserts.
const HIDDEN: &str = "vramguard/last_position/hidden";
/// An int4 LM head's two positions of logits, of which the rewrite keeps the last.
const TWO: &str = "vramguard/last_position/two";
/// The `Slice`s' bounds along axis 1 (the sequence): from position -1 (or -2) to the end.
const LAST: &str = "vramguard/last_position/last";
const LAST_TWO: &str = "vramguard/last_position/last_two";
const END: &str = "vramguard/last_position/end";
const AXIS: &str = "vramguard/last_position/axis";
/// Nodes walked back from `logits` before giving up on finding its LM head.
const MAX_TAIL: usize = 8;
/// Producers followed back from a node's input to decide that it is a weight.
const MAX_WEIGHT_DEPTH: usize = 4;

/// `bytes` (a decoder's `ModelProto`) with its LM head fed the last position only, or why the
/// graph is better kept as it is.
pub fn last_position_logits(bytes: &[u8]) -> Result<Vec<u8>, String> {
    let model = Model::read(bytes)?;
    let graph = Graph::new(&model)?;
    let (head, shortened) = graph.lm_head()?;
    graph.rewrite(head, &shortened)
}

/// The main graph, indexed for the walk.
struct Graph<'m, 'a> {
    model: &'m Model<'a>,
    /// The node (its place in `model.nodes`) that computes each value.
    producers: HashMap<&'a str, usize>,
    /// How many node inputs and graph outputs name each value.
    uses: HashMap<&'a str, usize>,
}

impl<'m, 'a> Graph<'m, 'a> {
    fn new(model: &'m Model<'a>) -> Result<Graph<'m, 'a>, String> {
        match model.opset {
            Some(v) if v >= 10 => {}
            Some(v) => return Err(format!("it imports ONNX opset {v}; slicing by inputs needs opset 10")),
            None => return Err("it imports no ONNX opset".into()),
        }
        if model.ir_version < 4 {
            // Before IR 4 an initializer must also be a graph input.
            return Err(format!("its IR version is {}, before 4", model.ir_version));
        }
        let mut producers = HashMap::new();
        let mut uses: HashMap<&str, usize> = HashMap::new();
        for (at, (_, node)) in model.nodes.iter().enumerate() {
            if node.has_subgraph()? {
                return Err(format!(
                    "its graph has a {} node, whose subgraphs are not followed",
                    node.op
                ));
            }
            for output in &node.outputs {
                producers.insert(*output, at);
            }
            for input in node.inputs.iter().filter(|i| !i.is_empty()) {
                *uses.entry(*input).or_default() += 1;
            }
        }
        for (name, _, _) in &model.outputs {
            *uses.entry(*name).or_default() += 1;
        }
        let taken = |name: &str| {
            producers.contains_key(name) || model.initializers.contains_key(name) || model.inputs.contains(&name)
        };
        if let Some(name) = [HIDDEN, TWO, LAST, LAST_TWO, END, AXIS].into_iter().find(|n| taken(n)) {
            return Err(format!("it already has a value named `{name}`"));
        }
        Ok(Graph { model, producers, uses })
    }

    fn producer(&self, name: &str) -> Option<&'m Node<'a>> {
        self.producers.get(name).map(|&at| &self.model.nodes[at].1)
    }

    /// The LM head (its place in the model's nodes) and the values between it and `logits`
    /// (its output included), whose sequence axis the rewrite shortens to 1.
    fn lm_head(&self) -> Result<(usize, Vec<&'a str>), String> {
        if !self.model.outputs.iter().any(|(name, _, _)| *name == LOGITS) {
            return Err(format!("it has no output `{LOGITS}`"));
        }
        let mut shortened: Vec<&'a str> = Vec::new();
        let mut name: &'a str = LOGITS;
        for _ in 0..MAX_TAIL {
            shortened.push(name);
            if self.uses.get(name) != Some(&1) {
                return Err(format!("`{name}` is used by more than the way to `{LOGITS}`"));
            }
            let at = *self
                .producers
                .get(name)
                .ok_or_else(|| format!("`{name}` is not computed by a node"))?;
            let node = &self.model.nodes[at].1;
            let weight = |i: usize| node.inputs.get(i).is_some_and(|w| self.is_weight(w, 0));
            let head = match (node.op, node.domain) {
                ("MatMul", "" | "ai.onnx") => {
                    node.inputs.len() == 2 && weight(1) && self.dims(node.inputs[1]).is_none_or(|d| d.len() == 2)
                }
                ("MatMulNBits", "com.microsoft") => {
                    (1..node.inputs.len()).all(|i| node.inputs[i].is_empty() || weight(i))
                }
                ("Gemm", "" | "ai.onnx") => {
                    return Err(format!(
                        "`{name}` is an output of Gemm, whose input has every position flattened into its rows"
                    ));
                }
                _ => false,
            };
            if head {
                return Ok((at, shortened));
            }
            name = self.per_position_input(node).ok_or_else(|| {
                format!(
                    "`{name}` is an output of {}, which is neither an LM head nor an operator acting on each position alone",
                    node.op
                )
            })?;
        }
        Err(format!("no LM head within {MAX_TAIL} nodes of `{LOGITS}`"))
    }

    /// The one input of `node` that varies with the position, when `node` acts on each
    /// position on its own: a cast or an activation, or arithmetic with a constant that is the
    /// same for every position (a bias, a soft-capping scale).
    fn per_position_input(&self, node: &Node<'a>) -> Option<&'a str> {
        let (op, inputs) = (node.op, node.inputs.as_slice());
        let default = matches!(node.domain, "" | "ai.onnx");
        match inputs {
            [x] if default && matches!(op, "Cast" | "Identity" | "Tanh") => Some(x),
            [a, b] if default && matches!(op, "Add" | "Sub" | "Mul" | "Div") => {
                let same_everywhere = |name: &str| {
                    self.is_weight(name, 0)
                        && self
                            .dims(name)
                            .is_some_and(|d| d.len() <= 1 || (d.len() <= 3 && d[..d.len() - 1].iter().all(|&n| n == 1)))
                };
                match (same_everywhere(a), same_everywhere(b)) {
                    (false, true) => Some(a),
                    // `Sub` and `Div` of a constant by the logits still act position by position.
                    (true, false) => Some(b),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    /// Whether `name` is fixed by the model: an initializer, a `Constant`, or one of those seen
    /// through a transpose, cast, reshape or dequantization.
    fn is_weight(&self, name: &str, depth: usize) -> bool {
        if self.model.initializers.contains_key(name) {
            return true;
        }
        let Some(node) = self.producer(name) else { return false };
        let through = ["Transpose", "Cast", "Identity", "Reshape", "DequantizeLinear"];
        node.is("Constant")
            || (depth < MAX_WEIGHT_DEPTH
                && through.iter().any(|op| node.is(op))
                && node.inputs.iter().all(|i| i.is_empty() || self.is_weight(i, depth + 1)))
    }

    /// The dimensions of a weight, where the model says them: an initializer's, a
    /// `Constant`'s, or either through a `Cast` or `Transpose`.
    fn dims(&self, name: &str) -> Option<Vec<i64>> {
        if let Some(tensor) = self.model.initializers.get(name) {
            return ints(tensor, 1).ok();
        }
        let node = self.producer(name)?;
        if node.is("Constant") {
            // A `value` tensor's dims, or a scalar `value_float` / `value_int`.
            if let Some(value) = node.attribute("value").ok()? {
                return ints(first(value, 5).ok()??.bytes()?, 1).ok();
            }
            return ["value_float", "value_int"]
                .iter()
                .any(|a| node.attribute(a).ok().flatten().is_some())
                .then(Vec::new);
        }
        let input = self.dims(node.inputs.first()?)?;
        if node.is("Cast") || node.is("Identity") {
            return Some(input);
        }
        if node.is("Transpose") {
            let perm = match node.attribute("perm").ok()? {
                Some(attribute) => ints(attribute, 8).ok()?,
                None => (0..input.len() as i64).rev().collect(),
            };
            return perm
                .iter()
                .map(|&p| input.get(usize::try_from(p).ok()?).copied())
                .collect();
        }
        None
    }

    /// The model with a `Slice` of the last position before `head`, `shortened`'s value
    /// infos dropped and `logits` declared one position long.
    ///
    /// An int4 head (`MatMulNBits`) is given the last two positions and its output sliced to
    /// the last: ONNX Runtime's CPU kernel computes a single row by another method (no
    /// dequantized GEMM) whose sums differ in the last bits, and two rows keep the method the
    /// whole prompt's run took (a one-token prompt took the single-row one before too).
    fn rewrite(&self, head: usize, shortened: &[&str]) -> Result<Vec<u8>, String> {
        let (field, lm_head) = &self.model.nodes[head];
        let (hidden, output) = (lm_head.inputs[0], lm_head.outputs[0]);
        let (_, output_at, logits) = self
            .model
            .outputs
            .iter()
            .find(|(name, _, _)| *name == LOGITS)
            .expect("found by lm_head");
        let mut edit = Edit::default();
        edit.replace_output(*output_at, &one_position(logits)?);
        let sliced = replace_nth(lm_head.raw, 1, 0, HIDDEN.as_bytes())?;
        let bounds: &[(&str, i64)] = if lm_head.op == "MatMulNBits" {
            let sliced = replace_nth(&sliced, 2, 0, TWO.as_bytes())?;
            edit.replace_node(
                *field,
                &[
                    &node(&[hidden, LAST_TWO, END, AXIS], HIDDEN, "Slice", &[]).0,
                    &sliced,
                    &node(&[TWO, LAST, END, AXIS], output, "Slice", &[]).0,
                ],
            );
            &[(LAST_TWO, -2), (LAST, -1), (END, i64::MAX), (AXIS, 1)]
        } else {
            edit.replace_node(
                *field,
                &[&node(&[hidden, LAST, END, AXIS], HIDDEN, "Slice", &[]).0, &sliced],
            );
            &[(LAST, -1), (END, i64::MAX), (AXIS, 1)]
        };
        for &(name, value) in bounds {
            edit.add_initializer(&int64_tensor(name, &[1], &[value]).0);
        }
        for (name, at) in &self.model.value_infos {
            if shortened.contains(name) {
                edit.drop_field(*at);
            }
        }
        self.model.edited(&edit)
    }
}

/// `logits`' `ValueInfoProto` with its sequence axis (1) declared as 1.
fn one_position(info: &[u8]) -> Result<Vec<u8>, String> {
    let payload = |message: &[u8], number| -> Result<Vec<u8>, String> {
        Ok(first(message, number)?
            .and_then(|f| f.bytes())
            .ok_or_else(|| format!("`{LOGITS}` declares no tensor shape"))?
            .to_vec())
    };
    // ValueInfoProto.type → TypeProto.tensor_type → Tensor.shape → TensorShapeProto.dim.
    let kind = payload(info, 2)?;
    let tensor = payload(&kind, 1)?;
    let shape = payload(&tensor, 2)?;
    let dims: Vec<_> = all(&shape, 1).collect::<Result<_, _>>()?;
    if dims.len() != 3 {
        return Err(format!(
            "`{LOGITS}` is declared with {} axes, not [batch, sequence, vocab]",
            dims.len()
        ));
    }
    let sequence = dims[1].bytes().ok_or("a dimension is not a message")?;
    if let Some(size) = first(sequence, 1)? {
        return Err(format!("`{LOGITS}`' sequence axis is fixed ({:?})", size.value));
    }
    let mut one = Message::default();
    one.int(1, 1);
    let shape = replace_nth(&shape, 1, 1, &one.0)?;
    let tensor = replace_nth(&tensor, 2, 0, &shape)?;
    let kind = replace_nth(&kind, 1, 0, &tensor)?;
    replace_nth(info, 2, 0, &kind)
}

#[cfg(test)]
mod tests;
