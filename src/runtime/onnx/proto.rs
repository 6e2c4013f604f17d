//! ONNX models written by hand, with no ONNX library: the few messages of `onnx.proto` the
//! crate's own graphs need, each field as its number and wire type say (varints, and
//! length-delimited bytes for strings and messages).

/// `TensorProto.DataType.FLOAT`.
pub(super) const FLOAT: u64 = 1;
/// `TensorProto.DataType.FLOAT16`.
pub(super) const FLOAT16: u64 = 10;
/// `TensorProto.DataType.INT64`.
pub(super) const INT64: u64 = 7;
/// `AttributeProto.AttributeType.INT`.
const ATTRIBUTE_INT: u64 = 2;
/// `AttributeProto.AttributeType.INTS`.
const ATTRIBUTE_INTS: u64 = 7;

/// A protobuf message being written: its fields, in the order added.
#[derive(Debug, Default, Clone)]
pub(super) struct Message(pub(super) Vec<u8>);

impl Message {
    /// A varint field (wire type 0). Negative `int64` values are their two's complement.
    pub(super) fn int(&mut self, field: u64, value: u64) -> &mut Self {
        varint(&mut self.0, field << 3);
        varint(&mut self.0, value);
        self
    }

    /// A length-delimited field (wire type 2).
    pub(super) fn bytes(&mut self, field: u64, value: &[u8]) -> &mut Self {
        varint(&mut self.0, (field << 3) | 2);
        varint(&mut self.0, value.len() as u64);
        self.0.extend_from_slice(value);
        self
    }

    /// A string field.
    pub(super) fn text(&mut self, field: u64, value: &str) -> &mut Self {
        self.bytes(field, value.as_bytes())
    }

    /// An embedded message field.
    pub(super) fn message(&mut self, field: u64, value: &Message) -> &mut Self {
        self.bytes(field, &value.0)
    }
}

/// `value` as a base-128 varint.
pub(super) fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// A `NodeProto` of `op` from `inputs` to `output`, unnamed (as `onnx.helper.make_node` leaves it).
pub(super) fn node(inputs: &[&str], output: &str, op: &str, attributes: &[Message]) -> Message {
    let mut node = Message::default();
    for input in inputs {
        node.text(1, input);
    }
    node.text(2, output).text(4, op);
    for attribute in attributes {
        node.message(5, attribute);
    }
    node
}

/// An `INT` attribute.
pub(super) fn attribute_int(name: &str, value: i64) -> Message {
    let mut attribute = Message::default();
    attribute.text(1, name).int(3, value as u64).int(20, ATTRIBUTE_INT);
    attribute
}

/// An `INTS` attribute.
pub(super) fn attribute_ints(name: &str, values: &[i64]) -> Message {
    let mut attribute = Message::default();
    attribute.text(1, name);
    for &value in values {
        attribute.int(8, value as u64);
    }
    attribute.int(20, ATTRIBUTE_INTS);
    attribute
}

/// A `TensorProto` named `name` of `data_type`, its little-endian bytes given raw.
pub(super) fn tensor(name: &str, dims: &[u64], data_type: u64, raw: &[u8]) -> Message {
    let mut tensor = Message::default();
    for &dim in dims {
        tensor.int(1, dim);
    }
    tensor.int(2, data_type).text(8, name).bytes(9, raw);
    tensor
}

/// An INT64 `TensorProto` (an initializer of indices, axes or bounds).
pub(super) fn int64_tensor(name: &str, dims: &[u64], values: &[i64]) -> Message {
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    tensor(name, dims, INT64, &raw)
}

/// One dimension of a declared shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dim<'a> {
    /// A fixed size.
    Fixed(u64),
    /// A named, dynamic size.
    Symbolic(&'a str),
}

/// A `ValueInfoProto`: a tensor of `elem_type` (a `TensorProto.DataType`) and shape `dims`.
pub(super) fn value_info(name: &str, elem_type: u64, dims: &[Dim<'_>]) -> Message {
    let mut shape = Message::default();
    for dim in dims {
        let mut dimension = Message::default();
        match dim {
            Dim::Fixed(size) => dimension.int(1, *size),
            Dim::Symbolic(symbol) => dimension.text(2, symbol),
        };
        shape.message(1, &dimension);
    }
    let mut tensor = Message::default();
    tensor.int(1, elem_type).message(2, &shape);
    let mut kind = Message::default();
    kind.message(1, &tensor);
    let mut info = Message::default();
    info.text(1, name).message(2, &kind);
    info
}

/// A `GraphProto` being written: nodes, initializers, inputs and outputs.
#[derive(Debug, Default, Clone)]
pub(super) struct Graph {
    nodes: Vec<Message>,
    initializers: Vec<Message>,
    inputs: Vec<Message>,
    outputs: Vec<Message>,
}

impl Graph {
    /// Add a node (nodes must be added in topological order).
    pub(super) fn node(&mut self, node: Message) -> &mut Self {
        self.nodes.push(node);
        self
    }

    /// Add a constant initializer (not a graph input: IR version 4 and later allow that).
    pub(super) fn initializer(&mut self, tensor: Message) -> &mut Self {
        self.initializers.push(tensor);
        self
    }

    /// Declare an input.
    pub(super) fn input(&mut self, info: Message) -> &mut Self {
        self.inputs.push(info);
        self
    }

    /// Declare an output.
    pub(super) fn output(&mut self, info: Message) -> &mut Self {
        self.outputs.push(info);
        self
    }

    /// The `GraphProto`, named `name`.
    pub(super) fn to_message(&self, name: &str) -> Message {
        let mut graph = Message::default();
        for node in &self.nodes {
            graph.message(1, node);
        }
        graph.text(2, name);
        for initializer in &self.initializers {
            graph.message(5, initializer);
        }
        for input in &self.inputs {
            graph.message(11, input);
        }
        for output in &self.outputs {
            graph.message(12, output);
        }
        graph
    }
}

/// A `ModelProto`'s bytes: `graph`, declaring `ir_version` and importing the default domain at
/// `opset`, produced by `vramguard`.
pub(super) fn model(graph: &Message, ir_version: u64, opset: u64) -> Vec<u8> {
    let mut opset_import = Message::default();
    opset_import.text(1, "").int(2, opset);
    let mut model = Message::default();
    model.int(1, ir_version).text(2, "vramguard");
    model.message(7, graph).message(8, &opset_import);
    model.0
}
