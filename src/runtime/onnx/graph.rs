//! ONNX models read and edited with no ONNX library: a message's fields as protobuf's wire
//! format lays them out, each kept as the bytes it was read from, so that anything not edited
//! (every unknown field, every weight) is copied back byte for byte. Only `ModelProto`'s graph
//! and the parts of `GraphProto` an edit needs are looked into; a model of hundreds of MB is
//! read in one pass that allocates nothing per weight, and written in one copy.

use std::collections::HashMap;

use super::proto::{Message, varint};

/// A field's value as the wire gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Value<'a> {
    /// Wire type 0.
    Varint(u64),
    /// Wire type 1.
    Fixed64(u64),
    /// Wire type 2: a string, bytes, an embedded message or packed numbers.
    Bytes(&'a [u8]),
    /// Wire type 5.
    Fixed32(u32),
}

/// One field of a message.
#[derive(Debug, Clone, Copy)]
pub(super) struct Field<'a> {
    /// Its field number.
    pub(super) number: u64,
    /// Its value.
    pub(super) value: Value<'a>,
    /// The bytes it was read from, tag included.
    pub(super) raw: &'a [u8],
}

impl<'a> Field<'a> {
    /// Its length-delimited payload, if it has one.
    pub(super) fn bytes(&self) -> Option<&'a [u8]> {
        match self.value {
            Value::Bytes(b) => Some(b),
            _ => None,
        }
    }

    /// Its payload as a string (ONNX's names), or why it is not one.
    pub(super) fn text(&self) -> Result<&'a str, String> {
        let bytes = self
            .bytes()
            .ok_or_else(|| format!("field {} is not a string", self.number))?;
        std::str::from_utf8(bytes).map_err(|_| format!("field {} is not UTF-8", self.number))
    }
}

/// A base-128 varint at `at`, moving `at` past it.
fn read_varint(bytes: &[u8], at: &mut usize) -> Result<u64, String> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *bytes.get(*at).ok_or("a varint runs past the end of its message")?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err("a varint is longer than 10 bytes".into())
}

/// `n` bytes at `at`, moving `at` past them.
fn take<'a>(bytes: &'a [u8], at: &mut usize, n: u64) -> Result<&'a [u8], String> {
    let end = usize::try_from(n)
        .ok()
        .and_then(|n| at.checked_add(n))
        .filter(|&end| end <= bytes.len())
        .ok_or("a field runs past the end of its message")?;
    let taken = &bytes[*at..end];
    *at = end;
    Ok(taken)
}

/// The fields of a message, in the order written.
pub(super) fn fields(message: &[u8]) -> Fields<'_> {
    Fields { message, at: 0 }
}

/// Iterator of [`fields`]: a malformed message ends it with an error.
pub(super) struct Fields<'a> {
    message: &'a [u8],
    at: usize,
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<Field<'a>, String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.at >= self.message.len() {
            return None;
        }
        let start = self.at;
        let field = self.read(start);
        if field.is_err() {
            // Nothing after a malformed field can be read.
            self.at = self.message.len();
        }
        Some(field)
    }
}

impl<'a> Fields<'a> {
    fn read(&mut self, start: usize) -> Result<Field<'a>, String> {
        let bytes = self.message;
        let tag = read_varint(bytes, &mut self.at)?;
        let number = tag >> 3;
        let value = match tag & 7 {
            0 => Value::Varint(read_varint(bytes, &mut self.at)?),
            1 => Value::Fixed64(u64::from_le_bytes(
                take(bytes, &mut self.at, 8)?.try_into().expect("8 bytes"),
            )),
            2 => {
                let len = read_varint(bytes, &mut self.at)?;
                Value::Bytes(take(bytes, &mut self.at, len)?)
            }
            5 => Value::Fixed32(u32::from_le_bytes(
                take(bytes, &mut self.at, 4)?.try_into().expect("4 bytes"),
            )),
            wire => return Err(format!("field {number} has wire type {wire}, which ONNX never writes")),
        };
        Ok(Field {
            number,
            value,
            raw: &bytes[start..self.at],
        })
    }
}

/// Every field of `message` numbered `number`.
pub(super) fn all<'a>(message: &'a [u8], number: u64) -> impl Iterator<Item = Result<Field<'a>, String>> + 'a {
    fields(message).filter(move |f| f.as_ref().map_or(true, |f| f.number == number))
}

