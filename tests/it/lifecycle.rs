//! The request lifecycle without ONNX Runtime: a service assembled from a fake backend factory,
//! driven through `lifecycle::infer` with tokio's paused clock, so deferrals and deadlines take
//! no real time and nothing here depends on how fast the machine is.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use axum::http::StatusCode;
use tokio::time::Instant;
use vramguard::core::backend::{Backend, BackendError, Interrupts, RunMeta};
use vramguard::core::snapshot::Action;
use vramguard::core::tensor::{Tensor, TensorData};
use vramguard::http::status_of;
use vramguard::serve::lifecycle::{self, DeadlineMiss, Refused, Request, RequestError, Served};
use vramguard::serve::metrics::Outcome;
use vramguard::serve::service::Service;
use vramguard::testing::fakes::{self, FakeFactory, encoder_request};
use vramguard::testing::{Scratch, config};

/// What the fake backend does with a run, chosen by the first input value.
const PANIC: f32 = -1.0;
const WAIT_FOR_GATE: f32 = -2.0;
const SLOW: f32 = -3.0;
const SPIN: f32 = -4.0;

/// Echoes its input as `pooled`; panics or waits for the gate when the first value says so.
struct FakeBackend {
    gate: Arc<Mutex<mpsc::Receiver<()>>>,
    /// Set by the interrupt handle; a `SPIN` run ends when it is.
    interrupted: Arc<std::sync::atomic::AtomicBool>,
}

impl Backend for FakeBackend {
    fn run(
        &mut self,
        _model: &str,
        inputs: Vec<Tensor>,
        _outputs: &[String],
        _: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        let input = inputs.into_iter().next().expect("one input");
        let first = match &input.data {
            TensorData::Fp32(v) => v.first().copied().unwrap_or(0.0),
            _ => 0.0,
        };
        if first == PANIC {
            panic!("the fake backend was told to panic");
        }
        if first == SPIN {
            let until = std::time::Instant::now() + Duration::from_secs(10);
            while !self.interrupted.load(Ordering::SeqCst) {
                assert!(std::time::Instant::now() < until, "never interrupted");
                std::thread::sleep(Duration::from_millis(1));
            }
            return Err(BackendError::Cancelled);
        }
        if first == SLOW {
            std::thread::sleep(Duration::from_millis(50));
        }
        if first == WAIT_FOR_GATE {
            let _ = self.gate.lock().unwrap().recv();
        }
        Ok(vec![Tensor {
            name: "pooled".into(),
            ..input
        }])
    }

    vramguard::testing::fakes::lacks!(residency, generations, arenas, liveness);

    fn interrupts(&mut self) -> Option<&mut dyn Interrupts> {
        Some(self)
    }
}

impl Interrupts for FakeBackend {
    fn interrupt_handle(&self) -> vramguard::core::backend::Interrupt {
        let interrupted = Arc::clone(&self.interrupted);
        Arc::new(move || interrupted.store(true, Ordering::SeqCst))
    }

    fn clear_interrupt(&mut self) {
        self.interrupted.store(false, Ordering::SeqCst);
    }
}

struct Harness {
    service: Arc<Service>,
    factory: Arc<FakeFactory>,
    release: mpsc::Sender<()>,
    _script: Scratch,
}

/// A service with pools `gpu` (tried first) and `cpu`, both serving `encoder`, one worker each;
/// the pools named in `broken` get no backend.
fn harness(policy: &str, broken: &[&str], gpu_queue: &str) -> Harness {
    let script = Scratch::new();
    let yaml = format!(
        "models: [{{name: encoder, path: 'builtin:encoder', context: {{input: input, axis: 1, keep: end}}}}]\n\
         pools:\n\
         - {{name: gpu, provider: cpu, models: [encoder], workers: 1, queue: {gpu_queue}}}\n\
         - {{name: cpu, provider: cpu, models: [encoder], workers: 1}}\n{}",
        script.policy(policy)
    );
    let (release, gate) = mpsc::channel();
    let gate = Arc::new(Mutex::new(gate));
    let broken: Vec<String> = broken.iter().map(|s| s.to_string()).collect();
    let factory = Arc::new(FakeFactory::new(move |pool| {
        if broken.contains(&pool.name) {
            return Err(format!("no device for `{}` (fake)", pool.name));
        }
        Ok(Box::new(FakeBackend {
            gate: Arc::clone(&gate),
            interrupted: Arc::default(),
        }))
    }));
    let service = Arc::new(fakes::service(config::validated(&yaml), factory.clone()));
    Harness {
        service,
        factory,
        release,
        _script: script,
    }
}

