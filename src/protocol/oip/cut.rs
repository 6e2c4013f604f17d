//! The tensors' `data` arrays taken out of a JSON header before serde reads it.
//!
//! A JSON request's header is a few hundred bytes of names and shapes around `data` arrays of
//! thousands of numbers. Read whole by serde, each array is scanned twice: once by serde, to
//! find where it ends and hand it over as a `RawValue`, then by the codec, which parses the
//! numbers once it knows the tensor's datatype (and `datatype` may come after `data`). Here the
//! arrays' extents are found first, with a byte search for brackets, and serde reads a copy of
//! the header in which each array is `[]`. The codec then parses each array from the original
//! text, once.
//!
//! Nothing is decided here that serde or the codec would not decide: everything outside the
//! arrays reaches serde byte for byte, and every array reaches the codec, which accepts exactly
//! the arrays serde would (`TensorData::from_json`). A header this does not recognise
//! (a string inside an array, an escaped key, unbalanced brackets) is left whole to serde.

use memchr::{memchr2, memchr3};
use serde::Deserialize;
use serde_json::value::RawValue;

/// A JSON header whose tensors' `data` arrays stand apart from the rest.
pub(super) struct Cut<'a> {
    /// The header with each array replaced by `[]`.
    text: Vec<u8>,
    /// Where each `[]` stands in `text`, in order, and the array it replaces.
    arrays: Vec<(usize, &'a str)>,
}

impl<'a> Cut<'a> {
    /// `json` with the `data` arrays of the tensors listed under `list` (`inputs` in a
    /// request, `outputs` in an answer) taken out; `None` when it has none or is not the
    /// plain case.
    pub(super) fn new(json: &'a [u8], list: &str) -> Option<Cut<'a>> {
        let mut walk = Walk {
            b: json,
            i: 0,
            arrays: Vec::new(),
        };
        walk.document(list.as_bytes())?;
        if walk.arrays.is_empty() {
            // Binary tensors: nothing to take out, and no copy to make.
            return None;
        }
        let taken: usize = walk.arrays.iter().map(|&(start, end)| end - start).sum();
        let mut text = Vec::with_capacity(json.len() - taken + 2 * walk.arrays.len());
        let mut arrays = Vec::with_capacity(walk.arrays.len());
        let mut from = 0;
        for (start, end) in walk.arrays {
            text.extend_from_slice(&json[from..start]);
            arrays.push((text.len(), std::str::from_utf8(&json[start..end]).ok()?));
            text.extend_from_slice(b"[]");
            from = end;
        }
        text.extend_from_slice(&json[from..]);
        Some(Cut { text, arrays })
    }

    /// What serde reads.
    pub(super) fn text(&self) -> &[u8] {
        &self.text
    }

    /// A tensor's `data` as serde returned it from [`Cut::text`]: the array it stands for.
    pub(super) fn data<'b>(&'b self, raw: &'b RawValue) -> &'b str {
        let at = (raw.get().as_ptr() as usize).wrapping_sub(self.text.as_ptr() as usize);
        match self.arrays.binary_search_by_key(&at, |&(offset, _)| offset) {
            Ok(k) if raw.get() == "[]" => self.arrays[k].1,
            _ => raw.get(),
        }
    }
}

/// `json` read by serde, from its cut where there is one. A refusal is serde's for `json`
/// itself, so that the line and column it names are the client's, not the cut's.
pub(super) fn parse<'b, T: Deserialize<'b>>(cut: Option<&'b Cut<'_>>, json: &'b [u8]) -> serde_json::Result<T> {
    match cut {
        None => serde_json::from_slice(json),
        Some(cut) => {
            serde_json::from_slice(cut.text()).map_err(|e| serde_json::from_slice::<T>(json).err().unwrap_or(e))
        }
    }
}

/// A tensor's `data` as serde returned it, from the cut header where there is one.
pub(super) fn data_text<'b>(cut: Option<&'b Cut<'_>>, raw: &'b RawValue) -> &'b str {
    match cut {
        Some(cut) => cut.data(raw),
        None => raw.get(),
    }
}

/// A header read just far enough to find `data` arrays: their extents in `arrays`. Every method
/// returns `None` on anything unexpected, which ends the walk.
struct Walk<'a> {
    b: &'a [u8],
    i: usize,
    arrays: Vec<(usize, usize)>,
}

impl<'a> Walk<'a> {
    /// The top-level object, looking into the array under the key `list`.
    fn document(&mut self, list: &[u8]) -> Option<()> {
        self.ws();
        self.object(|walk, key| {
            if key == list && walk.peek() == Some(b'[') {
                walk.tensors()
            } else {
                walk.value()
            }
        })?;
        self.ws();
        (self.i == self.b.len()).then_some(())
    }

    /// An array of tensor objects, each one's `data` array recorded.
    fn tensors(&mut self) -> Option<()> {
        self.i += 1;
        self.members(b']', |walk| {
            if walk.peek() != Some(b'{') {
                return walk.value();
            }
            walk.object(|walk, key| {
                if key == b"data" && walk.peek() == Some(b'[') {
                    walk.data()
                } else {
                    walk.value()
                }
            })
        })
    }

