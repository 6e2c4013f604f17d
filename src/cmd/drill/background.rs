//! The background phase: a background service's request sent while interactive requests wait
//! must give way to them, and run once they no longer wait.
//!
//! Interactive load comes from closed-loop lanes of requests of an interactive service that
//! runs one request at a time (`concurrency: 1`), so that some of them wait nearly all the
//! time, whatever the speed of the target and of the drill. Once `vramguard_requests_waiting`
//! shows them waiting, requests of the background service's model go one after another until
//! the target has counted one's wait (`vramguard_service_waits_total{reason="background"}`),
//! at most [`TRIES`] of them; then the load stops. Every background request must be answered.
//! One that arrives at a moment between two interactive requests, when none waits, may run at
//! once: that is why the next one goes (on a loaded machine the lanes' next requests can lag
//! their answers). Each lane sends at most a bounded number of requests, so the phase ends by
//! itself on a target that never holds a background request back, and the criterion then says
//! so.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::client::Drill;
use super::criterion::Criterion;
use super::phase::Phase;
use super::record::Record;
use super::{BACKGROUND_MODEL, BACKGROUND_SERVICE, INTERACTIVE_MODEL};

/// Closed-loop lanes of interactive requests. Their service runs one request at a time, so
/// whenever two lanes have a request outstanding, one of them waits.
const LANES: usize = 6;
/// Tokens of each interactive request: enough that its run on one CPU thread, not the HTTP
/// exchange, is most of its time, so that the lanes' requests wait for each other.
const SEQ: usize = 1024;
/// How long to wait for interactive requests to show waiting, and then (all tries together)
/// for a background request's wait to be counted.
const WITHIN: Duration = Duration::from_secs(5);
/// Most background requests sent, one after another, for one whose wait is counted.
const TRIES: usize = 8;

/// What the background phase saw beside its requests.
#[derive(Debug, Default, Clone, Serialize)]
pub struct BackgroundFacts {
    /// The most interactive requests `vramguard_requests_waiting` showed waiting before the
    /// background request went.
    pub interactive_waiting: f64,
    /// Waits the target counted for the background service, reason `background`, meanwhile.
    pub waits_counted: f64,
    /// Background requests sent: the next goes only when one was answered without a wait
    /// counted, so the last is the one whose wait was (unless none was).
    pub background_sent: usize,
    /// Interactive requests sent.
    pub interactive_sent: usize,
    /// Milliseconds from the drill's start to the interactive load stopping (no lane sent
    /// another request after it).
    pub load_stopped_ms: f64,
}

/// The service waits counted for the background service, reason `background`.
async fn waits(drill: &Drill) -> f64 {
    let labels = format!("service=\"{BACKGROUND_SERVICE}\",reason=\"background\"");
    drill.counted("vramguard_service_waits_total{", &labels).await
}

/// Poll `read` every 10 ms until it gives at least `at_least` (at most [`WITHIN`]); the last
/// value read.
async fn until_at_least<F, Fut>(at_least: f64, read: F) -> f64
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = f64>,
{
    let since = Instant::now();
    loop {
        let value = read().await;
        if value >= at_least || since.elapsed() > WITHIN {
            return value;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Run the phase.
pub(super) async fn run(drill: &Arc<Drill>) -> Result<BackgroundFacts, String> {
    let per_lane = drill.n(40, 80);
    drill.begin(Phase::Background, LANES * per_lane + 1);
    let before = waits(drill).await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut lanes = Vec::new();
    for lane in 0..LANES {
        let (drill, stop) = (Arc::clone(drill), Arc::clone(&stop));
        lanes.push(tokio::spawn(async move {
            let mut sent = 0;
            while sent < per_lane && !stop.load(Ordering::Relaxed) {
                let id = format!("interactive-{lane}-{sent}");
                drill
                    .encoder_of(INTERACTIVE_MODEL, Phase::Background, &id, SEQ, "200")
                    .await
                    .judge(|r| r.status == Some(200))
                    .keep(&drill);
                sent += 1;
            }
            sent
        }));
    }
    let interactive_waiting = until_at_least(1.0, || drill.counted("vramguard_requests_waiting ", "")).await;
    let (mut tries, mut waits_counted) = (0, 0.0);
    let mut last = None;
    let since = Instant::now();
    while tries < TRIES && waits_counted < 1.0 {
        let id = format!("background-{tries}");
        tries += 1;
        let try_once = {
            let drill = Arc::clone(drill);
            tokio::spawn(async move {
                let expect = "200 once no interactive request waits";
                drill
                    .classifier_of(Phase::Background, &id, BACKGROUND_MODEL, expect)
                    .await
            })
        };
        // Until its wait is counted (the load stops then, and it runs), or until it is answered
        // without one (it came between two interactive requests: the next one goes).
        loop {
            waits_counted = waits(drill).await - before;
            if waits_counted >= 1.0 || try_once.is_finished() || since.elapsed() > WITHIN {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if waits_counted < 1.0 && try_once.is_finished() {
            keep(drill, try_once).await?;
            waits_counted = waits(drill).await - before;
        } else {
            last = Some(try_once);
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let load_stopped_ms = drill.elapsed_ms();
    let mut interactive_sent = 0;
    for lane in lanes {
        interactive_sent += lane.await.map_err(|e| format!("an interactive lane failed: {e}"))?;
    }
    if let Some(try_once) = last {
        keep(drill, try_once).await?;
    }
    Ok(BackgroundFacts {
        interactive_waiting,
        waits_counted,
        background_sent: tries,
        interactive_sent,
        load_stopped_ms,
    })
}

/// Judge and keep a background request's record once it is answered.
async fn keep(drill: &Drill, request: tokio::task::JoinHandle<Record>) -> Result<(), String> {
    let record = request
        .await
        .map_err(|e| format!("a background request's task failed: {e}"))?;
    record.judge(|r| r.status == Some(200)).keep(drill);
    Ok(())
}

/// The phase's criterion: interactive requests were seen waiting, the target counted the
/// background request's wait for them, and served it.
pub(super) fn criterion(records: &[Record], facts: Option<&BackgroundFacts>) -> Criterion {
    const NAME: &str = "background service gives way to interactive";
    let Some(facts) = facts else {
        return Criterion {
            name: NAME,
            measured: "the phase did not run".into(),
            passed: false,
        };
    };
    let background: Vec<&Record> = records
        .iter()
        .filter(|r| r.phase == Phase::Background && r.kind.starts_with(BACKGROUND_MODEL))
        .collect();
    let Some(last) = background.last() else {
        return Criterion {
            name: NAME,
            measured: "no background request was recorded".into(),
            passed: false,
        };
    };
    let served = background.iter().filter(|r| r.status == Some(200)).count();
    // Once no interactive request waits, even for a moment between two of the load's, the
    // target may let one run: it need not outlast the load.
    let answered_ms = last.sent_ms + last.latency_ms;
    let measured = format!(
        "{} interactive waiting, {} wait counted, {} sent; background {} of {} answered 200, the last after {:.0} ms, {} the load stopped",
        facts.interactive_waiting,
        facts.waits_counted,
        facts.interactive_sent,
        served,
        background.len(),
        last.latency_ms,
        if answered_ms >= facts.load_stopped_ms {
            "after"
        } else {
            "before"
        }
    );
    Criterion {
        name: NAME,
        measured,
        passed: facts.interactive_waiting >= 1.0 && facts.waits_counted >= 1.0 && served == background.len(),
    }
}
