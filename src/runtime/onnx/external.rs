//! External data: the files a model's initializers keep their bytes in (`TensorProto.external_data`,
//! how exporters write weights over 2 GB and the ONNX Runtime GenAI builder all of them), found by
//! reading just those fields of the serialized graph, checked before any session is built (each
//! file inside the model's folder, present, readable and long enough) and counted for the weights'
//! estimate.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use super::graph::{self, Value};

/// The session config entry that tells ONNX Runtime where a graph built from bytes finds its
/// external data (without it, relative to the working directory).
pub(super) const FOLDER_ENTRY: &str = "session.model_external_initializers_file_folder_path";

/// Nested graphs (`If`, `Loop`, `Scan` bodies) followed at most this deep: deeper is no model an
/// exporter writes, and the walk is recursive.
const MAX_DEPTH: usize = 64;

/// `TensorProto.DataLocation.EXTERNAL`.
const EXTERNAL: u64 = 1;

/// What a model keeps outside its graph.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExternalData {
    /// Each file, in the model's folder, once.
    pub files: Vec<PathBuf>,
    /// The bytes its tensors take in them (the ranges they read: a file re-exported in place
    /// can hold stale bytes no tensor reads).
    pub bytes: u64,
}

/// One tensor's reference to external data.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Reference {
    tensor: String,
    location: String,
    offset: u64,
    length: Option<u64>,
}

/// The external data of the model `graph` (a serialized `ModelProto`) whose file lies in
/// `folder` (`None`: held only in memory, so it may reference none), every file checked.
pub fn external_data(graph: &[u8], folder: Option<&Path>) -> Result<ExternalData, String> {
    let mut references = Vec::new();
    model(graph, &mut references).map_err(|e| format!("cannot read the graph's external data fields: {e}"))?;
    let Some(first) = references.first() else {
        return Ok(ExternalData::default());
    };
    let Some(folder) = folder else {
        return Err(format!(
            "tensor `{}` keeps its data in `{}`, and a model held only in memory has no folder to find it in",
            first.tensor, first.location
        ));
    };
    let mut sizes: BTreeMap<&str, u64> = BTreeMap::new();
    let mut bytes = 0u64;
    for r in &references {
        let location = checked_location(&r.location).map_err(|why| format!("tensor `{}`: {why}", r.tensor))?;
        let size = match sizes.get(r.location.as_str()) {
            Some(&size) => size,
            None => {
                let size = file_size(folder, location).map_err(|why| format!("tensor `{}`: {why}", r.tensor))?;
                sizes.insert(&r.location, size);
                size
            }
        };
        let length = r.length.unwrap_or(size.saturating_sub(r.offset));
        let end = r.offset.saturating_add(length);
        if end > size {
            return Err(format!(
                "tensor `{}` reads bytes {}..{end} of external data file {}, which has {size}: is it complete?",
                r.tensor,
                r.offset,
                folder.join(location).display()
            ));
        }
        bytes = bytes.saturating_add(length);
    }
    Ok(ExternalData {
        files: sizes.keys().map(|location| folder.join(location)).collect(),
        bytes,
    })
}

/// `location` as a path inside the model's folder: refused when absolute or when it climbs out
/// (a `..` part), since a model file must not read what lies elsewhere on the machine.
fn checked_location(location: &str) -> Result<&Path, String> {
    if location.is_empty() {
        return Err("its external data has no location".into());
    }
    let path = Path::new(location);
    // `\` separates parts on Windows, where models are exported too: `..\x` climbs there.
    let climbs = location.split(['/', '\\']).any(|part| part == "..");
    let absolute = path.is_absolute()
        || location.starts_with(['/', '\\'])
        || location.as_bytes().get(1) == Some(&b':')
        || path
            .components()
            .any(|c| matches!(c, Component::RootDir | Component::Prefix(_)));
    if absolute || climbs {
        return Err(format!(
            "external data location `{location}` is outside the model's folder; only paths relative to it, without `..`, are read"
        ));
    }
    Ok(path)
}

/// The size of external data file `location` in `folder`, which must be a readable file whose
/// real path (links followed) stays in the folder: ONNX Runtime refuses one that leaves it.
fn file_size(folder: &Path, location: &Path) -> Result<u64, String> {
    let file = folder.join(location);
    let opened = std::fs::File::open(&file)
        .and_then(|f| f.metadata())
        .map_err(|e| format!("cannot read external data file {}: {e}", file.display()))?;
    if !opened.is_file() {
        return Err(format!("external data file {} is not a file", file.display()));
    }
    let real = std::fs::canonicalize(&file).map_err(|e| format!("cannot resolve {}: {e}", file.display()))?;
    let home = std::fs::canonicalize(folder).map_err(|e| format!("cannot resolve {}: {e}", folder.display()))?;
    if !real.starts_with(&home) {
        return Err(format!(
            "external data file {} links to {}, outside the model's folder, which ONNX Runtime refuses to read: copy the file into the folder (a Hugging Face cache's snapshot links to its blobs: download with `--local-dir`)",
            file.display(),
            real.display()
        ));
    }
    Ok(opened.len())
}

