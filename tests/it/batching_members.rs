//! A batch's members each keep their own life (`models[].batching`), on a fake backend that
//! echoes its input and can be held on a gate, with tokio's paused clock: a member whose
//! deadline passes gets its deadline error while the others' rows run; a member whose client
//! goes away is left out; a batch whose members have all gone is never run; and the policy is
//! asked once for the batch, seeing its rows and its estimate.
//!
//! Synchronization is explicit: the backend says when a run started, the test waits until
//! the batcher holds the rows it sent, and releases the gate itself.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use vramguard::core::backend::{Backend, BackendError, RunMeta};
use vramguard::core::tensor::{Tensor, TensorData};
use vramguard::runtime::estimate::Dims;
use vramguard::serve::batching::{Batchers, Series};
use vramguard::serve::lifecycle::{self, DeadlineMiss, Refused, Request, RequestError, Served};
use vramguard::serve::service::Service;
use vramguard::testing::fakes::{self, FakeFactory, encoder_request};
use vramguard::testing::{Scratch, config};

/// A first value that holds the run until the test releases the gate.
const WAIT_FOR_GATE: f32 = -2.0;

/// Echoes its input as `pooled`; counts its runs; says when a gated run starts.
struct Echo {
    gate: Arc<Mutex<mpsc::Receiver<()>>>,
    started: UnboundedSender<()>,
    runs: Arc<AtomicUsize>,
}

impl Backend for Echo {
    fn run(&mut self, _: &str, inputs: Vec<Tensor>, _: &[String], _: &RunMeta) -> Result<Vec<Tensor>, BackendError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let input = inputs.into_iter().next().expect("one input");
        if matches!(&input.data, TensorData::Fp32(v) if v.first() == Some(&WAIT_FOR_GATE)) {
            let _ = self.started.send(());
            let _ = self.gate.lock().unwrap().recv();
        }
        Ok(vec![Tensor {
            name: "pooled".into(),
            ..input
        }])
    }

    vramguard::testing::fakes::lacks!(residency, generations, arenas, liveness, interrupts);
}

struct Harness {
    service: Arc<Service>,
    batchers: Arc<Batchers>,
    release: mpsc::Sender<()>,
    started: UnboundedReceiver<()>,
    runs: Arc<AtomicUsize>,
    _script: Scratch,
}

/// `encoder` with batching (up to 8 rows, `max_delay`) on one CPU worker, under `policy`.
fn harness(policy: &str, max_delay: &str) -> Harness {
    harness_on(policy, max_delay, "provider: cpu, workers: 1")
}

/// [`harness`] on the pool `cpu` that `pool` describes (its provider, device and workers).
fn harness_on(policy: &str, max_delay: &str, pool: &str) -> Harness {
    let script = Scratch::new();
    let yaml = format!(
        "devices: [{{name: gpu0, kind: simulated, capacity: 4GiB}}]\n\
         models:\n\
         - {{name: encoder, path: 'builtin:encoder', context: {{input: input, axis: 1}}, batching: {{max_batch: 8, max_delay: {max_delay}}}}}\n\
         - {{name: plain, path: 'builtin:encoder', context: {{input: input, axis: 1}}}}\n\
         pools: [{{name: cpu, {pool}, models: [encoder, plain], queue: {{capacity: 8, max_wait: 1h}}}}]\n{}",
        script.policy(policy)
    );
    let (release, gate) = mpsc::channel();
    let gate = Arc::new(Mutex::new(gate));
    let (tell, started) = unbounded_channel();
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let factory = Arc::new(FakeFactory::new(move |_| {
        Ok(Box::new(Echo {
            gate: Arc::clone(&gate),
            started: tell.clone(),
            runs: Arc::clone(&counted),
        }))
    }));
    let service = Arc::new(fakes::service(config::validated(&yaml), factory));
    Harness {
        batchers: Arc::new(Batchers::new(Arc::clone(&service))),
        service,
        release,
        started,
        runs,
        _script: script,
    }
}

fn spawn(h: &Harness, request: Request) -> tokio::task::JoinHandle<Result<Served, Refused>> {
    let batchers = Arc::clone(&h.batchers);
    tokio::spawn(async move { batchers.infer(request).await })
}

/// A request of 4 positions, every value `value`.
fn member(value: f32) -> Request {
    encoder_request(4, value)
}

/// Hold the only worker with a gated run, and wait until it runs.
async fn hold_the_worker(h: &mut Harness) -> tokio::task::JoinHandle<Result<Served, Refused>> {
    let held = spawn(h, member(WAIT_FOR_GATE));
    h.started.recv().await.expect("the gated run starts");
    held
}

/// Wait until the batcher holds `rows` rows in batches that have not gone.
async fn rows_waiting(h: &Harness, rows: u64) {
    let batcher = h.batchers.batcher("encoder").expect("batching is configured");
    while batcher.waiting_rows() != rows {
        tokio::task::yield_now().await;
    }
}

