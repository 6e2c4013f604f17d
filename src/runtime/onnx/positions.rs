//! Decoders that take no `position_ids` made to take them, so each row of a batch has its own
//! positions. Hugging Face Optimum exports some architectures (Gemma, Gemma 2 and 3, GPT-OSS)
//! without that input: the graph then rotates each token by its slot in the cache (the past
//! length plus its index), the same for every row. A batch's rows are left-padded and its caches
//! arranged again as rows join, leave and skip steps (see `generations.rs`), so a row's slots
//! are not its positions, and rotary attention, which depends on the distance between the
//! query's and the keys' positions, sees the wrong distances: its logits drift from the same
//! request's alone (by 1e-3 to 1e-1 on small random Gemmas) and greedy tokens change.
//!
//! Such a graph computes its positions as `Unsqueeze(Range(past, past + new), 0)`, which feeds
//! both the rotary embedding (on its way to `Cos` and `Sin`) and the causal mask. The rewrite
//! gives the rotary embedding's consumers of that tensor a new input `position_ids`
//! `[batch, sequence]` instead, and leaves the mask on the slots, where the attention mask's
//! columns are. Any other graph is left as it is.

use std::collections::{HashMap, HashSet};

use super::graph::{self, Field};
use super::proto::{self, Dim};

/// The input the rewrite adds, as exporters that keep it name it.
const POSITION_IDS: &str = "position_ids";

/// `model` (an ONNX `ModelProto`) with `position_ids` feeding its rotary embedding, when it is a
/// decoder with past key values that computes its positions from its slots; `None` for any
/// other model (and for bytes it cannot read, which ONNX Runtime then reports).
pub(super) fn with_position_ids(model: &[u8]) -> Option<Vec<u8>> {
    let top = fields(model)?;
    let graph_bytes = top.iter().find(|f| f.number == GRAPH)?.bytes()?;
    let graph = fields(graph_bytes)?;
    let inputs: Vec<&str> = graph
        .iter()
        .filter(|f| f.number == GRAPH_INPUT)
        .filter_map(|f| string_field(f.bytes()?, 1))
        .collect();
    if inputs.contains(&POSITION_IDS) || !inputs.iter().any(|n| n.starts_with("past_key_values.")) {
        return None;
    }
    let nodes: Vec<(usize, Node)> = graph
        .iter()
        .enumerate()
        .filter(|(_, f)| f.number == GRAPH_NODE)
        .map(|(at, f)| Some((at, Node::read(f.bytes()?)?)))
        .collect::<Option<_>>()?;
    let (slots, rotary) = rotary_consumers(&nodes)?;
    let mut out_graph = Vec::with_capacity(graph_bytes.len() + 64);
    for (at, field) in graph.iter().enumerate() {
        match rotary.contains(&at) {
            true => {
                let node = renamed_inputs(field.bytes()?, slots)?;
                proto::varint(&mut out_graph, (GRAPH_NODE << 3) | 2);
                proto::varint(&mut out_graph, node.len() as u64);
                out_graph.extend_from_slice(&node);
            }
            false => out_graph.extend_from_slice(field.raw),
        }
    }
    let dims = [Dim::Symbolic("batch_size"), Dim::Symbolic("sequence_length")];
    let input = proto::value_info(POSITION_IDS, proto::INT64, &dims);
    proto::varint(&mut out_graph, (GRAPH_INPUT << 3) | 2);
    proto::varint(&mut out_graph, input.0.len() as u64);
    out_graph.extend_from_slice(&input.0);
    let mut out = Vec::with_capacity(model.len() + 64);
    for field in &top {
        if field.number == GRAPH {
            proto::varint(&mut out, (GRAPH << 3) | 2);
            proto::varint(&mut out, out_graph.len() as u64);
            out.extend_from_slice(&out_graph);
        } else {
            out.extend_from_slice(field.raw);
        }
    }
    Some(out)
}

/// `ModelProto.graph`.
const GRAPH: u64 = 7;
/// `GraphProto.node`.
const GRAPH_NODE: u64 = 1;
/// `GraphProto.input`.
const GRAPH_INPUT: u64 = 11;

