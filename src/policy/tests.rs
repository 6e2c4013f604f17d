//! Policy scripts, hot reload, test-case runner and CLI: plain data in, plain data out; no GPU,
//! no ONNX Runtime, no sleeps.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::*;
use crate::config::{BuiltinPolicy, PolicySource};
use crate::core::snapshot::{
    BreakerState, Decision, DeviceClass, DeviceState, Estimate, HostState, PoolState, ProcessState, ProviderKind,
    RequestInfo, Snapshot,
};
use crate::testing::{DEFER_WHEN_QUEUED, Scratch};

const FALLBACK: &str = "policy fallback";

fn settings(params: &[(&str, serde_json::Value)]) -> PolicySettings {
    PolicySettings {
        fallback: Decision::Reject {
            reason: FALLBACK.into(),
        },
        params: params.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(),
    }
}

fn script(source: &str) -> Script {
    Script::compile(source, "test.rhai", &settings(&[])).expect("compiles")
}

fn compile_error(source: &str) -> PolicyError {
    Script::compile(source, "test.rhai", &settings(&[])).expect_err("must not compile")
}

fn request() -> RequestInfo {
    RequestInfo {
        id: "req-1".into(),
        model: "encoder".into(),
        pool: "gpu".into(),
        context_tokens: 128,
        max_new_tokens: 16,
        batch: 2,
        priority: -3,
        replayable: true,
        allow_shrink: true,
        deadline_ms: 250,
        estimate: Estimate {
            weights_bytes: 1000,
            context_bytes: 200,
            workspace_bytes: 30,
            total_bytes: 1230,
        },
    }
}

fn snapshot() -> Snapshot {
    Snapshot {
        devices: BTreeMap::from([(
            "gpu0".to_string(),
            DeviceState {
                kind: DeviceClass::Simulated,
                total_bytes: 512,
                used_bytes: 300,
                free_bytes: 212,
                reserved_bytes: 100,
                active_bytes: 40,
                headroom_bytes: 272,
            },
        )]),
        pools: BTreeMap::from([
            (
                "gpu".to_string(),
                PoolState {
                    provider: ProviderKind::Simulated,
                    device: "gpu0".into(),
                    breaker: BreakerState::Closed,
                    queue_depth: 3,
                    queue_oldest_age_ms: 40,
                    inflight: 1,
                    concurrency: 1,
                    alloc_failures_recent: 2,
                    est_delay_ms: 90,
                    max_context: 512,
                    sequences_waiting: 1,
                    sequences_running: 2,
                    kv_cache_bytes: 4096,
                },
            ),
            (
                "cpu".to_string(),
                PoolState {
                    provider: ProviderKind::Cpu,
                    device: "host".into(),
                    breaker: BreakerState::Open,
                    ..PoolState::default()
                },
            ),
        ]),
        host: HostState {
            mem_available_bytes: 7000,
            mem_total_bytes: 16000,
            reserve_bytes: 2000,
        },
        processes: vec![
            ProcessState {
                pid: 11,
                name: "ollama".into(),
                service: "llm".into(),
                device: "gpu0".into(),
                used_bytes: 100,
            },
            ProcessState {
                pid: 12,
                name: "python3".into(),
                service: "other".into(),
                device: "gpu0".into(),
                used_bytes: 50,
            },
        ],
        degraded: true,
    }
}

fn decide(source: &str) -> Evaluation {
    script(source).decide(&request(), &snapshot())
}

fn assert_fallback(evaluation: &Evaluation, kind: PolicyErrorKind) -> &PolicyError {
    assert_eq!(
        evaluation.decision,
        Decision::Reject {
            reason: FALLBACK.into()
        },
        "the configured fallback is used"
    );
    let error = evaluation.error.as_ref().expect("an error is reported");
    assert_eq!(error.kind, kind, "{error}");
    error
}

// ─── decisions ────────────────────────────────────────────────────────────────────────────