/// Each field of message `buf`, in order, handed to `each` as its number and value.
fn fields<'a>(buf: &'a [u8], mut each: impl FnMut(u64, Value<'a>) -> Result<(), String>) -> Result<(), String> {
    for field in graph::fields(buf) {
        let field = field?;
        each(field.number, field.value)?;
    }
    Ok(())
}

/// The messages `ModelProto`'s walk descends into, by their field numbers in `onnx.proto`.
#[derive(Clone, Copy)]
enum Kind {
    Graph,
    Function,
    Node,
    Attribute,
    Sparse,
    Tensor,
}

impl Kind {
    /// What field `field` of this kind holds, when it can hold tensors.
    fn child(self, field: u64) -> Option<Kind> {
        use Kind::*;
        match (self, field) {
            (Graph, 1) | (Function, 7) => Some(Node),
            (Graph, 5) | (Attribute, 5 | 10) | (Sparse, 1 | 2) => Some(Tensor),
            (Graph, 15) | (Attribute, 22 | 23) => Some(Sparse),
            (Node, 5) => Some(Attribute),
            (Attribute, 6 | 11) => Some(Graph),
            _ => None,
        }
    }
}

/// Every external reference of `ModelProto` `buf`: its graph's and its functions'.
fn model(buf: &[u8], out: &mut Vec<Reference>) -> Result<(), String> {
    fields(buf, |field, value| match (field, value) {
        (7, Value::Bytes(graph)) => walk(Kind::Graph, graph, 0, out),
        (25, Value::Bytes(function)) => walk(Kind::Function, function, 0, out),
        _ => Ok(()),
    })
}

/// Every external reference in message `buf` of `kind`, `depth` graphs down.
fn walk(kind: Kind, buf: &[u8], depth: usize, out: &mut Vec<Reference>) -> Result<(), String> {
    if let Kind::Tensor = kind {
        return tensor(buf, out);
    }
    let depth = depth + usize::from(matches!(kind, Kind::Graph));
    if depth > MAX_DEPTH {
        return Err(format!("graphs nested over {MAX_DEPTH} deep"));
    }
    fields(buf, |field, value| match (kind.child(field), value) {
        (Some(child), Value::Bytes(bytes)) => walk(child, bytes, depth, out),
        _ => Ok(()),
    })
}

