//! The drill's verdict: a table per phase and the drill's pass criteria.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use super::criterion::Criterion;
use super::phase::Phase;
use super::phases::Facts;
use super::record::{Record, Samples};
use crate::core::human::human_bytes;
use crate::core::snapshot::Action;

/// One phase, summed up.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseSummary {
    /// Which phase.
    pub phase: Phase,
    /// Requests sent.
    pub requests: usize,
    /// Answered 200.
    pub succeeded: usize,
    /// Met the phase's expectation (a documented 503 can be what was expected).
    pub as_expected: usize,
    /// Median latency, ms.
    pub p50_ms: f64,
    /// 95th percentile latency, ms.
    pub p95_ms: f64,
    /// Largest queue age seen in any pool, ms.
    pub max_queue_age_ms: u64,
    /// Lowest host `MemAvailable` seen.
    pub min_host_available_bytes: Option<u64>,
}

/// The whole drill.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Whether every criterion passed.
    pub passed: bool,
    /// Seconds it took.
    pub seconds: f64,
    /// The host memory reserve it was held to.
    pub host_reserve_bytes: u64,
    /// Per phase.
    pub phases: Vec<PhaseSummary>,
    /// The criteria.
    pub criteria: Vec<Criterion>,
    /// Facts measured beside the requests.
    pub facts: Facts,
    /// Every request.
    pub records: Vec<Record>,
}

impl Report {
    /// Sum up the records and judge them against the drill's criteria.
    pub(super) fn judge(
        phases: &[Phase],
        records: Vec<Record>,
        samples: BTreeMap<Phase, Samples>,
        facts: Facts,
        host_reserve: u64,
        took: Duration,
    ) -> Report {
        let summaries = summarise(phases, &records, &samples);
        let mut criteria = vec![
            as_expected(&records),
            duplicates(&records, &facts),
            lost(&records, &facts),
            identity(&records),
            token_equivalence(&facts),
            recovery(&facts),
            redirects_flagged(&records),
            host_reserve_kept(&summaries, host_reserve),
            device_within_capacity(&samples),
        ];
        if phases.contains(&Phase::Residency) {
            criteria.extend(super::residency::criteria(&records, facts.residency.as_ref()));
        }
        if phases.contains(&Phase::Background) {
            criteria.push(super::background::criterion(&records, facts.background.as_ref()));
        }
        if phases.contains(&Phase::Speech) {
            criteria.push(super::speech::criterion(facts.speech.as_ref()));
        }
        if phases.contains(&Phase::WorkerLost) {
            criteria.extend(super::worker::criteria(&records, facts.worker_lost.as_ref()));
        }
        Report {
            passed: criteria.iter().all(|c| c.passed),
            seconds: took.as_secs_f64(),
            host_reserve_bytes: host_reserve,
            phases: summaries,
            criteria,
            facts,
            records,
        }
    }

    /// The criteria that failed, by name.
    pub fn failed(&self) -> Vec<&'static str> {
        self.criteria.iter().filter(|c| !c.passed).map(|c| c.name).collect()
    }

    /// The report as people read it.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "vramguard drill: SIMULATED accelerator `{}`, {:.1} s\n",
            super::DEVICE,
            self.seconds
        );
        let _ = writeln!(
            out,
            "{:<16} {:>8} {:>13} {:>12} {:>9} {:>9} {:>14} {:>14}",
            "phase", "requests", "answered 200", "as expected", "p50 ms", "p95 ms", "max queue ms", "min host avail"
        );
        for p in &self.phases {
            // A count and its share of the phase's requests.
            let share = |n: usize| {
                if p.requests == 0 {
                    "-".to_string()
                } else {
                    format!("{n} ({:.0}%)", 100.0 * n as f64 / p.requests as f64)
                }
            };
            let _ = writeln!(
                out,
                "{:<16} {:>8} {:>13} {:>12} {:>9.1} {:>9.1} {:>14} {:>14}",
                p.phase.label(),
                p.requests,
                share(p.succeeded),
                share(p.as_expected),
                p.p50_ms,
                p.p95_ms,
                p.max_queue_age_ms,
                p.min_host_available_bytes.map_or_else(|| "-".to_string(), human_bytes)
            );
        }
        let _ = writeln!(
            out,
            "\nanswered 200: of a phase's requests, those answered 200 (and their share); as expected: those that\n\
             got what the phase expects of them, which may be a 503, a client's hang-up or a stream's error event."
        );
        let faults: Vec<_> = self
            .phases
            .iter()
            .filter_map(|p| Some((p.phase.label(), p.phase.injects()?)))
            .collect();
        if !faults.is_empty() {
            let _ = writeln!(out, "\nfaults the drill injects (the errors they cause are expected):");
            for (phase, fault) in faults {
                let _ = writeln!(out, "  {phase:<16} {fault}");
            }
        }
        let starts: Vec<f64> = self.records.iter().filter_map(|r| r.cpu_started_ms).collect();
        if !starts.is_empty() {
            let _ = writeln!(
                out,
                "\n{} requests retried on the CPU pool after an allocator failure: their CPU run started {:.1} ms (median; max {:.1}) after the server received them",
                starts.len(),
                percentile(&starts, 50.0),
                percentile(&starts, 100.0)
            );
        }
        if let Some(r) = &self.facts.residency {
            let _ = writeln!(
                out,
                "\nresidency: {} requests in {:.2} s ({:.1}/s); model loads {} ({:.0}/min); evictions {}; {} of pressure sizing the room",
                r.requests,
                r.seconds,
                r.requests_per_second(),
                r.loads,
                r.loads_per_minute(),
                r.evictions.len(),
                human_bytes(r.pressure_bytes)
            );
        }
        let _ = writeln!(out);
        for c in &self.criteria {
            let _ = writeln!(
                out,
                "{:<4} {:<52} {}",
                if c.passed { "ok" } else { "FAIL" },
                c.name,
                c.measured
            );
        }
        let _ = writeln!(
            out,
            "\n{}",
            if self.passed {
                "PASS: every criterion met".to_string()
            } else {
                format!("FAIL: {}", self.failed().join("; "))
            }
        );
        out
    }
}