fn simple(policy: &str) -> Harness {
    harness(policy, &[], "{capacity: 8, max_wait: 1s}")
}

async fn served(h: &Harness, request: Request) -> Served {
    match lifecycle::infer(&h.service, request).await {
        Ok(served) => served,
        Err(refused) => panic!("refused: {}", refused.error),
    }
}

async fn refused(h: &Harness, request: Request) -> Refused {
    match lifecycle::infer(&h.service, request).await {
        Ok(served) => panic!("served on {} ({})", served.pool.name(), served.action),
        Err(refused) => refused,
    }
}

fn counter(h: &Harness, needle: &str) -> f64 {
    crate::common::sample(&vramguard::telemetry::metrics::encode(&h.service.registry), needle)
}

#[tokio::test(start_paused = true)]
async fn admit_runs_on_the_first_ready_pool_and_counts_ok() {
    let h = simple("fn decide(req, state) { admit() }");
    let s = served(&h, encoder_request(8, 0.5)).await;
    assert_eq!(s.pool.name(), "gpu");
    assert_eq!(s.action, Action::Admit);
    assert_eq!(s.context, None);
    assert_eq!(s.outputs[0].shape, vec![1, 8, 4]);
    assert_eq!(
        counter(
            &h,
            "vramguard_requests_total{model=\"encoder\",pool=\"gpu\",outcome=\"ok\"}"
        ),
        1.0
    );
    assert_eq!(
        counter(&h, "vramguard_policy_decisions_total{action=\"admit\",pool=\"gpu\"}"),
        1.0
    );
}

