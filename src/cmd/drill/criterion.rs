//! A pass criterion of the drill: what the report and each phase with criteria of its own
//! (residency, background, worker_lost) judge.

use serde::Serialize;

/// A pass criterion of the drill.
#[derive(Debug, Clone, Serialize)]
pub struct Criterion {
    /// What it checks.
    pub name: &'static str,
    /// What was measured.
    pub measured: String,
    /// Whether it passed.
    pub passed: bool,
}
