//! The background phase: a background service's request sent while interactive requests wait
//! must give way to them, and run once they no longer wait.
//!
//! Interactive load comes from closed-loop lanes of requests of an interactive service that
//! runs one request at a time (`concurrency: 1`), so that some of them always wait, whatever
//! the speed of the target and of the drill. Once `vramguard_requests_waiting` shows them waiting, one request of the
//! background service's model goes; the load keeps going until the target has counted that
//! request's wait (`vramguard_service_waits_total{reason="background"}`), then stops, and the
//! background request must be answered (the target may let it run at a moment between two
//! interactive requests, before the load stops). Each lane sends at most a bounded number of requests,
//! so the phase ends by itself on a target that never holds the background request back, and
//! the criterion then says so.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::client::Drill;
use super::phases::Phase;
use super::record::Record;
use super::report::Criterion;
use super::{BACKGROUND_MODEL, BACKGROUND_SERVICE, INTERACTIVE_MODEL};

/// Closed-loop lanes of interactive requests. Their service runs one request at a time, so
/// whenever two lanes have a request outstanding, one of them waits.
const LANES: usize = 6;
/// Tokens of each interactive request: enough that its run on one CPU thread, not the HTTP
/// exchange, is most of its time, so that the lanes' requests wait for each other.
const SEQ: usize = 1024;
/// How long to wait for interactive requests to show waiting, and then for the background
/// request's wait to be counted.
const WITHIN: Duration = Duration::from_secs(5);

/// What the background phase saw beside its requests.
#[derive(Debug, Default, Clone, Serialize)]
pub struct BackgroundFacts {
    /// The most interactive requests `vramguard_requests_waiting` showed waiting before the
    /// background request went.
    pub interactive_waiting: f64,
    /// Waits the target counted for the background service, reason `background`, meanwhile.
    pub waits_counted: f64,
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
    let background = {
        let drill = Arc::clone(drill);
        tokio::spawn(async move {
            drill
                .classifier_of(
                    Phase::Background,
                    "background-0",
                    BACKGROUND_MODEL,
                    "200 once no interactive request waits",
                )
                .await
        })
    };
    let waits_counted = until_at_least(before + 1.0, || waits(drill)).await - before;
    stop.store(true, Ordering::Relaxed);
    let load_stopped_ms = drill.elapsed_ms();
    let mut interactive_sent = 0;
    for lane in lanes {
        interactive_sent += lane.await.map_err(|e| format!("an interactive lane failed: {e}"))?;
    }
    let record = background
        .await
        .map_err(|e| format!("the background request's task failed: {e}"))?;
    record.judge(|r| r.status == Some(200)).keep(drill);
    Ok(BackgroundFacts {
        interactive_waiting,
        waits_counted,
        interactive_sent,
        load_stopped_ms,
    })
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
    let background = records
        .iter()
        .find(|r| r.phase == Phase::Background && r.kind.starts_with(BACKGROUND_MODEL));
    let Some(background) = background else {
        return Criterion {
            name: NAME,
            measured: "no background request was recorded".into(),
            passed: false,
        };
    };
    let served = background.status == Some(200);
    // Once no interactive request waits, even for a moment between two of the load's, the
    // target may let it run: it need not outlast the load.
    let answered_ms = background.sent_ms + background.latency_ms;
    let measured = format!(
        "{} interactive waiting, {} wait counted, {} sent; background {} after {:.0} ms, {} the load stopped",
        facts.interactive_waiting,
        facts.waits_counted,
        facts.interactive_sent,
        background.status.map_or("no answer".into(), |s| s.to_string()),
        background.latency_ms,
        if answered_ms >= facts.load_stopped_ms {
            "after"
        } else {
            "before"
        }
    );
    Criterion {
        name: NAME,
        measured,
        passed: facts.interactive_waiting >= 1.0 && facts.waits_counted >= 1.0 && served,
    }
}