/// Each phase's requests, latencies and samples.
fn summarise(phases: &[Phase], records: &[Record], samples: &BTreeMap<Phase, Samples>) -> Vec<PhaseSummary> {
    let grouped = by_phase(records);
    phases
        .iter()
        .map(|&phase| {
            let rs = grouped.get(&phase).cloned().unwrap_or_default();
            let seen = samples.get(&phase);
            let latencies: Vec<f64> = rs.iter().filter(|r| r.status.is_some()).map(|r| r.latency_ms).collect();
            PhaseSummary {
                phase,
                requests: rs.len(),
                succeeded: rs.iter().filter(|r| r.status == Some(200)).count(),
                as_expected: rs.iter().filter(|r| r.as_expected).count(),
                p50_ms: percentile(&latencies, 50.0),
                p95_ms: percentile(&latencies, 95.0),
                max_queue_age_ms: seen.map_or(0, |s| s.max_queue_age_ms),
                min_host_available_bytes: seen.and_then(|s| s.min_host_available),
            }
        })
        .collect()
}

/// Every request met its phase's expectation; each that did not is named with what happened
/// instead, so a failed run explains itself.
fn as_expected(records: &[Record]) -> Criterion {
    let unexpected: Vec<String> = records
        .iter()
        .filter(|r| !r.as_expected)
        .map(|r| {
            format!(
                "{} (expected {}; got {} on {}{}{}{})",
                r.id,
                r.expect,
                r.status.map_or_else(|| "no answer".to_string(), |s| s.to_string()),
                r.pool.as_deref().unwrap_or("no pool"),
                r.retry.as_deref().map(|x| format!(", retry {x}")).unwrap_or_default(),
                r.degraded
                    .as_deref()
                    .map(|x| format!(", degraded: {x}"))
                    .unwrap_or_default(),
                r.first_failure
                    .as_ref()
                    .map(|f| format!(", {}", crate::core::human::clipped(&f.to_string(), 160)))
                    .unwrap_or_default()
            )
        })
        .collect();
    Criterion {
        name: "every request as its phase expects",
        measured: if unexpected.is_empty() {
            format!("{} of {}", records.len(), records.len())
        } else {
            format!(
                "{} of {}; not: {}",
                records.len() - unexpected.len(),
                records.len(),
                unexpected.join("; ")
            )
        },
        passed: unexpected.is_empty() && !records.is_empty(),
    }
}

/// Nothing ran twice: no duplicate runs counted, no request of the non_replayable phase served
/// by the fallback (each failed after it started: it would have run twice), and none of the
/// worker_lost phase's non-replayable requests answered by the fallback as a retry.
fn duplicates(records: &[Record], facts: &Facts) -> Criterion {
    let moved = records
        .iter()
        .filter(|r| r.phase == Phase::NonReplayable && r.pool.as_deref() == Some(super::CPU))
        .count() as u64;
    let duplicates = facts.duplicate_runs + moved + super::worker::ran_twice(records);
    Criterion {
        name: "duplicate executions",
        measured: duplicates.to_string(),
        passed: duplicates == 0,
    }
}