#[test]
fn every_constructor_yields_its_decision() {
    let cases = [
        ("admit()", Decision::Admit { pool: None }),
        (
            "admit(\"cpu\")",
            Decision::Admit {
                pool: Some("cpu".into()),
            },
        ),
        ("defer(25)", Decision::Defer { ms: 25 }),
        ("defer(12.9)", Decision::Defer { ms: 12 }),
        ("shrink_context(64)", Decision::ShrinkContext { tokens: 64 }),
        (
            "shrink_context(req.context_tokens / 2)",
            Decision::ShrinkContext { tokens: 64 },
        ),
        ("redirect(\"cpu\")", Decision::Redirect { pool: "cpu".into() }),
        ("reject(\"full\")", Decision::Reject { reason: "full".into() }),
    ];
    for (call, expected) in cases {
        let evaluation = decide(&format!("fn decide(req, state) {{ {call} }}"));
        assert_eq!(evaluation.error, None, "{call}");
        assert_eq!(evaluation.decision, expected, "{call}");
        assert!(!evaluation.used_fallback());
    }
}

#[test]
fn impossible_decision_values_are_bad_returns_at_the_call() {
    for (call, needle) in [
        ("defer(-5)", "ms must be ≥ 0, got -5"),
        ("defer(-0.5)", "ms must be a finite number ≥ 0"),
        ("shrink_context(-1)", "tokens must be ≥ 0"),
        ("shrink_context(0)", "tokens must be ≥ 1"),
        ("redirect(\"\")", "the pool name is empty"),
        ("admit(\" \")", "the pool name is empty"),
        ("reject(\"\")", "give the client a reason"),
    ] {
        let evaluation = decide(&format!("fn decide(req, state) {{\n    {call}\n}}"));
        let error = assert_fallback(&evaluation, PolicyErrorKind::BadReturn);
        assert_eq!(error.location, "test.rhai:2:5", "{call}");
        assert!(error.message.contains(needle), "{call}: {error}");
    }
}

#[test]
fn a_pool_missing_from_the_snapshot_is_a_bad_return() {
    for call in ["redirect(\"cpuu\")", "admit(\"gpu2\")"] {
        let evaluation = decide(&format!("fn decide(req, state) {{ {call} }}"));
        let error = assert_fallback(&evaluation, PolicyErrorKind::BadReturn);
        assert!(error.message.contains("unknown pool"), "{error}");
        assert!(error.message.contains("cpu, gpu"), "lists the known pools: {error}");
    }
}

#[test]
fn returning_something_else_is_a_bad_return() {
    for (body, shown) in [("42", "i64 `42`"), ("\"admit\"", "string `admit`"), ("()", "()")] {
        let evaluation = decide(&format!("fn decide(req, state) {{ {body} }}"));
        let error = assert_fallback(&evaluation, PolicyErrorKind::BadReturn);
        assert!(error.message.contains(shown), "{error}");
        assert!(error.message.contains("expected a decision"), "{error}");
    }
}

// ─── sandbox limits ───────────────────────────────────────────────────────────────────────

#[test]
fn an_endless_loop_hits_the_operations_limit() {
    let evaluation = decide("fn decide(req, state) { loop { } }");
    let error = assert_fallback(&evaluation, PolicyErrorKind::Limit);
    assert!(error.message.contains("too many operations"), "{error}");
}

#[test]
fn a_huge_string_hits_the_size_limit() {
    let evaluation = decide("fn decide(req, state) { let s = \"x\"; loop { s += s; } }");
    let error = assert_fallback(&evaluation, PolicyErrorKind::Limit);
    assert!(error.message.contains("string"), "{error}");
}

#[test]
fn huge_arrays_and_maps_hit_the_size_limits() {
    let array = decide("fn decide(req, state) { let a = []; for i in 0..2000 { a.push(i); } admit() }");
    assert_fallback(&array, PolicyErrorKind::Limit);
    // Rhai checks a map's size when it is combined or passed on, not on each `m[k] = v`.
    let map =
        decide("fn decide(req, state) { let m = #{}; for i in 0..300 { m[`k${i}`] = i; } m += #{z: 1}; admit() }");
    assert_fallback(&map, PolicyErrorKind::Limit);
}

