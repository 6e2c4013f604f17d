//! The residency phase: three dense models that do not fit on the accelerator together, requests
//! alternating between them, and a pinned model that must stay. What the phase sends, what it
//! sees of the target meanwhile ([`Seen`], fed by the `/status` sampler), and how it is judged.
//!
//! The dense models stand aside (unloaded) while the other phases run and are loaded again when
//! this one, the last, begins. The room is sized with the simulated device's pressure: the headroom left is the policy's
//! reserve and half a dense model, so the two dense models loaded at start stay, while the
//! on-demand one (`dense_c`, priority 5) fits only once `make_room` has evicted the idle one of
//! the lowest priority (`dense_b`, 1); `dense_b` then does not fit again and may evict neither
//! of the others, so it is redirected to the CPU pool.
//!
//! Its requests go one at a time, so that what is judged does not depend on which request
//! happened to be running when another arrived. The check that needs concurrent load (a
//! background service giving way while interactive requests wait) is the phase after it
//! ([`super::background`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::json;

use super::criterion::Criterion;
use super::phase::Phase;
use super::record::Record;
use super::seen::Seen;
use super::{CPU, DENSE, DEVICE, Drill, GPU, MIN_RESIDENCY_S, PINNED, RESERVE_BYTES};
use crate::core::snapshot::Action;
use crate::protocol::status::{EvictionStatus, StatusReport};

/// What the residency phase measured beside its requests.
#[derive(Debug, Default, Clone, Serialize)]
pub struct ResidencyFacts {
    /// From its first request to its last answer.
    pub seconds: f64,
    /// Requests it sent.
    pub requests: usize,
    /// Model loads the target counted meanwhile (`vramguard_model_loads_total`, every reason).
    pub loads: f64,
    /// Evictions the target counted meanwhile (`vramguard_model_unloads_total{reason="evicted"}`).
    pub evicted_counted: f64,
    /// The evictions `/status` showed that were not there before the phase, oldest first.
    pub evictions: Vec<EvictionStatus>,
    /// For each of those, how long its model had been loaded on that pool, seconds (by
    /// `/status`'s whole seconds); `None` when no load of it was seen.
    pub resident_for_s: Vec<Option<u64>>,
    /// Every model's priority, as `/status` gives it.
    pub priorities: BTreeMap<String, i64>,
    /// The pinned models on the accelerator pool.
    pub pinned: Vec<String>,
    /// Samples in which a pinned model was not resident there.
    pub pinned_missing: Vec<String>,
    /// External pressure that sized the room, bytes.
    pub pressure_bytes: u64,
}

impl ResidencyFacts {
    /// Requests per second of the phase.
    pub fn requests_per_second(&self) -> f64 {
        self.requests as f64 / self.seconds.max(1e-3)
    }

    /// Model loads per minute of the phase.
    pub fn loads_per_minute(&self) -> f64 {
        self.loads * 60.0 / self.seconds.max(1e-3)
    }
}

/// `/status` models whose names the phase needs; an error names the first one missing.
fn check_models(status: &StatusReport) -> Result<(), String> {
    for name in DENSE.iter().map(|m| m.name).chain([PINNED]) {
        if !status.models.iter().any(|m| m.name == name) {
            return Err(format!(
                "the target has no model `{name}`; start it with the drill's config (vramguard drill --print-config, and --write-models beside it)"
            ));
        }
    }
    Ok(())
}

fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The weights of `model` on the accelerator pool, as `/status` gives them (every worker's).
fn weights_on_gpu(status: &StatusReport, model: &str) -> u64 {
    status
        .models
        .iter()
        .find(|m| m.name == model)
        .and_then(|m| m.pools.iter().find(|p| p.pool == GPU))
        .map_or(0, |p| p.weights_bytes)
}

/// Wait until every resident dense model has been loaded for its `min_residency` (a second more,
/// for `/status`'s whole seconds), so `make_room` may take one: at most that long.
async fn past_min_residency(status: &StatusReport) {
    let last_load = status
        .models
        .iter()
        .filter(|m| DENSE.iter().any(|d| d.name == m.name))
        .flat_map(|m| m.pools.iter().filter_map(|p| p.loaded_unix))
        .max()
        .unwrap_or(0);
    let until = last_load + MIN_RESIDENCY_S + 1;
    let bound = Instant::now() + Duration::from_secs(MIN_RESIDENCY_S + 2);
    while now_unix() < until && Instant::now() < bound {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether `model` is resident on the accelerator pool.
pub(super) fn resident_on_gpu(status: &StatusReport, model: &str) -> bool {
    status
        .models
        .iter()
        .find(|m| m.name == model)
        .and_then(|m| m.pools.iter().find(|p| p.pool == GPU))
        .is_some_and(|p| p.resident)
}

/// The phase's starting point: the dense models loaded at start resident again, the on-demand
/// one not (the operator's load and unload make it so, on a target that ran the drill before
/// too).
async fn prepare(drill: &Drill, status: &StatusReport) -> Result<(), String> {
    for model in &DENSE {
        let path = if model.on_demand { "unload" } else { "load" };
        if resident_on_gpu(status, model.name) == model.on_demand {
            drill
                .post_admin(&format!("/admin/models/{}/{path}", model.name), json!({}))
                .await?;
        }
    }
    Ok(())
}

/// Before the other phases: unload the dense models (the operator's unload), so that those
/// phases find the accelerator as a drill without them would, and [`run`] loads them again.
/// Their weights would otherwise stand beside every other phase's requests: with them resident,
/// encoder requests after the pressure phase were sometimes redirected to the CPU (2 of 16 quick
/// drills, none of 44 without them), whose estimates the simulated arena's peak, pressure
/// included, had raised near what the device then had room for.
pub(super) async fn stand_aside(drill: &Drill) -> Result<(), String> {
    let status = drill.status().await?;
    check_models(&status)?;
    for model in DENSE.iter().filter(|m| resident_on_gpu(&status, m.name)) {
        drill
            .post_admin(&format!("/admin/models/{}/unload", model.name), json!({}))
            .await?;
    }
    Ok(())
}

/// Squeeze the device until its headroom is the policy's reserve and half the lowest-priority
/// dense model (the one to evict), and wait (at most 2 s) for a sample to show it; the pressure
/// applied.
async fn size_the_room(drill: &Drill, status: &StatusReport) -> Result<u64, String> {
    let (victim, _) = lowest();
    let weights = weights_on_gpu(status, victim);
    if weights == 0 {
        return Err(format!(
            "`{victim}` holds no weights on `{GPU}`: /status {}",
            json!(status.models)
        ));
    }
    let target = RESERVE_BYTES + weights / 2;
    let headroom = status.devices.get(DEVICE).map_or(0, |d| d.memory.headroom_bytes);
    let applied = drill.squeeze(headroom.saturating_sub(target)).await?;
    let since = Instant::now();
    while since.elapsed() < Duration::from_secs(2) {
        let now = drill.status().await?;
        if now
            .devices
            .get(DEVICE)
            .is_some_and(|d| d.memory.headroom_bytes < target + (1 << 20))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(applied)
}

/// Run the phase: requests alternating between the dense models, one at a time (a model with a
/// request running is never a victim, so concurrency would only blur what is judged).
pub(super) async fn run(drill: &Arc<Drill>) -> Result<ResidencyFacts, String> {
    let count = drill.n(9, 30);
    drill.begin(Phase::Residency, count);
    let status = drill.status().await?;
    check_models(&status)?;
    prepare(drill, &status).await?;
    past_min_residency(&drill.status().await?).await;
    let status = drill.status().await?;
    let before: BTreeSet<(u64, String, String, String)> = status
        .evictions
        .iter()
        .map(|e| (e.at_unix, e.pool.clone(), e.model.clone(), e.for_request.clone()))
        .collect();
    let loads = drill.counted("vramguard_model_loads_total{", "").await;
    let evicted_before = evicted(drill).await;
    // The loads before any eviction, from this reading: the sampler's next may come too late.
    let mut seen = Seen::default();
    seen.observe(&status, drill.elapsed_ms());
    *drill.seen.lock().unwrap_or_else(|e| e.into_inner()) = seen;
    let pressure_bytes = size_the_room(drill, &status).await?;
    let started = Instant::now();
    for i in 0..count {
        let model = DENSE[i % DENSE.len()].name;
        drill
            .dense(Phase::Residency, &format!("residency-{i}-{model}"), model)
            .await
            .judge(|r| r.status == Some(200))
            .keep(drill);
    }
    let seconds = started.elapsed().as_secs_f64();
    let end = drill.status().await?;
    let loads = drill.counted("vramguard_model_loads_total{", "").await - loads;
    let evicted_counted = evicted(drill).await - evicted_before;
    drill.admin(json!({"pressure": 0})).await?;
    let mut seen = std::mem::take(&mut *drill.seen.lock().unwrap_or_else(|e| e.into_inner()));
    seen.observe(&end, drill.elapsed_ms());
    let evictions: Vec<EvictionStatus> = seen
        .evictions
        .iter()
        .filter(|(key, _)| !before.contains(*key))
        .map(|(_, e)| e.clone())
        .collect();
    let resident_for_s = evictions
        .iter()
        .map(|e| seen.loaded_before(&e.model, &e.pool, e.at_unix).map(|l| e.at_unix - l))
        .collect();
    Ok(ResidencyFacts {
        seconds,
        requests: count,
        loads,
        evicted_counted,
        evictions,
        resident_for_s,
        priorities: end.models.iter().map(|m| (m.name.clone(), m.priority)).collect(),
        pinned: end
            .models
            .iter()
            .filter(|m| m.residency == "pinned" && m.pools.iter().any(|p| p.pool == GPU))
            .map(|m| m.name.clone())
            .collect(),
        pinned_missing: seen.pinned_missing,
        pressure_bytes,
    })
}

/// Evictions the target has counted, every model and pool.
async fn evicted(drill: &Drill) -> f64 {
    drill
        .counted("vramguard_model_unloads_total{", "reason=\"evicted\"")
        .await
}

/// The model a residency record was sent to (its `kind` is the model's name).
fn sent_to(record: &Record) -> &str {
    record.kind.split(' ').next().unwrap_or_default()
}

/// The phase's criteria, judged on its records and facts; every one fails when the phase did
/// not run.
pub(super) fn criteria(records: &[Record], facts: Option<&ResidencyFacts>) -> Vec<Criterion> {
    let Some(facts) = facts else {
        return [
            "residency: higher priority ran after an eviction",
            "residency: lowest priority redirected, evicts none",
            "residency: pinned models resident, never evicted",
            "residency: no eviction within min_residency",
            "residency: evictions in /metrics match /status",
        ]
        .map(|name| Criterion {
            name,
            measured: "the phase did not run".into(),
            passed: false,
        })
        .to_vec();
    };
    let ours: Vec<&Record> = records.iter().filter(|r| r.phase == Phase::Residency).collect();
    vec![
        made_room(&ours, facts),
        lowest_redirected(&ours, facts),
        pinned_kept(facts),
        min_residency_kept(facts),
        evictions_reconcile(facts),
    ]
}

/// The lowest priority among the dense models, and its model.
fn lowest() -> (&'static str, i64) {
    DENSE
        .iter()
        .min_by_key(|m| m.priority)
        .map_or(("", 0), |m| (m.name, m.priority))
}

fn made_room(ours: &[&Record], facts: &ResidencyFacts) -> Criterion {
    let (_, low) = lowest();
    let priority = |r: &Record| facts.priorities.get(sent_to(r)).copied().unwrap_or(i64::MIN);
    let made: Vec<&str> = ours
        .iter()
        .filter(|r| r.served_on(GPU) && r.decision == Some(Action::MakeRoom) && priority(r) > low)
        .map(|r| r.id.as_str())
        .collect();
    Criterion {
        name: "residency: higher priority ran after an eviction",
        measured: format!(
            "{} make_room answers on {GPU} ({}), {} evictions",
            made.len(),
            made.join(", "),
            facts.evictions.len()
        ),
        passed: !made.is_empty(),
    }
}

fn lowest_redirected(ours: &[&Record], facts: &ResidencyFacts) -> Criterion {
    let (model, _) = lowest();
    let moved: Vec<&&Record> = ours
        .iter()
        .filter(|r| sent_to(r) == model && !r.served_on(GPU))
        .collect();
    let wrong: Vec<&str> = moved
        .iter()
        .filter(|r| !(r.served_on(CPU) && r.decision == Some(Action::Redirect)))
        .map(|r| r.id.as_str())
        .collect();
    let priority = |m: &str| facts.priorities.get(m).copied().unwrap_or(i64::MAX);
    let upward: Vec<String> = facts
        .evictions
        .iter()
        .filter(|e| priority(&e.model) > priority(&e.for_model))
        .map(|e| format!("{} for {}", e.model, e.for_model))
        .collect();
    let mut measured = format!("{model}: {} redirected to {CPU}", moved.len() - wrong.len());
    if !wrong.is_empty() {
        measured.push_str(&format!("; not redirected: {}", wrong.join(", ")));
    }
    if !upward.is_empty() {
        measured.push_str(&format!("; evicted a higher priority: {}", upward.join(", ")));
    }
    Criterion {
        name: "residency: lowest priority redirected, evicts none",
        measured,
        passed: !moved.is_empty() && wrong.is_empty() && upward.is_empty(),
    }
}

fn pinned_kept(facts: &ResidencyFacts) -> Criterion {
    let evicted: Vec<&str> = facts
        .evictions
        .iter()
        .filter(|e| facts.pinned.contains(&e.model))
        .map(|e| e.model.as_str())
        .collect();
    let mut measured = format!("{} pinned ({})", facts.pinned.len(), facts.pinned.join(", "));
    if !facts.pinned_missing.is_empty() {
        let missing: Vec<&str> = facts.pinned_missing.iter().take(5).map(String::as_str).collect();
        measured.push_str(&format!("; not resident: {}", missing.join(", ")));
    }
    if !evicted.is_empty() {
        measured.push_str(&format!("; evicted: {}", evicted.join(", ")));
    }
    Criterion {
        name: "residency: pinned models resident, never evicted",
        measured,
        passed: facts.pinned.iter().any(|m| m == PINNED) && facts.pinned_missing.is_empty() && evicted.is_empty(),
    }
}

fn min_residency_kept(facts: &ResidencyFacts) -> Criterion {
    let minimum = |model: &str| {
        if DENSE.iter().any(|m| m.name == model) {
            MIN_RESIDENCY_S
        } else {
            crate::config::DEFAULT_MIN_RESIDENCY.as_secs()
        }
    };
    let early: Vec<String> = facts
        .evictions
        .iter()
        .zip(&facts.resident_for_s)
        .filter(|(e, held)| held.is_none_or(|s| s < minimum(&e.model)))
        .map(|(e, held)| match held {
            Some(s) => format!("{} after {s} s", e.model),
            None => format!("{} (no load of it seen)", e.model),
        })
        .collect();
    let shortest = facts.resident_for_s.iter().flatten().min();
    Criterion {
        name: "residency: no eviction within min_residency",
        measured: if early.is_empty() {
            shortest.map_or_else(
                || "no evictions".to_string(),
                |s| format!("shortest {s} s resident (min_residency {MIN_RESIDENCY_S} s)"),
            )
        } else {
            format!("too early: {}", early.join(", "))
        },
        passed: early.is_empty(),
    }
}

fn evictions_reconcile(facts: &ResidencyFacts) -> Criterion {
    Criterion {
        name: "residency: evictions in /metrics match /status",
        measured: format!(
            "{} counted, {} in /status",
            facts.evicted_counted,
            facts.evictions.len()
        ),
        passed: facts.evicted_counted == facts.evictions.len() as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(i: usize, model: &str, pool: &str, decision: Action) -> Record {
        Record {
            latency_ms: 2.0,
            status: Some(200),
            pool: Some(pool.into()),
            decision: Some(decision),
            id_kept: true,
            as_expected: true,
            ..Record::new(
                Phase::Residency,
                &format!("residency-{i}-{model}"),
                format!("{model} [1, 64]"),
                "200, on either pool",
                0.0,
            )
        }
    }

    fn eviction(model: &str, for_model: &str) -> EvictionStatus {
        EvictionStatus {
            at_unix: 1_800_000_003,
            pool: GPU.into(),
            device: DEVICE.into(),
            model: model.into(),
            freed_bytes: 8 << 20,
            for_model: for_model.into(),
            for_request: "residency-2-dense_c".into(),
        }
    }

    /// What a passing phase looks like: `dense_c` makes room by evicting `dense_b`, which then
    /// runs on the CPU.
    fn passing() -> (Vec<Record>, ResidencyFacts) {
        let records = vec![
            record(0, "dense_a", GPU, Action::Admit),
            record(1, "dense_b", GPU, Action::Admit),
            record(2, "dense_c", GPU, Action::MakeRoom),
            record(3, "dense_a", GPU, Action::Admit),
            record(4, "dense_b", CPU, Action::Redirect),
            record(5, "dense_c", GPU, Action::Admit),
        ];
        let facts = ResidencyFacts {
            seconds: 0.5,
            requests: records.len(),
            loads: 1.0,
            evicted_counted: 1.0,
            evictions: vec![eviction("dense_b", "dense_c")],
            resident_for_s: vec![Some(3)],
            priorities: [("dense_a", 5), ("dense_b", 1), ("dense_c", 5), ("keeper", 0)]
                .map(|(m, p)| (m.to_string(), p))
                .into(),
            pinned: vec!["keeper".into()],
            pinned_missing: vec![],
            pressure_bytes: 60 << 20,
        };
        (records, facts)
    }

    fn failed(records: &[Record], facts: Option<&ResidencyFacts>) -> Vec<&'static str> {
        criteria(records, facts)
            .into_iter()
            .filter(|c| !c.passed)
            .map(|c| c.name)
            .collect()
    }

    #[test]
    fn a_phase_that_made_room_and_redirected_the_lowest_priority_passes() {
        let (records, facts) = passing();
        let all = criteria(&records, Some(&facts));
        assert_eq!(all.len(), 5);
        assert!(all.iter().all(|c| c.passed), "{all:?}");
        assert_eq!(facts.requests_per_second(), 12.0);
        assert_eq!(facts.loads_per_minute(), 120.0);
    }

    #[test]
    fn no_make_room_for_a_higher_priority_fails() {
        let (mut records, facts) = passing();
        records[2].decision = Some(Action::Admit);
        // make_room for the lowest priority does not count: it may evict nothing above it.
        records[1].decision = Some(Action::MakeRoom);
        assert_eq!(
            failed(&records, Some(&facts)),
            ["residency: higher priority ran after an eviction"]
        );
    }

    #[test]
    fn the_lowest_priority_not_redirected_or_evicting_a_higher_one_fails() {
        let name = ["residency: lowest priority redirected, evicts none"];
        let (mut records, facts) = passing();
        records[4].decision = Some(Action::Admit);
        assert_eq!(failed(&records, Some(&facts)), name, "on the CPU without a redirect");
        let (mut records, facts) = passing();
        records[4].status = Some(503);
        assert_eq!(failed(&records, Some(&facts)), name, "not served");
        let (mut records, facts) = passing();
        records[4].pool = Some(GPU.into());
        assert_eq!(failed(&records, Some(&facts)), name, "it never had to move");
        let (records, mut facts) = passing();
        facts.evictions.push(eviction("dense_a", "dense_b"));
        facts.resident_for_s.push(Some(5));
        facts.evicted_counted = 2.0;
        assert_eq!(failed(&records, Some(&facts)), name, "it evicted a higher priority");
    }

    #[test]
    fn a_pinned_model_missing_once_or_evicted_fails() {
        let name = ["residency: pinned models resident, never evicted"];
        let (records, mut facts) = passing();
        facts.pinned_missing.push("keeper at +1200 ms".into());
        assert_eq!(failed(&records, Some(&facts)), name);
        let (records, mut facts) = passing();
        facts.evictions.push(eviction("keeper", "dense_c"));
        facts.resident_for_s.push(Some(40));
        facts.evicted_counted = 2.0;
        assert_eq!(failed(&records, Some(&facts)), name);
        let (records, mut facts) = passing();
        facts.pinned.clear();
        assert_eq!(failed(&records, Some(&facts)), name, "no pinned model to watch");
    }

    #[test]
    fn an_eviction_inside_min_residency_or_of_an_unseen_load_fails() {
        let name = ["residency: no eviction within min_residency"];
        let (records, mut facts) = passing();
        facts.resident_for_s = vec![Some(MIN_RESIDENCY_S - 1)];
        assert_eq!(failed(&records, Some(&facts)), name);
        facts.resident_for_s = vec![None];
        assert_eq!(failed(&records, Some(&facts)), name);
    }

    #[test]
    fn evictions_counted_but_not_shown_fail_and_a_phase_that_did_not_run_fails_every_criterion() {
        let (records, mut facts) = passing();
        facts.evicted_counted = 2.0;
        assert_eq!(
            failed(&records, Some(&facts)),
            ["residency: evictions in /metrics match /status"]
        );
        assert_eq!(failed(&records, None).len(), 5);
    }

    #[test]
    fn the_sampler_keeps_each_eviction_once_and_the_load_before_it() {
        let (_, facts) = passing();
        let mut seen = Seen::default();
        let status = |evictions: Vec<EvictionStatus>, loaded: Option<u64>, keeper: bool| {
            let mut status = crate::protocol::status::tests::report();
            status.evictions = evictions;
            status.models = [("dense_b", loaded, loaded.is_some()), ("keeper", Some(1), keeper)]
                .map(|(name, loaded_unix, resident)| crate::protocol::status::ModelStatus {
                    name: name.into(),
                    service: name.into(),
                    priority: facts.priorities[name],
                    residency: if name == "keeper" { "pinned" } else { "resident" }.into(),
                    fallback_model: None,
                    pools: vec![crate::protocol::status::ModelOnPool {
                        pool: GPU.into(),
                        resident,
                        loaded_unix,
                        idle_ms: Some(0),
                        running: 0,
                        queued: 0,
                        weights_bytes: 8 << 20,
                        shares_weights_of: None,
                    }],
                    components: Vec::new(),
                })
                .to_vec();
            status
        };
        seen.observe(&status(vec![], Some(1_800_000_000), true), 10.0);
        let evicted = eviction("dense_b", "dense_c");
        seen.observe(&status(vec![evicted.clone()], None, true), 20.0);
        seen.observe(&status(vec![evicted.clone()], None, false), 30.0);
        assert_eq!(seen.evictions.len(), 1);
        assert_eq!(seen.loaded_before("dense_b", GPU, evicted.at_unix), Some(1_800_000_000));
        assert_eq!(seen.loaded_before("dense_b", GPU, 1_799_999_999), None);
        assert_eq!(seen.pinned_missing, ["keeper at +30 ms"]);
    }
}
