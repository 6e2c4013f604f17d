//! What a model's ONNX bytes say beyond the signature a session reports, read with no ONNX
//! library: the operators its graph uses (a `GroupQueryAttention` decoder pads its batch on the
//! right), and metadata vramguard adds to a model's bytes so that every session built from
//! them, in this process or a worker's, reads the same facts back
//! (`OrtSession::metadata`).

use std::collections::BTreeSet;

use super::graph::{Model, fields};
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

/// Every operator type a model's graph (and its subgraphs) uses.
pub fn operators(model: &[u8]) -> Result<BTreeSet<String>, String> {
    let mut found = BTreeSet::new();
    for field in fields(model) {
        let field = field.map_err(|e| format!("not an ONNX model: {e}"))?;
        if let (MODEL_GRAPH, Some(graph)) = (field.number, field.bytes()) {
            graph_operators(graph, &mut found).map_err(|e| format!("not an ONNX graph: {e}"))?;
        }
    }
    Ok(found)
}

fn graph_operators(graph: &[u8], found: &mut BTreeSet<String>) -> Result<(), String> {
    for field in fields(graph) {
        let field = field?;
        let (GRAPH_NODE, Some(node)) = (field.number, field.bytes()) else {
            continue;
        };
        for field in fields(node) {
            let field = field?;
            match (field.number, field.bytes()) {
                (NODE_OP_TYPE, Some(_)) => {
                    found.insert(field.text()?.to_string());
                }
                (NODE_ATTRIBUTE, Some(attribute)) => {
                    for field in fields(attribute) {
                        let field = field?;
                        if let (number, Some(subgraph)) = (field.number, field.bytes())
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

/// Whether `model`'s graph takes past key values (`past_key_values.0.key`): a decoder, known
/// from its bytes before any session of it is built.
pub fn takes_past_key_values(model: &[u8]) -> bool {
    Model::read(model).is_ok_and(|m| m.inputs.contains(&"past_key_values.0.key"))
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
        assert!(takes_past_key_values(BuiltinModel::Decoder.bytes()));
        assert!(!takes_past_key_values(BuiltinModel::Encoder.bytes()) && !takes_past_key_values(&[1, 2]));
        let err = operators(&[0x3a, 0x10, 1]).unwrap_err();
        assert_eq!(err, "not an ONNX model: a field runs past the end of its message");
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
