//! `vramguard policy check|test|eval`. Each command has a `*_to` twin writing to any output, so
//! tests read exactly what a user would see.
//!
//! Exit status: 0 when everything passed; 1 when a test case failed or an evaluation fell back
//! or did not match; 64 ([`EXIT_CONFIG`]) when a file is unreadable, a script does not compile
//! or (`check`) fails on a representative request.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use serde::Serialize;

use crate::cmd::exit::{EXIT_CONFIG, EXIT_FAILED};
use crate::config::{BuiltinPolicy, Config, PolicySource, read_yaml};
use crate::core::snapshot::{Decision, Estimate};
use crate::policy::builtin;
use crate::policy::cases::{self, Case, CaseFile, CaseResult};
use crate::policy::{
    LoadError, PolicySettings, configured_estimate, configured_snapshot, load_script, smoke_requests, smoke_test,
};

/// Evaluations timed by `policy eval`; it reports their median, since a single cold run mostly
/// measures cache misses.
const EVAL_RUNS: usize = 101;

/// `policy check [--config FILE] FILE...`: compile and lint each script, then evaluate it once
/// per model and pool of the config (the embedded default without `--config`), as `serve` does
/// before it starts; errors read `file:line:col: message`.
pub fn check(files: &[PathBuf], config: Option<&Path>) -> ExitCode {
    check_to(files, config, &mut std::io::stdout(), &mut std::io::stderr())
}

/// [`check`] writing to `out` (one `file: ok` per good script) and `err` (one line per error).
///
/// The representative requests and state come from the config without ONNX Runtime (see
/// `smoke.rs`). A script's params are the builtin defaults for a policy of its file name
/// (`availability-first.rhai` gets builtin:availability-first's; any other name builtin:default's),
/// overridden by the config's `policy.params`.
pub fn check_to(files: &[PathBuf], config: Option<&Path>, out: &mut dyn Write, err: &mut dyn Write) -> ExitCode {
    if files.is_empty() {
        let _ = writeln!(err, "error: name at least one policy file");
        return ExitCode::from(EXIT_CONFIG);
    }
    let config = match config {
        Some(path) => match Config::load(path) {
            Ok(config) => config,
            Err(error) => {
                let _ = writeln!(err, "error: {error}");
                return ExitCode::from(EXIT_CONFIG);
            }
        },
        None => Config::embedded(crate::device::nvidia_gpu_present()),
    };
    let requests = smoke_requests(&config, |_| true, configured_estimate);
    let snapshot = configured_snapshot(&config);
    let mut failed = false;
    for file in files {
        let name = file.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
        let mut params = builtin::default_params(BuiltinPolicy::from_name(name).unwrap_or(BuiltinPolicy::Default));
        params.extend(config.policy.params.clone());
        let settings = PolicySettings {
            params,
            ..PolicySettings::default()
        };
        let checked = load_script(&PolicySource::File(file.clone()), &settings)
            .map_err(|e| e.to_string())
            .and_then(|(script, _)| smoke_test(&script, &requests, &snapshot).map_err(|e| e.to_string()));
        match checked {
            Ok(()) => {
                let _ = writeln!(out, "{}: ok", file.display());
            }
            Err(error) => {
                failed = true;
                let _ = writeln!(err, "{error}");
            }
        }
    }
    if failed {
        ExitCode::from(EXIT_CONFIG)
    } else {
        ExitCode::SUCCESS
    }
}

/// `policy test [PATH...]`: run the case files (folders expanded; `policies/tests/` by default),
/// print `PASS file: case` / `FAIL file: case: expected …, got …` and `N passed, N failed`.
pub fn test(paths: &[PathBuf]) -> ExitCode {
    test_to(paths, &mut std::io::stdout())
}

