//! What a model's ONNX bytes say beyond the signature a session reports, read with no ONNX
//! library: the operators its graph uses (a `GroupQueryAttention` decoder pads its batch on the
//! right), and metadata vramguard adds to a model's bytes so that every session built from
//! them, in this process or a worker's, reads the same facts back
//! (`OrtSession::metadata`).

use std::collections::BTreeSet;

use super::proto::{Message, varint};
use crate::runtime::decoder::{CacheHints, Padding};
use crate::runtime::folder::ModelFolder;

/// `ModelProto.graph`.
const MODEL_GRAPH: u64 = 7;
/// `ModelProto.metadata_props`.
const MODEL_METADATA: u64 = 14;
/// `GraphProto.node`.
const GRAPH_NODE: u64 = 1;
/// `NodeProto.op_type`.
const NODE_OP_TYPE: u64 = 4;
/// `NodeProto.attribute`.
const NODE_ATTRIBUTE: u64 = 5;
/// `AttributeProto.g` and `.graphs`: subgraphs (an `If`'s branches, a `Loop`'s body).
const ATTRIBUTE_GRAPHS: [u64; 2] = [6, 11];

/// One field of a protobuf message: its number and, for length-delimited fields, its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field<'a> {
    /// A varint, fixed64 or fixed32 field (its value is not needed here).
    Scalar(u64),
    /// A length-delimited field (a string, bytes, or an embedded message) and its bytes.
    Bytes(u64, &'a [u8]),
}

/// The fields of message `bytes`, in order; an error names where the bytes stop making sense.
fn fields(bytes: &[u8]) -> impl Iterator<Item = Result<Field<'_>, String>> {
    let mut at = 0;
    std::iter::from_fn(move || {
        if at >= bytes.len() {
            return None;
        }
        Some(
            (|| {
                let key = read_varint(bytes, &mut at)?;
                let number = key >> 3;
                match key & 7 {
                    0 => read_varint(bytes, &mut at).map(|_| Field::Scalar(number)),
                    1 | 5 => {
                        let width = if key & 7 == 1 { 8 } else { 4 };
                        at = at
                            .checked_add(width)
                            .filter(|end| *end <= bytes.len())
                            .ok_or("a fixed-width field runs past the end")?;
                        Ok(Field::Scalar(number))
                    }
                    2 => {
                        let len = usize::try_from(read_varint(bytes, &mut at)?)
                            .map_err(|_| "a field's length is too large")?;
                        let end = at
                            .checked_add(len)
                            .filter(|end| *end <= bytes.len())
                            .ok_or("a field's length runs past the end")?;
                        let field = Field::Bytes(number, &bytes[at..end]);
                        at = end;
                        Ok(field)
                    }
                    other => Err(format!("wire type {other} at byte {at} is not one ONNX uses")),
                }
            })()
            .inspect_err(|_| at = bytes.len()),
        )
    })
}

fn read_varint(bytes: &[u8], at: &mut usize) -> Result<u64, String> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *bytes.get(*at).ok_or("a varint runs past the end")?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err("a varint is longer than 10 bytes".into())
}

/// Every operator type a model's graph (and its subgraphs) uses.
pub fn operators(model: &[u8]) -> Result<BTreeSet<String>, String> {
    let mut found = BTreeSet::new();
    for field in fields(model) {
        if let Field::Bytes(MODEL_GRAPH, graph) = field.map_err(|e| format!("not an ONNX model: {e}"))? {
            graph_operators(graph, &mut found).map_err(|e| format!("not an ONNX graph: {e}"))?;
        }
    }
    Ok(found)
}

fn graph_operators(graph: &[u8], found: &mut BTreeSet<String>) -> Result<(), String> {
    for field in fields(graph) {
        let Field::Bytes(GRAPH_NODE, node) = field? else {
            continue;
        };
        for field in fields(node) {
            match field? {
                Field::Bytes(NODE_OP_TYPE, op) => {
                    found.insert(String::from_utf8_lossy(op).into_owned());
                }
                Field::Bytes(NODE_ATTRIBUTE, attribute) => {
                    for field in fields(attribute) {
                        if let Field::Bytes(number, subgraph) = field?
                            && ATTRIBUTE_GRAPHS.contains(&number)
                        {
                            graph_operators(subgraph, found)?;
                        }
                    }
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// What a decoder's `model` bytes and its folder say that its signature does not: a graph with
/// `GroupQueryAttention` pads its batch on the right.
pub fn cache_hints(model: &[u8], folder: &ModelFolder) -> Result<CacheHints, String> {
    let genai = folder.genai.as_ref();
    let padding = match operators(model)?.contains("GroupQueryAttention") {
        true => Padding::Right,
        false => Padding::Left,
    };
    Ok(CacheHints {
        head_size: genai.and_then(|g| g.head_size),
        kv_heads: genai.and_then(|g| g.kv_heads),
        padding,
        context: folder.context,
    })
}

/// `model` with `entries` added to its metadata (`metadata_props`): appended after its other
/// fields, which a protobuf reader merges into the repeated field, so nothing else moves.
pub fn with_metadata(mut model: Vec<u8>, entries: &[(&str, String)]) -> Vec<u8> {
    for (key, value) in entries {
        let mut entry = Message::default();
        entry.text(1, key).text(2, value);
        varint(&mut model, (MODEL_METADATA << 3) | 2);
        varint(&mut model, entry.0.len() as u64);
        model.extend_from_slice(&entry.0);
    }
    model
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::model::BuiltinModel;
    use crate::runtime::onnx::{SessionOptions, build_session, runtime};

    #[test]
    fn the_operators_of_a_graph_are_read_from_its_bytes() {
        let ops = operators(BuiltinModel::Decoder.bytes()).unwrap();
        assert!(ops.contains("MatMul") && ops.contains("Softmax"), "{ops:?}");
        assert!(!ops.contains("GroupQueryAttention"));
        let err = operators(&[0x3a, 0x10, 1]).unwrap_err();
        assert_eq!(err, "not an ONNX model: a field's length runs past the end");
    }

    #[test]
    fn metadata_added_to_a_model_is_what_its_sessions_read() {
        let rt = runtime(None).expect("ONNX Runtime loads");
        let bytes = BuiltinModel::Classifier.bytes().to_vec();
        let tagged = with_metadata(bytes, &[("vramguard.cache_padding", "right".into()), ("k", "v".into())]);
        let session = build_session(rt, tagged.as_slice(), &SessionOptions::quiet_cpu()).unwrap();
        let metadata = session.metadata().unwrap();
        assert_eq!(metadata.custom("vramguard.cache_padding").as_deref(), Some("right"));
        assert_eq!(metadata.custom("k").as_deref(), Some("v"));
        assert_eq!(
            operators(&tagged).unwrap(),
            operators(BuiltinModel::Classifier.bytes()).unwrap()
        );
    }
}
