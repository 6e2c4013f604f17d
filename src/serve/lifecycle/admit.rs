//! Admission: the router's first choice of pool, then the policy's decision (or the configured
//! fallback when the script fails or asks for something that cannot be done), carried out until
//! the request is placed on a pool (possibly after deferring, without holding a worker, or
//! with its context shrunk) or refused.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::Keep;
use crate::core::snapshot::{Action, Decision, Estimate, RequestInfo};
use crate::policy::PolicyErrorKind;
use crate::pool::Pool;
use crate::serve::metrics::{DecisionLabels, FailoverReason, KindLabels};
use crate::serve::router::{self, Plan, PoolView};
use crate::serve::service::{ModelEntry, Service};

use super::room::{DeviceHold, evictable_bytes, hold_device, make_room, on_local_device};
use super::run::is_accelerator;
use super::{DeadlineMiss, Refused, Request, RequestError};

/// Where the policy sent a request.
pub(super) struct Admitted {
    /// The pool it runs on.
    pub(super) pool: Arc<Pool>,
    /// The decision that placed it there.
    pub(super) action: Action,
    /// `(from, to)` context tokens when it was shrunk.
    pub(super) context: Option<(u64, u64)>,
    /// What a shrink of a generation's prompt left out.
    pub(super) context_cut: Option<String>,
    /// The estimate for what actually runs (after any shrink).
    pub(super) estimate: Estimate,
    /// What the policy's deferrals left of the routed pool's `max_wait`: how long it may still
    /// wait for its service's budgets (set by `admit` once it is placed).
    pub(super) wait_left: Duration,
    /// Held when it loads its model on an accelerator or made room there: released once its
    /// first run has ended and the device was sampled again.
    pub(super) hold: Option<DeviceHold>,
}