#[test]
fn deep_recursion_hits_the_call_depth_limit() {
    let evaluation = decide("fn down(n) { down(n + 1) }\nfn decide(req, state) { down(0) }");
    let error = assert_fallback(&evaluation, PolicyErrorKind::Limit);
    assert!(error.message.contains("call depth"), "{error}");
}

#[test]
fn run_time_errors_fall_back_with_the_script_position() {
    let evaluation = decide("fn decide(req, state) {\n    let x = 1;\n    x / 0\n}");
    let error = assert_fallback(&evaluation, PolicyErrorKind::Runtime);
    assert_eq!(error.location, "test.rhai:3:7");
    assert!(error.message.contains("Division by zero"), "{error}");
    assert_eq!(error.to_string(), format!("test.rhai:3:7: {}", error.message));

    // Inside a helper, the innermost position is reported.
    let nested = decide("fn helper(s) {\n  s.pools.gpu.no_such_field\n}\nfn decide(req, state) { helper(state) }");
    let error = assert_fallback(&nested, PolicyErrorKind::Runtime);
    assert!(error.location.starts_with("test.rhai:2:"), "{error}");
    assert!(error.message.contains("no_such_field"), "{error}");

    let thrown = decide("fn decide(req, state) { throw \"no\" }");
    assert_fallback(&thrown, PolicyErrorKind::Runtime);
}

#[test]
fn a_misspelt_property_is_an_error_not_unit() {
    let evaluation = decide("fn decide(req, state) { if req.estimate.total_byte > 0 { admit() } else { defer(1) } }");
    let error = assert_fallback(&evaluation, PolicyErrorKind::Runtime);
    assert!(error.message.contains("total_byte"), "{error}");
}

// ─── compile-time checks ──────────────────────────────────────────────────────────────────

#[test]
fn an_undefined_variable_is_a_compile_error() {
    let error = compile_error("fn decide(req, state) {\n    if reqq.pool == \"gpu\" { admit() } else { defer(1) }\n}");
    assert_eq!(error.kind, PolicyErrorKind::Compile);
    assert_eq!(error.location, "test.rhai:2:8");
    assert!(error.message.contains("reqq"), "{error}");
}

#[test]
fn syntax_errors_name_file_line_and_column() {
    let error = compile_error("fn decide(req, state) {\n    admit(\n}");
    assert_eq!(error.kind, PolicyErrorKind::Compile);
    assert!(error.location.starts_with("test.rhai:3:"), "{error}");
}

#[test]
fn decide_must_exist_with_two_parameters() {
    let missing = compile_error("fn choose(req, state) { admit() }");
    assert_eq!(missing.location, "test.rhai");
    assert!(
        missing.message.contains("must define `fn decide(req, state)`"),
        "{missing}"
    );

    let wrong = compile_error("// policy\nfn decide(req) { admit() }");
    assert_eq!(wrong.location, "test.rhai:2:1");
    assert!(wrong.message.contains("takes 1"), "{wrong}");

    // An extra overload is fine as long as the two-parameter one exists.
    script("fn decide(req) { admit() }\nfn decide(req, state) { decide(req) }");
}

#[test]
fn eval_and_import_are_not_available() {
    let eval = compile_error("fn decide(req, state) { eval(\"admit()\") }");
    assert!(eval.message.contains("eval"), "{eval}");
    let import = compile_error("import \"other\" as other;\nfn decide(req, state) { admit() }");
    assert!(import.message.contains("import"), "{import}");
}

#[test]
fn print_and_debug_do_not_fail_the_script() {
    let evaluation = decide("fn decide(req, state) { print(`pool ${req.pool}`); debug(state.pools.gpu); admit() }");
    assert_eq!(evaluation.error, None);
}

// ─── inputs ───────────────────────────────────────────────────────────────────────────────