    /// A `data` array: its extent found by counting brackets, in a byte search (the numbers
    /// between are the codec's to read). A string in it, where a bracket may be text, ends
    /// the walk.
    fn data(&mut self) -> Option<()> {
        let start = self.i;
        let mut depth = 0usize;
        loop {
            let found = self.i + memchr3(b'[', b']', b'"', &self.b[self.i..])?;
            match self.b[found] {
                b'[' => depth += 1,
                b']' => depth -= 1,
                _ => return None,
            }
            self.i = found + 1;
            if depth == 0 {
                self.arrays.push((start, self.i));
                return Some(());
            }
        }
    }

    /// An object, `field` called on each key with the walk at its value. A key with an escape
    /// in it ends the walk (serde would read it as another name).
    fn object(&mut self, mut field: impl FnMut(&mut Self, &[u8]) -> Option<()>) -> Option<()> {
        if self.next()? != b'{' {
            return None;
        }
        self.members(b'}', |walk| {
            let key = walk.key()?;
            walk.ws();
            if walk.next()? != b':' {
                return None;
            }
            walk.ws();
            field(walk, key)
        })
    }

    /// The comma-separated members of an array or object just opened, up to its `close`:
    /// `member` called at each, past the whitespace before it.
    fn members(&mut self, close: u8, mut member: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.ws();
        if self.peek() == Some(close) {
            self.i += 1;
            return Some(());
        }
        loop {
            self.ws();
            member(self)?;
            self.ws();
            match self.next()? {
                b',' => continue,
                c if c == close => return Some(()),
                _ => return None,
            }
        }
    }

