//! What a script sees: `req`, `state` and `params` as the contract documents them, the inputs a
//! smoke test builds from the config, and pool load read live from a view built once.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::*;

// ─── inputs ───────────────────────────────────────────────────────────────────────────────

#[test]
fn req_carries_every_contract_field() {
    let evaluation = decide(
        r#"fn decide(req, state) {
            let e = req.estimate;
            let ok = req.id == "req-1" && req.model == "encoder" && req.pool == "gpu" && req.service == "search"
                && req.context_tokens == 128 && req.max_new_tokens == 16 && req.batch == 2
                && req.priority == -3 && req.replayable && req.allow_shrink && req.deadline_ms == 250
                && e.weights_bytes == 1000 && e.context_bytes == 200 && e.workspace_bytes == 30
                && e.total_bytes == 1230 && e.source == "observed"
                && req.dims.seq == 128 && req.dims.batch == 2 && req.dims.len() == 2
                && req.load_bytes == 4000 && req.evictable_bytes == 5000
                && req.len() == 15 && e.len() == 5;
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
            let s = state.services[req.service];
            let services_ok = s.class == "background" && s.priority == 2 && s.running == 1
                && s.concurrency == 4 && s.budget_bytes == 300 && s.memory_bytes.gpu0 == 120
                && s.len() == 6 && state.services.get("chat") == () && state.services.keys() == ["search"];
            let params_ok = state.params.cpu_pool == "cpu" && state.params.reserve_bytes == 67108864
                && state.params.defer_ms == 2000 && (state.params.get("missing") ?? true);
            let m = state.models.speech;
            let on = m.pools.gpu;
            let models_ok = m.priority == 2 && m.residency == "resident" && m.len() == 3
                && on.resident && on.busy == 0 && on.idle_ms == 9000 && on.loaded_ms_ago == 60000
                && on.weights_bytes == 700 && on.host_tier && on.reload_ms == 12 && on.len() == 7
                && state.models.keys() == ["speech"];
            if devices_ok && pools_ok && host_ok && processes_ok && tables_ok && services_ok && params_ok
                && models_ok && state.degraded {
                admit()
            } else {
                reject(`${devices_ok} ${pools_ok} ${host_ok} ${processes_ok} ${tables_ok} ${services_ok} ${params_ok} ${models_ok}`)
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

#[test]
fn every_request_sees_its_own_names_however_many_there_are() {
    // A thread keeps the names it has handed out, up to a bound; past it they are built afresh.
    let compiled = script("fn decide(req, state) { reject(`${req.model}/${req.service}/${req.estimate.source}`) }");
    let snapshot = snapshot();
    for i in 0..200 {
        let mut req = request();
        req.model = format!("model-{i}");
        req.service = format!("service-{}", i % 7);
        let evaluation = compiled.decide(&req, &snapshot);
        assert_eq!(
            evaluation.decision,
            Decision::Reject {
                reason: format!("model-{i}/service-{}/observed", i % 7)
            }
        );
    }
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
            ("classifier", "cpu", 0),
            ("tiny", "cpu", 0),
            ("tiny-embed", "gpu", 0),
            ("tiny-embed", "cpu", 0),
            ("tiny-whisper", "gpu", 0),
            ("tiny-whisper", "cpu", 0)
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

/// What a service runs and holds is read live too; a service the live source does not know
/// keeps its sampled figures.
#[test]
fn services_read_what_they_run_and_hold_live() {
    #[derive(Debug)]
    struct Busy;
    impl LiveLoad for Busy {
        fn pool_load(&self, _pool: &str) -> Option<PoolLoadNow> {
            None
        }
        fn service_now(&self, service: &str) -> Option<crate::policy::ServiceNow> {
            (service == "search").then(|| crate::policy::ServiceNow {
                running: 3,
                memory_bytes: BTreeMap::from([("gpu0".to_string(), 250)]),
            })
        }
    }
    let view = StateView::new(&snapshot()).with_live_load(Arc::new(Busy));
    assert_eq!(script_value(&view, r#"state.services["search"].running"#), 3);
    assert_eq!(script_value(&view, r#"state.services.search.memory_bytes.gpu0"#), 250);
    assert_eq!(script_value(&view, r#"state.services.search.budget_bytes"#), 300);
    let sampled = StateView::new(&snapshot());
    assert_eq!(script_value(&sampled, r#"state.services.search.running"#), 1);
}

fn script_value(view: &StateView, expression: &str) -> i64 {
    let source = format!("fn decide(req, state) {{ reject(`${{{expression}}}`) }}");
    match script(&source).decide_view(&request(), view).decision {
        Decision::Reject { reason } => reason.parse().unwrap(),
        other => panic!("{other:?}"),
    }
}
