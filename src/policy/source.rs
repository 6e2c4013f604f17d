//! Where a policy's script and its test cases come from, read and compiled.
//!
//! A [`PolicySource::File`] is read from disk on every load and reload, and its cases are the
//! files in `tests/` beside it whose `policy:` names it. A [`PolicySource::Builtin`] is text
//! compiled into the binary, cases included: nothing is written to or read from disk, so any
//! number of servers (or tests) in one process load it without sharing a path.
//!
//! This module depends on [`cases`](super::cases) and [`Script`], never the other way round;
//! [`PolicyHandle`](super::PolicyHandle) builds on it.

use crate::config::PolicySource;

use super::builtin;
use super::cases::{self, CaseFile, CaseFileError};
use super::script::{PolicyError, PolicySettings, Script};

/// Why a policy could not be (re)loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The script file could not be read.
    #[error("{path}: cannot read: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The script does not compile or fails the lint (`kind` is always `compile`).
    #[error(transparent)]
    Compile(#[from] PolicyError),
    /// A test-case file for this policy could not be read or is malformed.
    #[error(transparent)]
    CaseFile(#[from] CaseFileError),
    /// The script compiled but failed some of its own test cases.
    #[error("{path}: {failed} of {total} test cases failed, first: {first}")]
    TestsFailed {
        /// The script's origin (see [`origin`]).
        path: String,
        /// How many failed.
        failed: usize,
        /// How many ran.
        total: usize,
        /// The first failure, as `file: case: expected …, got …`.
        first: String,
    },
}

/// Read (from disk or the binary) and compile a policy; errors are located as
/// `origin:line:col`. Returns the script and its text (hashed for `/status`).
pub fn load_script(source: &PolicySource, settings: &PolicySettings) -> Result<(Script, String), LoadError> {
    let text = match source {
        PolicySource::File(path) => std::fs::read_to_string(path).map_err(|e| LoadError::Read {
            path: path.display().to_string(),
            source: e,
        })?,
        PolicySource::Builtin(policy) => builtin::get(*policy).script.to_string(),
    };
    let script = Script::compile(&text, &source.to_string(), settings)?;
    Ok((script, text))
}

/// The policy's own test cases, each file with the name its cases are reported under: for a
/// file, the case files in `tests/` beside it that name it; for a builtin, the ones shipped
/// with it.
pub fn test_cases(source: &PolicySource) -> Result<Vec<(String, CaseFile)>, LoadError> {
    match source {
        PolicySource::File(path) => Ok(cases::files_for_policy(path)?
            .into_iter()
            .map(|(path, file)| (path.display().to_string(), file))
            .collect()),
        PolicySource::Builtin(policy) => {
            let file_name = format!("builtin:tests/{policy}.yaml");
            let file = CaseFile::parse(builtin::get(*policy).cases, &file_name)?;
            Ok(vec![(file_name, file)])
        }
    }
}
