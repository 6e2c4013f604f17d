//! `make_room(pool)`: unload idle, unpinned models of no higher priority from the pool's
//! device until the request fits, then admit it there.
//!
//! Victims are chosen across every accelerator pool on the device: lower priorities first,
//! then the cheapest to lose, which is the time to load it again times how often it is asked
//! for, per byte freed. If all of them together would not be enough, nothing is unloaded and
//! the policy decides again without the option. Memory counts as free only once a fresh sample
//! of the device shows it back: an arena that keeps freed blocks, or a driver slow to release,
//! must not let the new model in on a promise.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::pool::{Pool, Resident};
use crate::serve::service::{Eviction, ModelEntry, Service};

use crate::core::snapshot::ProviderKind;

/// How long to wait for a device sample to show the evicted memory back.
const MEMORY_BACK_BOUND: Duration = Duration::from_secs(2);

/// Load rate assumed for a model never loaded since the start (file read and session build).
const ASSUMED_LOAD_BYTES_PER_SECOND: f64 = 500e6;

/// Whether `pool` runs on an accelerator of this host (`cuda` or `simulated`): the only pools
/// whose device `make_room` can free (a remote pool's memory is another server's).
pub(super) fn on_local_device(pool: &Pool) -> bool {
    matches!(pool.provider().kind(), ProviderKind::Cuda | ProviderKind::Simulated)
}

/// A model eviction could take, on one pool of the device.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Victim {
    /// The pool holding it.
    pub(super) pool: String,
    /// Model name.
    pub(super) model: String,
    /// Its priority.
    pub(super) priority: i64,
    /// Its weights on that pool.
    pub(super) bytes: u64,
    /// Reload seconds × requests per second ÷ bytes freed: lower goes first.
    pub(super) cost: f64,
}

impl Victim {
    /// `resident` on `pool` as a victim, or `None` when it holds nothing.
    fn of(pool: &str, resident: &Resident) -> Option<Victim> {
        let bytes = resident.weights_bytes;
        if bytes == 0 {
            return None;
        }
        let reload = resident
            .last_load
            .map_or(bytes as f64 / ASSUMED_LOAD_BYTES_PER_SECOND, |d| d.as_secs_f64())
            .max(0.001);
        // How often it is asked for, from how long ago it last was: a model asked for a second
        // ago is likely asked for again soon; one idle for a minute is not.
        let rate = 1.0 / resident.since_request.as_secs_f64().max(1.0);
        Some(Victim {
            pool: pool.to_string(),
            model: resident.model.clone(),
            priority: resident.priority,
            bytes,
            cost: reload * rate / bytes as f64,
        })
    }
}

