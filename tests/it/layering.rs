//! The source tree keeps its layers: `src/lib.rs` lists the layers lowest first, and a module may
//! name only its own layer or one listed before it. Within the crate, the modules of the second
//! level (`serve::lifecycle`, `pool::sequences`, a layer's own `mod.rs`) form no cycle. Test code
//! keeps the same rule, except that it may use `testing`, the shared scaffolding. Nor do the files
//! of one folder: no two files (or subfolders) beside each other use each other, directly or
//! round a loop, so each folder reads from its leaves up.
//!
//! Paths are read from the text (`crate::…`, `super::…`, grouped `use` trees), comments removed,
//! so the check needs nothing but the files. A failure names the file, the line and the path.
//!
//! One rule is stricter than the order of the layers: `http` names nothing of `runtime` or
//! `pool`. It speaks the API; `serve` does the work, and may not hand their items up under its
//! own name to let `http` name them anyway.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The source tree the checks read.
pub(crate) const SRC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src");

/// One file of `src/`, read once for every check of the tree.
pub(crate) struct Source {
    /// Its path.
    pub(crate) path: PathBuf,
    /// Its text.
    pub(crate) text: String,
    /// The text with comments and strings blanked ([`code_only`]).
    pub(crate) code: String,
}

impl Source {
    fn read(path: PathBuf) -> Source {
        let text = std::fs::read_to_string(&path).expect("read source");
        let code = code_only(&text);
        Source { path, text, code }
    }
}

/// Every file under `src/`, sorted, read once however many checks look at them.
pub(crate) fn tree() -> &'static [Source] {
    static TREE: OnceLock<Vec<Source>> = OnceLock::new();
    TREE.get_or_init(|| {
        let mut files = Vec::new();
        rust_files(Path::new(SRC), &mut files);
        files.sort();
        files.into_iter().map(Source::read).collect()
    })
}

/// The scaffolding module, allowed to test code of any layer.
const TESTING: &str = "testing";

/// One reference from a module to a path of the crate.
#[derive(Debug, Clone)]
struct Reference {
    file: String,
    line: usize,
    /// The module the file is (`serve::lifecycle`).
    from: Vec<String>,
    /// The path named, made absolute (`pool::sequences::Waiting`).
    to: Vec<String>,
    /// Whether it is in test code (a `tests.rs` file or a `#[cfg(test)] mod tests` block).
    in_test: bool,
}

/// The layers in `src/lib.rs`'s order, lowest first.
fn layers(src: &Path) -> Vec<String> {
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("src/lib.rs");
    lib.lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod "))
        .map(|l| l.trim_end_matches(';').to_string())
        .collect()
}

