//! `/status` `models`, `evictions` and `speech`: where each model's sessions (and each of its
//! components) are loaded now, what `make_room` unloaded for whom, and what each speech model
//! transcribed where.

use std::time::{Duration, SystemTime};

use crate::config::Provider;
use crate::protocol::status::{ComponentStatus, EvictionStatus, ModelOnPool, ModelStatus, SpeechStatus};
use crate::serve::service::Service;

/// Every configured model, each pool serving it.
pub(super) fn models(service: &Service) -> Vec<ModelStatus> {
    let now = SystemTime::now();
    service
        .models
        .iter()
        .map(|entry| {
            let config = &entry.config;
            let pools: Vec<ModelOnPool> = service
                .pools
                .iter()
                .filter(|p| p.serves(&config.name))
                .map(|pool| {
                    let state = pool.residency().model_state(&config.name);
                    let remote = matches!(pool.config.provider, Provider::Remote(_));
                    ModelOnPool {
                        pool: pool.name().to_string(),
                        resident: state.resident,
                        loaded_unix: state
                            .since_load
                            .filter(|_| state.resident)
                            .map(|age| unix_seconds(now.checked_sub(age).unwrap_or(now))),
                        idle_ms: (!remote).then(|| millis(state.since_request)),
                        running: state.running,
                        queued: state.queued,
                        weights_bytes: state.weights_bytes,
                        shares_weights_of: state.shares_weights_of,
                    }
                })
                .collect();
            // Every component of a model is loaded with it today; each says where it is, so
            // that one held apart from the rest (on another pool, or only while it runs) can.
            let resident: Vec<String> = pools.iter().filter(|p| p.resident).map(|p| p.pool.clone()).collect();
            let components = entry
                .components
                .iter()
                .map(|c| ComponentStatus {
                    name: c.name.to_string(),
                    files: c.files.clone(),
                    weights_bytes: c.weights_bytes,
                    resident: resident.clone(),
                })
                .collect();
            ModelStatus {
                name: config.name.clone(),
                service: config.service.clone(),
                priority: config.priority,
                residency: config.residency.label().to_string(),
                fallback_model: config.fallback_model.clone(),
                pools,
                components,
            }
        })
        .collect()
}

/// Every speech model on each pool serving it, in config order: what the speech metrics
/// counted of it there.
pub(super) fn speech(service: &Service) -> Vec<SpeechStatus> {
    let metrics = &service.metrics.speech;
    service
        .models
        .iter()
        .filter(|entry| entry.kind.speech().is_some())
        .flat_map(|entry| {
            let model = &entry.config.name;
            service.pools.iter().filter(|p| p.serves(model)).map(move |pool| {
                let totals = metrics.totals(model, pool.name());
                SpeechStatus {
                    model: model.clone(),
                    pool: pool.name().to_string(),
                    transcriptions: totals.transcriptions,
                    audio_seconds: totals.audio_seconds,
                    real_time_factor: totals.mean_real_time_factor(),
                }
            })
        })
        .collect()
}

/// The recent evictions, newest first.
pub(super) fn evictions(service: &Service) -> Vec<EvictionStatus> {
    service
        .rooms
        .recent()
        .into_iter()
        .map(|e| EvictionStatus {
            at_unix: unix_seconds(e.at),
            pool: e.pool,
            device: e.device,
            model: e.model,
            freed_bytes: e.freed_bytes,
            for_model: e.for_model,
            for_request: e.for_request,
        })
        .collect()
}

/// Whole seconds since the Unix epoch (0 before it).
pub(super) fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
