//! What a model's ONNX bytes say beyond the signature a session reports, read with no ONNX
//! library: the operators its graph uses (a `GroupQueryAttention` decoder pads its batch on the
//! right), and metadata vramguard adds to a model's bytes so that every session built from
//! them, in this process or a worker's, reads the same facts back
//! (`OrtSession::metadata`).

use std::collections::BTreeSet;

use super::graph::{Model, Value, fields, first};
use super::proto::{Message, varint};
use crate::runtime::decoder::{CacheHints, Padding, Window};
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
/// `GroupQueryAttention` pads its batch on the right, and the layers whose operator keeps a
/// window of the cache ([`windows`]).
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
        window: windows(model)?,
        slot_window: folder.sliding_window,
    })
}

/// The layers whose `GroupQueryAttention` has `sliding_window_cache` set (their cache is
/// `local_window_size` slots, as the GenAI builder writes a sliding-window model's local
/// layers), by the layer of the past key each reads (`past_key_values.N.key`); `None` when
/// there are none. Layers whose windows differ are refused by name: one size is kept.
pub fn windows(model: &[u8]) -> Result<Option<Window>, String> {
    let model = Model::read(model)?;
    let mut found: Option<Window> = None;
    for (_, node) in &model.nodes {
        if node.op != "GroupQueryAttention" || node.attribute("sliding_window_cache")?.is_none() {
            continue;
        }
        let int = |name: &str| -> Result<Option<i64>, String> {
            Ok(match node.attribute(name)? {
                Some(attribute) => match first(attribute, 3)?.map(|f| f.value) {
                    Some(Value::Varint(v)) => Some(v as i64),
                    _ => None,
                },
                None => None,
            })
        };
        if int("sliding_window_cache")? != Some(1) {
            continue;
        }
        let past = node.inputs.get(3).copied().unwrap_or_default();
        let layer = past
            .strip_prefix("past_key_values.")
            .and_then(|rest| rest.strip_suffix(".key"))
            .and_then(|l| l.parse::<usize>().ok())
            .filter(|&l| l < Window::MAX_LAYERS)
            .ok_or_else(|| {
                format!(
                    "a windowed GroupQueryAttention reads past key `{past}`, not `past_key_values.N.key` (N < {})",
                    Window::MAX_LAYERS
                )
            })?;
        let size = int("local_window_size")?
            .and_then(|s| u64::try_from(s).ok())
            .filter(|s| *s > 0)
            .ok_or_else(|| format!("layer {layer}'s windowed GroupQueryAttention has no local_window_size"))?;
        let window = found.get_or_insert(Window { size, layers: 0 });
        if window.size != size {
            return Err(format!(
                "layer {layer}'s attention keeps a window of {size} positions, another layer's {}: vramguard keeps one size",
                window.size
            ));
        }
        window.layers |= 1 << layer;
    }
    Ok(found)
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
    fn the_layers_whose_attention_keeps_a_window_are_read_from_the_graph() {
        let real = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/real");
        let read = |folder: &str| windows(&std::fs::read(real.join(folder).join("model.onnx")).unwrap());
        // The GenAI builder's Gemma 2: layer 0 local (a window of 8), layer 1 global.
        assert_eq!(read("gemma2-genai").unwrap(), Some(Window { size: 8, layers: 0b01 }));
        // Optimum's keeps every position in every layer (the window is in its mask), and a
        // model without local layers has none.
        assert_eq!(read("gemma2-optimum").unwrap(), None);
        assert_eq!(read("llama-genai").unwrap(), None);
        assert_eq!(windows(BuiltinModel::Decoder.bytes()).unwrap(), None);
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