/// Ask the policy what to do with the request and carry it out until it is placed on a pool
/// (possibly after deferring, without holding a worker) or refused.
pub(super) async fn admit(service: &Service, entry: &ModelEntry, request: &mut Request) -> Result<Admitted, Refused> {
    let refuse = |error: RequestError| Refused { pool: None, error };
    let routed = routed_pool(service, &entry.config.name).map_err(refuse)?;
    let dims = entry.with_new_tokens(entry.dims_of(&request.inputs), request.max_new_tokens);
    let dims = entry.with_generations(dims, request.generations);
    let mut info = request_info(service, entry, request, &routed);
    if let Some(never) = super::fits::never_fits(service, entry, request, &info.estimate, &dims) {
        return Err(refuse(RequestError::NeverFits(Box::new(never))));
    }
    // The padding a generation brings to its batch is there only while the batch is: it
    // counts now, not in whether the request could ever fit.
    info.estimate = joining(entry, request, &routed, info.context_tokens, info.estimate);
    let mut deferred = Duration::ZERO;
    // Why the last `make_room` could not free enough: the policy then decides without it.
    let mut no_room: Option<String> = None;
    let mut hold = None;
    if info.load_bytes > 0 && on_local_device(&routed) {
        // A cold start on an accelerator: wait for the loads before it to show in the samples.
        hold = hold_device(service, &routed).await;
        info.load_bytes = load_bytes(service, entry, &routed);
        info.evictable_bytes = evictable_bytes(service, &routed, entry);
    }
    loop {
        if let Some(deadline) = request.deadline() {
            // The policy sees the time left, not the time the client first gave.
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let miss = if deferred.is_zero() {
                    DeadlineMiss::OnArrival
                } else {
                    DeadlineMiss::WhileDeferred
                };
                return Err(refuse(RequestError::Deadline(miss)));
            }
            info.deadline_ms = (left.as_millis() as u64).max(1);
        }
        let (decision, plan) = decide(service, entry, request, &info, &routed, deferred, no_room.as_deref());
        match plan {
            Plan::MakeRoom { pool, bytes } => {
                let pool = service.pool(&pool).cloned().expect("plan only names existing pools");
                let bytes = bytes.unwrap_or_else(|| need_on(service, entry, &info, &pool));
                match make_room(service, entry, &pool, bytes, &info.id, &mut hold).await {
                    Ok(_) => {
                        let mut admitted =
                            shrink(entry, request, &info, pool, decision.action(), None).map_err(refuse)?;
                        admitted.hold = hold;
                        admitted.wait_left = routed.config.max_wait.saturating_sub(deferred);
                        return Ok(admitted);
                    }
                    Err(why) => {
                        tracing::info!(request_id = %info.id, model = %info.model, pool = pool.name(), reason = %why, "make_room freed too little; the policy decides again without it");
                        info.evictable_bytes = 0;
                        no_room = Some(why);
                    }
                }
            }
            Plan::Run { pool, shrink_to } => {
                let pool = service.pool(&pool).cloned().expect("plan only names existing pools");
                if pool.name() != routed.name() && is_accelerator(&routed) {
                    service.failover(&routed, &pool, FailoverReason::policy_redirect);
                }
                let mut admitted = shrink(entry, request, &info, pool, decision.action(), shrink_to).map_err(refuse)?;
                admitted.wait_left = routed.config.max_wait.saturating_sub(deferred);
                // Sent elsewhere, it changes nothing on the held device.
                let same_device =
                    on_local_device(&admitted.pool) && admitted.pool.config.device == routed.config.device;
                admitted.hold = hold.filter(|_| same_device);
                return Ok(admitted);
            }
            Plan::Wait(wait) => {
                if request.deadline().is_some_and(|d| Instant::now() + wait >= d) {
                    return Err(refuse(RequestError::Deadline(DeadlineMiss::ByDeferral)));
                }
                tokio::time::sleep(wait).await;
                deferred += wait;
            }
            Plan::DeferredTooLong { total, bound } => {
                return Err(refuse(RequestError::DeferredTooLong {
                    pool: routed.name().to_string(),
                    deferred,
                    bound,
                    retry_after: total,
                }));
            }
            Plan::Refuse(reason) => {
                return Err(refuse(RequestError::Refused {
                    reason,
                    retry_after: routed.load().estimated_delay,
                }));
            }
            Plan::Invalid(_) => unreachable!("replaced by the fallback in decide()"),
        }
    }
}

/// `estimate` of a generation whose prompt of `prompt` tokens joins its model's batch on
/// `pool`, with the left padding that brings: its own row padded up to the batch's length, or
/// every other row up to its own ([`crate::pool::batch::sequences::padding_tokens`]). A single run,
/// or a pool that keeps no caches, joins no batch.
fn joining(entry: &ModelEntry, request: &Request, pool: &Pool, prompt: u64, mut estimate: Estimate) -> Estimate {
    let (Some(layout), Some(_)) = (entry.kind.decoder(), request.sequence) else {
        return estimate;
    };
    if !pool.keeps_caches() {
        return estimate;
    }
    let padding = pool.sequences.join_padding(&entry.config.name, prompt);
    let bytes = padding.saturating_mul(layout.kv_bytes_per_token());
    estimate.context_bytes = estimate.context_bytes.saturating_add(bytes);
    estimate.total_bytes = estimate.total_bytes.saturating_add(bytes);
    estimate
}

/// The weights `pool` must load before it runs `entry`'s model: 0 when they are there (its
/// own, or a model's it shares them with).
fn load_bytes(service: &Service, entry: &ModelEntry, pool: &Pool) -> u64 {
    match pool.residency().holds_weights_of(&entry.config.name) {
        true => 0,
        false => service.weights_on(pool, entry),
    }
}

/// What a request needs on `pool` beyond what is there now: its run's context and workspace,
/// and its weights when they are not loaded there.
fn need_on(service: &Service, entry: &ModelEntry, info: &RequestInfo, pool: &Pool) -> u64 {
    let run = info
        .estimate
        .context_bytes
        .saturating_add(info.estimate.workspace_bytes);
    match pool.residency().holds_weights_of(&entry.config.name) {
        true => run,
        false => run.saturating_add(service.weights_on(pool, entry)),
    }
}