/// [`test`] writing to `out`. A file that cannot be loaded counts as one failure.
pub fn test_to(paths: &[PathBuf], out: &mut dyn Write) -> ExitCode {
    let files = match cases::discover(paths) {
        Ok(files) => files,
        Err(error) => {
            let _ = writeln!(out, "FAIL {error}");
            let _ = writeln!(out, "0 passed, 1 failed");
            return ExitCode::from(EXIT_FAILED);
        }
    };
    let (mut passed, mut failed) = (0, 0);
    for file in &files {
        match run_file(file) {
            Ok(results) => {
                for result in results {
                    if result.passed() {
                        passed += 1;
                        let _ = writeln!(out, "PASS {}: {}", file.display(), result.name);
                    } else {
                        failed += 1;
                        let _ = writeln!(out, "FAIL {}: {}: {}", file.display(), result.name, result.describe());
                    }
                }
            }
            Err(error) => {
                failed += 1;
                let _ = writeln!(out, "FAIL {}: {error}", file.display());
            }
        }
    }
    let _ = writeln!(out, "{passed} passed, {failed} failed");
    if failed == 0 && passed > 0 {
        ExitCode::SUCCESS
    } else {
        if passed == 0 && failed == 0 {
            let _ = writeln!(out, "no test cases found");
        }
        ExitCode::from(EXIT_FAILED)
    }
}

/// Load a case file and the policy it names, and run every case.
fn run_file(path: &Path) -> Result<Vec<CaseResult>, LoadError> {
    let file = CaseFile::load(path)?;
    let policy = PolicySource::File(file.policy_path(path));
    let (script, _) = load_script(&policy, &PolicySettings::default())?;
    Ok(cases::run_cases(&script, &file))
}

/// What `policy eval` prints, as YAML or JSON.
#[derive(Debug, Serialize)]
struct EvalReport {
    /// The decision (the fallback when `error` is set).
    decision: Decision,
    /// `script` or `fallback`.
    source: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<ErrorReport>,
    /// Median of [`EVAL_RUNS`] evaluations, in microseconds.
    eval_time_us: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    expected: Option<Decision>,
    #[serde(skip_serializing_if = "Option::is_none")]
    matched: Option<bool>,
    /// What the decision was made on: the request's estimate, parts and source, and its size
    /// along each dynamic axis, so a surprising decision can be traced to its inputs.
    request: RequestReport,
}

/// The part of the evaluated request that explains a decision on memory.
#[derive(Debug, Serialize)]
struct RequestReport {
    estimate: Estimate,
    dims: BTreeMap<String, u64>,
}

#[derive(Debug, Serialize)]
struct ErrorReport {
    kind: &'static str,
    message: String,
}

/// `policy eval FILE --input CASE.yaml [--json]`: one dry-run decision with its eval time and,
/// when the case has `expect`, whether it matched.
pub fn eval(file: &Path, input: &Path, json: bool) -> ExitCode {
    eval_to(file, input, json, &mut std::io::stdout(), &mut std::io::stderr())
}

/// [`eval`] writing the report to `out` and load errors to `err`.
pub fn eval_to(file: &Path, input: &Path, json: bool, out: &mut dyn Write, err: &mut dyn Write) -> ExitCode {
    let case: Case = match read_yaml(input) {
        Ok(case) => case,
        Err(error) => {
            let _ = writeln!(err, "error: {error}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let script = match load_script(&PolicySource::File(file.to_path_buf()), &PolicySettings::default()) {
        Ok((script, _)) => script,
        Err(error) => {
            let _ = writeln!(err, "{error}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let mut results: Vec<CaseResult> = (0..EVAL_RUNS)
        .map(|_| cases::run_case(&script, &Default::default(), &case))
        .collect();
    let mut times: Vec<Duration> = results
        .iter()
        .filter_map(|r| r.outcome.as_ref().ok().map(|e| e.duration))
        .collect();
    times.sort();
    let result = results.swap_remove(0);
    let evaluation = match &result.outcome {
        Ok(evaluation) => evaluation,
        Err(error) => {
            let _ = writeln!(err, "{error}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let matched = result.expected.as_ref().map(|_| result.passed());
    let report = EvalReport {
        decision: evaluation.decision.clone(),
        source: if evaluation.used_fallback() {
            "fallback"
        } else {
            "script"
        },
        error: evaluation.error.as_ref().map(|e| ErrorReport {
            kind: e.kind.label(),
            message: e.to_string(),
        }),
        eval_time_us: times.get(times.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e6),
        expected: result.expected.clone(),
        matched,
        request: RequestReport {
            estimate: case.request.estimate,
            dims: case.request.dims.clone(),
        },
    };
    let text = if json {
        serde_json::to_string_pretty(&report)
            .map(|s| s + "\n")
            .unwrap_or_default()
    } else {
        crate::config::to_yaml(&report)
    };
    let _ = out.write_all(text.as_bytes());
    if evaluation.used_fallback() || matched == Some(false) {
        ExitCode::from(EXIT_FAILED)
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests;
