//! The service budgets between the policy's decision and the run: a request whose service is at
//! its `concurrency`, over its `device_memory` while its own running requests would free
//! enough, or (a background service's) behind waiting interactive work or a device short of
//! its reserve, waits without holding a worker, bounded by its deadline and by what the
//! policy's deferrals left of the routed pool's `queue.max_wait`; past the bound it gets 429
//! with the reason. One that would go over its `device_memory` whatever finishes is refused
//! with 503. A request let through holds its [`Slot`](crate::serve::service::Slot) until it is
//! answered.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::serve::service::{Ask, HeldBack, Memory, ModelEntry, Service, memory_of};

use super::admit::Admitted;
use super::{DeadlineMiss, Refused, Request, RequestError};

/// How often a waiting request looks again when nothing was given back: a device's headroom
/// and the interactive requests' waiting count change without a notification.
const RECHECK: Duration = Duration::from_millis(20);

/// Wait until `request`'s service lets it run on the pool it was admitted to, needing
/// `estimate_bytes` there, and keep its place until it is answered; or refuse it.
pub(super) async fn enter(
    service: &Service,
    entry: &ModelEntry,
    admitted: &mut Admitted,
    request: &Request,
    estimate_bytes: u64,
) -> Result<(), Refused> {
    let pool = Arc::clone(&admitted.pool);
    let pool = &pool;
    let name = entry.config.service.as_str();
    let device = match memory_of(pool) {
        Some(Memory::Device(device)) => Some(device),
        _ => None,
    };
    // A model the pool does not hold now (nor a model it shares them with) is loaded for this
    // request: its weights count too.
    let loads = device.is_some() && !pool.residency().holds_weights_of(&entry.config.name);
    let weights = if loads { service.weights_on(pool, entry) } else { 0 };
    let started = Instant::now();
    let bound = started + admitted.wait_left;
    let mut counted = false;
    loop {
        // Registered before looking, so a slot given back meanwhile is not missed.
        let changed = service.services.changed().notified();
        let ask = Ask {
            device,
            need_bytes: estimate_bytes.saturating_add(weights),
            interactive_waiting: service.services.interactive_waiting(),
            headroom_short: device.and_then(|d| headroom_short(service, d)),
        };
        let why = match service.services.enter(name, &ask) {
            Ok(slot) => {
                if let Some(slot) = slot {
                    request.progress.hold(Box::new(slot));
                }
                return Ok(());
            }
            Err(HeldBack::Refuse(reason)) => {
                let retry_after = pool.load().estimated_delay;
                return Err(Refused::at(pool, RequestError::Refused { reason, retry_after }));
            }
            Err(HeldBack::Wait(reason, why)) => {
                if !counted {
                    counted = true;
                    service.metrics.service_waits.waited(name, reason);
                }
                why
            }
        };
        let now = Instant::now();
        if request.deadline().is_some_and(|d| d <= now) {
            return Err(Refused::at(pool, RequestError::Deadline(DeadlineMiss::WhileBudgeted)));
        }
        if now >= bound {
            return Err(Refused::at(
                pool,
                RequestError::OverBudget {
                    reason: why,
                    pool: pool.name().to_string(),
                    waited: now - started,
                    retry_after: pool.load().estimated_delay.max(admitted.wait_left),
                },
            ));
        }
        // A request that waits gives up its device's hold (a cold start's, or the room it made):
        // nothing of it runs yet, and other services' cold starts on the device must not wait
        // behind this service's budget.
        drop(admitted.hold.take());
        let until = request.deadline().map_or(bound, |d| d.min(bound)).min(now + RECHECK);
        tokio::select! {
            () = changed => {}
            () = tokio::time::sleep_until(until) => {}
        }
    }
}

/// The device's headroom and the policy's `reserve_bytes`, when the headroom is under it (no
/// reserve configured, or no reading of the device: never).
fn headroom_short(service: &Service, device: &str) -> Option<(u64, u64)> {
    let reserve = super::fits::reserve_bytes(service)?;
    let sample = service.store.latest();
    let headroom = sample.snapshot.devices.get(device)?.headroom_bytes;
    (headroom < reserve).then_some((headroom, reserve))
}
