//! The handle the server holds: loading, hot reload that keeps the last good script, case files,
//! builtin policies.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::*;
use crate::config::{BuiltinPolicy, PolicySource};

// ─── the handle: decisions and hot reload ─────────────────────────────────────────────────

const DEFER_CASES: &str = r#"
policy: policy.rhai
params: {max_queue: 2}
cases:
  - name: short queue admits
    request: {pool: gpu}
    state: {pools: {gpu: {queue_depth: 2}}}
    expect: {action: admit}
  - name: long queue defers
    request: {pool: gpu}
    state: {pools: {gpu: {queue_depth: 3}}}
    expect: {action: defer, ms: 10}
"#;

fn handle_in(scratch: &Scratch) -> PolicyHandle {
    scratch.write("tests/policy.yaml", DEFER_CASES);
    let path = scratch.write("policy.rhai", DEFER_WHEN_QUEUED);
    PolicyHandle::load(PolicySource::File(path), settings(&[("max_queue", 5.into())])).expect("loads")
}

fn queue_of(depth: u64) -> Arc<Snapshot> {
    let mut snapshot = snapshot();
    snapshot.pools.get_mut("gpu").expect("gpu pool").queue_depth = depth;
    Arc::new(snapshot)
}

#[test]
fn the_handle_uses_config_params_and_tracks_snapshot_changes() {
    let scratch = Scratch::new();
    let handle = handle_in(&scratch);
    assert_eq!(handle.current().cases, 2, "its test cases ran at load");
    // Config params (max_queue 5), not the test file's (2), govern real decisions.
    let snapshot = queue_of(4);
    assert_eq!(
        handle.decide(&request(), &snapshot).decision,
        Decision::Admit { pool: None }
    );
    assert_eq!(
        handle.decide(&request(), &snapshot).decision,
        Decision::Admit { pool: None }
    );
    // A new snapshot is seen at once, although the previous one's view was cached.
    let busier = queue_of(6);
    assert_eq!(handle.decide(&request(), &busier).decision, Decision::Defer { ms: 10 });
}

#[test]
fn a_reload_with_bad_syntax_keeps_the_last_good_script() {
    let scratch = Scratch::new();
    let handle = handle_in(&scratch);
    let before = handle.status();
    scratch.write("policy.rhai", "fn decide(req, state) {\n  admit(\n}");
    let error = handle.reload().expect_err("bad syntax is refused");
    assert!(
        matches!(&error, LoadError::Compile(e) if e.kind == PolicyErrorKind::Compile),
        "{error}"
    );
    assert!(error.to_string().contains("policy.rhai:3:"), "{error}");
    let after = handle.status();
    assert_eq!(after.sha256, before.sha256);
    assert_eq!(after.loaded_at, before.loaded_at);
    assert_eq!(after.last_error, Some(error.to_string()));
    assert_eq!(
        handle.decide(&request(), &queue_of(6)).decision,
        Decision::Defer { ms: 10 }
    );
}

#[test]
fn a_reload_failing_its_own_test_cases_keeps_the_last_good_script() {
    let scratch = Scratch::new();
    let handle = handle_in(&scratch);
    let before = handle.status();
    // Compiles, but never defers: the "long queue defers" case fails.
    scratch.write("policy.rhai", "fn decide(req, state) { admit() }");
    let error = handle.reload().expect_err("a failing case is refused");
    match &error {
        LoadError::TestsFailed {
            failed, total, first, ..
        } => {
            assert_eq!((*failed, *total), (1, 2));
            assert!(
                first.contains("long queue defers: expected defer(10), got admit()"),
                "{first}"
            );
        }
        other => panic!("expected TestsFailed, got {other}"),
    }
    assert_eq!(handle.status().sha256, before.sha256);
    assert!(handle.status().last_error.is_some());
    assert_eq!(
        handle.decide(&request(), &queue_of(6)).decision,
        Decision::Defer { ms: 10 }
    );
}

