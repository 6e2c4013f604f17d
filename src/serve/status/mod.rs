//! The server's state as `/status` reports it (JSON for tools and the status page): its pools,
//! devices, services, policy and degraded mode here, each model's residency, evictions and
//! speech totals in `models.rs`.

mod models;

use self::models::unix_seconds;
use crate::core::snapshot::DeviceClass;
use crate::pool::{Availability, Pool};
use crate::protocol::status::{
    ArenaStatus, DegradedStatus, DeviceStatus, FallbackStatus, HostTierStatus, PoolAvailability, PoolStatus,
    ServiceStatus, ServingPolicy, StatusReport,
};
use crate::serve::service::Service;
use std::time::SystemTime;

impl Service {
    /// The server's state now, as `/status` says it: the server started at `started` and is
    /// `shutting_down` or not.
    pub fn status_report(&self, started: SystemTime, shutting_down: bool) -> StatusReport {
        report(self, started, shutting_down)
    }

    /// The policy serving now: `/status`'s `policy`, and the answer to a reload.
    pub fn serving_policy(&self) -> ServingPolicy {
        policy_status(self)
    }
}

/// The server's state now, as `/status` says it.
fn report(service: &Service, started: SystemTime, shutting_down: bool) -> StatusReport {
    let sample = service.store.latest();
    let devices = sample
        .snapshot
        .devices
        .iter()
        .map(|(name, memory)| {
            let simulated = service.simulated_device(name);
            let device = DeviceStatus {
                memory: memory.clone(),
                simulated: simulated.is_some(),
                pressure_bytes: simulated.map(|sim| sim.pressure()),
            };
            (name.clone(), device)
        })
        .collect();
    StatusReport {
        host_tier: service.tier.as_ref().map(|tier| HostTierStatus {
            bytes: tier.bytes(),
            budget_bytes: tier.budget(),
            models: tier.models(),
        }),
        version: env!("CARGO_PKG_VERSION").to_string(),
        onnxruntime: service.runtime_version.clone(),
        config: service.config.source.clone(),
        started_unix: unix_seconds(started),
        shutting_down,
        degraded: match service.degraded.now() {
            Some(now) => DegradedStatus {
                active: true,
                reason: Some(now.reason),
                cause: Some(now.cause.label().to_string()),
                since_unix: Some(unix_seconds(now.since)),
                fallbacks: fallbacks(service),
            },
            None => DegradedStatus::default(),
        },
        pools: service.pools.iter().map(|p| pool_status(service, p)).collect(),
        devices,
        host: sample.snapshot.host.clone(),
        processes: sample.snapshot.processes.clone(),
        sample_age_ms: sample.taken_at.map(|t| t.elapsed().as_millis() as u64),
        policy: policy_status(service),
        recent_decisions: service.decisions.list(),
        models: models::models(service),
        evictions: models::evictions(service),
        services: services(service, &sample.snapshot),
        speech: models::speech(service),
    }
}

/// Every service with its budgets, what it runs and what it holds on each device.
fn services(service: &Service, snapshot: &crate::core::snapshot::Snapshot) -> Vec<ServiceStatus> {
    service
        .services
        .configs()
        .map(|s| {
            let mut memory = service.services.memory_or_seen(&s.name, snapshot);
            // A service whose models run here shows the devices of the pools serving them, not
            // every device at 0; another runtime's shows where its processes were seen.
            let devices = service_devices(service, &s.name);
            if !devices.is_empty() {
                memory.retain(|device, _| devices.contains(device.as_str()));
            }
            ServiceStatus {
                name: s.name.clone(),
                class: s.class,
                priority: s.priority,
                configured: s.configured,
                device_memory_budget_bytes: s.device_memory,
                concurrency: s.concurrency,
                running: service.services.running(&s.name),
                memory,
            }
        })
        .collect()
}

/// The devices of the pools that serve a model of service `name` (host pools' included, which
/// no service memory is kept for); empty when no model here is of that service.
fn service_devices<'a>(service: &'a Service, name: &str) -> std::collections::BTreeSet<&'a str> {
    service
        .models
        .iter()
        .filter(|m| m.config.service == name)
        .flat_map(|m| service.pools.iter().filter(move |p| p.serves(&m.config.name)))
        .map(|p| p.config.device.as_str())
        .collect()
}

fn pool_status(service: &Service, p: &Pool) -> PoolStatus {
    let load = p.load();
    let (state, reason) = match p.availability() {
        Availability::Ready if p.is_ready() => (PoolAvailability::Ready, None),
        Availability::Ready => (PoolAvailability::Stopping, None),
        Availability::Unavailable(r) => (PoolAvailability::Unavailable, Some(r)),
    };
    PoolStatus {
        name: p.name().to_string(),
        provider: p.provider().kind(),
        device: p.config.device.clone(),
        device_kind: p.device_kind,
        simulated: p.device_kind == DeviceClass::Simulated,
        state,
        reason,
        models: p.config.models.clone(),
        workers: p.config.workers,
        queue_depth: load.queue_depth,
        queue_capacity: p.config.queue_capacity,
        queue_oldest_age_ms: load.oldest_age.as_millis() as u64,
        inflight: load.inflight,
        estimated_delay_ms: load.estimated_delay.as_millis() as u64,
        breaker: p.health().breaker_state(),
        breaker_reason: p.health().breaker_tripped(),
        max_context: p.config.max_context,
        fallback: p.config.fallback.clone(),
        alloc_failures_recent: p.health().alloc_failures_recent(),
        arena: crate::telemetry::exporter::pool_arena(p, &service.simulated).map(ArenaStatus::from),
        isolation: match p.config.isolation {
            crate::config::Isolation::Process => "process",
            crate::config::Isolation::Thread => "thread",
        }
        .into(),
        worker_pid: p.supervisor().worker_pid(),
        cpus: p.config.cpus.as_ref().map(ToString::to_string),
    }
}

/// Where work goes while degraded: each configured `fallback`, with the limits a redirected
/// request meets there and the delay a new one should expect (queue position × recent run time).
fn fallbacks(service: &Service) -> Vec<FallbackStatus> {
    service
        .pools
        .iter()
        .filter_map(|from| {
            let to = service.pool(from.config.fallback.as_deref()?)?;
            let load = to.load();
            Some(FallbackStatus {
                from: from.name().to_string(),
                pool: to.name().to_string(),
                max_context: to.config.max_context,
                concurrency: to.config.workers,
                queue_capacity: to.config.queue_capacity,
                queue_position: load.queue_depth + load.inflight + 1,
                estimated_delay_ms: load.estimated_delay.as_millis() as u64,
            })
        })
        .collect()
}

/// The policy serving now: `/status`'s `policy`, and the answer to a reload.
fn policy_status(service: &Service) -> ServingPolicy {
    let status = service.policy.status();
    ServingPolicy {
        path: status.origin,
        source: match &service.config.policy.source {
            crate::config::PolicySource::File(_) => "file".to_string(),
            builtin @ crate::config::PolicySource::Builtin(_) => builtin.to_string(),
        },
        sha256: status.sha256,
        loaded_at_unix: unix_seconds(status.loaded_at),
        cases: service.policy.current().cases,
        last_error: status.last_error,
        fallback: service.config.policy.fallback.clone(),
    }
}
