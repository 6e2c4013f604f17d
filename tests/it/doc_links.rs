//! Every relative link in README.md, CHANGELOG.md and docs/*.md leads somewhere: the file it
//! names exists and, where it names an anchor, a heading of that file makes that anchor by
//! GitHub's rule. Pages move and headings get renamed; this catches the links left behind.
//! External links (http, https, mailto) are not followed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The Markdown files whose links are checked.
fn documents() -> Vec<PathBuf> {
    let root = Path::new(ROOT);
    let mut files = vec![root.join("README.md"), root.join("CHANGELOG.md")];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    files.sort();
    files
}

/// The lines of `text` with inline code spans removed, and fenced code blocks as empty lines
/// (`[x](y)` written as code is not a link).
fn prose(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        let code = fenced || line.trim_start().starts_with("```");
        lines.push(if code {
            String::new()
        } else {
            line.split('`').step_by(2).collect()
        });
    }
    lines
}

/// GitHub's anchor for a heading's text: lowercase, each space a `-`, every other character
/// but letters, digits, `-` and `_` dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors a Markdown file's headings make, a repeated one numbered `-1`, `-2`, … as
/// GitHub numbers them.
fn anchors(text: &str) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut found = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if fenced || !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(&line[hashes..]);
        let count = seen.entry(base.clone()).or_insert(0);
        found.push(if *count == 0 {
            base.clone()
        } else {
            format!("{base}-{count}")
        });
        *count += 1;
    }
    found
}

/// The targets of the inline links `[text](target)` in `line`.
fn targets(line: &str) -> Vec<&str> {
    line.match_indices("](")
        .filter_map(|(at, _)| {
            let rest = &line[at + 2..];
            let end = rest.find(')')?;
            rest[..end].split_whitespace().next()
        })
        .collect()
}

/// What is wrong with `target`, linked from the file `from`, if anything.
fn broken(from: &Path, target: &str) -> Option<String> {
    let (path, anchor) = match target.split_once('#') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (target, None),
    };
    let file = if path.is_empty() {
        from.to_path_buf()
    } else {
        from.parent()?.join(path)
    };
    if !file.exists() {
        return Some(format!("{} does not exist", file.display()));
    }
    let anchor = anchor?;
    let text = std::fs::read_to_string(&file).ok()?;
    if anchors(&text).iter().any(|a| a == anchor) {
        return None;
    }
    Some(format!("no heading of {} makes #{anchor}", file.display()))
}

#[test]
fn slugs_follow_githubs_rule() {
    assert_eq!(slug(" Idle CPUs"), "idle-cpus");
    assert_eq!(
        slug("2026-12-04: on a real GPU (NVIDIA H200, issue 22)"),
        "2026-12-04-on-a-real-gpu-nvidia-h200-issue-22"
    );
    assert_eq!(
        slug("`vramguard_requests_total` — every_answer"),
        "vramguard_requests_total--every_answer"
    );
    assert_eq!(slug("Triton's extensions"), "tritons-extensions");
    let text = "# Top\n## Notes\n```sh\n# not a heading\n```\n## Notes\n#no space\n### Notes\n";
    assert_eq!(anchors(text), ["top", "notes", "notes-1", "notes-2"]);
    let line = &prose("see [a](x.md#b) and [`c`](../y.md \"title\"), `[d](z.md)`")[0];
    assert_eq!(targets(line), ["x.md#b", "../y.md"]);
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let mut problems = Vec::new();
    for file in documents() {
        let text = std::fs::read_to_string(&file).unwrap();
        for (number, line) in prose(&text).iter().enumerate() {
            for target in targets(line) {
                if ["http://", "https://", "mailto:"].iter().any(|s| target.starts_with(s)) {
                    continue;
                }
                if let Some(problem) = broken(&file, target) {
                    let name = file.strip_prefix(ROOT).unwrap_or(&file).display();
                    problems.push(format!("{name}:{}: ({target}): {problem}", number + 1));
                }
            }
        }
    }
    assert!(problems.is_empty(), "broken links:\n{}", problems.join("\n"));
}
