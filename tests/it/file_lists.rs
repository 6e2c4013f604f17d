//! The module docs name files that are there. A `//!` comment that names a file in backticks
//! (`queue.rs`, `validate/`, `tests/it/layering.rs`; not a route like `/v1/` or a build output under
//! `target/`) must name one that exists, seen from the
//! file's own folder, a folder above it, or the repository's root. A folder's `mod.rs` whose
//! `//!` names two or more of its own files is its folder's list: it must name every file and
//! folder beside it, so that a newcomer reading it sees the whole folder.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::layering::{SRC, tree};

/// The paths a `//!` comment names in backticks: a name ending in `.rs` or `/`, of path
/// characters only (`src/main.rs`, `validate/`), not a Rust path or a URL.
fn named_paths(text: &str) -> Vec<String> {
    let docs: String = text
        .lines()
        .take_while(|l| l.starts_with("//!") || l.trim().is_empty())
        .filter_map(|l| l.strip_prefix("//!"))
        .collect::<Vec<_>>()
        .join("\n");
    docs.split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| s.ends_with(".rs") || s.ends_with('/'))
        // A route (`/v1/`) or what a build writes (`target/bench/`) is not a source file.
        .filter(|s| !s.starts_with('/') && !s.starts_with("target/"))
        .filter(|s| {
            s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '/' | '.' | '-'))
        })
        .map(str::to_string)
        .collect()
}

/// Whether `named` exists seen from `folder`, a folder above it, or the repository's root.
fn resolves(folder: &Path, named: &str) -> bool {
    let root = Path::new(SRC).parent().expect("the repository");
    folder
        .ancestors()
        .take_while(|a| a.starts_with(root))
        .any(|a| a.join(named).exists())
}

/// The files and folders of `folder` that its `mod.rs` list must name: every `.rs` file but
/// itself and `tests.rs`, as `x.rs`, and every folder but `tests/` (test code, which the
/// layering check knows by those names), as `x/`. A module's file and its folder of submodules
/// (`remote.rs` and `remote/`) are one entry, named by either.
fn entries(folder: &Path) -> BTreeSet<String> {
    let found: BTreeSet<String> = std::fs::read_dir(folder)
        .expect("read a source folder")
        .map(|e| e.expect("a folder entry").path())
        .filter_map(|p: PathBuf| {
            let name = p.file_name()?.to_str()?.to_string();
            if p.is_dir() {
                (name != "tests").then(|| format!("{name}/"))
            } else {
                (name.ends_with(".rs") && name != "mod.rs" && name != "tests.rs").then_some(name)
            }
        })
        .collect();
    found
        .iter()
        .filter(|e| !e.strip_suffix('/').is_some_and(|m| found.contains(&format!("{m}.rs"))))
        .cloned()
        .collect()
}

#[test]
fn every_file_a_module_doc_names_exists() {
    let mut missing = Vec::new();
    for source in tree() {
        let folder = source.path.parent().expect("a folder");
        for named in named_paths(&source.text) {
            if !resolves(folder, &named) {
                missing.push(format!("{}: `{named}`", source.path.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "module docs name files that do not exist:\n{}",
        missing.join("\n")
    );
}

#[test]
fn a_folder_list_names_every_file_of_its_folder() {
    let mut incomplete = Vec::new();
    for source in tree().iter().filter(|s| s.path.ends_with("mod.rs")) {
        let folder = source.path.parent().expect("a folder");
        let there = entries(folder);
        let named: BTreeSet<String> = named_paths(&source.text)
            .into_iter()
            .map(|n| match n.split_once('/') {
                // `process/host.rs` names the folder `process/`; `remote/` is `remote.rs`'s.
                Some((first, _)) if there.contains(&format!("{first}.rs")) => format!("{first}.rs"),
                Some((first, rest)) if !rest.is_empty() => format!("{first}/"),
                _ => n,
            })
            .filter(|n| there.contains(n))
            .collect();
        if named.len() < 2 {
            continue;
        }
        let unnamed: Vec<&String> = there.difference(&named).collect();
        if !unnamed.is_empty() {
            incomplete.push(format!("{} does not name {unnamed:?}", source.path.display()));
        }
    }
    assert!(
        incomplete.is_empty(),
        "a mod.rs that lists its folder's files must list them all:\n{}",
        incomplete.join("\n")
    );
}

#[test]
fn the_doc_reader_finds_what_a_list_names() {
    let text = "//! `queue.rs` is the queue, `validate/` the checks, [`Pool`] a type,\n//! `crate::pool` a path.\n\nfn f() {}\n// `not_docs.rs`\n";
    assert_eq!(named_paths(text), ["queue.rs", "validate/"]);
}