/// The first field of `message` numbered `number`.
pub(super) fn first(message: &[u8], number: u64) -> Result<Option<Field<'_>>, String> {
    all(message, number).next().transpose()
}

/// The strings of every field `number` of `message`.
pub(super) fn texts(message: &[u8], number: u64) -> Result<Vec<&str>, String> {
    all(message, number).map(|f| f?.text()).collect()
}

/// A repeated integer field's values, packed or not (`TensorProto.dims`).
pub(super) fn ints(message: &[u8], number: u64) -> Result<Vec<i64>, String> {
    let mut values = Vec::new();
    for field in all(message, number) {
        match field?.value {
            Value::Varint(v) => values.push(v as i64),
            Value::Bytes(packed) => {
                let mut at = 0;
                while at < packed.len() {
                    values.push(read_varint(packed, &mut at)? as i64);
                }
            }
            _ => return Err(format!("field {number} is not an integer")),
        }
    }
    Ok(values)
}

/// `message` with its `n`th field numbered `number` (a length-delimited one) holding `payload`
/// instead; every other field copied as it was.
pub(super) fn replace_nth(message: &[u8], number: u64, n: usize, payload: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Message::default();
    let mut seen = 0;
    for field in fields(message) {
        let field = field?;
        if field.number == number {
            if seen == n {
                out.bytes(number, payload);
            } else {
                out.0.extend_from_slice(field.raw);
            }
            seen += 1;
        } else {
            out.0.extend_from_slice(field.raw);
        }
    }
    if seen <= n {
        return Err(format!("the message has {seen} fields {number}, not {}", n + 1));
    }
    Ok(out.0)
}

/// `ModelProto.graph`.
const MODEL_GRAPH: u64 = 7;
/// `ModelProto.ir_version`.
const MODEL_IR_VERSION: u64 = 1;
/// `ModelProto.opset_import`.
const MODEL_OPSET_IMPORT: u64 = 8;
/// `GraphProto.node`.
const GRAPH_NODE: u64 = 1;
/// `GraphProto.initializer`.
const GRAPH_INITIALIZER: u64 = 5;
/// `GraphProto.input`.
const GRAPH_INPUT: u64 = 11;
/// `GraphProto.output`.
const GRAPH_OUTPUT: u64 = 12;
/// `GraphProto.value_info`.
const GRAPH_VALUE_INFO: u64 = 13;
/// `TensorProto.name`.
const TENSOR_NAME: u64 = 8;
/// `ValueInfoProto.name`.
const VALUE_INFO_NAME: u64 = 1;

/// A node of the main graph: what [`Model`] reads of a `NodeProto`.
#[derive(Debug)]
pub(super) struct Node<'a> {
    /// The `NodeProto`'s bytes.
    pub(super) raw: &'a [u8],
    /// Input names, in order (an empty name is an omitted optional input).
    pub(super) inputs: Vec<&'a str>,
    /// Output names.
    pub(super) outputs: Vec<&'a str>,
    /// `op_type`.
    pub(super) op: &'a str,
    /// `domain`: empty for ONNX's own operators.
    pub(super) domain: &'a str,
}