/// The router's choice: the first ready pool serving the model (config order). The policy may
/// move the request elsewhere.
fn routed_pool(service: &Service, model: &str) -> Result<Arc<Pool>, RequestError> {
    let mut skipped: Option<&Arc<Pool>> = None;
    for pool in service.pools.iter().filter(|p| p.serves(model) && p.is_ready()) {
        if !pool.health().breaker_allows() {
            // Its breaker is open: the next pool takes new work, and says where it came from.
            skipped.get_or_insert(pool);
            continue;
        }
        if let Some(from) = skipped {
            service.failover(from, pool, FailoverReason::breaker_open);
        }
        return Ok(Arc::clone(pool));
    }
    if let Some(pool) = skipped {
        return Err(RequestError::breaker_open(pool));
    }
    let reasons: Vec<String> = service
        .pools
        .iter()
        .filter(|p| p.serves(model))
        .map(|p| {
            format!(
                "{}: {}",
                p.name(),
                p.unready_reason().unwrap_or_else(|| "not ready".into())
            )
        })
        .collect();
    Err(RequestError::NoPool {
        model: model.to_string(),
        reasons: reasons.join("; "),
    })
}

/// What the policy is told about the request, routed to `routed` (its deadline is filled in
/// before each decision).
fn request_info(service: &Service, entry: &ModelEntry, request: &Request, routed: &Pool) -> RequestInfo {
    // Generations sharing the prompt's run each hold a cache: they are the request's batch.
    let sent = entry.with_generations(entry.dims_of(&request.inputs), request.generations);
    let (tokens, batch) = entry.tokens_and_batch(&sent);
    let dims = entry
        .profile
        .axes
        .iter()
        .enumerate()
        .map(|(i, axis)| (axis.name.clone(), sent.get(i)))
        .collect();
    RequestInfo {
        id: request.meta.request_id.clone(),
        model: entry.config.name.clone(),
        pool: routed.name().to_string(),
        service: entry.config.service.clone(),
        context_tokens: tokens,
        max_new_tokens: request.max_new_tokens,
        batch,
        priority: request.meta.priority,
        replayable: request.meta.replayable,
        allow_shrink: request.meta.allow_shrink,
        deadline_ms: 0,
        estimate: entry.estimate(&entry.with_new_tokens(sent, request.max_new_tokens)),
        dims,
        load_bytes: load_bytes(service, entry, routed),
        evictable_bytes: evictable_bytes(service, routed, entry),
    }
}