/// The module path of a source file: `src/serve/service/mod.rs` is `serve::service`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = relative.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let last = parts.pop().expect("a file name");
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_string());
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The text with comments blanked (line structure kept), and string and character literals
/// blanked so that a message mentioning `crate::` is not read as a path, nor a `'{'` as a brace.
pub(crate) fn code_only(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        let rest = &text[i..];
        if rest.starts_with("//") {
            let end = rest.find('\n').unwrap_or(rest.len());
            out.push_str(&" ".repeat(end));
            i += end;
        } else if rest.starts_with("/*") {
            let end = rest.find("*/").map_or(rest.len(), |e| e + 2);
            out.extend(rest[..end].chars().map(|c| if c == '\n' { '\n' } else { ' ' }));
            i += end;
        } else if let Some(raw) = raw_string_len(rest) {
            out.extend(rest[..raw].chars().map(|c| if c == '\n' { '\n' } else { ' ' }));
            i += raw;
        } else if rest.starts_with('"') {
            let mut j = 1;
            while j < rest.len() {
                match rest.as_bytes()[j] {
                    b'\\' => j += 2,
                    b'"' => break,
                    _ => j += 1,
                }
            }
            let end = (j + 1).min(rest.len());
            out.extend(rest[..end].chars().map(|c| if c == '\n' { '\n' } else { ' ' }));
            i += end;
        } else if rest.starts_with('\'')
            && rest.len() > 2
            && rest.as_bytes()[1].is_ascii()
            && rest.as_bytes()[2] == b'\''
        {
            // A one-character literal: '"' would otherwise open a string, and '{' (or b'}')
            // would count as a brace of the code around it.
            out.push_str("   ");
            i += 3;
        } else {
            let c = rest.chars().next().expect("a char");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The length of a raw string literal (`r"…"`, `r#"…"#`) at the start of `text`.
fn raw_string_len(text: &str) -> Option<usize> {
    let after_r = text.strip_prefix('r')?;
    let hashes = after_r.len() - after_r.trim_start_matches('#').len();
    let body = after_r[hashes..].strip_prefix('"')?;
    let close = format!("\"{}", "#".repeat(hashes));
    let end = body.find(&close)?;
    Some(1 + hashes + 1 + end + close.len())
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Read a path tree at `text[i..]` (after `crate::` or `super::`): `a::b`, `a::{b, c::d}`,
/// `{a, b}`. Each complete path is pushed, relative to where reading started.
fn read_tree(text: &str, mut i: usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
    let bytes = text.as_bytes();
    let mut path = prefix;
    loop {
        while i < bytes.len() && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        if i < bytes.len() && bytes[i] == b'{' {
            i += 1;
            loop {
                i = read_tree(text, i, path.clone(), out);
                while i < bytes.len() && (bytes[i].is_ascii_whitespace() || bytes[i] == b',') {
                    i += 1;
                }
                if i >= bytes.len() || bytes[i] == b'}' {
                    return i + 1;
                }
            }
        }
        let start = i;
        while i < bytes.len() && is_ident(bytes[i] as char) {
            i += 1;
        }
        if start == i {
            out.push(path);
            return i;
        }
        path.push(text[start..i].to_string());
        if text[i..].starts_with("::") {
            i += 2;
        } else {
            out.push(path);
            return i;
        }
    }
}

/// Every `crate::` and `super::` path in one file, made absolute.
fn references(src: &Path, source: &Source) -> Vec<Reference> {
    let (file, text) = (source.path.as_path(), &source.code);
    let module = module_of(src, file);
    if module.is_empty() {
        return Vec::new(); // lib.rs and main.rs: the crate's root declares the layers
    }
    let name = file
        .strip_prefix(src.parent().expect("the project"))
        .expect("in the project");
    // `tests.rs`, or a file in a `tests/` folder under `src/` (a split test module).
    let whole_file_is_test = file.file_name().is_some_and(|n| n == "tests.rs")
        || file.strip_prefix(src).is_ok_and(|p| p.iter().any(|c| c == "tests"));
    let test_block = ["#[cfg(test)]\nmod tests", "#[cfg(test)]\npub(crate) mod tests"]
        .iter()
        .filter_map(|start| text.find(start))
        .min()
        .unwrap_or(text.len());
    let reference = |at: usize, to: Vec<String>| Reference {
        file: name.display().to_string(),
        line: line_of(text, at),
        from: module.clone(),
        to,
        in_test: whole_file_is_test || at > test_block,
    };
    let mut found = Vec::new();
    let starts = ["crate::", "super::", "self::"].map(|s| text.match_indices(s));
    for (at, _) in starts.into_iter().flatten() {
        if at > 0 && (is_ident(text[..at].chars().last().expect("a char")) || text[..at].ends_with("::")) {
            continue; // `$crate::`, `vramguard_crate::`, or the middle of `super::super::`
        }
        let mut base: Vec<String> = Vec::new();
        let mut i = at;
        if text[at..].starts_with("crate::") {
            i += "crate::".len();
        } else if text[at..].starts_with("self::") {
            base = module.clone();
            i += "self::".len();
        } else {
            base = module.clone();
            // A `tests.rs` file or an inline `mod tests` is one level below its file's module.
            let in_tests_module = whole_file_is_test || at > test_block;
            if !in_tests_module || whole_file_is_test {
                base.pop();
            }
            i += "super::".len();
            while text[i..].starts_with("super::") {
                base.pop();
                i += "super::".len();
            }
        }
        let mut paths = Vec::new();
        read_tree(text, i, base, &mut paths);
        found.extend(paths.into_iter().filter(|p| !p.is_empty()).map(|to| reference(at, to)));
    }
    // A parent names its children without `crate::` (`openai::chat`); a `pub use` of a child is
    // the folder's facade, not a use.
    for child in declared_children(text) {
        let needle = format!("{child}::");
        for (at, _) in text.match_indices(&needle) {
            let before = &text[..at];
            let line_start = before.rfind('\n').map_or(0, |n| n + 1);
            if before.chars().last().is_some_and(|c| is_ident(c) || c == ':')
                || text[line_start..].trim_start().starts_with("pub use")
            {
                continue;
            }
            let mut paths = Vec::new();
            read_tree(text, at, module.clone(), &mut paths);
            found.extend(paths.into_iter().map(|to| reference(at, to)));
        }
    }
    found
}

fn line_of(text: &str, at: usize) -> usize {
    text[..at].matches('\n').count() + 1
}

/// The modules a file declares (`mod x;`, `pub mod x;`), tests excepted.
fn declared_children(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l.strip_prefix("pub mod ").or_else(|| l.strip_prefix("mod "))?;
            let name = rest.strip_suffix(';')?;
            (name != "tests").then(|| name.to_string())
        })
        .collect()
}

fn all_references() -> (Vec<String>, Vec<Reference>, BTreeSet<Vec<String>>) {
    let src = Path::new(SRC);
    let modules: BTreeSet<Vec<String>> = tree().iter().map(|f| module_of(src, &f.path)).collect();
    let refs = tree().iter().flat_map(|f| references(src, f)).collect();
    (layers(src), refs, modules)
}

/// What a reference breaks, if anything: naming a layer above its own.
fn upward(layers: &[String], r: &Reference) -> Option<String> {
    let rank = |name: &str| layers.iter().position(|l| l == name);
    let (from, to) = (r.from.first()?, r.to.first()?);
    if r.in_test && to == TESTING {
        return None;
    }
    let (Some(from_rank), Some(to_rank)) = (rank(from), rank(to)) else {
        return Some(format!(
            "{}:{}: `{}` is not a layer of src/lib.rs",
            r.file,
            r.line,
            r.to.join("::")
        ));
    };
    (to_rank > from_rank).then(|| {
        format!(
            "{}:{}: `{from}` uses `crate::{}`, from the layer `{to}` above it",
            r.file,
            r.line,
            r.to.join("::")
        )
    })
}

/// The second-level module a path belongs to: `serve::lifecycle::Request` is `serve::lifecycle`,
/// `pool::Pool` is `pool` (the layer's `mod.rs`).
fn unit(modules: &BTreeSet<Vec<String>>, path: &[String]) -> String {
    let two = &path[..path.len().min(2)];
    if two.len() == 2 && modules.iter().any(|m| m.starts_with(two)) {
        two.join("::")
    } else {
        path[0].clone()
    }
}

/// The graph of second-level modules that the non-test references draw: for each module, the
/// modules it uses, each with the first reference that does.
fn graph<'a>(
    refs: &'a [Reference],
    modules: &BTreeSet<Vec<String>>,
) -> BTreeMap<String, BTreeMap<String, &'a Reference>> {
    let mut edges: BTreeMap<String, BTreeMap<String, &Reference>> = BTreeMap::new();
    for r in refs.iter().filter(|r| !r.in_test) {
        let (from, to) = (unit(modules, &r.from), unit(modules, &r.to));
        if from != to {
            edges.entry(from).or_default().entry(to).or_insert(r);
        }
    }
    edges
}