    /// A key without escapes, its text.
    fn key(&mut self) -> Option<&'a [u8]> {
        if self.next()? != b'"' {
            return None;
        }
        let start = self.i;
        let end = start + memchr2(b'"', b'\\', &self.b[start..])?;
        if self.b[end] != b'"' {
            return None;
        }
        self.i = end + 1;
        Some(&self.b[start..end])
    }

    /// Past any value: serde checks what it is, since it reads these bytes unchanged.
    fn value(&mut self) -> Option<()> {
        match self.peek()? {
            b'"' => self.string(),
            b'[' | b'{' => {
                let mut depth = 0usize;
                loop {
                    match self.next()? {
                        b'[' | b'{' => depth += 1,
                        b']' | b'}' => {
                            depth = depth.checked_sub(1)?;
                            if depth == 0 {
                                return Some(());
                            }
                        }
                        b'"' => {
                            self.i -= 1;
                            self.string()?;
                        }
                        _ => {}
                    }
                }
            }
            _ => {
                while !matches!(self.peek()?, b',' | b']' | b'}' | b' ' | b'\n' | b'\r' | b'\t') {
                    self.i += 1;
                }
                Some(())
            }
        }
    }

    /// Past a string, escapes and all.
    fn string(&mut self) -> Option<()> {
        self.i += 1;
        loop {
            let found = self.i + memchr2(b'"', b'\\', &self.b[self.i..])?;
            if self.b[found] == b'"' {
                self.i = found + 1;
                return Some(());
            }
            self.i = found + 2;
            if self.i > self.b.len() {
                return None;
            }
        }
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\n' | b'\r' | b'\t')) {
            self.i += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{Value, json};

    /// `doc` as serde reads it, with the arrays the cut takes out (`list`'s tensors' `data`)
    /// replaced by `[]`, and those arrays in order.
    fn split_by_serde(doc: &str, list: &str) -> (Value, Vec<Value>) {
        let mut value: Value = serde_json::from_str(doc).unwrap();
        let mut arrays = Vec::new();
        if let Some(Value::Array(tensors)) = value.get_mut(list) {
            for tensor in tensors {
                if let Some(data @ Value::Array(_)) = tensor.get_mut("data") {
                    arrays.push(std::mem::replace(data, json!([])));
                }
            }
        }
        (value, arrays)
    }

    /// Whatever the cut takes out, serde would have read the same: the rest is the same
    /// document, and each array is the same value.
    pub(in crate::protocol::oip) fn loses_nothing(doc: &str, list: &str) -> bool {
        let Some(cut) = Cut::new(doc.as_bytes(), list) else {
            return false;
        };
        let (rest, arrays) = split_by_serde(doc, list);
        assert_eq!(serde_json::from_slice::<Value>(cut.text()).unwrap(), rest, "{doc}");
        let taken: Vec<Value> = cut
            .arrays
            .iter()
            .map(|(_, a)| serde_json::from_str(a).unwrap())
            .collect();
        assert_eq!(taken, arrays, "{doc}");
        true
    }

    #[test]
    fn requests_as_clients_write_them_are_cut() {
        let doc = json!({
            "id": "a [tricky] \"id\" {",
            "parameters": {"data": [9, 9], "inputs": [{"data": [8]}]},
            "inputs": [
                {"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [[0.5, -1e-3], [2, 3]]},
                {"data": [1, 2, 3], "name": "ids", "shape": [3], "datatype": "INT64"},
                {"name": "m", "shape": [0], "datatype": "BOOL", "data": []},
                {"name": "b", "shape": [1], "datatype": "INT64", "parameters": {"binary_data_size": 8}}
            ],
            "outputs": [{"name": "y", "data": [7]}]
        });
        for doc in [doc.to_string(), serde_json::to_string_pretty(&doc).unwrap()] {
            assert!(loses_nothing(&doc, "inputs"), "{doc}");
            assert!(loses_nothing(&doc, "outputs"), "{doc}");
        }
        // Only the listed tensors' arrays go: three of them here; the parameters' stay.
        let doc = doc.to_string();
        let cut = Cut::new(doc.as_bytes(), "inputs").unwrap();
        assert_eq!(cut.arrays.len(), 3);
    }

    #[test]
    fn what_it_does_not_recognise_or_need_is_left_whole_to_serde() {
        for doc in [
            r#"{"inputs": [{"name": "s", "datatype": "BYTES", "data": ["]", "a"]}]}"#,
            r#"{"inputs": [{"name": "x", "d\u0061ta": [1]}]}"#,
            r#"{"inputs": [{"name": "x", "data": [1, [2]}]}"#,
            r#"{"inputs": [{"name": "x", "data": [1, 2"#,
            r#"{"inputs": [{"name": "x", "data": [1]}]} trailing"#,
            r#"{"inputs": [{"name": "x", "data": [1]}],}"#,
            r#"["inputs"]"#,
            // Nothing to take out: binary tensors only.
            r#"{"inputs": [{"name": "b", "shape": [2], "parameters": {"binary_data_size": 8}}]}"#,
            "",
        ] {
            assert!(Cut::new(doc.as_bytes(), "inputs").is_none(), "{doc}");
        }
    }

    #[test]
    fn serde_names_the_place_in_the_clients_text() {
        // The error is after a data array: the cut is shorter there, the client's text is not.
        let doc = r#"{"inputs": [{"name": "x", "data": [1, 2, 3, 4, 5], "shape": [5], "datatype": FP32}]}"#;
        let cut = Cut::new(doc.as_bytes(), "inputs").unwrap();
        let err = parse::<Value>(Some(&cut), doc.as_bytes()).unwrap_err();
        assert_eq!(err.column(), serde_json::from_str::<Value>(doc).unwrap_err().column());
        assert_eq!(err.column(), doc.find("FP32").unwrap() + 1);
    }

    #[test]
    fn a_placeholder_the_client_wrote_is_not_taken_for_one_of_ours() {
        // `[]` in the client's own text is its own; only those standing where an array was
        // taken out are replaced.
        let doc = r#"{"inputs": [{"name": "a", "data": [1, 2]}, {"name": "b", "data": []}], "id": "[]"}"#;
        let cut = Cut::new(doc.as_bytes(), "inputs").unwrap();
        #[derive(serde::Deserialize)]
        struct Tensor<'a> {
            #[serde(borrow)]
            data: &'a RawValue,
        }
        #[derive(serde::Deserialize)]
        struct Request<'a> {
            #[serde(borrow)]
            inputs: Vec<Tensor<'a>>,
        }
        let request: Request = serde_json::from_slice(cut.text()).unwrap();
        let texts: Vec<&str> = request.inputs.iter().map(|t| cut.data(t.data)).collect();
        assert_eq!(texts, ["[1, 2]", "[]"]);
        let other: Box<RawValue> = serde_json::from_str("[]").unwrap();
        assert_eq!(cut.data(&other), "[]");
    }

    fn number() -> impl Strategy<Value = Value> {
        prop_oneof![
            any::<f32>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| json!(f)),
            any::<i64>().prop_map(|n| json!(n)),
            any::<bool>().prop_map(|b| json!(b)),
        ]
    }

    fn data() -> impl Strategy<Value = Value> {
        let leaf = prop::collection::vec(number(), 0..12).prop_map(Value::Array);
        leaf.prop_recursive(3, 48, 4, |inner| {
            prop::collection::vec(inner, 0..4).prop_map(Value::Array)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn every_plain_request_is_cut_and_loses_nothing(
            arrays in prop::collection::vec(data(), 1..4),
            pretty in any::<bool>(),
            id in "[ -~]{0,8}",
        ) {
            let inputs: Vec<Value> = arrays
                .into_iter()
                .enumerate()
                .map(|(k, data)| json!({"name": format!("t{k}"), "shape": [1], "data": data, "datatype": "FP32"}))
                .collect();
            let doc = json!({"id": id, "inputs": inputs, "parameters": {"p": [1, {"q": "]"}]}});
            let doc = if pretty { serde_json::to_string_pretty(&doc).unwrap() } else { doc.to_string() };
            prop_assert!(loses_nothing(&doc, "inputs"));
        }
    }
}