#[test]
fn req_carries_every_contract_field() {
    let evaluation = decide(
        r#"fn decide(req, state) {
            let e = req.estimate;
            let ok = req.id == "req-1" && req.model == "encoder" && req.pool == "gpu"
                && req.context_tokens == 128 && req.max_new_tokens == 16 && req.batch == 2
                && req.priority == -3 && req.replayable && req.allow_shrink && req.deadline_ms == 250
                && e.weights_bytes == 1000 && e.context_bytes == 200 && e.workspace_bytes == 30
                && e.total_bytes == 1230 && req.len() == 11 && e.len() == 4;
            if ok { admit() } else { reject(`req was ${req}`) }
        }"#,
    );
    assert_eq!(evaluation.error, None);
    assert_eq!(evaluation.decision, Decision::Admit { pool: None });
}

#[test]
fn state_carries_every_contract_field() {
    let evaluation = decide_with_params(
        r#"fn decide(req, state) {
            let d = state.devices["gpu0"];
            let p = state.pools.gpu;
            let h = state.host;
            let devices_ok = d.kind == "simulated" && d.total_bytes == 512 && d.used_bytes == 300
                && d.free_bytes == 212 && d.reserved_bytes == 100 && d.active_bytes == 40
                && d.headroom_bytes == 272 && d.len() == 7;
            let pools_ok = p.provider == "simulated" && p.device == "gpu0" && p.breaker == "closed"
                && p.queue_depth == 3 && p.queue_oldest_age_ms == 40 && p.inflight == 1
                && p.concurrency == 1 && p.alloc_failures_recent == 2 && p.est_delay_ms == 90
                && p.max_context == 512 && p.sequences_waiting == 1 && p.sequences_running == 2
                && p.kv_cache_bytes == 4096 && p.len() == 13 && state.pools.cpu.breaker == "open";
            let host_ok = h.mem_available_bytes == 7000 && h.mem_total_bytes == 16000
                && h.reserve_bytes == 2000;
            let used = 0;
            for proc in state.processes { used += proc.used_bytes; }
            let last = state.processes[-1];
            let processes_ok = used == 150 && state.processes.len() == 2 && last.pid == 12
                && last.name == "python3" && last.service == "other" && last.device == "gpu0"
                && state.processes.to_array().filter(|p| p.service == "llm").len() == 1;
            let tables_ok = "gpu" in state.pools && !("tpu" in state.pools)
                && state.pools.keys() == ["cpu", "gpu"] && state.devices.len() == 1
                && state.pools.get("tpu") == () && state.pools.values().len() == 2;
            let params_ok = state.params.cpu_pool == "cpu" && state.params.reserve_bytes == 67108864
                && state.params.defer_ms == 2000 && (state.params.get("missing") ?? true);
            if devices_ok && pools_ok && host_ok && processes_ok && tables_ok && params_ok && state.degraded {
                admit()
            } else {
                reject(`${devices_ok} ${pools_ok} ${host_ok} ${processes_ok} ${tables_ok} ${params_ok}`)
            }
        }"#,
    );
    assert_eq!(evaluation.error, None);
    assert_eq!(evaluation.decision, Decision::Admit { pool: None });
}

/// Evaluate with params of every kind the config may give: strings, sizes, durations, null.
fn decide_with_params(source: &str) -> Evaluation {
    let settings = settings(&[
        ("cpu_pool", "cpu".into()),
        ("reserve_bytes", "64MiB".into()),
        ("defer_ms", "2s".into()),
        ("missing_ms", serde_json::Value::Null),
    ]);
    Script::compile(source, "test.rhai", &settings)
        .expect("compiles")
        .decide(&request(), &snapshot())
}

#[test]
fn params_accept_sizes_and_durations_and_reject_nonsense() {
    let evaluation = decide_with_params(
        "fn decide(req, state) { if state.params.reserve_bytes == 67108864 && state.params.defer_ms == 2000 \
         && state.params.missing_ms == () { admit() } else { reject(`${state.params}`) } }",
    );
    assert_eq!(evaluation.error, None, "{evaluation:?}");
    assert_eq!(evaluation.decision, Decision::Admit { pool: None });

    let bad = Script::compile(
        "fn decide(req, state) { admit() }",
        "test.rhai",
        &settings(&[("reserve_bytes", "lots".into())]),
    )
    .expect_err("an unparseable size is refused");
    assert!(bad.message.contains("params.reserve_bytes"), "{bad}");
}