#[test]
fn a_good_reload_swaps_and_clears_the_last_error() {
    let scratch = Scratch::new();
    let handle = handle_in(&scratch);
    let before = handle.status();
    scratch.write("policy.rhai", "fn decide(req, state) {\n  admit(\n}");
    assert!(handle.reload().is_err());

    // Same decisions as the test cases demand, but with a longer deferral for queues over 8.
    let script = "fn decide(req, state) { let q = state.pools[req.pool].queue_depth; \
                  if q > 8 { defer(99) } else if q > state.params.max_queue { defer(10) } else { admit() } }";
    scratch.write("policy.rhai", script);
    let loaded = handle.reload().expect("a good script swaps in");
    let status = handle.status();
    assert_eq!(status.sha256, loaded.sha256);
    assert_ne!(status.sha256, before.sha256);
    assert_eq!(status.last_error, None);
    assert_eq!(status.origin, scratch.path().join("policy.rhai").display().to_string());
    assert_eq!(
        handle.decide(&request(), &queue_of(9)).decision,
        Decision::Defer { ms: 99 }
    );
}

#[test]
fn loading_refuses_a_script_that_fails_its_test_cases() {
    let scratch = Scratch::new();
    scratch.write("tests/policy.yaml", DEFER_CASES);
    let path = scratch.write("policy.rhai", "fn decide(req, state) { defer(10) }");
    let error = PolicyHandle::load(PolicySource::File(path), settings(&[])).expect_err("refused");
    assert!(
        matches!(
            error,
            LoadError::TestsFailed {
                failed: 1,
                total: 2,
                ..
            }
        ),
        "{error}"
    );
}

#[test]
fn case_files_for_other_policies_do_not_apply() {
    let scratch = Scratch::new();
    scratch.write(
        "tests/other.yaml",
        "policy: other.rhai\ncases:\n  - {name: x, expect: {action: admit}}\n",
    );
    let path = scratch.write("policy.rhai", "fn decide(req, state) { defer(1) }");
    let handle = PolicyHandle::load(PolicySource::File(path), settings(&[])).expect("no case applies");
    assert_eq!(handle.current().cases, 0);
}

#[test]
fn every_builtin_policy_loads_from_memory_and_passes_its_own_cases() {
    for name in BuiltinPolicy::ALL {
        let settings = PolicySettings {
            params: builtin::default_params(name),
            ..PolicySettings::default()
        };
        let handle =
            PolicyHandle::load(PolicySource::Builtin(name), settings).unwrap_or_else(|e| panic!("builtin:{name}: {e}"));
        assert!(handle.current().cases >= 8, "builtin:{name} has too few cases");
        // Named for what it is wherever it shows (/status, vramguard_policy_info), never a path.
        assert_eq!(handle.status().origin, format!("builtin:{name}"));
        let before = handle.status();
        handle
            .reload()
            .unwrap_or_else(|e| panic!("builtin:{name} reloads: {e}"));
        assert_eq!(handle.status().sha256, before.sha256, "the same text, checked again");
    }
}

// An unknown `builtin:<name>` cannot reach a load: the config refuses it, naming the builtin
// policies (see `config/tests.rs`), and a `PolicySource` holds only a `BuiltinPolicy`.
#[test]
fn a_builtin_policy_is_named_in_errors() {
    // A builtin's runtime errors are located as builtin:<name>:line:col. Without the params it
    // reads, the default policy fails on the first one it needs.
    let (script, _) = load_script(&PolicySource::Builtin(BuiltinPolicy::Default), &settings(&[])).expect("compiles");
    let error = script
        .decide(&request(), &snapshot())
        .error
        .expect("fails without params");
    assert!(error.location.starts_with("builtin:default:"), "{error}");
    assert_eq!(
        error.location.split(':').count(),
        4,
        "builtin:default:line:col, got {error}"
    );
}

#[test]
fn a_case_file_path_resolves_beside_its_folder() {
    let file = cases::CaseFile {
        policy: "default.rhai".into(),
        params: Params::new(),
        cases: Vec::new(),
    };
    assert_eq!(
        file.policy_path(Path::new("policies/tests/x.yaml")),
        PathBuf::from("policies/default.rhai")
    );
    assert_eq!(
        file.policy_path(Path::new("tests/x.yaml")),
        PathBuf::from("default.rhai")
    );
    assert_eq!(file.policy_path(Path::new("x.yaml")), PathBuf::from("../default.rhai"));
}

#[test]
fn the_handle_can_be_shared_across_request_tasks() {
    fn shareable<T: Send + Sync>() {}
    shareable::<PolicyHandle>();
    shareable::<Script>();
    shareable::<Evaluation>();
    shareable::<LoadError>();
}
