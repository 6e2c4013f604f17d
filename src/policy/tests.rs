//! Policy scripts, hot reload, test-case runner and CLI: plain data in, plain data out; no GPU,
//! no ONNX Runtime, no sleeps. This file holds the fixtures the files below share.
//!
//! The test scaffolding (`crate::testing`) is imported here for the files below: this file is the
//! one `tests/it/layering.rs` recognises as test code, by its name.

mod evaluators;
mod handle;
mod script;
mod values;

use std::collections::BTreeMap;

use super::*;
use crate::core::snapshot::{
    BreakerState, Decision, DeviceClass, DeviceState, Estimate, HostState, PoolState, ProcessState, ProviderKind,
    RequestInfo, ServiceState, Snapshot,
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
        service: "search".into(),
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
            source: crate::core::snapshot::EstimateSource::Observed,
        },
        dims: BTreeMap::from([("batch".into(), 2), ("seq".into(), 128)]),
        load_bytes: 4000,
        evictable_bytes: 5000,
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
        services: BTreeMap::from([(
            "search".to_string(),
            ServiceState {
                class: "background".into(),
                priority: 2,
                running: 1,
                concurrency: 4,
                budget_bytes: 300,
                memory_bytes: BTreeMap::from([("gpu0".to_string(), 120)]),
            },
        )]),
        models: BTreeMap::from([(
            "speech".into(),
            crate::core::snapshot::ModelState {
                priority: 2,
                residency: "resident".into(),
                pools: BTreeMap::from([(
                    "gpu".into(),
                    crate::core::snapshot::ModelOnPoolState {
                        resident: true,
                        busy: 0,
                        idle_ms: 9000,
                        loaded_ms_ago: 60000,
                        weights_bytes: 700,
                        host_tier: true,
                        reload_ms: 12,
                    },
                )]),
            },
        )]),
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
