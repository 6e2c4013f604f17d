//! The compiled evaluation (`compiled/`) against Rhai's: wherever the compiled one answers,
//! its answer must be Rhai's, for every case the shipped policies are tested with, for generated
//! requests and states that reach every branch of those policies (numbers that overflow
//! included), for every field of `req` and `state`, and for scripts that fail in every way the
//! sandbox knows. And it must answer, not give up, on the paths requests take: the shipped
//! policies' admits, redirects, deferrals and shrinks.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::core::snapshot::EstimateSource;
use crate::policy::cases::{CaseFile, yaml_files};

/// Rhai's answer, after checking the compiled one agrees where it answers; and whether it did.
fn on_both(script: &Script, req: &RequestInfo, view: &StateView, what: &str) -> (Result<Decision, PolicyError>, bool) {
    let rhai = script.run_interpreted(req, view);
    let compiled = script.run_compiled(req, view);
    if let Some(decision) = &compiled {
        assert_eq!(
            script.checked(decision.clone(), view),
            rhai,
            "{what}: the compiled evaluation disagrees with Rhai"
        );
    }
    (rhai, compiled.is_some())
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// The shipped policies with the params their case files give them.
fn shipped() -> Vec<(PathBuf, CaseFile, Script)> {
    let mut out = Vec::new();
    for path in yaml_files(&repo("policies/tests")).expect("policies/tests is readable") {
        let file = CaseFile::load(&path).expect("a case file that parses");
        let policy = file.policy_path(&path);
        let source = std::fs::read_to_string(&policy).expect("the case file's policy");
        let settings = PolicySettings {
            fallback: Decision::Reject {
                reason: FALLBACK.into(),
            },
            params: file.params.clone(),
        };
        let script = Script::compile(&source, &policy.display().to_string(), &settings).expect("compiles");
        out.push((path, file, script));
    }
    assert!(out.len() >= 3, "the three shipped policies' case files");
    out
}

#[test]
fn every_shipped_case_gets_rhais_answer_and_the_common_ones_without_rhai() {
    let (mut compared, mut answered) = (0, 0);
    for (path, file, script) in shipped() {
        for case in &file.cases {
            let mut params = file.params.clone();
            params.extend(case.params.clone());
            let script = script.with_params(&params).expect("the case's params");
            let view = StateView::new(&case.state);
            let what = format!("{}: {}", path.display(), case.name);
            let (answer, compiled) = on_both(&script, &case.request, &view, &what);
            assert_eq!(answer.ok(), case.expect, "{what}");
            compared += 1;
            // Only a rejection explaining the estimate's origin (`switch`, `+=`) is left to Rhai.
            if compiled {
                answered += 1;
            } else {
                assert!(
                    matches!(case.expect, Some(Decision::Reject { .. })),
                    "{what}: left to Rhai"
                );
            }
        }
    }
    assert!(compared >= 97, "{compared} cases compared");
    assert!(
        answered * 4 >= compared * 3,
        "the compiled evaluation answered {answered} of {compared}"
    );
}

/// Every field of `req` and of each kind of record in `state`, read by the compiled evaluation:
/// the same value as Rhai's, and no field Rhai's maps have that it lacks.
#[test]
fn every_field_reads_as_rhai_reads_it() {
    let records = [
        ("req", "req"),
        ("req.estimate", "req.estimate"),
        ("req.dims", "req.dims"),
        ("state.devices.gpu0", "state.devices.gpu0"),
        ("state.pools.gpu", "state.pools.gpu"),
        ("state.pools.cpu", "state.pools[\"cpu\"]"),
        ("state.services.search", "state.services.search"),
        (
            "state.services.search.memory_bytes",
            "state.services.search.memory_bytes",
        ),
        ("state.models.speech", "state.models.speech"),
        ("state.models.speech.pools.gpu", "state.models.speech.pools.gpu"),
        ("state.host", "state.host"),
        ("state.params", "state.params"),
    ];
    let settings = settings(&[
        ("cpu_pool", "cpu".into()),
        ("reserve_bytes", "64MiB".into()),
        ("ratio", 0.5.into()),
        ("strict", true.into()),
    ]);
    let views = [
        StateView::new(&snapshot()),
        StateView::new(&snapshot()).with_live_load(Arc::new(Moving)),
    ];
    for view in &views {
        for (what, path) in records {
            // The record's keys, as Rhai has them.
            let keys = Script::compile(
                &format!("fn decide(req, state) {{ let k = {path}.keys(); k.sort(); reject(k.reduce(|a, b| a + \",\" + b)) }}"),
                "keys.rhai",
                &settings,
            )
            .expect("compiles");
            let Ok(Decision::Reject { reason }) = keys.run_interpreted(&request(), view) else {
                panic!("{what}: the keys");
            };
            for key in reason.split(',').filter(|k| !k.is_empty()) {
                let read = Script::compile(
                    &format!("fn decide(req, state) {{ let v = {path}[\"{key}\"]; reject(`{key}=${{v}}`) }}"),
                    "field.rhai",
                    &settings,
                )
                .expect("compiles");
                let (answer, compiled) = on_both(&read, &request(), view, &format!("{what}.{key}"));
                assert!(answer.is_ok(), "{what}.{key}: {answer:?}");
                // Nested records and floats print in Rhai's own way, which the compiled
                // evaluation leaves to Rhai.
                let printed_by_rhai = matches!(
                    (what, key),
                    ("req", "estimate" | "dims")
                        | ("state.services.search", "memory_bytes")
                        | ("state.models.speech", "pools")
                        | ("state.params", "ratio")
                );
                assert_eq!(
                    compiled, !printed_by_rhai,
                    "{what}.{key} answered by the compiled evaluation"
                );
            }
        }
    }
}

/// Live pool and service figures that differ from the snapshot's.
#[derive(Debug)]
struct Moving;

impl LiveLoad for Moving {
    fn pool_load(&self, pool: &str) -> Option<PoolLoadNow> {
        (pool == "gpu").then_some(PoolLoadNow {
            queue_depth: 11,
            queue_oldest_age_ms: 12,
            inflight: 13,
            alloc_failures_recent: 14,
            est_delay_ms: 15,
            breaker: BreakerState::HalfOpen,
            sequences_waiting: 16,
            sequences_running: 17,
            kv_cache_bytes: 18,
        })
    }

    fn service_now(&self, service: &str) -> Option<ServiceNow> {
        (service == "search").then(|| ServiceNow {
            running: 19,
            memory_bytes: BTreeMap::from([("gpu0".to_string(), 20)]),
        })
    }
}

/// Scripts that fail, or come close, in each way the sandbox and the language know: wherever the
/// compiled evaluation answers, it answers as Rhai does.
#[test]
fn scripts_that_fail_fail_alike() {
    let bodies = [
        "let x = 1;\n    x / 0",
        "9223372036854775807 + req.batch; admit()",
        "-9223372036854775807 - req.batch; admit()",
        "defer(9223372036854775807 * req.batch)",
        "defer(req.batch % 0)",
        "let f = req.batch.to_float() / 0.0; defer(f)",
        "defer((1e30).to_int())",
        "defer((req.batch.to_float() * 1e300 * 1e300).to_int())",
        "if req.batch { admit() } else { defer(1) }",
        "if req.pool > 3 { admit() } else { defer(1) }",
        "reject(req.pool + 1)",
        "defer(req.batch.floor())",
        "if req.batch && true { admit() } else { defer(1) }",
        "if !req.batch { admit() } else { defer(1) }",
        "defer(-req.batch)",
        "req.estimate.total_byte",
        "state.pools[\"nope\"]",
        "state.pools.gpu.no_such_field",
        "state.processes[7]",
        "state.params.missing",
        "let m = #{a: 1}; m.b",
        "defer(-5)",
        "defer(-0.5)",
        "shrink_context(0)",
        "shrink_context(req.batch - 2)",
        "redirect(\"\")",
        "admit(\" \")",
        "reject(\"\")",
        "redirect(\"cpuu\")",
        "admit(req.model)",
        "make_room(\"gpu\", -1)",
        "make_room(req.pool, 1.5 * 1000)",
        "42",
        "\"admit\"",
        "()",
        "throw \"no\"",
        "try { throw \"inner\" } catch (e) { reject(`caught ${e}`) }",
        "loop { }",
        "let s = \"x\"; loop { s += s; }",
        "let s = \"x\"; s = s + s; reject(s + s)",
        "let a = []; for i in 0..2000 { a.push(i); } admit()",
        "down(0)",
        "let n = 0; while n < 10 { n += 1; } defer(n)",
        "let total = 0; for p in state.processes { total += p.used_bytes; } defer(total)",
        "let big = state.processes.to_array().filter(|p| p.used_bytes > 60); defer(big.len())",
        "switch req.pool { \"gpu\" => admit(), \"cpu\" => defer(1), _ => reject(\"other\") }",
        "print(`pool ${req.pool}`); debug(state.pools.gpu); admit()",
        "let x = if req.batch > 1 { return defer(7); } else { 1 }; defer(x)",
        "const LIMIT = 3; if req.batch < LIMIT { defer(LIMIT) } else { admit() }",
        "let x = 1; { let x = 5; } defer(x)",
        "let x = 1; { x = 5; } defer(x)",
        "defer(twice(req.batch) + twice(1))",
        "defer(state.params.get(\"nope\") ?? 9)",
        "if \"gpu\" in state.pools && !(\"x\" in state.pools) { defer(state.pools.len()) } else { admit() }",
        "defer(state.services.search.memory_bytes.get(\"gpu0\") ?? 0)",
        "let s = state.services.get(\"none\") ?? #{budget_bytes: 4}; defer(s.budget_bytes)",
        "if 0.1 + 0.2 == 0.3 && 1 < 1.0000000000000002 { defer(1) } else { defer(2) }",
        "if 3 == 3.0 && 2.5 >= 2 && req.pool == \"gpu\" && req.pool != \"cpu\" { defer(1) } else { defer(2) }",
        "defer(7 / 2 + 7 % 3 - (-7) / 2)",
        "reject(`${req.batch} ${req.replayable} ${req.pool} ${state.degraded}`)",
        "reject(`${1.5}`)",
        "defer(req.id.len() + \"é\".len())",
        "if \"processes\" in state && \"degraded\" in state { defer(1) } else { defer(2) }",
        "if state.get(\"processes\") != () { defer(1) } else { defer(2) }",
        "if \"limits\" in state.params { defer(1) } else { defer(2) }",
    ];
    // A param that is an array: there, though the compiled evaluation cannot read it.
    let settings = settings(&[("limits", serde_json::json!([1, 2]))]);
    let source = |body: &str| {
        format!("fn down(n) {{ down(n + 1) }}\nfn twice(n) {{ n * 2 }}\nfn decide(req, state) {{\n    {body}\n}}")
    };
    // More variables than the sandbox allows (Rhai refuses the 257th `let`).
    let crowded: String = (0..300).map(|i| format!("let v{i} = {i}; ")).collect::<String>() + "defer(v299)";
    let view = StateView::new(&snapshot());
    let (mut failed, mut answered) = (0, 0);
    for body in bodies.iter().copied().chain([crowded.as_str()]) {
        let script = Script::compile(&source(body), "test.rhai", &settings).expect("compiles");
        let (answer, compiled) = on_both(&script, &request(), &view, body);
        failed += usize::from(answer.is_err());
        answered += usize::from(compiled);
    }
    assert!(failed >= 30, "most of these fail: {failed}");
    assert!(answered >= 15, "the compiled evaluation answered {answered}");
}

fn sizes() -> impl Strategy<Value = u64> {
    prop_oneof![
        8 => 0u64..3000,
        1 => Just(0u64),
        1 => Just(i64::MAX as u64),
        1 => Just(u64::MAX),
    ]
}

fn breaker() -> impl Strategy<Value = BreakerState> {
    prop_oneof![
        Just(BreakerState::Closed),
        Just(BreakerState::HalfOpen),
        Just(BreakerState::Open)
    ]
}

fn source() -> impl Strategy<Value = EstimateSource> {
    prop_oneof![
        Just(EstimateSource::Profile),
        Just(EstimateSource::Observed),
        Just(EstimateSource::Config),
        Just(EstimateSource::KvCache),
        Just(EstimateSource::WeightsOnly),
    ]
}

fn provider() -> impl Strategy<Value = ProviderKind> {
    prop_oneof![
        Just(ProviderKind::Simulated),
        Just(ProviderKind::Cuda),
        Just(ProviderKind::Cpu),
        Just(ProviderKind::Remote),
    ]
}

/// A request and a state around the fixtures, with every number the shipped policies branch on
/// drawn afresh.
fn situation() -> impl Strategy<Value = (RequestInfo, Snapshot)> {
    (
        (sizes(), sizes(), sizes(), sizes(), sizes(), source()),
        (
            sizes(),
            0u64..600,
            any::<bool>(),
            prop_oneof![Just(0u64), 1u64..400],
            prop_oneof![Just(0u64), 1u64..600],
        ),
        (sizes(), sizes(), sizes(), breaker(), breaker(), provider()),
        (
            0u64..5,
            0u64..4,
            0u64..200,
            prop_oneof![Just(0u64), 1u64..300],
            0u64..3,
            sizes(),
        ),
        (
            any::<bool>(),
            prop_oneof![Just(0u64), 1u64..4000],
            0u64..4,
            any::<bool>(),
        ),
    )
        .prop_map(|(estimate, request_numbers, memory, health, service)| {
            let (context, workspace, weights, load_bytes, evictable, source) = estimate;
            let (total, context_tokens, allow_shrink, deadline, max_context) = request_numbers;
            let (headroom, available, reserve, gpu_breaker, cpu_breaker, gpu_provider) = memory;
            let (queue, inflight, cpu_delay, gpu_delay, failures, active) = health;
            let (on_cpu, budget, running, no_context) = service;
            let mut req = request();
            req.pool = if on_cpu { "cpu".into() } else { "gpu".into() };
            req.context_tokens = if no_context { 0 } else { context_tokens };
            req.allow_shrink = allow_shrink;
            req.deadline_ms = deadline;
            req.estimate = Estimate {
                weights_bytes: weights,
                context_bytes: context,
                workspace_bytes: workspace,
                total_bytes: total,
                source,
            };
            req.load_bytes = load_bytes;
            req.evictable_bytes = evictable;
            let mut state = snapshot();
            let device = state.devices.get_mut("gpu0").expect("fixture");
            device.headroom_bytes = headroom;
            device.active_bytes = active;
            state.host.mem_available_bytes = available;
            state.host.reserve_bytes = reserve;
            let gpu = state.pools.get_mut("gpu").expect("fixture");
            gpu.breaker = gpu_breaker;
            gpu.provider = gpu_provider;
            gpu.queue_depth = queue;
            gpu.inflight = inflight;
            gpu.est_delay_ms = gpu_delay;
            gpu.max_context = max_context;
            gpu.alloc_failures_recent = failures;
            let cpu = state.pools.get_mut("cpu").expect("fixture");
            cpu.breaker = cpu_breaker;
            cpu.est_delay_ms = cpu_delay;
            cpu.max_context = max_context / 2;
            let search = state.services.get_mut("search").expect("fixture");
            search.budget_bytes = budget;
            search.running = running;
            (req, state)
        })
}

thread_local! {
    static SHIPPED: Vec<(PathBuf, CaseFile, Script)> = shipped();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn the_shipped_policies_answer_as_rhai_does(
        (req, state) in situation(),
        reserve in sizes(),
        pressure in 0u64..500,
        live in any::<bool>(),
    ) {
        let view = match live {
            true => StateView::new(&state).with_live_load(Arc::new(Moving)),
            false => StateView::new(&state),
        };
        SHIPPED.with(|shipped| {
            for (path, file, script) in shipped {
                let mut params = file.params.clone();
                params.insert("reserve_bytes".into(), reserve.into());
                params.insert("pressure_bytes".into(), pressure.into());
                let script = script.with_params(&params).expect("params");
                let (answer, compiled) = on_both(&script, &req, &view, &format!("{}: {req:?}", path.display()));
                // It leaves to Rhai only errors and rejections that explain the estimate.
                if !compiled {
                    assert!(answer.is_err() || matches!(answer, Ok(Decision::Reject { .. })), "{}: {answer:?}", path.display());
                }
            }
        });
    }
}