/// Everything eviction may take on `device` for a request of `requester`'s model now.
pub(super) fn victims(service: &Service, device: &str, requester: &ModelEntry) -> Vec<Victim> {
    let priority = requester.config.priority;
    service
        .pools
        .iter()
        .filter(|p| on_local_device(p) && p.config.device == device)
        .flat_map(|pool| {
            pool.residency()
                .residents()
                .into_iter()
                // Nor a model whose weights the requester's are: they are what it runs on.
                .filter(|r| r.model != requester.config.name && r.evictable_for(priority))
                .filter(|r| !pool.residency().shares_sessions_of(&requester.config.name, &r.model))
                .filter_map(|r| Victim::of(pool.name(), &r))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// What eviction could free on `pool`'s device for a request of `requester`'s model now
/// (`req.evictable_bytes`; 0 on a CPU or remote pool).
pub(super) fn evictable_bytes(service: &Service, pool: &Pool, requester: &ModelEntry) -> u64 {
    let device = pool.config.device.as_str();
    let name = requester.config.name.as_str();
    // On every request: an accelerator that serves no other model has nothing to evict, and
    // finding that out must cost no allocation.
    let others = service
        .pools
        .iter()
        .any(|p| on_local_device(p) && p.config.device == device && p.config.models.iter().any(|m| m != name));
    if !on_local_device(pool) || !others {
        return 0;
    }
    victims(service, device, requester).iter().map(|v| v.bytes).sum()
}

/// The cheapest victims that free at least `shortfall` bytes together: lower priorities first,
/// then lower cost; `None` when all of them are not enough.
pub(super) fn choose(mut victims: Vec<Victim>, shortfall: u64) -> Option<Vec<Victim>> {
    victims.sort_by(|a, b| a.priority.cmp(&b.priority).then(a.cost.total_cmp(&b.cost)));
    let mut freed = 0u64;
    let mut chosen = Vec::new();
    for victim in victims {
        if freed >= shortfall {
            break;
        }
        freed = freed.saturating_add(victim.bytes);
        chosen.push(victim);
    }
    (freed >= shortfall).then_some(chosen)
}

/// The device's headroom in the latest sample.
fn headroom(service: &Service, device: &str) -> u64 {
    service
        .store
        .latest()
        .snapshot
        .devices
        .get(device)
        .map_or(0, |d| d.headroom_bytes)
}

/// Held while a request changes what its device holds (it loads its model's weights, or made
/// room for them) until its first run has ended and a sample shows the result: the next such
/// request on the device then decides on memory as it is, not as it was before this load.
pub(super) type DeviceHold = tokio::sync::OwnedMutexGuard<()>;

/// Take `pool`'s device's hold, waiting at most the pool's `max_wait` (past it the request goes
/// on without: it must not wait for ever on another's slow run), then sample the device.
pub(super) async fn hold_device(service: &Service, pool: &Pool) -> Option<DeviceHold> {
    let lock = service.rooms.lock_for(&pool.config.device);
    let hold = tokio::time::timeout(pool.config.max_wait, lock.lock_owned()).await.ok();
    service.resample_now().await;
    hold
}

/// Make `bytes` of headroom on `pool`'s device for a request of `entry`'s model (`request_id`),
/// under the device's hold (taken into `hold` unless the request has it): the models unloaded,
/// or why no room could be made (nothing was unloaded then, unless a victim's memory did not
/// come back in time).
pub(super) async fn make_room(
    service: &Service,
    entry: &ModelEntry,
    pool: &Arc<Pool>,
    bytes: u64,
    request_id: &str,
    hold: &mut Option<DeviceHold>,
) -> Result<Vec<Eviction>, String> {
    let device = pool.config.device.as_str();
    if hold.is_none() {
        *hold = hold_device(service, pool).await;
    }
    let before = headroom(service, device);
    if bytes <= before {
        return Ok(Vec::new());
    }
    let shortfall = bytes - before;
    let candidates = victims(service, device, entry);
    let available: u64 = candidates.iter().map(|v| v.bytes).sum();
    let Some(chosen) = choose(candidates, shortfall) else {
        return Err(format!(
            "device `{device}` has {before} bytes of headroom, {shortfall} short of {bytes}, and evicting every idle model of no higher priority than `{}` would free only {available}",
            entry.config.name
        ));
    };
    let mut evicted = Vec::new();
    for victim in chosen {
        let Some(holder) = service.pool(&victim.pool).cloned() else {
            continue;
        };
        let model = victim.model.clone();
        // A request for it that arrived since it was chosen keeps it: then fewer bytes come back
        // and the wait below says so.
        let done = tokio::task::spawn_blocking(move || holder.residency().evict(&model))
            .await
            .unwrap_or(false);
        if !done {
            continue;
        }
        let eviction = Eviction {
            at: SystemTime::now(),
            pool: victim.pool,
            device: device.to_string(),
            model: victim.model,
            freed_bytes: victim.bytes,
            for_model: entry.config.name.clone(),
            for_request: request_id.to_string(),
        };
        tracing::info!(pool = %eviction.pool, model = %eviction.model, freed_bytes = eviction.freed_bytes, for_model = %eviction.for_model, request_id, "evicted to make room");
        service.rooms.record(eviction.clone());
        evicted.push(eviction);
    }
    memory_back(service, device, bytes).await.map(|()| evicted)
}

/// Wait until a fresh sample of `device` shows `bytes` of headroom, up to the bound.
async fn memory_back(service: &Service, device: &str, bytes: u64) -> Result<(), String> {
    let until = tokio::time::Instant::now() + MEMORY_BACK_BOUND;
    loop {
        service.resample_now().await;
        let now = headroom(service, device);
        if now >= bytes {
            return Ok(());
        }
        if tokio::time::Instant::now() >= until {
            return Err(format!(
                "device `{device}` shows {now} bytes of headroom {MEMORY_BACK_BOUND:?} after the eviction, short of {bytes}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn victim(model: &str, priority: i64, bytes: u64, cost: f64) -> Victim {
        Victim {
            pool: "gpu".into(),
            model: model.into(),
            priority,
            bytes,
            cost,
        }
    }

    fn names(chosen: Option<Vec<Victim>>) -> Option<Vec<String>> {
        chosen.map(|v| v.into_iter().map(|v| v.model).collect())
    }

    #[test]
    fn lower_priorities_go_first_then_the_cheapest_until_enough_is_free() {
        let all = vec![
            victim("speech", 5, 300, 0.1),
            victim("vision", 1, 200, 9.0),
            victim("embed", 1, 200, 0.5),
        ];
        assert_eq!(names(choose(all.clone(), 150)), Some(vec!["embed".to_string()]));
        assert_eq!(
            names(choose(all.clone(), 350)),
            Some(vec!["embed".to_string(), "vision".to_string()])
        );
        assert_eq!(
            names(choose(all.clone(), 700)),
            Some(vec!["embed".into(), "vision".into(), "speech".into()])
        );
        assert_eq!(names(choose(all, 701)), None, "not enough together: nothing is taken");
        assert_eq!(names(choose(Vec::new(), 0)), Some(Vec::new()));
    }

    #[test]
    fn a_model_asked_for_recently_or_slow_to_load_costs_more_to_lose() {
        let resident = |since_request: u64, last_load: Option<u64>| Resident {
            model: "m".into(),
            priority: 0,
            pinned: false,
            busy: 0,
            since_load: Duration::from_secs(60),
            since_request: Duration::from_secs(since_request),
            min_residency: Duration::ZERO,
            last_load: last_load.map(Duration::from_millis),
            weights_bytes: 1 << 20,
        };
        let cost = |r: &Resident| Victim::of("gpu", r).unwrap().cost;
        assert!(cost(&resident(1, Some(100))) > cost(&resident(60, Some(100))));
        assert!(cost(&resident(10, Some(900))) > cost(&resident(10, Some(100))));
        let empty = Resident {
            weights_bytes: 0,
            ..resident(1, None)
        };
        assert!(Victim::of("gpu", &empty).is_none(), "nothing to free");
    }

    #[test]
    fn pinned_busy_fresh_or_more_important_models_are_never_victims() {
        let base = Resident {
            model: "m".into(),
            priority: 5,
            pinned: false,
            busy: 0,
            since_load: Duration::from_secs(31),
            since_request: Duration::from_secs(10),
            min_residency: Duration::from_secs(30),
            last_load: None,
            weights_bytes: 1 << 20,
        };
        assert!(base.evictable_for(5), "same priority: allowed");
        assert!(!base.evictable_for(4), "never for a lower priority");
        assert!(
            !Resident {
                pinned: true,
                ..base.clone()
            }
            .evictable_for(9)
        );
        assert!(
            !Resident {
                busy: 1,
                ..base.clone()
            }
            .evictable_for(9)
        );
        assert!(
            !Resident {
                since_load: Duration::from_secs(29),
                ..base
            }
            .evictable_for(9),
            "inside min_residency"
        );
    }
}