/// The values of a member's answer: its own rows, echoed.
fn echoed(answer: Result<Served, Refused>) -> Vec<f32> {
    let served = answer.unwrap_or_else(|r| panic!("refused: {}", r.error));
    assert_eq!(served.outputs[0].shape, vec![1, 4, 4], "its own row only");
    match &served.outputs[0].data {
        TensorData::Fp32(v) => v.clone(),
        other => panic!("{other:?}"),
    }
}

fn runs_and_rows(h: &Harness) -> (f64, f64) {
    let text = vramguard::telemetry::metrics::encode(&h.service.registry);
    let labels = r#"{model="encoder",pool="cpu"}"#;
    (
        crate::common::sample(&text, &format!("vramguard_batch_rows_count{labels}")),
        crate::common::sample(&text, &format!("vramguard_batch_rows_sum{labels}")),
    )
}

#[tokio::test(start_paused = true)]
async fn a_member_whose_deadline_passes_gets_its_error_and_the_others_run() {
    let mut h = harness(vramguard::testing::ADMIT_ALL, "60s");
    let held = hold_the_worker(&mut h).await;
    let mut late = member(1.0);
    late.meta.deadline = Some((tokio::time::Instant::now() + Duration::from_secs(1)).into_std());
    let late = spawn(&h, late);
    let (b, c) = (spawn(&h, member(2.0)), spawn(&h, member(3.0)));
    rows_waiting(&h, 3).await;
    // The worker is held: the deadline passes while its batch waits.
    let refused = late.await.unwrap().expect_err("its deadline passed");
    assert_eq!(refused.error, RequestError::Deadline(DeadlineMiss::InPool));
    h.release.send(()).unwrap();
    assert!(echoed(held.await.unwrap()).iter().all(|v| *v == WAIT_FOR_GATE));
    assert!(echoed(b.await.unwrap()).iter().all(|v| *v == 2.0));
    assert!(echoed(c.await.unwrap()).iter().all(|v| *v == 3.0));
    // The late member's row was left out of the run.
    assert_eq!(runs_and_rows(&h), (2.0, 3.0));
}

#[tokio::test(start_paused = true)]
async fn a_member_whose_client_goes_away_is_left_out_and_the_others_run() {
    let mut h = harness(vramguard::testing::ADMIT_ALL, "60s");
    let held = hold_the_worker(&mut h).await;
    let gone = spawn(&h, member(1.0));
    let (b, c) = (spawn(&h, member(2.0)), spawn(&h, member(3.0)));
    rows_waiting(&h, 3).await;
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    h.release.send(()).unwrap();
    held.await.unwrap().unwrap();
    assert!(echoed(b.await.unwrap()).iter().all(|v| *v == 2.0));
    assert!(echoed(c.await.unwrap()).iter().all(|v| *v == 3.0));
    assert_eq!(runs_and_rows(&h), (2.0, 3.0));
    let text = vramguard::telemetry::metrics::encode(&h.service.registry);
    let cancelled = r#"vramguard_requests_total{model="encoder",pool="",outcome="cancelled"}"#;
    assert_eq!(crate::common::sample(&text, cancelled), 1.0);
}

#[tokio::test(start_paused = true)]
async fn a_queued_batch_whose_members_all_went_away_never_runs() {
    let mut h = harness(vramguard::testing::ADMIT_ALL, "1s");
    let held = hold_the_worker(&mut h).await;
    let members = [spawn(&h, member(1.0)), spawn(&h, member(2.0))];
    rows_waiting(&h, 2).await;
    // Another model's request waits in the pool's queue: past its delay the batch goes there
    // too, to keep its place, and waits behind it.
    let mut other = encoder_request(4, 7.0);
    other.model = "plain".into();
    let other = spawn(&h, other);
    let pool = Arc::clone(&h.service.pools[0]);
    while pool.load().queue_depth < 2 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for member in members {
        member.abort();
        assert!(member.await.unwrap_err().is_cancelled());
    }
    h.release.send(()).unwrap();
    held.await.unwrap().unwrap();
    echoed(other.await.unwrap());
    // A request after it: by its answer the worker has taken the queue in order.
    echoed(lifecycle::infer(&h.service, member(5.0)).await);
    let runs = h.runs.load(Ordering::SeqCst);
    assert_eq!(
        runs, 3,
        "the held run, the other model's and the one after; not the batch"
    );
}

