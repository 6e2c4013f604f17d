//! Trying a script once before it is trusted. Compiling finds syntax errors and undefined
//! variables, but a misspelt property (`req.priorty`) or a param the config lacks only fails
//! when `decide` runs, and then it fails on every request. So `serve` (on its first real
//! snapshot) and `policy check` (on inputs built from a config, without ONNX Runtime) evaluate
//! the script once per model and pool serving it, with [`smoke_test`].

use std::collections::BTreeMap;

use crate::config::{Config, DeviceKind, ModelConfig, PoolConfig};
use crate::core::snapshot::{
    DeviceState, Estimate, EstimateSource, HostState, PoolState, RequestInfo, ServiceState, Snapshot,
};
use crate::runtime::estimate::MemoryProfile;

use super::script::{PolicyError, Script};
use super::values::StateView;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Context length of a representative request for a model with a context axis.
pub const SMOKE_CONTEXT_TOKENS: u64 = 128;

/// A script failed on a representative request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{error} (deciding for model `{model}` on pool `{pool}`)")]
pub struct SmokeError {
    /// The request's model.
    pub model: String,
    /// The request's pool.
    pub pool: String,
    /// What went wrong, located as `origin:line:col` when the position is known.
    pub error: PolicyError,
}

/// Evaluate `script` once for each of `requests` against `snapshot`; the first request it
/// fails on (a run-time error, a sandbox limit, a value that is not a valid decision) is the
/// error. The decisions themselves are not judged: any decision is a working script.
pub fn smoke_test(script: &Script, requests: &[RequestInfo], snapshot: &Snapshot) -> Result<(), SmokeError> {
    let view = StateView::new(snapshot);
    for req in requests {
        if let Some(error) = script.decide_view(req, &view).error {
            return Err(SmokeError {
                model: req.model.clone(),
                pool: req.pool.clone(),
                error,
            });
        }
    }
    Ok(())
}

/// One request per model of `config` and pool serving it (only pools for which `serves` is
/// true): batch 1, replayable, [`SMOKE_CONTEXT_TOKENS`] of context when the model has a
/// context axis (else 0), and `estimate(model, context_tokens)`.
pub fn smoke_requests(
    config: &Config,
    serves: impl Fn(&PoolConfig) -> bool,
    estimate: impl Fn(&ModelConfig, u64) -> Estimate,
) -> Vec<RequestInfo> {
    let mut requests = Vec::new();
    for model in &config.models {
        let tokens = if model.context.is_some() {
            SMOKE_CONTEXT_TOKENS
        } else {
            0
        };
        for pool in config
            .pools
            .iter()
            .filter(|p| p.models.contains(&model.name) && serves(p))
        {
            requests.push(RequestInfo {
                id: "smoke-test".into(),
                model: model.name.clone(),
                pool: pool.name.clone(),
                service: model.service.clone(),
                context_tokens: tokens,
                batch: 1,
                replayable: true,
                estimate: estimate(model, tokens),
                ..RequestInfo::default()
            });
        }
    }
    requests
}

/// What a request for `model` is estimated to need without loading it: its configured
/// `memory_profile`, or 1 MiB of weights and 1 MiB of context when it has none (the real profile
/// is measured only when `serve` loads the model).
pub fn configured_estimate(model: &ModelConfig, context_tokens: u64) -> Estimate {
    match &model.profile {
        // Without the model's signature its axes are named by position; the numbers are the
        // same as `serve` computes from the same profile.
        Some(p) => {
            let unread = crate::runtime::onnx::ModelSignature {
                inputs: Vec::new(),
                outputs: Vec::new(),
            };
            MemoryProfile::configured(p, MIB, model.context.as_ref(), &unread).estimate_tokens(context_tokens, 1)
        }
        None => Estimate {
            weights_bytes: MIB,
            context_bytes: MIB,
            workspace_bytes: 0,
            total_bytes: 2 * MIB,
            source: EstimateSource::Profile,
        },
    }
}

/// A plausible state for `config` without sampling anything: every device half used (NVIDIA
/// ones taken as 16 GiB), every pool idle with its breaker closed, 8 of 16 GiB of host memory
/// available with the configured reserve, no other processes.
pub fn configured_snapshot(config: &Config) -> Snapshot {
    let devices = config
        .devices
        .iter()
        .map(|d| {
            let total = match d.kind {
                DeviceKind::Simulated { capacity } => capacity,
                DeviceKind::Nvidia { .. } => 16 * GIB,
            };
            let (used, reserved, active) = (total / 2, total / 4, total / 8);
            let state = DeviceState {
                kind: match d.kind {
                    DeviceKind::Simulated { .. } => crate::core::snapshot::DeviceClass::Simulated,
                    DeviceKind::Nvidia { .. } => crate::core::snapshot::DeviceClass::Nvml,
                },
                total_bytes: total,
                used_bytes: used,
                free_bytes: total - used,
                reserved_bytes: reserved,
                active_bytes: active,
                headroom_bytes: total - used + reserved - active,
            };
            (d.name.clone(), state)
        })
        .collect();
    let pools = config
        .pools
        .iter()
        .map(|p| {
            let state = PoolState {
                provider: p.provider.kind(),
                device: p.device.clone(),
                breaker: crate::core::snapshot::BreakerState::Closed,
                concurrency: p.workers as u64,
                ..PoolState::default()
            };
            (p.name.clone(), state)
        })
        .collect();
    Snapshot {
        devices,
        pools,
        host: HostState {
            mem_available_bytes: 8 * GIB,
            mem_total_bytes: 16 * GIB,
            reserve_bytes: config.host_reserve,
        },
        processes: Vec::new(),
        degraded: false,
        services: configured_services(config),
        models: config
            .models
            .iter()
            .map(|m| {
                let on = crate::core::snapshot::ModelOnPoolState {
                    resident: m.residency.loaded_at_start(),
                    ..Default::default()
                };
                let pools = config
                    .pools
                    .iter()
                    .filter(|p| p.models.contains(&m.name))
                    .map(|p| (p.name.clone(), on.clone()))
                    .collect();
                let state = crate::core::snapshot::ModelState {
                    priority: m.priority,
                    residency: m.residency.label().to_string(),
                    pools,
                };
                (m.name.clone(), state)
            })
            .collect(),
    }
}

/// Every service of `config` as `state.services` shows it with nothing running and nothing
/// held: its class, priority and budgets (0 where it has none).
pub fn configured_services(config: &Config) -> BTreeMap<String, ServiceState> {
    config
        .services
        .iter()
        .map(|s| {
            let state = ServiceState {
                class: s.class.label().to_string(),
                priority: s.priority,
                concurrency: s.concurrency.map_or(0, |c| c as u64),
                budget_bytes: s.device_memory.unwrap_or(0),
                ..ServiceState::default()
            };
            (s.name.clone(), state)
        })
        .collect()
}
