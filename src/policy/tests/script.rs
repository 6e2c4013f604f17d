//! Scripts evaluated in their sandbox: the decisions they return, the limits that stop them, what
//! fails at compile time.

use super::*;

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

#[test]
fn make_room_names_its_pool_and_optionally_the_bytes_to_free() {
    assert_eq!(
        decide(r#"fn decide(req, state) { make_room("gpu") }"#).decision,
        Decision::MakeRoom {
            pool: "gpu".into(),
            bytes: None
        }
    );
    assert_eq!(
        decide(r#"fn decide(req, state) { make_room(req.pool, 1.5 * 1000) }"#).decision,
        Decision::MakeRoom {
            pool: "gpu".into(),
            bytes: Some(1500)
        }
    );
    let negative = decide(r#"fn decide(req, state) { make_room("gpu", -1) }"#);
    assert!(
        negative
            .error
            .as_ref()
            .is_some_and(|e| e.to_string().contains("make_room(bytes)")),
        "{negative:?}"
    );
    assert!(decide(r#"fn decide(req, state) { make_room("") }"#).error.is_some());
}

#[test]
fn every_evaluation_starts_from_an_empty_scope() {
    // A thread reuses one scope. Run more evaluations, each declaring variables and half of them
    // failing part-way, than the sandbox allows variables at once: leftovers of one evaluation
    // would pile up into the variables limit.
    let compiled = script(
        "fn decide(req, state) { let a = 1; let b = 2; let c = a + b; if req.batch == 2 { admit() } else { c / 0 } }",
    );
    let snapshot = snapshot();
    let mut failing = request();
    failing.batch = 3;
    for i in 0..2 * MAX_VARIABLES {
        if i % 2 == 0 {
            let evaluation = compiled.decide(&request(), &snapshot);
            assert_eq!(evaluation.error, None, "evaluation {i}: {evaluation:?}");
        } else {
            assert_fallback(&compiled.decide(&failing, &snapshot), PolicyErrorKind::Runtime);
        }
    }
}