#[tokio::test(start_paused = true)]
async fn the_policy_is_asked_once_for_the_batch_and_sees_its_rows_and_estimate() {
    let h = harness(
        "fn decide(req, state) {\n\
           if req.batch > 1 { return reject(\"batch \" + req.batch + \" of \" + req.estimate.total_bytes); }\n\
           admit()\n\
         }\n",
        "60s",
    );
    let answers = [spawn(&h, member(1.0)), spawn(&h, member(2.0)), spawn(&h, member(3.0))];
    let entry = h.service.model("encoder").unwrap();
    let estimate = entry.estimate(&Dims::new(&[3, 4])).total_bytes;
    for answer in answers {
        let refused = answer.await.unwrap().expect_err("the policy refused the batch");
        assert_eq!(
            refused.error.to_string(),
            format!("rejected by policy: batch 3 of {estimate}")
        );
    }
    let text = vramguard::telemetry::metrics::encode(&h.service.registry);
    let rejected = crate::common::sum_samples(&text, |l| {
        l.starts_with("vramguard_policy_decisions_total{") && l.contains("action=\"reject\"")
    });
    assert_eq!(rejected, 1.0, "one decision for the three");
    // Alone, a request is a batch of one, which it admits.
    echoed(lifecycle::infer(&h.service, member(4.0)).await);
}

/// Place `request` as the next run of `series`; the task gives the series back with the answer.
fn spawn_next(
    h: &Harness,
    request: Request,
    series: Series,
) -> tokio::task::JoinHandle<(Result<Served, Refused>, Series)> {
    let batchers = Arc::clone(&h.batchers);
    tokio::spawn(async move { (batchers.place_next(request, &series).await, series) })
}

/// Wait (yielding, so the paused clock stands still) until the batcher holds no rows: a batch
/// that went on a notification, not on a timer. False when it did not within many turns.
async fn batch_went(h: &Harness) -> bool {
    let batcher = h.batchers.batcher("encoder").expect("batching is configured");
    for _ in 0..10_000 {
        if batcher.waiting_rows() == 0 {
            return true;
        }
        tokio::task::yield_now().await;
    }
    false
}

#[tokio::test(start_paused = true)]
async fn a_batch_that_could_go_waits_for_a_series_between_its_runs() {
    let h = harness(vramguard::testing::ADMIT_ALL, "1h");
    let batcher = h.batchers.batcher("encoder").expect("batching is configured");
    // A transcription preparing its next window: the worker is free, yet the lone request's
    // batch waits for it, and they run as one.
    let series = h.batchers.series("encoder");
    let lone = spawn(&h, member(1.0));
    rows_waiting(&h, 1).await;
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert_eq!(batcher.waiting_rows(), 1, "still waiting for the series");
    let next = spawn_next(&h, member(2.0), series);
    assert!(echoed(lone.await.unwrap()).iter().all(|v| *v == 1.0));
    let (answer, series) = next.await.unwrap();
    assert!(echoed(answer).iter().all(|v| *v == 2.0));
    assert_eq!(runs_and_rows(&h), (1.0, 2.0), "one run of both rows");
    // Its run is over: it is due again until it ends, and its end lets the batch go.
    let waiting = spawn(&h, member(3.0));
    rows_waiting(&h, 1).await;
    drop(series);
    assert!(batch_went(&h).await, "the series' end let the batch go");
    echoed(waiting.await.unwrap());
    // No series: a lone request waits for nothing.
    let alone = spawn(&h, member(4.0));
    assert!(batch_went(&h).await);
    echoed(alone.await.unwrap());
    assert_eq!(runs_and_rows(&h), (3.0, 4.0));
}

#[tokio::test(start_paused = true)]
async fn a_series_that_does_not_come_is_waited_for_up_to_max_delay() {
    let h = harness(vramguard::testing::ADMIT_ALL, "1s");
    let batcher = h.batchers.batcher("encoder").expect("batching is configured");
    let _series = h.batchers.series("encoder");
    let lone = spawn(&h, member(1.0));
    rows_waiting(&h, 1).await;
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(batcher.waiting_rows(), 1, "waiting for the series");
    echoed(lone.await.unwrap());
    assert_eq!(runs_and_rows(&h), (1.0, 1.0));
}

/// Four series in step (transcriptions whose next windows come together) on a pool of two
/// workers: on a CPU pool, whose workers each have their own cores, two runs of two rows, one
/// per worker; on an accelerator's pool, whose workers share the device, one run of four.
#[tokio::test(start_paused = true)]
async fn series_in_step_share_a_cpu_pools_free_workers_and_an_accelerators_one_run() {
    let pools = [
        ("provider: cpu, workers: 2, isolation: thread", (2.0, 4.0)),
        (
            "provider: simulated, device: gpu0, workers: 2, isolation: thread",
            (1.0, 4.0),
        ),
    ];
    for (pool, want) in pools {
        let h = harness_on(vramguard::testing::ADMIT_ALL, "1h", pool);
        let series: Vec<Series> = (0..4).map(|_| h.batchers.series("encoder")).collect();
        let next: Vec<_> = (series.into_iter().enumerate())
            .map(|(i, series)| spawn_next(&h, member(i as f32 + 1.0), series))
            .collect();
        let mut kept = Vec::new();
        for (i, task) in next.into_iter().enumerate() {
            let (answer, series) = task.await.unwrap();
            assert!(
                echoed(answer).iter().all(|v| *v == i as f32 + 1.0),
                "{pool}: its own rows"
            );
            kept.push(series);
        }
        assert_eq!(runs_and_rows(&h), want, "{pool}: runs and rows");
    }
}