fn describe(r: &Reference) -> String {
    format!(
        "{}:{}: `{}` uses `crate::{}`",
        r.file,
        r.line,
        r.from.join("::"),
        r.to.join("::")
    )
}

/// A cycle in the graph of second-level modules, as the references that close it.
fn find_cycle(edges: &BTreeMap<String, BTreeMap<String, &Reference>>) -> Option<Vec<String>> {
    fn visit<'a>(
        node: &'a str,
        edges: &'a BTreeMap<String, BTreeMap<String, &Reference>>,
        state: &mut BTreeMap<&'a str, bool>,
        stack: &mut Vec<&'a str>,
    ) -> Option<Vec<String>> {
        state.insert(node, false);
        stack.push(node);
        for (next, reference) in edges.get(node).into_iter().flatten() {
            match state.get(next.as_str()) {
                Some(false) => {
                    let start = stack.iter().position(|n| n == next).expect("on the stack");
                    let mut cycle: Vec<String> =
                        stack[start..].windows(2).map(|w| describe(edges[w[0]][w[1]])).collect();
                    cycle.push(describe(reference));
                    return Some(cycle);
                }
                Some(true) => {}
                None => {
                    if let Some(cycle) = visit(next, edges, state, stack) {
                        return Some(cycle);
                    }
                }
            }
        }
        stack.pop();
        state.insert(node, true);
        None
    }
    let mut state = BTreeMap::new();
    for node in edges.keys() {
        if !state.contains_key(node.as_str()) {
            let mut stack = Vec::new();
            if let Some(cycle) = visit(node, edges, &mut state, &mut stack) {
                return Some(cycle);
            }
        }
    }
    None
}

