//! [`PolicyHandle`]: the policy the server runs, and hot reload.
//!
//! A reload reads the file, compiles it and runs the policy's own test cases (the case files in
//! `tests/` beside it whose `policy:` is this file) against the new script; only when all of
//! that succeeds does the new script replace the old one. Otherwise the last good script keeps
//! serving and the error is kept for `/status`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Instant, SystemTime};

use sha2::{Digest, Sha256};

use super::cases::{self, CaseFileError};
use super::script::{Evaluation, PolicyError, PolicySettings, Script};
use super::values::StateView;
use crate::snapshot::{RequestInfo, Snapshot};

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
        /// The script.
        path: String,
        /// How many failed.
        failed: usize,
        /// How many ran.
        total: usize,
        /// The first failure, as `file: case: expected …, got …`.
        first: String,
    },
}

/// Read and compile a policy file; its path is the origin in error messages.
pub fn load_script(path: &Path, settings: &PolicySettings) -> Result<(Script, String), LoadError> {
    let source = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
        path: path.display().to_string(),
        source,
    })?;
    let script = Script::compile(&source, &path.display().to_string(), settings)?;
    Ok((script, source))
}

/// One loaded version of the policy.
#[derive(Debug)]
pub struct LoadedPolicy {
    /// The compiled script.
    pub script: Script,
    /// Hex SHA-256 of the script's source (`vramguard_policy_info{sha256}`, `/status`).
    pub sha256: String,
    /// When it was loaded.
    pub loaded_at: SystemTime,
    /// How many of its test cases ran (and passed) before it was accepted.
    pub cases: usize,
}

/// What `/status` shows about the policy.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyStatus {
    /// The script's path.
    pub path: PathBuf,
    /// Hex SHA-256 of the script now serving.
    pub sha256: String,
    /// When the script now serving was loaded.
    pub loaded_at: SystemTime,
    /// Why the latest reload failed, while the previous script keeps serving; cleared by the
    /// next successful reload.
    pub last_error: Option<String>,
}

/// The policy the server runs: the current script, reloadable while requests are evaluated.
#[derive(Debug)]
pub struct PolicyHandle {
    path: PathBuf,
    settings: PolicySettings,
    current: RwLock<Arc<LoadedPolicy>>,
    last_error: Mutex<Option<String>>,
    /// Serializes reloads (file watcher and admin endpoint), so the newest file read wins.
    reloading: Mutex<()>,
}

impl PolicyHandle {
    /// Load the policy at `path` (compile, then run its test cases); fails like a reload would,
    /// so a server refuses to start on a script that would be refused on reload.
    pub fn load(path: impl Into<PathBuf>, settings: PolicySettings) -> Result<Self, LoadError> {
        let path = path.into();
        let loaded = prepare(&path, &settings)?;
        Ok(PolicyHandle {
            path,
            settings,
            current: RwLock::new(Arc::new(loaded)),
            last_error: Mutex::new(None),
            reloading: Mutex::new(()),
        })
    }

    /// The script's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The version now serving.
    pub fn current(&self) -> Arc<LoadedPolicy> {
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Decide for one request with the current script, converting `snapshot` for it. The server
    /// keeps its converted view between requests and calls [`PolicyHandle::decide_view`] instead
    /// (see `Engine::policy_view`); this is for one-off decisions.
    pub fn decide(&self, req: &RequestInfo, snapshot: &Snapshot) -> Evaluation {
        let started = Instant::now();
        let view = StateView::new(snapshot);
        self.current().script.evaluate(started, req, &view)
    }

    /// Decide for one request with the current script against a prepared view.
    pub fn decide_view(&self, req: &RequestInfo, view: &StateView) -> Evaluation {
        self.current().script.decide_view(req, view)
    }

    /// Read, compile and test the file again; swap it in only if all of that succeeds. On error
    /// the previous script keeps serving and the error is kept for [`PolicyHandle::status`].
    /// Count the result as `vramguard_policy_reloads_total{result="ok"|"error"}`.
    pub fn reload(&self) -> Result<Arc<LoadedPolicy>, LoadError> {
        let _one_at_a_time = self.reloading.lock().unwrap_or_else(PoisonError::into_inner);
        match prepare(&self.path, &self.settings) {
            Ok(loaded) => {
                let loaded = Arc::new(loaded);
                *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::clone(&loaded);
                *self.last_error.lock().unwrap_or_else(PoisonError::into_inner) = None;
                tracing::info!(path = %self.path.display(), sha256 = %loaded.sha256, cases = loaded.cases, "policy reloaded");
                Ok(loaded)
            }
            Err(error) => {
                tracing::warn!(path = %self.path.display(), %error, "policy reload refused; the previous script keeps serving");
                *self.last_error.lock().unwrap_or_else(PoisonError::into_inner) = Some(error.to_string());
                Err(error)
            }
        }
    }

    /// Path, hash and load time of the script now serving, and the last reload error.
    pub fn status(&self) -> PolicyStatus {
        let current = self.current();
        PolicyStatus {
            path: self.path.clone(),
            sha256: current.sha256.clone(),
            loaded_at: current.loaded_at,
            last_error: self.last_error.lock().unwrap_or_else(PoisonError::into_inner).clone(),
        }
    }
}

/// Everything a script must pass before it serves: read, compile, its own test cases.
fn prepare(path: &Path, settings: &PolicySettings) -> Result<LoadedPolicy, LoadError> {
    let (script, source) = load_script(path, settings)?;
    let mut total = 0;
    let mut failures = Vec::new();
    for (case_path, file) in cases::files_for_policy(path)? {
        for result in cases::run_cases(&script, &file) {
            total += 1;
            if !result.passed() {
                failures.push(format!(
                    "{}: {}: {}",
                    case_path.display(),
                    result.name,
                    result.describe()
                ));
            }
        }
    }
    if total == 0 {
        tracing::warn!(path = %path.display(), "policy has no test cases in tests/ beside it; loading it untested");
    }
    if let Some(first) = failures.first() {
        return Err(LoadError::TestsFailed {
            path: path.display().to_string(),
            failed: failures.len(),
            total,
            first: first.clone(),
        });
    }
    Ok(LoadedPolicy {
        script,
        sha256: format!("{:x}", Sha256::digest(source.as_bytes())),
        loaded_at: SystemTime::now(),
        cases: total,
    })
}