impl<'a> Node<'a> {
    fn read(raw: &'a [u8]) -> Result<Node<'a>, String> {
        let text = |number| -> Result<&'a str, String> { first(raw, number)?.map_or(Ok(""), |f| f.text()) };
        Ok(Node {
            raw,
            inputs: texts(raw, 1)?,
            outputs: texts(raw, 2)?,
            op: text(4)?,
            domain: text(7)?,
        })
    }

    /// Whether it is ONNX's operator `op` (the default domain).
    pub(super) fn is(&self, op: &str) -> bool {
        self.op == op && matches!(self.domain, "" | "ai.onnx")
    }

    /// Whether an attribute holds a graph (`If`, `Loop`, `Scan`): its subgraphs may name
    /// values of this graph, which [`Model`] does not follow.
    pub(super) fn has_subgraph(&self) -> Result<bool, String> {
        for attribute in all(self.raw, 5) {
            let attribute = attribute?;
            let attribute = attribute.bytes().ok_or("a node's attribute is not a message")?;
            // `AttributeProto.g` and `.graphs`.
            if first(attribute, 6)?.is_some() || first(attribute, 11)?.is_some() {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The payload of its attribute `name`, if it has it.
    pub(super) fn attribute(&self, name: &str) -> Result<Option<&'a [u8]>, String> {
        for attribute in all(self.raw, 5) {
            let attribute = attribute?.bytes().ok_or("a node's attribute is not a message")?;
            if first(attribute, 1)?.map(|f| f.text()).transpose()? == Some(name) {
                return Ok(Some(attribute));
            }
        }
        Ok(None)
    }
}

/// A model read from its bytes: the fields of `ModelProto`, and of its main graph the nodes,
/// the initializers by name, the outputs and value infos, each with the index of its field in
/// the graph (what an [`Edit`] names).
#[derive(Debug)]
pub(super) struct Model<'a> {
    bytes: &'a [u8],
    /// `ModelProto.ir_version`.
    pub(super) ir_version: u64,
    /// The version of ONNX's own operator set it imports.
    pub(super) opset: Option<u64>,
    /// The graph's fields, in order.
    graph: Vec<Field<'a>>,
    /// Its nodes, in order, with their field's index.
    pub(super) nodes: Vec<(usize, Node<'a>)>,
    /// Its initializers (`TensorProto`), by name.
    pub(super) initializers: HashMap<&'a str, &'a [u8]>,
    /// The names of its declared inputs.
    pub(super) inputs: Vec<&'a str>,
    /// Its outputs (`ValueInfoProto`): name, field index, bytes.
    pub(super) outputs: Vec<(&'a str, usize, &'a [u8])>,
    /// Its value infos: name and field index.
    pub(super) value_infos: Vec<(&'a str, usize)>,
}

impl<'a> Model<'a> {
    /// Read `bytes` as a `ModelProto`.
    pub(super) fn read(bytes: &'a [u8]) -> Result<Model<'a>, String> {
        let mut model = Model {
            bytes,
            ir_version: 0,
            opset: None,
            graph: Vec::new(),
            nodes: Vec::new(),
            initializers: HashMap::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            value_infos: Vec::new(),
        };
        let mut graph = None;
        for field in fields(bytes) {
            let field = field.map_err(|e| format!("not an ONNX model: {e}"))?;
            match (field.number, field.value) {
                (MODEL_IR_VERSION, Value::Varint(v)) => model.ir_version = v,
                (MODEL_OPSET_IMPORT, Value::Bytes(set)) => {
                    let domain = first(set, 1)?.map(|f| f.text()).transpose()?.unwrap_or("");
                    if matches!(domain, "" | "ai.onnx")
                        && let Some(Value::Varint(version)) = first(set, 2)?.map(|f| f.value)
                    {
                        model.opset = Some(version);
                    }
                }
                (MODEL_GRAPH, Value::Bytes(g)) if graph.is_none() => graph = Some(g),
                (MODEL_GRAPH, _) => return Err("the model has more than one graph".into()),
                _ => {}
            }
        }
        let graph = graph.ok_or("the model has no graph")?;
        for field in fields(graph) {
            let field = field.map_err(|e| format!("the graph is malformed: {e}"))?;
            let index = model.graph.len();
            model.graph.push(field);
            let Some(payload) = field.bytes() else { continue };
            let name = |number| -> Result<&'a str, String> { first(payload, number)?.map_or(Ok(""), |f| f.text()) };
            match field.number {
                GRAPH_NODE => model.nodes.push((index, Node::read(payload)?)),
                GRAPH_INITIALIZER => {
                    model.initializers.insert(name(TENSOR_NAME)?, payload);
                }
                GRAPH_INPUT => model.inputs.push(name(VALUE_INFO_NAME)?),
                GRAPH_OUTPUT => model.outputs.push((name(VALUE_INFO_NAME)?, index, payload)),
                GRAPH_VALUE_INFO => model.value_infos.push((name(VALUE_INFO_NAME)?, index)),
                _ => {}
            }
        }
        Ok(model)
    }

    /// The model's bytes with `edit` made, in one copy: every field it does not touch is
    /// written back as it was read.
    pub(super) fn edited(&self, edit: &Edit) -> Result<Vec<u8>, String> {
        let mut graph: Vec<&[u8]> = Vec::with_capacity(self.graph.len() + edit.appended.len());
        for (index, field) in self.graph.iter().enumerate() {
            match edit.replaced.get(&index) {
                Some(Some(by)) => graph.push(by),
                Some(None) => {}
                None => graph.push(field.raw),
            }
        }
        graph.extend(edit.appended.iter().map(Vec::as_slice));
        let graph_len: usize = graph.iter().map(|piece| piece.len()).sum();
        let mut out = Vec::with_capacity(self.bytes.len() + graph_len.saturating_sub(self.graph_len()) + 16);
        for field in fields(self.bytes) {
            let field = field?;
            if field.number != MODEL_GRAPH {
                out.extend_from_slice(field.raw);
                continue;
            }
            varint(&mut out, (MODEL_GRAPH << 3) | 2);
            varint(&mut out, graph_len as u64);
            for piece in &graph {
                out.extend_from_slice(piece);
            }
        }
        Ok(out)
    }

    fn graph_len(&self) -> usize {
        self.graph.iter().map(|f| f.raw.len()).sum()
    }
}

/// Changes to a [`Model`]'s graph, its fields named by their index.
#[derive(Debug, Default)]
pub(super) struct Edit {
    /// Fields (tags included, one or more) that replace the one at that index (`None`: dropped).
    replaced: HashMap<usize, Option<Vec<u8>>>,
    /// Fields to write after the last.
    appended: Vec<Vec<u8>>,
}

impl Edit {
    /// Replace the node at field `at` by `nodes` (`NodeProto`s, in the graph's order: the
    /// node itself edited, and those that feed it or read it).
    pub(super) fn replace_node(&mut self, at: usize, nodes: &[&[u8]]) {
        let fields = nodes.iter().flat_map(|node| field(GRAPH_NODE, node)).collect();
        self.replaced.insert(at, Some(fields));
    }

    /// Replace the output at field `at` by `info` (a `ValueInfoProto`).
    pub(super) fn replace_output(&mut self, at: usize, info: &[u8]) {
        self.replaced.insert(at, Some(field(GRAPH_OUTPUT, info)));
    }

    /// Drop the graph's field `at` (a value info whose shape no longer holds).
    pub(super) fn drop_field(&mut self, at: usize) {
        self.replaced.insert(at, None);
    }

    /// Add `node` (a `NodeProto`) after every node there is.
    pub(super) fn add_node(&mut self, node: &[u8]) {
        self.appended.push(field(GRAPH_NODE, node));
    }

    /// Add `info` (a `ValueInfoProto`) as an output.
    pub(super) fn add_output(&mut self, info: &[u8]) {
        self.appended.push(field(GRAPH_OUTPUT, info));
    }

    /// Add `tensor` (a `TensorProto`) as an initializer.
    pub(super) fn add_initializer(&mut self, tensor: &[u8]) {
        self.appended.push(field(GRAPH_INITIALIZER, tensor));
    }
}

/// A length-delimited field `number` holding `payload`, tag included.
fn field(number: u64, payload: &[u8]) -> Vec<u8> {
    let mut message = Message::default();
    message.bytes(number, payload);
    message.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::model::BuiltinModel;
    use crate::runtime::onnx::proto::{FLOAT, int64_tensor, node, value_info};

    /// Field `number` of wire type 5 and then of wire type 1: what no writer here makes.
    fn fixed_fields(out: &mut Vec<u8>, number: u64) {
        varint(out, (number << 3) | 5);
        out.extend_from_slice(&7u32.to_le_bytes());
        varint(out, ((number + 1) << 3) | 1);
        out.extend_from_slice(&9u64.to_le_bytes());
    }

    /// A model with fields ONNX does not define at both levels, packed dims and a value info.
    fn unusual_model() -> Vec<u8> {
        let mut graph = Message::default();
        graph.message(1, &node(&["x", "w"], "y", "MatMul", &[]));
        graph.message(5, &int64_tensor("w", &[2, 3], &[0; 6]));
        let mut packed = Message::default();
        packed.bytes(1, &[4, 5]).int(2, 7).text(8, "packed");
        graph.message(5, &packed);
        graph.message(11, &value_info("x", FLOAT, &[]));
        graph.message(12, &value_info("y", FLOAT, &[]));
        graph.message(13, &value_info("hint", FLOAT, &[]));
        graph.int(99, 1);
        fixed_fields(&mut graph.0, 100);
        let mut set = Message::default();
        set.text(1, "ai.onnx").int(2, 13);
        let mut model = Message::default();
        model.int(1, 9).text(2, "a tool").int(77, 3);
        fixed_fields(&mut model.0, 80);
        model.message(7, &graph).message(8, &set).text(20, "trailing");
        model.0
    }

    #[test]
    fn a_model_written_back_with_no_edit_is_the_same_bytes() {
        for model in BuiltinModel::ALL {
            let bytes = model.bytes();
            assert_eq!(
                Model::read(bytes).unwrap().edited(&Edit::default()).unwrap(),
                bytes,
                "{model:?}"
            );
        }
        let unusual = unusual_model();
        assert_eq!(
            Model::read(&unusual).unwrap().edited(&Edit::default()).unwrap(),
            unusual
        );
    }

    #[test]
    fn the_reader_finds_the_graphs_parts_and_an_edit_keeps_every_other_field() {
        let bytes = unusual_model();
        let model = Model::read(&bytes).unwrap();
        assert_eq!((model.ir_version, model.opset), (9, Some(13)));
        assert_eq!(model.nodes.len(), 1);
        let (_, matmul) = &model.nodes[0];
        assert_eq!(
            (matmul.op, matmul.inputs.as_slice(), matmul.outputs.as_slice()),
            ("MatMul", &["x", "w"][..], &["y"][..])
        );
        assert!(matmul.is("MatMul") && !matmul.has_subgraph().unwrap());
        assert_eq!(ints(model.initializers["w"], 1).unwrap(), [2, 3]);
        assert_eq!(ints(model.initializers["packed"], 1).unwrap(), [4, 5]);
        assert_eq!(model.inputs, ["x"]);
        assert_eq!(model.outputs.iter().map(|o| o.0).collect::<Vec<_>>(), ["y"]);
        assert_eq!(model.value_infos.iter().map(|v| v.0).collect::<Vec<_>>(), ["hint"]);

        let mut edit = Edit::default();
        let renamed = replace_nth(matmul.raw, 2, 0, b"z").unwrap();
        edit.replace_node(model.nodes[0].0, &[&node(&["x"], "x2", "Relu", &[]).0, &renamed]);
        edit.drop_field(model.value_infos[0].1);
        edit.replace_output(model.outputs[0].1, &value_info("z", FLOAT, &[]).0);
        edit.add_initializer(&int64_tensor("added", &[1], &[1]).0);
        let edited = model.edited(&edit).unwrap();
        let again = Model::read(&edited).unwrap();
        let ops: Vec<_> = again.nodes.iter().map(|(_, n)| (n.op, n.outputs[0])).collect();
        assert_eq!(ops, [("Relu", "x2"), ("MatMul", "z")]);
        assert!(again.value_infos.is_empty());
        assert_eq!(again.outputs[0].0, "z");
        assert!(again.initializers.contains_key("added") && again.initializers.contains_key("packed"));
        // Every field of the model but the graph is where it was; the graph's unknown ones too.
        let unknown = |bytes: &[u8]| -> Vec<Vec<u8>> {
            let top = fields(bytes).map(|f| f.unwrap()).filter(|f| f.number != MODEL_GRAPH);
            let graph = fields(first(bytes, MODEL_GRAPH).unwrap().unwrap().bytes().unwrap()).map(|f| f.unwrap());
            top.chain(graph.filter(|f| f.number > 13))
                .map(|f| f.raw.to_vec())
                .collect()
        };
        assert_eq!(unknown(&edited), unknown(&bytes));
        assert_eq!(unknown(&bytes).len(), 10);
    }

    #[test]
    fn malformed_bytes_say_what_is_wrong() {
        let err = |bytes: &[u8]| Model::read(bytes).expect_err("malformed");
        assert!(err(&[0x0a, 0x05, 1]).contains("runs past the end"));
        assert!(err(&[0x0b]).contains("wire type 3"));
        let mut endless = vec![0x08];
        endless.extend([0xff; 11]);
        assert!(err(&endless).contains("longer than 10 bytes"));
        assert!(err(&[0x08, 1]).contains("no graph"));
        // A graph whose node is cut short.
        assert!(err(&[0x3a, 0x02, 0x0a, 0x05]).contains("runs past the end"));
    }
}