#[test]
fn no_module_uses_a_layer_above_its_own() {
    let (layers, refs, _) = all_references();
    assert!(layers.len() >= 8, "src/lib.rs lists the layers, got {layers:?}");
    let broken: Vec<String> = refs.iter().filter_map(|r| upward(&layers, r)).collect();
    assert!(
        broken.is_empty(),
        "layers, lowest first: {}\n{}",
        layers.join(" < "),
        broken.join("\n")
    );
}

#[test]
fn the_modules_form_no_import_cycle() {
    let (_, refs, modules) = all_references();
    let cycles = cycles(graph(&refs, &modules));
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n\n"));
}

/// What each folder's `mod.rs` brings in from its children (`pub use record::Record;`, or a
/// private `use client::Drill;` its children reach as `super::Drill`): `(folder, item)` to the
/// child it comes from, so a use of the folder's name is a use of that child.
fn facades(src: &Path) -> BTreeMap<(Vec<String>, String), String> {
    let mut found = BTreeMap::new();
    for source in tree().iter().filter(|s| s.path.ends_with("mod.rs")) {
        let folder = module_of(src, &source.path);
        let children = declared_children(&source.code);
        for (at, _) in source.code.match_indices("use ") {
            let before = &source.code[..at];
            let line = &before[before.rfind('\n').map_or(0, |n| n + 1)..];
            if !matches!(line.trim(), "" | "pub" | "pub(crate)" | "pub(super)") {
                continue;
            }
            let mut paths = Vec::new();
            read_tree(&source.code, at + "use ".len(), Vec::new(), &mut paths);
            for path in paths.into_iter().filter(|p| p.len() >= 2 && children.contains(&p[0])) {
                found.insert((folder.clone(), path[path.len() - 1].clone()), path[0].clone());
            }
        }
    }
    found
}