#[tokio::test(start_paused = true)]
async fn redirect_runs_on_the_named_pool() {
    let h = simple(r#"fn decide(req, state) { redirect("cpu") }"#);
    let s = served(&h, encoder_request(8, 0.5)).await;
    assert_eq!((s.pool.name(), s.action), ("cpu", Action::Redirect));
}

#[tokio::test(start_paused = true)]
async fn shrink_cuts_the_context_axis_keeping_the_configured_end() {
    let h = simple("fn decide(req, state) { shrink_context(3) }");
    let mut req = encoder_request(8, 0.0);
    req.meta.allow_shrink = true;
    req.inputs[0].data = TensorData::Fp32((0..32).map(|i| i as f32).collect());
    let s = served(&h, req).await;
    assert_eq!(s.action, Action::ShrinkContext);
    assert_eq!(s.context, Some((8, 3)));
    assert_eq!(s.outputs[0].shape, vec![1, 3, 4]);
    // keep: end — the last three tokens survive.
    assert_eq!(
        s.outputs[0].data,
        TensorData::Fp32((20..32).map(|i| i as f32).collect())
    );
}

#[tokio::test(start_paused = true)]
async fn a_shrink_the_client_did_not_allow_takes_the_fallback_with_the_whole_context() {
    let h = simple("fn decide(req, state) { shrink_context(3) }");
    let s = served(&h, encoder_request(8, 0.5)).await;
    // The configured fallback is admit: the request runs whole on the router's pool.
    assert_eq!((s.pool.name(), s.action, s.context), ("gpu", Action::Admit, None));
    assert_eq!(s.outputs[0].shape, vec![1, 8, 4]);
    assert_eq!(counter(&h, "vramguard_policy_errors_total{kind=\"bad_return\"}"), 1.0);
}

#[tokio::test(start_paused = true)]
async fn a_decision_that_cannot_be_carried_out_takes_the_fallback() {
    let h = simple(r#"fn decide(req, state) { if req.priority == 7 { redirect("nowhere") } else { admit() } }"#);
    let mut req = encoder_request(4, 0.5);
    req.meta.priority = 7;
    let s = served(&h, req).await;
    // The configured fallback is admit: the router's pool runs it.
    assert_eq!((s.pool.name(), s.action), ("gpu", Action::Admit));
    assert_eq!(counter(&h, "vramguard_policy_errors_total{kind=\"bad_return\"}"), 1.0);
}

#[tokio::test(start_paused = true)]
async fn a_script_that_fails_at_run_time_takes_the_fallback() {
    let h = simple(r#"fn decide(req, state) { if req.priority == 7 { throw "broken"; } admit() }"#);
    let mut req = encoder_request(4, 0.5);
    req.meta.priority = 7;
    let s = served(&h, req).await;
    assert_eq!((s.pool.name(), s.action), ("gpu", Action::Admit));
    assert_eq!(counter(&h, "vramguard_policy_errors_total{kind=\"runtime\"}"), 1.0);
}

#[tokio::test(start_paused = true)]
async fn reject_answers_503_with_the_reason_and_retry_after() {
    let h = simple(r#"fn decide(req, state) { if req.priority == 7 { reject("host memory low") } else { admit() } }"#);
    let mut req = encoder_request(4, 0.5);
    req.meta.priority = 7;
    let r = refused(&h, req).await;
    assert_eq!(status_of(&r.error), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.error.outcome(), Outcome::rejected);
    assert!(r.error.to_string().contains("host memory low"), "{}", r.error);
    assert_eq!(r.error.retry_after_secs(), Some(1));
}

#[tokio::test(start_paused = true)]
async fn deferral_is_bounded_by_the_pools_max_wait() {
    let h = simple("fn decide(req, state) { if req.priority == 7 { defer(300) } else { admit() } }");
    let mut req = encoder_request(4, 0.5);
    req.meta.priority = 7;
    let started = Instant::now();
    let r = refused(&h, req).await;
    // max_wait 1s: three deferrals of 300ms fit, the fourth would pass it.
    assert_eq!(started.elapsed(), Duration::from_millis(900));
    assert_eq!(status_of(&r.error), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.error.outcome(), Outcome::deferred_timeout);
    assert_eq!(r.error.retry_after_secs(), Some(1));
    assert!(
        matches!(&r.error, RequestError::DeferredTooLong { deferred, bound, .. }
            if *deferred == Duration::from_millis(900) && *bound == Duration::from_secs(1)),
        "{:?}",
        r.error
    );
    assert_eq!(
        counter(
            &h,
            "vramguard_requests_total{model=\"encoder\",pool=\"\",outcome=\"deferred_timeout\"}"
        ),
        1.0
    );
}

#[tokio::test(start_paused = true)]
async fn a_deferred_request_holds_no_worker_and_runs_once_the_pool_frees() {
    let h = harness(
        r#"fn decide(req, state) { if req.priority == 7 && state.pools["gpu"].inflight > 0 { defer(50) } else { admit() } }"#,
        &[],
        "{capacity: 8, max_wait: 1h}",
    );
    let blocker = tokio::spawn({
        let req = encoder_request(4, WAIT_FOR_GATE);
        let service = Arc::clone(&h.service);
        async move { lifecycle::infer(&service, req).await.map(|s| s.pool.name().to_string()) }
    });
    while h.service.pool("gpu").unwrap().load().inflight == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut deferred = encoder_request(4, 0.5);
    deferred.meta.priority = 7;
    let waiting = tokio::spawn({
        let service = Arc::clone(&h.service);
        async move {
            lifecycle::infer(&service, deferred)
                .await
                .map(|s| s.pool.name().to_string())
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Deferred, not queued: the pool's queue is empty while the first request runs.
    assert_eq!(h.service.pool("gpu").unwrap().load().queue_depth, 0);
    assert!(!waiting.is_finished());
    h.release.send(()).unwrap();
    assert_eq!(blocker.await.unwrap().unwrap(), "gpu");
    assert_eq!(waiting.await.unwrap().unwrap(), "gpu");
    assert!(counter(&h, "vramguard_policy_decisions_total{action=\"defer\",pool=\"gpu\"}") >= 1.0);
}

/// `vramguard_requests_waiting` and `vramguard_requests_running`, what the endpoint picker reads.
fn picker_load(h: &Harness) -> (f64, f64) {
    (
        counter(h, "vramguard_requests_waiting "),
        counter(h, "vramguard_requests_running "),
    )
}

#[tokio::test(start_paused = true)]
async fn the_pickers_gauges_count_deferred_and_queued_requests_as_waiting_until_they_run() {
    let h = harness(
        r#"fn decide(req, state) { if req.priority == 7 && state.pools["gpu"].inflight > 0 { defer(50) } else { admit() } }"#,
        &[],
        "{capacity: 8, max_wait: 1h}",
    );
    assert_eq!(picker_load(&h), (0.0, 0.0));
    let spawn = |req: Request| {
        let service = Arc::clone(&h.service);
        tokio::spawn(async move { lifecycle::infer(&service, req).await.is_ok() })
    };
    // One runs on the only worker, one queues behind it, one is deferred by the policy.
    let running = spawn(encoder_request(4, WAIT_FOR_GATE));
    // The request counts as running once its worker starts the run, a moment after the pool
    // counts the job in flight (on a loaded machine, after paused time has jumped ahead).
    while picker_load(&h).1 == 0.0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let queued = spawn(encoder_request(4, WAIT_FOR_GATE));
    while h.service.pool("gpu").unwrap().load().queue_depth == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut req = encoder_request(4, 0.5);
    req.meta.priority = 7;
    let deferred = spawn(req);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(picker_load(&h), (2.0, 1.0));

    // The first ends, the queued one starts; the deferred one still waits behind it. The pool
    // counts a job in flight when its worker takes it, a moment before the run starts and the
    // request counts as running: wait for that, not for the pool's count.
    h.release.send(()).unwrap();
    assert!(running.await.unwrap());
    for _ in 0..10_000 {
        if picker_load(&h).1 > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(picker_load(&h), (1.0, 1.0));

    h.release.send(()).unwrap();
    assert!(queued.await.unwrap());
    assert!(deferred.await.unwrap());
    assert_eq!(picker_load(&h), (0.0, 0.0));
}

#[tokio::test(start_paused = true)]
async fn a_deadline_the_deferral_would_pass_is_a_504() {
    let h = simple("fn decide(req, state) { if req.priority == 7 { defer(100) } else { admit() } }");
    let mut req = encoder_request(4, 0.5);
    req.meta.priority = 7;
    req.meta.deadline = Some((Instant::now() + Duration::from_millis(250)).into_std());
    let r = refused(&h, req).await;
    assert_eq!(r.error, RequestError::Deadline(DeadlineMiss::ByDeferral));
    assert_eq!(status_of(&r.error), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(r.error.outcome(), Outcome::cancelled);
}

#[tokio::test(start_paused = true)]
async fn a_deadline_that_passes_during_the_run_is_a_504_and_the_pool_recovers() {
    let h = simple("fn decide(req, state) { admit() }");
    let mut req = encoder_request(4, WAIT_FOR_GATE);
    req.meta.deadline = Some((Instant::now() + Duration::from_secs(2)).into_std());
    let r = refused(&h, req).await;
    assert_eq!(r.error, RequestError::Deadline(DeadlineMiss::InPool));
    assert_eq!(r.pool.as_ref().map(|p| p.name()), Some("gpu"));
    h.release.send(()).unwrap();
    let s = served(&h, encoder_request(4, 0.5)).await;
    assert_eq!(s.pool.name(), "gpu");
    assert_eq!(h.service.pool("gpu").unwrap().load().inflight, 0);
    assert_eq!(
        counter(
            &h,
            "vramguard_requests_total{model=\"encoder\",pool=\"gpu\",outcome=\"cancelled\"}"
        ),
        1.0
    );
}

#[tokio::test(start_paused = true)]
async fn a_panicking_backend_fails_only_its_request_and_the_worker_is_replaced() {
    let h = simple("fn decide(req, state) { admit() }");
    let built = h.factory.built();
    let r = refused(&h, encoder_request(4, PANIC)).await;
    assert_eq!(r.error, RequestError::Failed { pool: "gpu".into() });
    assert_eq!(status_of(&r.error), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(r.error.outcome(), Outcome::failed);
    // The same single worker serves the next request, on a fresh backend.
    let s = served(&h, encoder_request(4, 0.5)).await;
    assert_eq!(s.pool.name(), "gpu");
    assert_eq!(h.factory.built(), built + 1);
    let load = h.service.pool("gpu").unwrap().load();
    assert_eq!((load.inflight, load.queue_depth), (0, 0));
    assert!(h.service.pool("gpu").unwrap().is_ready());
}

#[tokio::test(start_paused = true)]
async fn an_unavailable_pool_is_skipped_and_no_pool_at_all_is_a_503() {
    let h = harness("fn decide(req, state) { admit() }", &["gpu"], "{capacity: 8}");
    let s = served(&h, encoder_request(4, 0.5)).await;
    assert_eq!(s.pool.name(), "cpu");

    let none = harness("fn decide(req, state) { admit() }", &["gpu", "cpu"], "{capacity: 8}");
    let r = refused(&none, encoder_request(4, 0.5)).await;
    assert_eq!(status_of(&r.error), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.error.retry_after_secs(), Some(5));
    let text = r.error.to_string();
    assert!(
        text.contains("no pool can take `encoder`") && text.contains("gpu: no device for `gpu` (fake)"),
        "{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_is_a_503_and_accepted_work_still_completes() {
    let h = harness("fn decide(req, state) { admit() }", &[], "{capacity: 1}");
    let running = tokio::spawn({
        let service = Arc::clone(&h.service);
        async move {
            lifecycle::infer(&service, encoder_request(4, WAIT_FOR_GATE))
                .await
                .is_ok()
        }
    });
    while h.service.pool("gpu").unwrap().load().inflight == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let queued = tokio::spawn({
        let service = Arc::clone(&h.service);
        async move { lifecycle::infer(&service, encoder_request(4, 0.5)).await.is_ok() }
    });
    while h.service.pool("gpu").unwrap().load().queue_depth == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let r = refused(&h, encoder_request(4, 0.5)).await;
    assert!(
        matches!(r.error, RequestError::QueueFull { capacity: 1, .. }),
        "{:?}",
        r.error
    );
    assert_eq!(status_of(&r.error), StatusCode::SERVICE_UNAVAILABLE);
    h.release.send(()).unwrap();
    assert!(running.await.unwrap());
    assert!(queued.await.unwrap());
}

#[tokio::test(start_paused = true)]
async fn unknown_models_are_404_and_not_counted() {
    let h = simple("fn decide(req, state) { admit() }");
    let mut req = encoder_request(4, 0.5);
    req.model = "nope".into();
    let r = refused(&h, req).await;
    assert_eq!(status_of(&r.error), StatusCode::NOT_FOUND);
    assert!(r.error.to_string().contains("models: encoder"), "{}", r.error);
    assert!(!vramguard::telemetry::metrics::encode(&h.service.registry).contains("model=\"nope\""));
}

#[tokio::test(start_paused = true)]
async fn a_deadline_the_queue_cannot_meet_is_answered_at_once() {
    let h = simple("fn decide(req, state) { admit() }");
    // One 50 ms run teaches the pool its service time.
    served(&h, encoder_request(4, SLOW)).await;
    let mut req = encoder_request(4, 0.5);
    req.meta.deadline = Some((Instant::now() + Duration::from_millis(10)).into_std());
    let r = refused(&h, req).await;
    assert_eq!(r.error, RequestError::Deadline(DeadlineMiss::Estimated));
    assert_eq!(status_of(&r.error), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(h.service.pool("gpu").unwrap().load().queue_depth, 0, "never queued");
    assert_eq!(
        counter(
            &h,
            "vramguard_requests_total{model=\"encoder\",pool=\"gpu\",outcome=\"cancelled\"}"
        ),
        1.0
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_that_goes_away_is_counted_cancelled_and_its_queued_job_never_runs() {
    let h = simple("fn decide(req, state) { admit() }");
    let blocker = tokio::spawn({
        let service = Arc::clone(&h.service);
        async move {
            lifecycle::infer(&service, encoder_request(4, WAIT_FOR_GATE))
                .await
                .is_ok()
        }
    });
    while h.service.pool("gpu").unwrap().load().inflight == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let built = h.factory.built();
    let leaving = tokio::spawn({
        let service = Arc::clone(&h.service);
        async move { lifecycle::infer(&service, encoder_request(4, PANIC)).await.is_ok() }
    });
    while h.service.pool("gpu").unwrap().load().queue_depth == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    leaving.abort();
    assert!(leaving.await.unwrap_err().is_cancelled());
    h.release.send(()).unwrap();
    assert!(blocker.await.unwrap());
    // The abandoned job was skipped: had it run, its backend would have panicked and been rebuilt.
    served(&h, encoder_request(4, 0.5)).await;
    assert_eq!(h.factory.built(), built);
    assert_eq!(
        counter(
            &h,
            "vramguard_requests_total{model=\"encoder\",pool=\"\",outcome=\"cancelled\"}"
        ),
        1.0
    );
}

/// A client that goes away while its request runs stops the run (ONNX Runtime's terminate flag
/// in production): the device is not spent on an answer nobody reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_client_went_away_is_interrupted() {
    let h = simple("fn decide(req, state) { admit() }");
    let leaving = tokio::spawn({
        let service = Arc::clone(&h.service);
        async move { lifecycle::infer(&service, encoder_request(4, SPIN)).await.is_ok() }
    });
    let pool = h.service.pool("gpu").unwrap();
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while pool.load().inflight == 0 {
        assert!(std::time::Instant::now() < until, "the run never started");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    leaving.abort();
    assert!(leaving.await.unwrap_err().is_cancelled());
    while pool.load().inflight > 0 {
        assert!(std::time::Instant::now() < until, "the run was not interrupted");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(
        counter(
            &h,
            "vramguard_requests_total{model=\"encoder\",pool=\"\",outcome=\"cancelled\"}"
        ),
        1.0
    );
    // The backend serves the next request normally.
    assert_eq!(served(&h, encoder_request(4, 0.5)).await.pool.name(), "gpu");
}
