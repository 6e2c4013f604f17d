//! `vramguard policy check|test|eval`: what each prints and exits with, on the shipped policies
//! and on scratch files.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super as cli;
use crate::cmd::exit::EXIT_CONFIG;
use crate::config::{BuiltinPolicy, PolicySource};
use crate::policy::cases;
use crate::policy::{PolicySettings, load_script};
use crate::testing::{DEFER_WHEN_QUEUED, Scratch};

// ─── test-case files and the CLI ──────────────────────────────────────────────────────────

fn run_test(paths: &[PathBuf]) -> (ExitCode, String) {
    let mut out = Vec::new();
    let code = cli::test_to(paths, &mut out);
    (code, String::from_utf8(out).expect("utf-8"))
}

#[test]
fn the_shipped_policies_pass_their_test_cases() {
    let (code, out) = run_test(&[PathBuf::from("policies/tests")]);
    assert_eq!(code, ExitCode::SUCCESS, "{out}");
    let summary = out.lines().last().expect("a summary line");
    assert!(summary.ends_with(" passed, 0 failed"), "{summary}");
    assert!(!out.contains("FAIL"), "{out}");
}

#[test]
fn each_shipped_policy_has_cases_for_every_action_it_takes() {
    let required: [(&str, &[&str]); 3] = [
        ("default", &["admit", "defer", "shrink_context", "redirect", "reject"]),
        ("latency-first", &["admit", "defer", "shrink_context", "reject"]),
        (
            "availability-first",
            &["admit", "defer", "shrink_context", "redirect", "reject"],
        ),
    ];
    for (name, actions) in required {
        let path = PathBuf::from(format!("policies/tests/{name}.yaml"));
        let file = cases::CaseFile::load(&path).expect("case file loads");
        assert_eq!(file.policy, format!("{name}.rhai"));
        assert!(file.cases.len() >= 8, "{name}: {} cases", file.cases.len());
        for action in actions {
            let covered = file
                .cases
                .iter()
                .filter_map(|c| c.expect.as_ref())
                .filter(|d| d.action().label() == *action);
            assert!(covered.count() >= 1, "{name} has no case expecting {action}");
        }
        // Every shipped policy compiles and is checked by `policy check`.
        let script = file.policy_path(&path);
        assert_eq!(script, PathBuf::from(format!("policies/{name}.rhai")));
        assert!(load_script(&PolicySource::File(script), &PolicySettings::default()).is_ok());
    }
}

#[test]
fn a_failing_case_prints_what_was_expected_and_what_came() {
    let scratch = Scratch::new();
    scratch.write(
        "policy.rhai",
        "fn decide(req, state) { if req.batch > 1 { admit() } else { state.nope } }",
    );
    let cases = scratch.write(
        "tests/policy.yaml",
        r#"policy: policy.rhai
cases:
  - {name: batch admits, request: {batch: 2}, expect: {action: admit}}
  - {name: wrong expectation, request: {batch: 2}, expect: {action: defer, ms: 5}}
  - {name: script error, request: {batch: 1}, expect: {action: admit}}
"#,
    );
    let (code, out) = run_test(&[scratch.path().join("tests")]);
    assert_eq!(code, ExitCode::from(1));
    let lines: Vec<&str> = out.lines().collect();
    let file = cases.display();
    assert_eq!(lines[0], format!("PASS {file}: batch admits"));
    assert_eq!(
        lines[1],
        format!("FAIL {file}: wrong expectation: expected defer(5), got admit()")
    );
    assert!(
        lines[2].starts_with(&format!(
            "FAIL {file}: script error: expected admit(), got fallback admit() after a runtime error: "
        )),
        "a fallback never passes, even when it equals the expectation: {}",
        lines[2]
    );
    assert_eq!(lines[3], "1 passed, 2 failed");
}

#[test]
fn an_unusable_case_file_counts_as_a_failure() {
    let scratch = Scratch::new();
    let bad = scratch.write(
        "tests/bad.yaml",
        "policy: policy.rhai\ncases:\n  - {name: x, expect: {action: nap}}\n",
    );
    let (code, out) = run_test(std::slice::from_ref(&bad));
    assert_eq!(code, ExitCode::from(1));
    assert!(out.starts_with(&format!("FAIL {}: ", bad.display())), "{out}");
    assert!(out.ends_with("0 passed, 1 failed\n"), "{out}");

    let unnamed = scratch.write(
        "tests/unnamed.yaml",
        "policy: policy.rhai\ncases:\n  - {expect: {action: admit}}\n",
    );
    let error = cases::CaseFile::load(&unnamed).expect_err("a case needs a name");
    assert!(error.to_string().contains("cases[0]: `name` is missing"), "{error}");
}

#[test]
fn check_reports_file_line_and_column() {
    let scratch = Scratch::new();
    let good = scratch.write("good.rhai", "fn decide(req, state) { admit() }");
    let bad = scratch.write("bad.rhai", "fn decide(req, state) {\n    admit(missing)\n}");
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = cli::check_to(&[good.clone(), bad.clone()], None, &mut out, &mut err);
    assert_eq!(code, ExitCode::from(EXIT_CONFIG));
    assert_eq!(String::from_utf8_lossy(&out), format!("{}: ok\n", good.display()));
    let err = String::from_utf8_lossy(&err);
    assert!(err.starts_with(&format!("{}:2:11: ", bad.display())), "{err}");
    assert!(err.contains("missing"), "{err}");
}

