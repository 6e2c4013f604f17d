//! `/status` (JSON for tools and the status page) and the status page itself.

use super::state::AppState;
use crate::core::snapshot::DeviceClass;
use crate::pool::Availability;
use crate::serve::service::Service;
use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use serde_json::{Map, Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

/// `GET /`: a status page for people, served from the binary; it polls `/status`.
pub(super) async fn status_page() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        include_str!("status.html"),
    )
}

pub(super) async fn status(State(state): State<Arc<AppState>>) -> Json<Value> {
    let service = &state.service;
    let sample = service.store.latest();
    let pools: Vec<Value> = service
        .pools
        .iter()
        .map(|p| {
            let load = p.load();
            let (state_name, reason) = match p.availability() {
                Availability::Ready if p.is_ready() => ("ready", None),
                Availability::Ready => ("stopping", None),
                Availability::Unavailable(r) => ("unavailable", Some(r)),
            };
            let arena = crate::telemetry::exporter::pool_arena(p, &service.simulated).map(|s| {
                json!({"reserved_bytes": s.reserved_bytes, "active_bytes": s.active_bytes,
                       "peak_active_bytes": s.peak_active_bytes, "limit_bytes": s.limit_bytes,
                       "extensions": s.extensions, "shrinkages": s.shrinkages})
            });
            json!({
                "name": p.name(),
                "provider": p.provider().label(),
                "device": p.config.device,
                "device_kind": p.device_kind,
                "simulated": p.device_kind == DeviceClass::Simulated,
                "state": state_name,
                "reason": reason,
                "models": p.config.models,
                "workers": p.config.workers,
                "queue_depth": load.queue_depth,
                "queue_capacity": p.config.queue_capacity,
                "queue_oldest_age_ms": load.oldest_age.as_millis() as u64,
                "inflight": load.inflight,
                "estimated_delay_ms": load.estimated_delay.as_millis() as u64,
                "breaker": p.breaker_state().label(),
                "breaker_reason": p.breaker_tripped(),
                "max_context": p.config.max_context,
                "fallback": p.config.fallback,
                "alloc_failures_recent": p.alloc_failures_recent(),
                "arena": arena,
            })
        })
        .collect();
    let devices: Map<String, Value> = sample
        .snapshot
        .devices
        .iter()
        .map(|(name, d)| {
            let mut value = json!(d);
            if let Some(sim) = service.simulated_device(name) {
                value["simulated"] = json!(true);
                value["pressure_bytes"] = json!(sim.pressure());
            }
            (name.clone(), value)
        })
        .collect();
    let started = state
        .started
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "onnxruntime": service.runtime_version,
        "config": service.config.source,
        "started_unix": started,
        "shutting_down": state.shutting_down.load(Ordering::SeqCst),
        "degraded": match service.degraded.now() {
            Some(now) => json!({"active": true, "reason": now.reason, "cause": now.cause.label(),
                                "since_unix": unix_seconds(now.since),
                                "fallbacks": fallbacks(service)}),
            None => json!({"active": false, "reason": null, "cause": null, "since_unix": null,
                           "fallbacks": []}),
        },
        "pools": pools,
        "devices": devices,
        "host": sample.snapshot.host,
        "processes": sample.snapshot.processes,
        "sample_age_ms": sample.taken_at.map(|t| t.elapsed().as_millis() as u64),
        "policy": policy_status(service),
        "recent_decisions": service.decisions.list(),
    }))
}

/// Where work goes while degraded: each configured `fallback`, with the limits a redirected
/// request meets there and the delay a new one should expect (queue position × recent run time).
pub(super) fn fallbacks(service: &Service) -> Vec<Value> {
    service
        .pools
        .iter()
        .filter_map(|from| {
            let to = service.pool(from.config.fallback.as_deref()?)?;
            let load = to.load();
            Some(json!({
                "from": from.name(),
                "pool": to.name(),
                "max_context": to.config.max_context,
                "concurrency": to.config.workers,
                "queue_capacity": to.config.queue_capacity,
                "queue_position": load.queue_depth + load.inflight + 1,
                "estimated_delay_ms": load.estimated_delay.as_millis() as u64,
            }))
        })
        .collect()
}

pub(super) fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub(super) fn policy_status(service: &Service) -> Value {
    let status = service.policy.status();
    json!({
        "path": status.origin,
        "source": match &service.config.policy.source {
            crate::config::PolicySource::File(_) => "file".to_string(),
            crate::config::PolicySource::Builtin(name) => format!("builtin:{name}"),
        },
        "sha256": status.sha256,
        "loaded_at_unix": unix_seconds(status.loaded_at),
        "cases": service.policy.current().cases,
        "last_error": status.last_error,
        "fallback": service.config.policy.fallback,
    })
}
