//! Policy test cases: YAML files beside the policies (`policies/tests/*.yaml`), each naming the
//! policy it tests and listing cases of request + state (+ params) → expected decision.
//!
//! ```yaml
//! policy: default.rhai          # a file in the folder above this one
//! params: {cpu_pool: cpu, reserve_bytes: 64MiB}   # defaults for every case
//! cases:
//!   - name: fits with the reserve kept
//!     request: {pool: gpu, context_tokens: 128, estimate: {context_bytes: 1000000}}
//!     state:
//!       pools: {gpu: {provider: simulated, device: gpu0, breaker: closed}}
//!       devices: {gpu0: {headroom_bytes: 300000000}}
//!     params: {reserve_bytes: 32MiB}   # overrides for this case only
//!     expect: {action: admit}
//! ```
//!
//! Fields left out take their defaults (zero, empty, `false`). Cases use only the params written
//! here, never the server's config, so tuning the config cannot break a policy's tests. A case
//! passes when the script itself returns the expected decision; a fallback never passes.

use std::path::{Component, Path, PathBuf};

use serde::Deserialize;

use super::script::{Evaluation, PolicyError, Script};
use super::values::Params;
use crate::config::{ConfigError, parse_yaml, read_yaml};
use crate::core::snapshot::{Decision, RequestInfo, Snapshot};

/// A test-case file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseFile {
    /// The policy under test: a path relative to the folder above the one holding this file.
    pub policy: String,
    /// Params for every case.
    #[serde(default)]
    pub params: Params,
    /// The cases.
    pub cases: Vec<Case>,
}

/// One case; also the input format of `vramguard policy eval` (where `name` and `expect` are
/// optional).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    /// What it checks, in words.
    #[serde(default)]
    pub name: String,
    /// The script's `req`.
    #[serde(default)]
    pub request: RequestInfo,
    /// The script's `state` (less `params`).
    #[serde(default)]
    pub state: Snapshot,
    /// Params overriding the file's for this case.
    #[serde(default)]
    pub params: Params,
    /// The decision the script must return.
    #[serde(default)]
    pub expect: Option<Decision>,
}

/// Why a case file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CaseFileError {
    /// Unreadable, not YAML, or not the schema (the message names the file and the key).
    #[error(transparent)]
    Parse(#[from] ConfigError),
    /// Parsed but unusable.
    #[error("{file}: {message}")]
    Invalid {
        /// The file.
        file: String,
        /// What is wrong.
        message: String,
    },
}

impl CaseFile {
    /// Read and check a case file.
    pub fn load(path: &Path) -> Result<Self, CaseFileError> {
        read_yaml::<CaseFile>(path)?.checked(&path.display().to_string())
    }

    /// Parse and check case-file text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Self, CaseFileError> {
        parse_yaml::<CaseFile>(text, file)?.checked(file)
    }

    /// Every case has a name (unique) and an expected decision.
    fn checked(self, file: &str) -> Result<Self, CaseFileError> {
        let invalid = |message: String| CaseFileError::Invalid {
            file: file.to_string(),
            message,
        };
        if self.cases.is_empty() {
            return Err(invalid("`cases` is empty".into()));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, case) in self.cases.iter().enumerate() {
            if case.name.trim().is_empty() {
                return Err(invalid(format!("cases[{i}]: `name` is missing")));
            }
            if !seen.insert(case.name.as_str()) {
                return Err(invalid(format!("cases[{i}]: the name `{}` is used twice", case.name)));
            }
            if case.expect.is_none() {
                return Err(invalid(format!("cases[{i}] ({}): `expect` is missing", case.name)));
            }
        }
        Ok(self)
    }

    /// Where the policy under test is, for a case file at `path`.
    pub fn policy_path(&self, path: &Path) -> PathBuf {
        let tests_dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        normalize(&tests_dir.join("..").join(&self.policy))
    }
}