/// The tensor of positions computed from the slots (`Unsqueeze` of a `Range`) and the graph
/// fields of its consumers that lead to `Cos` or `Sin`: exactly one such tensor, or none.
fn rotary_consumers<'a>(nodes: &'a [(usize, Node<'a>)]) -> Option<(&'a str, Vec<usize>)> {
    let ranges: Vec<&str> = nodes
        .iter()
        .filter(|(_, n)| n.op == "Range")
        .flat_map(|(_, n)| n.outputs.iter().copied())
        .collect();
    let mut consumers: HashMap<&str, Vec<&Node>> = HashMap::new();
    for (_, node) in nodes {
        for input in &node.inputs {
            consumers.entry(input).or_default().push(node);
        }
    }
    let mut found = None;
    for (_, unsqueeze) in nodes.iter().filter(|(_, n)| n.op == "Unsqueeze") {
        if !unsqueeze.inputs.first().is_some_and(|i| ranges.contains(i)) {
            continue;
        }
        let Some(&slots) = unsqueeze.outputs.first() else {
            continue;
        };
        let rotary: Vec<usize> = nodes
            .iter()
            .filter(|(_, n)| n.inputs.contains(&slots) && reaches_rotation(&consumers, &n.outputs))
            .map(|(at, _)| *at)
            .collect();
        if rotary.is_empty() {
            continue;
        }
        if found.is_some() {
            return None;
        }
        found = Some((slots, rotary));
    }
    found
}

/// Whether any of `tensors` flows into a `Cos` or `Sin` node.
fn reaches_rotation(consumers: &HashMap<&str, Vec<&Node>>, tensors: &[&str]) -> bool {
    let mut seen: HashSet<&str> = tensors.iter().copied().collect();
    let mut queue: Vec<&str> = tensors.to_vec();
    while let Some(tensor) = queue.pop() {
        for node in consumers.get(tensor).into_iter().flatten() {
            if node.op == "Cos" || node.op == "Sin" {
                return true;
            }
            queue.extend(node.outputs.iter().copied().filter(|o| seen.insert(o)));
        }
    }
    false
}

/// A `NodeProto`'s bytes with every input named `from` renamed `position_ids`.
fn renamed_inputs(node: &[u8], from: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(node.len() + 16);
    for field in fields(node)? {
        if field.number == 1 && field.bytes() == Some(from.as_bytes()) {
            proto::varint(&mut out, (1 << 3) | 2);
            proto::varint(&mut out, POSITION_IDS.len() as u64);
            out.extend_from_slice(POSITION_IDS.as_bytes());
        } else {
            out.extend_from_slice(field.raw);
        }
    }
    Some(out)
}

/// What the rewrite reads of a `NodeProto`: its op (default domain only) and tensor names.
struct Node<'a> {
    op: &'a str,
    inputs: Vec<&'a str>,
    outputs: Vec<&'a str>,
}

impl<'a> Node<'a> {
    fn read(bytes: &'a [u8]) -> Option<Node<'a>> {
        let fields = fields(bytes)?;
        let text = |f: &Field<'a>| f.bytes().and_then(|b| std::str::from_utf8(b).ok());
        let strings = |number| fields.iter().filter(|f| f.number == number).filter_map(text).collect();
        let domain = fields.iter().find(|f| f.number == 7).and_then(text).unwrap_or("");
        let op = fields.iter().find(|f| f.number == 4).and_then(text).unwrap_or("");
        Some(Node {
            // An op of another domain that shares a name is not the one meant.
            op: if domain.is_empty() || domain == "ai.onnx" {
                op
            } else {
                ""
            },
            inputs: strings(1),
            outputs: strings(2),
        })
    }
}

/// The fields of a protobuf message, or `None` when its bytes are not one.
fn fields(message: &[u8]) -> Option<Vec<Field<'_>>> {
    graph::fields(message).collect::<Result<_, _>>().ok()
}

/// The first string field `number` of `message`.
fn string_field(message: &[u8], number: u64) -> Option<&str> {
    let field = fields(message)?.into_iter().find(|f| f.number == number)?;
    std::str::from_utf8(field.bytes()?).ok()
}

#[cfg(test)]
mod tests;
