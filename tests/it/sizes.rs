//! No file in `src/` a person has to scroll for minutes, and no function they cannot hold in
//! their head: at most 700 lines a file and 120 a function. Where one concern really needs more,
//! a `// Long: …` comment says why (in a file's first lines, or right above the function), and
//! the check lets it be. No trait has more than 10 methods: a seam that large is several
//! capabilities, and an implementation that leaves one to a default can compile and be wrong.

use std::path::Path;

#[cfg(test)]
use super::layering::code_only;
use super::layering::{SRC, tree};

const MAX_FILE_LINES: usize = 700;
const MAX_FN_LINES: usize = 120;
const MAX_TRAIT_METHODS: usize = 10;
/// How a comment that justifies a long file or function starts.
const WHY: &str = "// Long:";

/// Each function in `code` (comments and strings already blanked): its name, first line (from 1)
/// and length in lines, from its `fn` line to its closing brace.
fn functions(code: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut found = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let Some(at) = fn_keyword(line) else { continue };
        let name: String = line[at + 3..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let mut depth = 0i64;
        let mut opened = false;
        'body: for (offset, text) in lines[start..].iter().enumerate() {
            let text = if offset == 0 { &text[at..] } else { text };
            for c in text.chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    // A declaration without a body (a trait method, an extern fn).
                    ';' if !opened => break 'body,
                    _ => {}
                }
                if opened && depth == 0 {
                    found.push((name.clone(), start + 1, offset + 1));
                    break 'body;
                }
            }
        }
    }
    found
}

/// Where `fn ` starts a function on this line, if it does (not `fn` inside a type like `Fn(`).
fn fn_keyword(line: &str) -> Option<usize> {
    let at = line.find("fn ")?;
    let before = line[..at].trim();
    let item_prefix = before
        .split_whitespace()
        .all(|w| matches!(w, "pub" | "async" | "const" | "unsafe" | "extern" | "\"C\"") || w.starts_with("pub("));
    item_prefix.then_some(at)
}

/// Whether the lines just above `line` (from 1) carry a `// Long:` comment.
fn justified(text: &[&str], line: usize) -> bool {
    text[..line - 1]
        .iter()
        .rev()
        .take_while(|l| {
            let l = l.trim_start();
            l.starts_with("//") || l.starts_with("#[")
        })
        .any(|l| l.trim_start().starts_with(WHY))
}

fn offenders(src: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for source in tree() {
        let (file, text) = (&source.path, &source.text);
        let lines: Vec<&str> = text.lines().collect();
        let name = file
            .strip_prefix(src.parent().expect("the project"))
            .expect("in the project");
        let file_justified = lines.iter().take(30).any(|l| l.trim_start().starts_with(WHY));
        if lines.len() > MAX_FILE_LINES && !file_justified {
            found.push(format!(
                "{}: {} lines (at most {MAX_FILE_LINES})",
                name.display(),
                lines.len()
            ));
        }
        for (function, line, length) in functions(&source.code) {
            if length > MAX_FN_LINES && !justified(&lines, line) {
                found.push(format!(
                    "{}:{line}: fn {function} is {length} lines (at most {MAX_FN_LINES})",
                    name.display()
                ));
            }
        }
    }
    found
}

/// Each trait declared in `code` (comments and strings already blanked): its name, line (from 1)
/// and the number of its methods (the `fn`s directly in its body).
fn traits(code: &str) -> Vec<(String, usize, usize)> {
    let mut found = Vec::new();
    for (at, _) in code.match_indices("trait ") {
        let before = &code[..at];
        let line_start = before.rfind('\n').map_or(0, |n| n + 1);
        let prefix = before[line_start..].trim();
        if !prefix
            .split_whitespace()
            .all(|w| matches!(w, "pub" | "unsafe") || w.starts_with("pub("))
        {
            continue; // `impl Trait for`, `dyn Trait`, a word inside an identifier
        }
        let name: String = code[at + 6..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let Some(open) = code[at..].find(['{', ';']).map(|o| at + o) else {
            continue;
        };
        if code.as_bytes()[open] == b';' {
            continue; // `trait A = B;` or a declaration without a body
        }
        let (mut depth, mut methods) = (0usize, 0usize);
        let mut i = open;
        while i < code.len() {
            let rest = &code[i..];
            match rest.as_bytes()[0] {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                _ if depth == 1 && rest.starts_with("fn ") && !is_ident_end(&code[..i]) => methods += 1,
                _ => {}
            }
            i += 1;
        }
        found.push((name, code[..at].matches('\n').count() + 1, methods));
    }
    found
}

/// Whether `text` ends in an identifier's character (so a `fn ` after it is part of a word).
fn is_ident_end(text: &str) -> bool {
    text.chars()
        .last()
        .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[test]
fn no_trait_has_more_than_ten_methods() {
    let src = Path::new(SRC);
    let mut found = Vec::new();
    for source in tree() {
        let name = source
            .path
            .strip_prefix(src.parent().expect("the project"))
            .expect("in the project");
        for (t, line, methods) in traits(&source.code) {
            if methods > MAX_TRAIT_METHODS {
                found.push(format!("{}:{line}: trait {t} has {methods} methods", name.display()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "split these into capabilities (at most {MAX_TRAIT_METHODS} methods a trait):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_trait_check_counts_methods_not_nested_ones() {
    let code = code_only(
        "pub trait Run: Send {\n    fn run(&self);\n    fn view(&self) -> u8 {\n        fn inner() {}\n        1\n    }\n    type X;\n}\nimpl Run for A { fn run(&self) {} }\nfn f(x: &dyn Run) {}\npub(crate) trait Empty {}\n",
    );
    assert_eq!(traits(&code), [("Run".to_string(), 1, 2), ("Empty".to_string(), 11, 0)]);
}

#[test]
fn no_file_or_function_is_longer_than_a_person_can_hold() {
    let found = offenders(Path::new(SRC));
    assert!(
        found.is_empty(),
        "split these, or say why in a `{WHY}` comment:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_check_measures_functions_and_honours_a_reason() {
    let body = "    let x = 1;\n".repeat(MAX_FN_LINES);
    let source = format!(
        "/// Short.\npub fn short() -> u8 {{ 1 }}\n\nfn long() {{\n{body}}}\n\n// Long: one table.\nfn table() {{\n{body}}}\n\ntrait T {{\n    fn declared(&self);\n}}\nfn takes(f: impl Fn(u8) -> u8) {{ let _ = \"{{\"; }}\nfn bytes(c: u8) -> bool {{\n    c == b'{{'\n}}\n"
    );
    let code = code_only(&source);
    let found: Vec<(String, usize, usize)> = functions(&code);
    let names: Vec<&str> = found.iter().map(|(n, _, _)| n.as_str()).collect();
    assert_eq!(names, ["short", "long", "table", "takes", "bytes"]);
    assert_eq!(found[0].2, 1);
    assert_eq!(found[1].2, MAX_FN_LINES + 2);
    // A brace in a character literal is not one of the function's.
    assert_eq!(found[4].2, 3);
    let lines: Vec<&str> = source.lines().collect();
    assert!(!justified(&lines, found[1].1));
    assert!(justified(&lines, found[2].1));
}