/// The graph of the files and subfolders of each folder: an edge from one to another beside it
/// that it uses (outside tests), with the first reference that does. Nodes are named by their
/// module path (`pool::process::conn`).
fn folder_graph<'a>(
    refs: &'a [Reference],
    modules: &BTreeSet<Vec<String>>,
    facades: &BTreeMap<(Vec<String>, String), String>,
) -> BTreeMap<String, BTreeMap<String, &'a Reference>> {
    let mut edges: BTreeMap<String, BTreeMap<String, &Reference>> = BTreeMap::new();
    for r in refs.iter().filter(|r| !r.in_test) {
        // The module the path names: its longest beginning that is one.
        let Some(to) = (1..=r.to.len())
            .rev()
            .map(|n| &r.to[..n])
            .find(|m| modules.contains(*m))
        else {
            continue;
        };
        let common = r.from.iter().zip(to).take_while(|(a, b)| a == b).count();
        // Only a use between two modules of one folder, below a layer.
        if common == 0 || common >= r.from.len() {
            continue;
        }
        let folder = &r.from[..common];
        let child = if to.len() > common {
            to[common].clone()
        } else {
            match r
                .to
                .get(common)
                .and_then(|item| facades.get(&(folder.to_vec(), item.clone())))
            {
                Some(child) => child.clone(),
                None => continue, // an item of the folder's own `mod.rs`
            }
        };
        let node = |c: &str| [folder, &[c.to_string()]].concat().join("::");
        if child != r.from[common] {
            edges
                .entry(node(&r.from[common]))
                .or_default()
                .entry(node(&child))
                .or_insert(r);
        }
    }
    edges
}

/// Every cycle of `edges`, each once, as the references that close it.
fn cycles(mut edges: BTreeMap<String, BTreeMap<String, &Reference>>) -> Vec<String> {
    let mut found = Vec::new();
    while let Some(cycle) = find_cycle(&edges) {
        // Report each cycle once: drop its last edge and look again.
        let last = cycle.last().expect("an edge").clone();
        found.push(cycle.join("\n"));
        for targets in edges.values_mut() {
            targets.retain(|_, r| describe(r) != last);
        }
    }
    found
}

#[test]
fn the_files_of_a_folder_form_no_loop() {
    let (_, refs, modules) = all_references();
    let loops = cycles(folder_graph(&refs, &modules, &facades(Path::new(SRC))));
    assert!(
        loops.is_empty(),
        "files of one folder that use each other (move what both need to where it belongs):\n{}",
        loops.join("\n\n")
    );
}

/// The layers `http` may not name: it speaks the API and hands requests down to `serve`, which
/// alone reaches the models (`runtime`) and the pools that run them (`pool`).
const BELOW_THE_SERVICE: [&str; 2] = ["runtime", "pool"];

/// What breaks the rule that `http` only speaks the API: an `http` file naming `runtime` or
/// `pool` (test code too), or a `serve` file handing one of their items up under its own name
/// (`pub use crate::pool::…`, `pub type X = crate::runtime::…`).
fn past_the_service(refs: &[Reference], sources: &[(String, &str)]) -> Vec<String> {
    let mut broken: Vec<String> = refs
        .iter()
        .filter(|r| r.from.first().is_some_and(|l| l == "http"))
        .filter(|r| r.to.first().is_some_and(|l| BELOW_THE_SERVICE.contains(&l.as_str())))
        .map(|r| format!("{}:{}: `http` names `crate::{}`", r.file, r.line, r.to.join("::")))
        .collect();
    for (file, code) in sources.iter().filter(|(f, _)| f.starts_with("src/serve/")) {
        for (n, line) in code.lines().enumerate() {
            let line = line.trim_start();
            let handed_up = ["pub use crate::", "pub type "].iter().any(|p| line.starts_with(p))
                && BELOW_THE_SERVICE
                    .iter()
                    .any(|l| line.contains(&format!("crate::{l}::")));
            if handed_up {
                broken.push(format!("{file}:{}: `serve` hands up `{}`", n + 1, line.trim_end()));
            }
        }
    }
    broken
}