/// No client that kept its connection went without an answer.
fn lost(records: &[Record], facts: &Facts) -> Criterion {
    let lost: Vec<&str> = records
        .iter()
        .filter(|r| r.connection_held && r.status.is_none())
        .map(|r| r.id.as_str())
        .collect();
    Criterion {
        name: "accepted but lost",
        measured: if lost.is_empty() {
            format!(
                "0 ({} clients hung up on purpose, {} counted cancelled by the server)",
                facts.hung_up, facts.cancelled_counted
            )
        } else {
            format!("{}: {}", lost.len(), lost.join(", "))
        },
        passed: lost.is_empty(),
    }
}

/// Every answer carried the request id it was sent with.
fn identity(records: &[Record]) -> Criterion {
    let answered: Vec<&Record> = records.iter().filter(|r| r.status.is_some()).collect();
    let changed: Vec<&str> = answered.iter().filter(|r| !r.id_kept).map(|r| r.id.as_str()).collect();
    Criterion {
        name: "request identity kept (x-request-id)",
        measured: if changed.is_empty() {
            format!("{} of {}", answered.len(), answered.len())
        } else {
            format!("not on: {}", changed.join(", "))
        },
        passed: changed.is_empty() && !answered.is_empty(),
    }
}

/// Every replayed or moved generation gave the reference's text.
fn token_equivalence(facts: &Facts) -> Criterion {
    let equal = facts.token_equivalence.iter().filter(|(_, same)| *same).count();
    Criterion {
        name: "replayed generations token-equivalent",
        measured: format!("{equal} of {}", facts.token_equivalence.len()),
        passed: !facts.token_equivalence.is_empty() && equal == facts.token_equivalence.len(),
    }
}

/// The accelerator pool served again after the restore.
fn recovery(facts: &Facts) -> Criterion {
    Criterion {
        name: "breaker recovery after restore",
        measured: facts
            .breaker_recovery_ms
            .map_or_else(|| "did not recover within 60 s".to_string(), |ms| format!("{ms:.0} ms")),
        passed: facts.breaker_recovery_ms.is_some(),
    }
}

/// Every answer redirected by the policy said it was degraded.
fn redirects_flagged(records: &[Record]) -> Criterion {
    let redirected: Vec<&Record> = records
        .iter()
        .filter(|r| r.status == Some(200) && r.decision == Some(Action::Redirect))
        .collect();
    let flagged = redirected.iter().filter(|r| r.degraded.is_some()).count();
    Criterion {
        name: "redirected answers carrying x-vramguard-degraded",
        measured: format!(
            "{flagged} of {} ({:.0}%)",
            redirected.len(),
            100.0 * flagged as f64 / redirected.len().max(1) as f64
        ),
        passed: !redirected.is_empty() && flagged == redirected.len(),
    }
}

/// Host memory never went under its reserve in any sample.
fn host_reserve_kept(summaries: &[PhaseSummary], host_reserve: u64) -> Criterion {
    let lowest = summaries.iter().filter_map(|s| s.min_host_available_bytes).min();
    Criterion {
        name: "host memory stays above its reserve",
        measured: match lowest {
            Some(low) => format!(
                "lowest {} available, reserve {}",
                human_bytes(low),
                human_bytes(host_reserve)
            ),
            None => "never sampled".to_string(),
        },
        passed: lowest.is_some_and(|low| low > host_reserve),
    }
}

/// The simulated device's used memory never went over its capacity in any sample.
fn device_within_capacity(samples: &BTreeMap<Phase, Samples>) -> Criterion {
    let highest = samples
        .values()
        .filter_map(|s| s.max_device_used)
        .max_by(|a, b| (a.0 as f64 / a.1.max(1) as f64).total_cmp(&(b.0 as f64 / b.1.max(1) as f64)));
    let over: Vec<&str> = samples
        .iter()
        .filter(|(_, s)| s.max_device_used.is_some_and(|(used, total)| used > total))
        .map(|(phase, _)| phase.label())
        .collect();
    Criterion {
        name: "device memory within its capacity",
        measured: match highest {
            Some((used, total)) if over.is_empty() => {
                format!("highest {} used of {}", human_bytes(used), human_bytes(total))
            }
            Some(_) => format!("over its capacity in: {}", over.join(", ")),
            None => "never sampled".to_string(),
        },
        passed: highest.is_some() && over.is_empty(),
    }
}

