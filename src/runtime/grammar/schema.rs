//! What a schema may hold before it is compiled: bounds on its size, so that a hostile schema
//! is refused rather than compiled for seconds, and no `$ref` that leads back to itself with
//! nothing in between (`{"$ref": "#"}`, or `a` naming `b` naming `a`), which would leave a
//! grammar that admits no text and an engine error that says nothing of why.

use std::collections::HashMap;

use serde_json::Value;

/// The most properties (over every object) the schemas of one grammar may name: `llguidance`
/// spends about the square of an object's optional properties compiling it (a thousand took
/// over a second) and recurses per property. OpenAI bounds its structured outputs the same way.
pub(super) const MOST_PROPERTIES: usize = 500;
/// The most `enum` values the schemas of one grammar may list.
pub(super) const MOST_ENUM_VALUES: usize = 1000;
/// The deepest a schema may nest, in JSON levels.
pub(super) const DEEPEST: usize = 64;

/// What the schemas of one grammar hold, against the limits above.
#[derive(Default)]
pub(super) struct Size {
    properties: usize,
    enum_values: usize,
}

impl Size {
    /// Count `schema` in, and refuse it if it passes a limit or a `$ref` of it cycles.
    pub(super) fn check(&mut self, schema: &Value) -> Result<(), String> {
        self.add(schema, 0)?;
        // Within the depth checked: the walk below recurses by the schema's levels.
        refuse_ref_cycles(schema)
    }

    /// Count `schema` in, at JSON depth `depth`: an error says which limit it passes.
    fn add(&mut self, schema: &Value, depth: usize) -> Result<(), String> {
        if depth >= DEEPEST {
            return Err(format!(
                "the schema nests {DEEPEST} levels deep or more; at most {} are compiled",
                DEEPEST - 1
            ));
        }
        let children: Box<dyn Iterator<Item = &Value>> = match schema {
            Value::Object(object) => {
                self.properties += object
                    .get("properties")
                    .and_then(Value::as_object)
                    .map_or(0, |p| p.len());
                self.enum_values += object.get("enum").and_then(Value::as_array).map_or(0, |e| e.len());
                Box::new(object.values())
            }
            Value::Array(items) => Box::new(items.iter()),
            _ => return Ok(()),
        };
        if self.properties > MOST_PROPERTIES {
            return Err(format!(
                "the schemas name more than {MOST_PROPERTIES} properties, the most compiled"
            ));
        }
        if self.enum_values > MOST_ENUM_VALUES {
            return Err(format!(
                "the schemas list more than {MOST_ENUM_VALUES} `enum` values, the most compiled"
            ));
        }
        children.into_iter().try_for_each(|child| self.add(child, depth + 1))
    }
}

/// The keywords whose values are data, not schemas: a `$ref` in them refers to nothing.
const DATA: [&str; 4] = ["const", "enum", "default", "examples"];

/// Refuse a `$ref` cycle in `schema` that passes through nothing the text must hold: each step a
/// `$ref` or an `allOf` member, which apply where the schema that names them applies. A cycle
/// through a property or an array's items (a tree of nodes) is a recursive schema, and fine.
/// Only local references (`#`, `#/$defs/a`) are followed: nothing else is fetched.
fn refuse_ref_cycles(root: &Value) -> Result<(), String> {
    let mut nodes = Vec::new();
    schemas(root, String::new(), &mut nodes);
    // The schemas applied in place of each one, by its JSON pointer.
    let in_place = |pointer: &str| -> Vec<String> {
        let Some(node) = root.pointer(pointer) else {
            return Vec::new();
        };
        let mut next: Vec<String> = node
            .get("$ref")
            .and_then(Value::as_str)
            .and_then(|r| r.strip_prefix('#'))
            .filter(|target| root.pointer(target).is_some())
            .map(str::to_string)
            .into_iter()
            .collect();
        let members = node.get("allOf").and_then(Value::as_array).map_or(0, Vec::len);
        next.extend((0..members).map(|i| format!("{pointer}/allOf/{i}")));
        next
    };
    // Depth-first, without recursion (a chain of references can be long): `true` while a
    // schema is on the path being walked, `false` once all it leads to is walked.
    let mut on_path: HashMap<String, bool> = HashMap::new();
    for start in nodes {
        if on_path.contains_key(&start) {
            continue;
        }
        on_path.insert(start.clone(), true);
        let mut path = vec![(in_place(&start), start)];
        while let Some((next, _)) = path.last_mut() {
            let Some(node) = next.pop() else {
                let (_, done) = path.pop().expect("not empty");
                on_path.insert(done, false);
                continue;
            };
            match on_path.get(&node) {
                Some(true) => {
                    let from = path.iter().position(|(_, p)| *p == node).expect("on the path");
                    let cycle: Vec<String> = path[from..]
                        .iter()
                        .map(|(_, p)| format!("#{p}"))
                        .chain(std::iter::once(format!("#{node}")))
                        .collect();
                    return Err(format!(
                        "the schema's `$ref` cycles with nothing in between ({}), so no value could ever match it",
                        cycle.join(" → ")
                    ));
                }
                Some(false) => {}
                None => {
                    on_path.insert(node.clone(), true);
                    path.push((in_place(&node), node));
                }
            }
        }
    }
    Ok(())
}

/// Every object in `value` (at JSON pointer `pointer`) that may be a schema, with its pointer.
fn schemas(value: &Value, pointer: String, out: &mut Vec<String>) {
    let escaped = |key: &str| key.replace('~', "~0").replace('/', "~1");
    match value {
        Value::Object(object) => {
            for (key, child) in object.iter().filter(|(k, _)| !DATA.contains(&k.as_str())) {
                schemas(child, format!("{pointer}/{}", escaped(key)), out);
            }
            out.push(pointer);
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                schemas(item, format!("{pointer}/{i}"), out);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_ref_cycle_with_nothing_in_between_is_refused_and_a_recursive_schema_is_not() {
        let refused = |schema: Value| refuse_ref_cycles(&schema).unwrap_err();
        assert_eq!(
            refused(json!({"$ref": "#"})),
            "the schema's `$ref` cycles with nothing in between (# → #), so no value could ever match it"
        );
        let error = refused(json!({
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/a"}},
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
        }));
        assert!(
            error.contains("(#/$defs/a → #/$defs/b → #/$defs/b/allOf/0 → #/$defs/a)"),
            "{error}"
        );
        for fine in [
            // A tree: each node's children are nodes.
            json!({"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}}),
            json!({"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}}),
            json!({"anyOf": [{"type": "string"}, {"$ref": "#/$defs/missing"}]}),
            json!({"const": {"$ref": "#"}}),
        ] {
            assert_eq!(refuse_ref_cycles(&fine), Ok(()), "{fine}");
        }
    }
}