#[test]
fn check_runs_the_script_and_reports_where_it_fails_at_run_time() {
    let scratch = Scratch::new();
    // Compiles: a misspelt property is only found when decide runs, on every request.
    let typo = scratch.write(
        "typo.rhai",
        "fn decide(req, state) {\n    if req.priorty > 0 { return admit(); }\n    admit()\n}",
    );
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = cli::check_to(std::slice::from_ref(&typo), None, &mut out, &mut err);
    assert_eq!(code, ExitCode::from(EXIT_CONFIG));
    assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
    let err = String::from_utf8_lossy(&err);
    assert!(err.starts_with(&format!("{}:2:12: ", typo.display())), "{err}");
    assert!(err.contains("priorty"), "{err}");
    assert!(err.contains("for model `encoder` on pool `gpu`"), "{err}");

    // A param neither the builtin defaults nor the config define fails the same way.
    let param = scratch.write("param.rhai", "fn decide(req, state) { defer(state.params.nap_ms) }");
    let (mut out, mut err) = (Vec::new(), Vec::new());
    assert_eq!(
        cli::check_to(&[param], None, &mut out, &mut err),
        ExitCode::from(EXIT_CONFIG)
    );
    assert!(String::from_utf8_lossy(&err).contains("nap_ms"));
}

#[test]
fn check_tries_the_shipped_policies_on_the_default_and_example_configs() {
    let shipped: Vec<PathBuf> = BuiltinPolicy::ALL
        .iter()
        .map(|name| PathBuf::from(format!("policies/{name}.rhai")))
        .collect();
    for config in [None, Some(Path::new("config/example.yaml"))] {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = cli::check_to(&shipped, config, &mut out, &mut err);
        assert_eq!(code, ExitCode::SUCCESS, "{config:?}: {}", String::from_utf8_lossy(&err));
        assert_eq!(String::from_utf8_lossy(&out).lines().count(), shipped.len());
    }
}

#[test]
fn eval_prints_the_decision_the_time_and_whether_it_matched() {
    let scratch = Scratch::new();
    let policy = scratch.write("policy.rhai", DEFER_WHEN_QUEUED);
    let input = scratch.write(
        "case.yaml",
        "request: {pool: gpu}\nstate: {pools: {gpu: {queue_depth: 3}}}\nparams: {max_queue: 2}\nexpect: {action: defer, ms: 10}\n",
    );
    let (mut out, mut err) = (Vec::new(), Vec::new());
    assert_eq!(
        cli::eval_to(&policy, &input, false, &mut out, &mut err),
        ExitCode::SUCCESS
    );
    let yaml: serde_yaml::Value = serde_yaml::from_slice(&out).expect("YAML output");
    assert_eq!(yaml["decision"]["action"], "defer");
    assert_eq!(yaml["decision"]["ms"], 10);
    assert_eq!(yaml["source"], "script");
    assert_eq!(yaml["matched"], true);
    assert!(yaml["eval_time_us"].as_f64().is_some_and(|t| t > 0.0));

    // JSON, and a mismatch exits 1.
    let mismatch = scratch.write(
        "mismatch.yaml",
        "request: {pool: gpu}\nstate: {pools: {gpu: {queue_depth: 1}}}\nparams: {max_queue: 2}\nexpect: {action: defer, ms: 10}\n",
    );
    let mut out = Vec::new();
    assert_eq!(
        cli::eval_to(&policy, &mismatch, true, &mut out, &mut err),
        ExitCode::from(1)
    );
    let json: serde_json::Value = serde_json::from_slice(&out).expect("JSON output");
    assert_eq!(json["decision"], serde_json::json!({"action": "admit"}));
    assert_eq!(json["matched"], false);

    // A script failure reports the fallback and the error.
    let no_params = scratch.write("no-params.yaml", "request: {pool: gpu}\nstate: {pools: {gpu: {}}}\n");
    let mut out = Vec::new();
    assert_eq!(
        cli::eval_to(&policy, &no_params, true, &mut out, &mut err),
        ExitCode::from(1)
    );
    let json: serde_json::Value = serde_json::from_slice(&out).expect("JSON output");
    assert_eq!(json["source"], "fallback");
    assert_eq!(json["error"]["kind"], "runtime");
    assert!(json.get("matched").is_none());
}

#[test]
fn eval_shows_the_estimate_its_source_and_the_dims_it_decided_on() {
    let scratch = Scratch::new();
    let policy = scratch.write("policy.rhai", "fn decide(req, state) { admit() }");
    let input = scratch.write(
        "case.yaml",
        "request: {pool: gpu, dims: {batch: 2, seq: 128}, estimate: {weights_bytes: 10, context_bytes: 20, workspace_bytes: 30, total_bytes: 60, source: observed}}\nstate: {pools: {gpu: {}}}\n",
    );
    let (mut out, mut err) = (Vec::new(), Vec::new());
    assert_eq!(
        cli::eval_to(&policy, &input, true, &mut out, &mut err),
        ExitCode::SUCCESS
    );
    let json: serde_json::Value = serde_json::from_slice(&out).expect("JSON output");
    assert_eq!(
        json["request"]["estimate"],
        serde_json::json!({"weights_bytes": 10, "context_bytes": 20, "workspace_bytes": 30, "total_bytes": 60, "source": "observed"})
    );
    assert_eq!(json["request"]["dims"], serde_json::json!({"batch": 2, "seq": 128}));
}