/// Percentile `p` (0–100) of `values` (nearest rank); 0 for none.
fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// Records by phase, in phase order.
fn by_phase(records: &[Record]) -> BTreeMap<Phase, Vec<&Record>> {
    let mut out: BTreeMap<Phase, Vec<&Record>> = BTreeMap::new();
    for r in records {
        out.entry(r.phase).or_default().push(r);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 3.0);
        assert_eq!(percentile(&v, 95.0), 5.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    fn record(phase: Phase, id: &str, pool: &str) -> Record {
        Record {
            latency_ms: 3.0,
            status: Some(200),
            pool: Some(pool.into()),
            decision: Some(Action::Admit),
            id_kept: true,
            as_expected: true,
            ..Record::new(phase, id, "encoder seq 32".into(), "ok", 0.0)
        }
    }

    #[test]
    fn a_failed_criterion_is_named_and_fails_the_drill() {
        let facts = Facts {
            breaker_recovery_ms: Some(100.0),
            token_equivalence: vec![("replayed".into(), true)],
            ..Facts::default()
        };
        let sampled = Samples {
            max_queue_age_ms: 5,
            min_host_available: Some(8 << 30),
            max_device_used: Some((80 << 20, 96 << 20)),
        };
        let samples = BTreeMap::from([(Phase::Baseline, sampled.clone()), (Phase::Redirect, sampled)]);
        let mut redirected = record(Phase::Redirect, "r1", "cpu");
        redirected.decision = Some(Action::Redirect);
        redirected.degraded = Some("memory".into());
        let good = vec![record(Phase::Baseline, "b1", "gpu"), redirected.clone()];
        let report = Report::judge(
            &[Phase::Baseline, Phase::Redirect],
            good.clone(),
            samples.clone(),
            facts.clone(),
            1 << 30,
            Duration::from_secs(1),
        );
        assert!(report.passed, "{}", report.table());

        // A non-replayable request served by the fallback ran twice; a redirect without the
        // degraded header; a client that waited and got nothing.
        let mut moved = record(Phase::NonReplayable, "n1", "cpu");
        moved.status = Some(200);
        let mut silent = redirected;
        silent.degraded = None;
        let mut lost = record(Phase::Baseline, "b2", "gpu");
        lost.status = None;
        let bad = [good, vec![moved, silent, lost]].concat();
        let report = Report::judge(
            &[Phase::Baseline, Phase::Redirect, Phase::NonReplayable],
            bad,
            samples,
            facts,
            1 << 30,
            Duration::from_secs(1),
        );
        assert!(!report.passed);
        assert_eq!(
            report.failed(),
            [
                "duplicate executions",
                "accepted but lost",
                "redirected answers carrying x-vramguard-degraded"
            ]
        );
        assert!(
            report
                .table()
                .contains("FAIL: duplicate executions; accepted but lost;"),
            "{}",
            report.table()
        );
    }

    #[test]
    fn a_device_sampled_over_its_capacity_or_a_residency_phase_without_facts_fails() {
        let facts = Facts {
            breaker_recovery_ms: Some(100.0),
            token_equivalence: vec![("replayed".into(), true)],
            ..Facts::default()
        };
        let sampled = |used: u64| Samples {
            max_queue_age_ms: 0,
            min_host_available: Some(8 << 30),
            max_device_used: Some((used, 96 << 20)),
        };
        let mut redirected = record(Phase::Redirect, "r1", "cpu");
        redirected.decision = Some(Action::Redirect);
        redirected.degraded = Some("memory".into());
        let records = vec![record(Phase::Baseline, "b1", "gpu"), redirected];
        let judge = |samples: BTreeMap<Phase, Samples>, phases: &[Phase]| {
            Report::judge(
                phases,
                records.clone(),
                samples,
                facts.clone(),
                1 << 30,
                Duration::from_secs(1),
            )
        };
        let phases = [Phase::Baseline, Phase::Redirect];
        let over = BTreeMap::from([
            (Phase::Baseline, sampled(90 << 20)),
            (Phase::Redirect, sampled(97 << 20)),
        ]);
        let report = judge(over, &phases);
        assert_eq!(report.failed(), ["device memory within its capacity"]);
        assert!(
            report.table().contains("over its capacity in: redirect"),
            "{}",
            report.table()
        );
        assert_eq!(
            judge(BTreeMap::new(), &phases).failed(),
            [
                "host memory stays above its reserve",
                "device memory within its capacity"
            ],
            "never sampled"
        );

        let within = BTreeMap::from([(Phase::Baseline, sampled(96 << 20))]);
        let report = judge(within, &[Phase::Baseline, Phase::Redirect, Phase::Residency]);
        assert_eq!(report.failed().len(), 5, "{}", report.table());
        assert!(report.failed().iter().all(|name| name.starts_with("residency: ")));
    }
}