#[test]
fn http_names_nothing_below_the_service() {
    let (_, refs, _) = all_references();
    let project = Path::new(SRC).parent().expect("the project");
    let sources: Vec<(String, &str)> = tree()
        .iter()
        .map(|s| {
            let name = s.path.strip_prefix(project).expect("in the project");
            (name.display().to_string(), s.code.as_str())
        })
        .collect();
    let broken = past_the_service(&refs, &sources);
    assert!(
        broken.is_empty(),
        "`http` parses a request, hands it to `serve` and formats the answer; the work below \
         belongs to `serve` (or plain data to `core`/`protocol`):\n{}",
        broken.join("\n")
    );
}

#[test]
fn the_check_catches_http_reaching_past_the_service() {
    let dir = vramguard::testing::Scratch::new();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("http")).unwrap();
    let planted = src.join("http/chat.rs");
    std::fs::write(
        &planted,
        "use crate::serve::lifecycle;\nuse crate::{core::x, runtime::chat::Template};\nfn f(p: &crate::pool::Pool) {}\n",
    )
    .unwrap();
    let refs = references(&src, &Source::read(planted));
    let facade =
        "//! x\npub use crate::pool::Pool;\npub type T = crate::runtime::text::TokenBytes;\nuse crate::pool::Pool;\n";
    let broken = past_the_service(&refs, &[("src/serve/facade.rs".into(), facade)]);
    assert_eq!(
        broken,
        [
            "src/http/chat.rs:2: `http` names `crate::runtime::chat::Template`",
            "src/http/chat.rs:3: `http` names `crate::pool::Pool`",
            "src/serve/facade.rs:2: `serve` hands up `pub use crate::pool::Pool;`",
            "src/serve/facade.rs:3: `serve` hands up `pub type T = crate::runtime::text::TokenBytes;`",
        ]
    );
}

/// The check itself finds what it must: an upward `use`, one in a group, and a cycle.
#[test]
fn the_check_catches_a_planted_upward_import_and_cycle() {
    let layers: Vec<String> = ["core", "pool", "http"].map(String::from).into();
    let dir = vramguard::testing::Scratch::new();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("core")).unwrap();
    std::fs::create_dir_all(src.join("pool")).unwrap();
    let planted = src.join("core/clock.rs");
    std::fs::write(
        &planted,
        "//! crate::http in a comment is not a use\nuse crate::{pool::Pool, core::x};\nconst S: &str = \"crate::http\";\nfn f() { super::clock::now(); self::g(); }\n",
    )
    .unwrap();
    let found = references(&src, &Source::read(planted.clone()));
    let broken: Vec<String> = found.iter().filter_map(|r| upward(&layers, r)).collect();
    assert_eq!(
        broken,
        ["src/core/clock.rs:2: `core` uses `crate::pool::Pool`, from the layer `pool` above it"]
    );
    assert!(found.iter().any(|r| r.to == ["core", "clock", "now"]), "{found:?}");
    assert!(found.iter().any(|r| r.to == ["core", "clock", "g"]), "{found:?}");

    let a = src.join("pool/mod.rs");
    let b = src.join("pool/sequences.rs");
    std::fs::write(&a, "use crate::pool::sequences::Sequences;\n").unwrap();
    std::fs::write(&b, "use super::Pool;\n").unwrap();
    let refs: Vec<Reference> = [a, b]
        .into_iter()
        .flat_map(|f| references(&src, &Source::read(f)))
        .collect();
    let modules: BTreeSet<Vec<String>> = [vec!["pool".to_string()], vec!["pool".into(), "sequences".into()]].into();
    let cycle = find_cycle(&graph(&refs, &modules)).expect("a cycle");
    assert_eq!(
        cycle,
        [
            "src/pool/mod.rs:1: `pool` uses `crate::pool::sequences::Sequences`",
            "src/pool/sequences.rs:1: `pool::sequences` uses `crate::pool::Pool`"
        ]
    );
}