/// `TensorProto` `buf`'s external reference, when its data location is external.
fn tensor(buf: &[u8], out: &mut Vec<Reference>) -> Result<(), String> {
    let mut name = String::new();
    let mut external = false;
    let mut entries: Vec<(String, String)> = Vec::new();
    fields(buf, |field, value| {
        match (field, value) {
            (8, Value::Bytes(b)) => name = String::from_utf8_lossy(b).into_owned(),
            (14, Value::Varint(v)) => external = v == EXTERNAL,
            (13, Value::Bytes(entry)) => {
                let (mut key, mut text) = (String::new(), String::new());
                fields(entry, |field, value| {
                    match (field, value) {
                        (1, Value::Bytes(b)) => key = String::from_utf8_lossy(b).into_owned(),
                        (2, Value::Bytes(b)) => text = String::from_utf8_lossy(b).into_owned(),
                        _ => {}
                    }
                    Ok(())
                })?;
                entries.push((key, text));
            }
            _ => {}
        }
        Ok(())
    })?;
    if !external {
        return Ok(());
    }
    let number = |key: &str| -> Result<Option<u64>, String> {
        entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| {
                v.parse()
                    .map_err(|_| format!("tensor `{name}`'s external data {key} `{v}` is not a number"))
            })
            .transpose()
    };
    let location = entries
        .iter()
        .find(|(k, _)| k == "location")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    out.push(Reference {
        offset: number("offset")?.unwrap_or(0),
        length: number("length")?,
        tensor: name.clone(),
        location,
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::scratch::OwnDir;
    use crate::runtime::onnx::proto::Message;

    /// A `TensorProto` named `name` whose data is `length` bytes at `offset` of `location`.
    fn external(name: &str, location: &str, offset: u64, length: u64) -> Message {
        let entry = |key: &str, value: &str| {
            let mut entry = Message::default();
            entry.text(1, key).text(2, value);
            entry
        };
        let mut tensor = Message::default();
        tensor.int(2, 1).text(8, name);
        tensor.message(13, &entry("location", location));
        tensor.message(13, &entry("offset", &offset.to_string()));
        tensor.message(13, &entry("length", &length.to_string()));
        tensor.int(14, EXTERNAL);
        tensor
    }

    /// A `ModelProto` whose graph has `initializers`, and one more tensor in a `Constant` node's
    /// attribute inside an `If` branch, where a walk of the top graph alone would miss it.
    fn model_of(initializers: &[Message], nested: Option<Message>) -> Vec<u8> {
        let mut graph = Message::default();
        for tensor in initializers {
            graph.message(5, tensor);
        }
        if let Some(tensor) = nested {
            let mut value = Message::default();
            value.text(1, "value").message(5, &tensor);
            let mut constant = Message::default();
            constant.message(5, &value);
            let mut branch = Message::default();
            branch.message(1, &constant);
            let mut then_branch = Message::default();
            then_branch.text(1, "then_branch").message(6, &branch);
            let mut if_node = Message::default();
            if_node.message(5, &then_branch);
            graph.message(1, &if_node);
        }
        let mut model = Message::default();
        model.int(1, 8).message(7, &graph);
        model.0
    }

    #[test]
    fn locations_outside_the_models_folder_are_refused() {
        for inside in [
            "model.onnx.data",
            "model.onnx_data",
            "weights/part-1.bin",
            "a..b",
            "./x",
        ] {
            assert_eq!(checked_location(inside), Ok(Path::new(inside)), "{inside}");
        }
        for outside in [
            "/etc/passwd",
            "../model.onnx.data",
            "w/../../x",
            "..",
            "..\\x",
            "C:\\x",
            "\\\\host\\x",
        ] {
            let why = checked_location(outside).unwrap_err();
            assert!(
                why.contains(&format!("`{outside}` is outside the model's folder")),
                "{why}"
            );
        }
        assert!(checked_location("").unwrap_err().contains("no location"));
    }

    #[test]
    fn every_file_is_counted_once_by_the_bytes_its_tensors_read() {
        let dir = OwnDir::new("test-external").unwrap();
        std::fs::write(dir.path().join("model.onnx.data"), vec![0u8; 300]).unwrap();
        std::fs::create_dir(dir.path().join("more")).unwrap();
        // Bytes past what any tensor reads (a re-export appended to the file) are not counted.
        std::fs::write(dir.path().join("more/w.bin"), vec![0u8; 500]).unwrap();
        let graph = model_of(
            &[
                external("a", "model.onnx.data", 0, 100),
                external("b", "model.onnx.data", 100, 200),
                tensor_inline(),
            ],
            Some(external("c", "more/w.bin", 64, 50)),
        );
        let data = external_data(&graph, Some(dir.path())).unwrap();
        assert_eq!(data.bytes, 350);
        assert_eq!(
            data.files,
            vec![dir.path().join("model.onnx.data"), dir.path().join("more/w.bin")]
        );
    }

    fn tensor_inline() -> Message {
        crate::runtime::onnx::proto::tensor("inline", &[2], crate::runtime::onnx::proto::FLOAT, &[0; 8])
    }

    #[test]
    fn a_missing_short_escaping_or_unplaceable_file_is_an_error_naming_it() {
        let dir = OwnDir::new("test-external").unwrap();
        let at = |tensor: Message| external_data(&model_of(&[tensor], None), Some(dir.path())).unwrap_err();
        let why = at(external("w", "model.onnx.data", 0, 4));
        assert!(why.contains("tensor `w`: cannot read external data file"), "{why}");
        assert!(why.contains("model.onnx.data"), "{why}");
        std::fs::write(dir.path().join("model.onnx.data"), [0u8; 10]).unwrap();
        let why = at(external("w", "model.onnx.data", 8, 4));
        assert!(why.contains("reads bytes 8..12 of external data file"), "{why}");
        assert!(why.contains("which has 10: is it complete?"), "{why}");
        let why = at(external("w", "../model.onnx.data", 0, 4));
        assert!(
            why.contains("tensor `w`: external data location `../model.onnx.data` is outside"),
            "{why}"
        );
        let elsewhere = OwnDir::new("test-external").unwrap();
        std::fs::write(elsewhere.path().join("blob"), [0u8; 10]).unwrap();
        std::os::unix::fs::symlink(elsewhere.path().join("blob"), dir.path().join("linked")).unwrap();
        let why = at(external("w", "linked", 0, 4));
        assert!(
            why.contains("outside the model's folder, which ONNX Runtime refuses"),
            "{why}"
        );
        let why = external_data(&model_of(&[external("w", "x.data", 0, 4)], None), None).unwrap_err();
        assert!(why.contains("a model held only in memory has no folder"), "{why}");
    }

    #[test]
    fn a_graph_with_inline_data_only_has_none_and_a_broken_one_is_an_error() {
        let graph = model_of(&[tensor_inline()], None);
        assert_eq!(external_data(&graph, None), Ok(ExternalData::default()));
        assert_eq!(
            external_data(crate::core::model::BuiltinModel::Decoder.bytes(), None),
            Ok(ExternalData::default())
        );
        let why = external_data(&graph[..graph.len() - 3], None).unwrap_err();
        assert!(why.contains("cannot read the graph's external data fields"), "{why}");
    }

    #[test]
    fn the_exporters_layouts_are_read_one_file_or_several() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/external");
        for (folder, files) in [("one", 1), ("several", 4), ("fp16", 1), ("int4", 1)] {
            let folder = fixtures.join(folder);
            let graph = std::fs::read(folder.join("model.onnx")).unwrap();
            let data = external_data(&graph, Some(&folder)).unwrap();
            let on_disk: u64 = data.files.iter().map(|f| f.metadata().unwrap().len()).sum();
            assert_eq!(data.files.len(), files, "{}", folder.display());
            assert_eq!(data.bytes, on_disk, "{}", folder.display());
        }
    }
}