/// Fold `dir/..` pairs so paths in reports read `policies/default.rhai`, not
/// `policies/tests/../default.rhai` (lexically: the test layout has no symlink games).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir if matches!(out.components().next_back(), Some(Component::Normal(_))) => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    if out.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        out
    }
}

/// The outcome of one case.
#[derive(Debug, Clone)]
pub struct CaseResult {
    /// The case's name.
    pub name: String,
    /// What it expected (`None` only for `policy eval` input without `expect`).
    pub expected: Option<Decision>,
    /// The evaluation, or why the case's params were unusable.
    pub outcome: Result<Evaluation, PolicyError>,
}

impl CaseResult {
    /// The script itself returned the expected decision.
    pub fn passed(&self) -> bool {
        match (&self.outcome, &self.expected) {
            (Ok(evaluation), Some(expected)) => !evaluation.used_fallback() && &evaluation.decision == expected,
            _ => false,
        }
    }

    /// `expected X, got Y` (with the script error when Y is the fallback).
    pub fn describe(&self) -> String {
        let expected = self.expected.as_ref().map_or("nothing".to_string(), |d| d.to_string());
        match &self.outcome {
            Err(error) => format!("expected {expected}, but the case's params are unusable: {error}"),
            Ok(evaluation) => match &evaluation.error {
                Some(error) => format!(
                    "expected {expected}, got fallback {} after a {} error: {error}",
                    evaluation.decision, error.kind
                ),
                None => format!("expected {expected}, got {}", evaluation.decision),
            },
        }
    }
}

/// Evaluate one case with `script` and the given params (file params, then the case's).
pub fn run_case(script: &Script, base_params: &Params, case: &Case) -> CaseResult {
    let mut params = base_params.clone();
    params.extend(case.params.iter().map(|(k, v)| (k.clone(), v.clone())));
    CaseResult {
        name: case.name.clone(),
        expected: case.expect.clone(),
        outcome: script
            .with_params(&params)
            .map(|script| script.decide(&case.request, &case.state)),
    }
}

/// Run every case of `file` against `script`.
pub fn run_cases(script: &Script, file: &CaseFile) -> Vec<CaseResult> {
    file.cases
        .iter()
        .map(|case| run_case(script, &file.params, case))
        .collect()
}

/// The case files in `tests/` beside `policy` that test it, sorted by path. No folder, no cases.
pub fn files_for_policy(policy: &Path) -> Result<Vec<(PathBuf, CaseFile)>, CaseFileError> {
    let tests_dir = policy.parent().unwrap_or(Path::new(".")).join("tests");
    if !tests_dir.is_dir() {
        return Ok(Vec::new());
    }
    let target = same_file_key(policy);
    let mut found = Vec::new();
    for path in yaml_files(&tests_dir).map_err(|source| ConfigError::Read {
        file: tests_dir.display().to_string(),
        source,
    })? {
        let file = CaseFile::load(&path)?;
        if same_file_key(&file.policy_path(&path)) == target {
            found.push((path, file));
        }
    }
    Ok(found)
}

/// Compare files by their canonical path when they exist, lexically otherwise.
fn same_file_key(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| normalize(path))
}

/// The `*.yaml` / `*.yml` files directly in `dir`, sorted.
pub fn yaml_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let yaml = path.extension().is_some_and(|e| e == "yaml" || e == "yml");
        if yaml && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Test-case files named by `paths` (files as given, folders expanded to their YAML files);
/// `policies/tests/` when `paths` is empty.
pub fn discover(paths: &[PathBuf]) -> Result<Vec<PathBuf>, CaseFileError> {
    let default = [PathBuf::from("policies/tests")];
    let paths = if paths.is_empty() { &default[..] } else { paths };
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            files.extend(yaml_files(path).map_err(|source| ConfigError::Read {
                file: path.display().to_string(),
                source,
            })?);
        } else {
            files.push(path.clone());
        }
    }
    Ok(files)
}
