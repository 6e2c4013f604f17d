//! [`PolicyHandle`]: the policy the server runs, and hot reload.
//!
//! A reload reads the script again (from its file, or the binary for a builtin), compiles it and
//! runs the policy's own test cases against it (see `source.rs` for where both come from); only
//! when all of that succeeds does the new script replace the old one. Otherwise the last good
//! script keeps serving and the error is kept for `/status`.

use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Instant, SystemTime};

use sha2::{Digest, Sha256};

use super::cases;
use super::script::{Evaluation, PolicySettings, Script};
use super::source::{self, LoadError};
use super::values::StateView;
use crate::config::{Config, PolicySource};
use crate::core::snapshot::{RequestInfo, Snapshot};

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
    /// The script's path, or `builtin:<name>` (`/status` `path`, `vramguard_policy_info{path}`).
    pub origin: String,
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
    source: PolicySource,
    origin: String,
    settings: PolicySettings,
    current: RwLock<Arc<LoadedPolicy>>,
    last_error: Mutex<Option<String>>,
    /// Serializes reloads (file watcher and admin endpoint), so the newest file read wins.
    reloading: Mutex<()>,
}

impl PolicyHandle {
    /// Load the policy from `source` (read, compile, then run its test cases); fails like a
    /// reload would, so a server refuses to start on a script that would be refused on reload.
    pub fn load(source: PolicySource, settings: PolicySettings) -> Result<Self, LoadError> {
        let loaded = prepare(&source, &settings)?;
        Ok(PolicyHandle {
            origin: source.to_string(),
            source,
            settings,
            current: RwLock::new(Arc::new(loaded)),
            last_error: Mutex::new(None),
            reloading: Mutex::new(()),
        })
    }

    /// Where the script comes from.
    pub fn source(&self) -> &PolicySource {
        &self.source
    }

    /// The script's path, or `builtin:<name>`: how errors, logs and `/status` name it.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The version now serving.
    pub fn current(&self) -> Arc<LoadedPolicy> {
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Decide for one request with the current script, converting `snapshot` for it. The server
    /// keeps its converted view between requests and calls [`PolicyHandle::decide_view`] instead
    /// (see `Service::policy_view`); this is for one-off decisions.
    pub fn decide(&self, req: &RequestInfo, snapshot: &Snapshot) -> Evaluation {
        let started = Instant::now();
        let view = StateView::new(snapshot);
        self.current().script.evaluate(started, req, &view)
    }

    /// Decide for one request with the current script against a prepared view.
    pub fn decide_view(&self, req: &RequestInfo, view: &StateView) -> Evaluation {
        self.current().script.decide_view(req, view)
    }

    /// Read, compile and test the script again (a builtin's text is the same, but its check is
    /// too); swap it in only if all of that succeeds. On error the previous script keeps serving and the error is kept for [`PolicyHandle::status`].
    /// Count the result as `vramguard_policy_reloads_total{result="ok"|"error"}`.
    pub fn reload(&self) -> Result<Arc<LoadedPolicy>, LoadError> {
        let _one_at_a_time = self.reloading.lock().unwrap_or_else(PoisonError::into_inner);
        match prepare(&self.source, &self.settings) {
            Ok(loaded) => {
                let loaded = Arc::new(loaded);
                *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::clone(&loaded);
                *self.last_error.lock().unwrap_or_else(PoisonError::into_inner) = None;
                tracing::info!(policy = %self.origin, sha256 = %loaded.sha256, cases = loaded.cases, "policy reloaded");
                Ok(loaded)
            }
            Err(error) => {
                tracing::warn!(policy = %self.origin, %error, "policy reload refused; the previous script keeps serving");
                *self.last_error.lock().unwrap_or_else(PoisonError::into_inner) = Some(error.to_string());
                Err(error)
            }
        }
    }

    /// Origin, hash and load time of the script now serving, and the last reload error.
    pub fn status(&self) -> PolicyStatus {
        let current = self.current();
        PolicyStatus {
            origin: self.origin.clone(),
            sha256: current.sha256.clone(),
            loaded_at: current.loaded_at,
            last_error: self.last_error.lock().unwrap_or_else(PoisonError::into_inner).clone(),
        }
    }
}

/// What `serve` gives the configured policy: `policy.fallback`, and `policy.params` over a
/// builtin policy's default params (a file policy gets only the config's).
pub fn settings_for(config: &Config) -> PolicySettings {
    let mut params = match &config.policy.source {
        PolicySource::Builtin(policy) => super::builtin::default_params(*policy),
        PolicySource::File(_) => super::Params::new(),
    };
    params.extend(config.policy.params.clone());
    PolicySettings {
        fallback: config.policy.fallback.clone(),
        params,
    }
}

/// Everything a script must pass before it serves: read, compile, its own test cases.
fn prepare(source: &PolicySource, settings: &PolicySettings) -> Result<LoadedPolicy, LoadError> {
    let (script, text) = source::load_script(source, settings)?;
    let mut total = 0;
    let mut failures = Vec::new();
    for (case_file, file) in source::test_cases(source)? {
        for result in cases::run_cases(&script, &file) {
            total += 1;
            if !result.passed() {
                failures.push(format!("{case_file}: {}: {}", result.name, result.describe()));
            }
        }
    }
    if total == 0 {
        tracing::warn!(policy = %script.origin(), "policy has no test cases in tests/ beside it; loading it untested");
    }
    if let Some(first) = failures.first() {
        return Err(LoadError::TestsFailed {
            path: script.origin().to_string(),
            failed: failures.len(),
            total,
            first: first.clone(),
        });
    }
    Ok(LoadedPolicy {
        script,
        sha256: format!("{:x}", Sha256::digest(text.as_bytes())),
        loaded_at: SystemTime::now(),
        cases: total,
    })
}