#[test]
fn a_script_cannot_change_what_the_next_evaluation_sees() {
    let compiled = script(
        "fn decide(req, state) { let seen = state.degraded; state.degraded = false; state.params.x = 1; \
         req.pool = \"cpu\"; if seen { admit() } else { reject(\"changed\") } }",
    );
    let snapshot = snapshot();
    let view = StateView::new(&snapshot);
    for _ in 0..3 {
        let evaluation = compiled.decide_view(&request(), &view);
        assert_eq!(evaluation.decision, Decision::Admit { pool: None }, "{evaluation:?}");
    }
}

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
fn smoke_inputs_come_from_the_config_without_onnx_runtime() {
    let config = crate::config::Config::embedded(false);
    let requests = smoke::smoke_requests(&config, |_| true, smoke::configured_estimate);
    let pairs: Vec<(&str, &str, u64)> = requests
        .iter()
        .map(|r| (r.model.as_str(), r.pool.as_str(), r.context_tokens))
        .collect();
    assert_eq!(
        pairs,
        [
            ("encoder", "gpu", 128),
            ("encoder", "cpu", 128),
            ("classifier", "gpu", 0),
            ("classifier", "cpu", 0)
        ]
    );
    assert!(
        requests
            .iter()
            .all(|r| r.batch == 1 && r.replayable && r.estimate.total_bytes > 0)
    );

    let snapshot = smoke::configured_snapshot(&config);
    let gpu0 = &snapshot.devices["gpu0"];
    assert_eq!((gpu0.kind, gpu0.total_bytes), (DeviceClass::Simulated, 512 << 20));
    assert_eq!(gpu0.used_bytes + gpu0.free_bytes, gpu0.total_bytes);
    let gpu = &snapshot.pools["gpu"];
    assert_eq!(
        (gpu.provider, gpu.device.as_str(), gpu.breaker, gpu.concurrency),
        (ProviderKind::Simulated, "gpu0", BreakerState::Closed, 1)
    );
    assert_eq!(snapshot.host.reserve_bytes, config.host_reserve);
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

/// Queues that move between samples are read live: the view is built once per sample.
#[test]
fn pools_read_their_load_live_from_a_view_built_once() {
    #[derive(Debug)]
    struct Moving(std::sync::atomic::AtomicU64);
    impl LiveLoad for Moving {
        fn pool_load(&self, pool: &str) -> Option<PoolLoadNow> {
            (pool == "gpu").then(|| PoolLoadNow {
                queue_depth: self.0.load(Ordering::SeqCst),
                inflight: 1,
                ..PoolLoadNow::default()
            })
        }
    }
    let moving = Arc::new(Moving(std::sync::atomic::AtomicU64::new(0)));
    let view = StateView::new(&snapshot()).with_live_load(moving.clone());
    let script = script(
        r#"fn decide(req, state) {
            let gpu = state.pools["gpu"];
            if gpu.queue_depth > 3 && gpu.inflight == 1 { defer(10) } else { admit() }
        }"#,
    );
    assert_eq!(
        script.decide_view(&request(), &view).decision,
        Decision::Admit { pool: None }
    );
    moving.0.store(5, Ordering::SeqCst);
    assert_eq!(
        script.decide_view(&request(), &view).decision,
        Decision::Defer { ms: 10 }
    );
    // A pool the live source does not know keeps its sampled numbers.
    let cpu = script_value(&view, r#"state.pools["cpu"].queue_depth"#);
    assert_eq!(cpu, snapshot().pools["cpu"].queue_depth as i64);
}

fn script_value(view: &StateView, expression: &str) -> i64 {
    let source = format!("fn decide(req, state) {{ reject(`${{{expression}}}`) }}");
    match script(&source).decide_view(&request(), view).decision {
        Decision::Reject { reason } => reason.parse().unwrap(),
        other => panic!("{other:?}"),
    }
}