/// One decision: the policy's, or the configured fallback when the script fails or its decision
/// cannot be carried out, with the plan that carries it out. Counted in the policy metrics and
/// kept for `/status`.
fn decide(
    service: &Service,
    entry: &ModelEntry,
    request: &Request,
    info: &RequestInfo,
    routed: &Pool,
    deferred: Duration,
    no_room: Option<&str>,
) -> (Decision, Plan) {
    let model = entry.config.name.as_str();
    let has_context = entry.config.context.is_some() || request.shrinker.is_some();
    let max_defer = routed.config.max_wait;
    let metrics = &service.metrics;
    let views: Vec<PoolView<'_>> = service
        .pools
        .iter()
        .map(|p| PoolView {
            name: p.name(),
            serves: p.serves(model),
            ready: p.refusal().map_or(Ok(()), Err),
            max_context: p.config.max_context,
            accelerator: on_local_device(p),
        })
        .collect();
    let eval_started = std::time::Instant::now();
    let view = service.policy_view();
    let evaluation = service.policy.decide_view(info, &view);
    // Building the script's inputs counts: the view is part of what every request pays.
    let eval_time = eval_started.elapsed();
    metrics.policy.eval_duration.observe(eval_time.as_secs_f64());
    let mut decision = evaluation.decision;
    let mut fell_back = evaluation.error.is_some();
    if let Some(error) = &evaluation.error {
        metrics
            .policy
            .errors
            .get_or_create(&KindLabels { kind: error.kind })
            .inc();
        tracing::warn!(request_id = %info.id, %error, fallback = %decision, "policy failed; using the fallback decision");
    }
    let mut plan = router::plan(&decision, info, has_context, &views, deferred, max_defer);
    if let (Plan::MakeRoom { .. }, Some(why)) = (&plan, no_room) {
        plan = Plan::Invalid(format!("make_room again after it could not free enough: {why}"));
    }
    if let Plan::Invalid(why) = &plan {
        metrics
            .policy
            .errors
            .get_or_create(&KindLabels {
                kind: PolicyErrorKind::BadReturn,
            })
            .inc();
        tracing::warn!(request_id = %info.id, decision = %decision, reason = %why, "policy decision cannot be carried out; using the fallback");
        decision = service.policy.current().script.fallback().clone();
        fell_back = true;
        plan = match router::plan(&decision, info, has_context, &views, deferred, max_defer) {
            Plan::Invalid(why) => Plan::Refuse(format!(
                "neither the policy's decision nor the fallback can be carried out: {why}"
            )),
            Plan::MakeRoom { .. } if no_room.is_some() => Plan::Refuse(format!(
                "the fallback decision is make_room, which could not free enough: {}",
                no_room.unwrap_or_default()
            )),
            other => other,
        };
    }
    let target = match &plan {
        Plan::Run { pool, .. } | Plan::MakeRoom { pool, .. } => pool.as_str(),
        _ => info.pool.as_str(),
    };
    metrics
        .policy
        .decisions
        .get_or_create(&DecisionLabels {
            action: decision.action(),
            pool: target.into(),
        })
        .inc();
    service.decisions.record(&info.id, model, &decision, target, fell_back);
    tracing::debug!(
        request_id = %info.id,
        model,
        action = %decision.action(),
        decision = %decision,
        pool = target,
        eval_us = eval_time.as_micros() as u64,
        estimate_bytes = info.estimate.total_bytes,
        "policy decision"
    );
    (decision, plan)
}

/// Carry out a decision to run on `pool`: cut the context to `shrink_to` tokens when the
/// decision shrank it (along the model's context axis, or by the request's own shrinker), and
/// estimate what actually runs.
fn shrink(
    entry: &ModelEntry,
    request: &mut Request,
    info: &RequestInfo,
    pool: Arc<Pool>,
    action: Action,
    shrink_to: Option<u64>,
) -> Result<Admitted, RequestError> {
    let mut context = None;
    let mut context_cut = None;
    let mut estimate = info.estimate;
    if let (Some(to), Some(axis)) = (shrink_to, &entry.config.context) {
        if let Some(tensor) = request.inputs.iter_mut().find(|t| t.name == axis.input) {
            tensor.truncate_axis(axis.axis, to as usize, axis.keep == Keep::End);
        }
        context = Some((info.context_tokens, to));
        estimate = entry.estimate_inputs(&request.inputs);
    } else if let (Some(to), Some(shrinker)) = (shrink_to, &request.shrinker) {
        let shrunk = (shrinker.0)(to).map_err(|why| RequestError::Refused {
            reason: format!("the policy asked to shrink the context to {to} tokens, but {why}"),
            retry_after: pool.load().estimated_delay,
        })?;
        context = Some((info.context_tokens, shrunk.tokens));
        context_cut = Some(shrunk.cut);
        request.inputs = shrunk.inputs;
        let caches = request.generations.max(1);
        estimate = entry.estimate_tokens(shrunk.tokens.saturating_add(request.max_new_tokens), caches);
        estimate = joining(entry, request, &pool, shrunk.tokens, estimate);
    }
    Ok(Admitted {
        pool,
        action,
        context,
        context_cut,
        estimate,
        wait_left: Duration::ZERO,
        hold: None,
    })
}
