//! The pool with fake backends: capacity, shutdown, abandoned and expired requests, queue age,
//! allocator failures, an unavailable pool.

use super::health::RECENT_FAILURE_WINDOW;
use super::*;
use crate::core::backend::{AllocFailureKind, ArenaStats, Arenas, BackendError, Liveness, Residency, RunMeta};
use crate::core::tensor::{Tensor, TensorData};
use std::sync::{Mutex, mpsc};

/// A backend that echoes its inputs, optionally blocking until released.
struct Echo {
    gate: Option<Arc<Mutex<mpsc::Receiver<()>>>>,
}

impl Backend for Echo {
    fn run(&mut self, _: &str, inputs: Vec<Tensor>, _: &[String], _: &RunMeta) -> Result<Vec<Tensor>, BackendError> {
        if let Some(gate) = &self.gate {
            gate.lock().unwrap().recv().unwrap();
        }
        Ok(inputs)
    }
    crate::testing::fakes::lacks!(residency, generations, arenas, liveness, interrupts);
}

/// Pool `p` on the host serving `m`, with room for `capacity` queued runs.
fn config(capacity: usize) -> PoolConfig {
    PoolConfig {
        queue_capacity: capacity,
        max_wait: Duration::from_secs(60),
        ..crate::testing::config::pool("p", "host", &["m"])
    }
}

fn job(v: f32) -> InferJob {
    InferJob {
        meta: RunMeta::default(),
        model: "m".into(),
        inputs: vec![Tensor {
            name: "x".into(),
            shape: vec![1],
            data: TensorData::Fp32(vec![v]),
        }]
        .into(),
        outputs: vec![],
        op: Default::default(),
        estimate_bytes: None,
        memory: RunMemory::default(),
        probe: false,
        cancel: RunCancel::default(),
    }
}

fn gated(capacity: usize) -> (Arc<Pool>, mpsc::Sender<()>) {
    let (tx, rx) = mpsc::channel();
    let gate = Arc::new(Mutex::new(rx));
    let pool = Pool::start(
        config(capacity),
        DeviceClass::Host,
        vec![Box::new(Echo { gate: Some(gate) })],
        None,
        PoolContext::default(),
    );
    (pool, tx)
}

fn wait_until(mut f: impl FnMut() -> bool) {
    for _ in 0..2000 {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("condition not reached");
}

#[test]
fn a_full_queue_refuses_and_accepted_work_completes() {
    let (pool, release) = gated(1);
    let first = pool.submit(job(1.0)).unwrap();
    wait_until(|| pool.load().inflight == 1);
    let second = pool.submit(job(2.0)).unwrap();
    assert_eq!(pool.load().queue_depth, 1);
    assert_eq!(
        pool.submit(job(3.0)).unwrap_err(),
        PoolError::QueueFull {
            pool: "p".into(),
            capacity: 1
        }
    );
    release.send(()).unwrap();
    release.send(()).unwrap();
    assert_eq!(
        first.blocking_recv().unwrap().unwrap()[0].data,
        TensorData::Fp32(vec![1.0])
    );
    assert_eq!(
        second.blocking_recv().unwrap().unwrap()[0].data,
        TensorData::Fp32(vec![2.0])
    );
    assert!(pool.shutdown(Duration::from_secs(1)));
}

#[test]
fn shutdown_answers_queued_work_and_lets_running_work_finish() {
    let (pool, release) = gated(4);
    let running = pool.submit(job(1.0)).unwrap();
    wait_until(|| pool.load().inflight == 1);
    let queued = pool.submit(job(2.0)).unwrap();
    let closer = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || pool.shutdown(Duration::from_secs(5)))
    };
    wait_until(|| !pool.is_ready());
    assert_eq!(
        queued.blocking_recv().unwrap().unwrap_err(),
        PoolError::ShuttingDown { pool: "p".into() }
    );
    assert!(matches!(pool.submit(job(3.0)), Err(PoolError::ShuttingDown { .. })));
    release.send(()).unwrap();
    assert!(running.blocking_recv().unwrap().is_ok());
    assert!(closer.join().unwrap());
}

#[test]
fn a_request_whose_client_left_is_not_run() {
    let (pool, release) = gated(4);
    let running = pool.submit(job(1.0)).unwrap();
    wait_until(|| pool.load().inflight == 1);
    drop(pool.submit(job(2.0)).unwrap());
    let third = pool.submit(job(3.0)).unwrap();
    release.send(()).unwrap();
    // Only one more release: if the abandoned job ran, the third would never finish.
    release.send(()).unwrap();
    assert!(running.blocking_recv().unwrap().is_ok());
    assert_eq!(
        third.blocking_recv().unwrap().unwrap()[0].data,
        TensorData::Fp32(vec![3.0])
    );
    pool.shutdown(Duration::from_secs(1));
}

#[test]
fn an_expired_deadline_is_reported_without_running() {
    let pool = Pool::start(
        config(4),
        DeviceClass::Host,
        vec![Box::new(Echo { gate: None })],
        None,
        PoolContext::default(),
    );
    let mut j = job(1.0);
    j.meta.deadline = Some(Instant::now());
    let rx = pool.submit(j).unwrap();
    assert_eq!(
        rx.blocking_recv().unwrap().unwrap_err(),
        PoolError::DeadlineExceeded { pool: "p".into() }
    );
    pool.shutdown(Duration::from_secs(1));
}

#[test]
fn queue_age_grows_while_a_request_waits_and_the_wait_is_recorded() {
    let clock = Arc::new(crate::core::clock::ManualClock::default());
    let metrics = PoolMetrics::detached();
    let (tx, rx) = mpsc::channel();
    let gate = Arc::new(Mutex::new(rx));
    let context = PoolContext {
        clock: clock.clone(),
        metrics: metrics.clone(),
        ..PoolContext::default()
    };
    let pool = Pool::start(
        config(4),
        DeviceClass::Host,
        vec![Box::new(Echo { gate: Some(gate) })],
        None,
        context,
    );
    let running = pool.submit(job(1.0)).unwrap();
    wait_until(|| pool.load().inflight == 1);
    let waiting = pool.submit(job(2.0)).unwrap();
    assert_eq!(pool.load().oldest_age, Duration::ZERO);
    clock.advance(Duration::from_secs(7));
    assert_eq!(pool.load().oldest_age, Duration::from_secs(7));
    clock.advance(Duration::from_secs(5));
    assert_eq!(pool.load().oldest_age, Duration::from_secs(12));
    tx.send(()).unwrap();
    tx.send(()).unwrap();
    running.blocking_recv().unwrap().unwrap();
    waiting.blocking_recv().unwrap().unwrap();
    assert_eq!(pool.load().oldest_age, Duration::ZERO);
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register("wait", "", metrics.queue_wait.clone());
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("wait_count 2\n") && text.contains("wait_sum 12.0\n"),
        "{text}"
    );
    pool.shutdown(Duration::from_secs(1));
}

/// Fails every run with an arena failure.
struct Full;

impl Backend for Full {
    fn run(&mut self, _: &str, _: Vec<Tensor>, _: &[String], _: &RunMeta) -> Result<Vec<Tensor>, BackendError> {
        Err(BackendError::Allocation {
            kind: AllocFailureKind::Oom,
            message: "BFCArena::AllocateRawInternal".into(),
        })
    }
    crate::testing::fakes::lacks!(residency, generations, arenas, liveness, interrupts);
}

#[test]
fn allocator_failures_are_counted_and_age_out_of_the_recent_window() {
    let clock = Arc::new(crate::core::clock::ManualClock::default());
    let metrics = PoolMetrics::detached();
    let context = PoolContext {
        clock: clock.clone(),
        metrics: metrics.clone(),
        ..PoolContext::default()
    };
    let pool = Pool::start(config(4), DeviceClass::Host, vec![Box::new(Full)], None, context);
    for _ in 0..2 {
        let result = pool.submit(job(1.0)).unwrap().blocking_recv().unwrap();
        assert!(matches!(
            result,
            Err(PoolError::Backend(BackendError::Allocation { .. }))
        ));
    }
    assert_eq!(metrics.oom_failures.get(), 2);
    assert_eq!(metrics.driver_failures.get(), 0);
    assert_eq!(pool.health().alloc_failures_recent(), 2);
    clock.advance(RECENT_FAILURE_WINDOW + Duration::from_secs(1));
    assert_eq!(pool.health().alloc_failures_recent(), 0);
    pool.shutdown(Duration::from_secs(1));
}

#[test]
fn an_unavailable_pool_says_why() {
    let pool = Pool::unavailable(
        config(4),
        DeviceClass::Nvml,
        "no NVIDIA driver".into(),
        PoolContext::default(),
    );
    assert!(!pool.is_ready());
    assert_eq!(
        pool.submit(job(1.0)).unwrap_err().to_string(),
        "pool `p` is unavailable: no NVIDIA driver"
    );
}

/// Counts the times it was asked to give its memory back.
struct Releasing {
    releases: Arc<std::sync::atomic::AtomicUsize>,
}

impl Backend for Releasing {
    fn run(&mut self, _: &str, inputs: Vec<Tensor>, _: &[String], _: &RunMeta) -> Result<Vec<Tensor>, BackendError> {
        Ok(inputs)
    }
    fn residency(&mut self) -> Option<&mut dyn Residency> {
        Some(self)
    }
    crate::testing::fakes::lacks!(generations, arenas, liveness, interrupts);
}

impl Residency for Releasing {
    fn load_model(&mut self, name: &str, _: crate::core::model::ModelData<'_>) -> Result<(), String> {
        Err(format!("`{name}`: this fake loads nothing"))
    }
    fn unload_model(&mut self, _: &str) {}
    fn share_model(&mut self, name: &str, _: &str) -> Result<(), String> {
        Err(format!("`{name}`: this fake shares nothing"))
    }
    fn release_memory(&mut self, _: &dyn Fn(&str) -> Option<Vec<Tensor>>) {
        self.releases.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn an_idle_pool_gives_its_memory_back_once_after_its_runs_and_a_busy_one_keeps_it() {
    let releases = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = || releases.load(std::sync::atomic::Ordering::SeqCst);
    let config = PoolConfig {
        idle_release: Some(Duration::from_millis(300)),
        ..config(8)
    };
    let backend = Releasing {
        releases: Arc::clone(&releases),
    };
    let pool = Pool::start(
        config,
        DeviceClass::Host,
        vec![Box::new(backend)],
        None,
        PoolContext::default(),
    );
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(count(), 0, "nothing ran: nothing to give back");
    // Runs closer together than the idle time: the blocks stay for the next run.
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_millis(600) {
        assert!(pool.submit(job(1.0)).unwrap().blocking_recv().unwrap().is_ok());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(count(), 0, "a busy pool reuses its memory");
    wait_until(|| count() == 1);
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(count(), 1, "once per idle spell");
}

#[test]
fn short_host_memory_takes_the_memory_back_without_waiting_for_the_idle_time() {
    let releases = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = || releases.load(std::sync::atomic::Ordering::SeqCst);
    // An idle time the test never reaches: only `release_soon` can give it back.
    let patient = PoolConfig {
        idle_release: Some(Duration::from_secs(600)),
        ..config(8)
    };
    let backend = Releasing {
        releases: Arc::clone(&releases),
    };
    let pool = Pool::start(
        patient,
        DeviceClass::Host,
        vec![Box::new(backend)],
        None,
        PoolContext::default(),
    );
    pool.release_soon();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(count(), 0, "nothing ran: nothing to give back");
    assert!(pool.submit(job(2.0)).unwrap().blocking_recv().unwrap().is_ok());
    pool.release_soon();
    wait_until(|| count() == 1);
    let never = PoolConfig {
        idle_release: None,
        ..config(8)
    };
    let backend = Releasing {
        releases: Arc::clone(&releases),
    };
    let kept = Pool::start(
        never,
        DeviceClass::Host,
        vec![Box::new(backend)],
        None,
        PoolContext::default(),
    );
    assert!(kept.submit(job(3.0)).unwrap().blocking_recv().unwrap().is_ok());
    kept.release_soon();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(count(), 1, "a pool that keeps its arena (idle_release off) keeps it");
}

/// A backend that says how each run got its inputs, and where their elements lay.
struct Where(Arc<Mutex<Vec<(&'static str, usize)>>>);

fn first_element(inputs: &[Tensor]) -> usize {
    match &inputs[0].data {
        TensorData::Fp32(v) => v.as_ptr() as usize,
        _ => 0,
    }
}

impl Backend for Where {
    fn run(&mut self, _: &str, inputs: Vec<Tensor>, _: &[String], _: &RunMeta) -> Result<Vec<Tensor>, BackendError> {
        self.0.lock().unwrap().push(("taken", first_element(&inputs)));
        Ok(Vec::new())
    }
    fn run_borrowed(
        &mut self,
        _: &str,
        inputs: &[Tensor],
        _: &[String],
        _: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        self.0.lock().unwrap().push(("borrowed", first_element(inputs)));
        Ok(Vec::new())
    }
    crate::testing::fakes::lacks!(residency, generations, arenas, liveness, interrupts);
}

#[test]
fn inputs_kept_for_a_retry_are_run_where_they_lie_and_others_are_taken_without_a_copy() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let pool = Pool::start(
        config(4),
        DeviceClass::Host,
        vec![Box::new(Where(Arc::clone(&seen)))],
        None,
        PoolContext::default(),
    );
    // A replayable request keeps its inputs for the fallback: a second reference, not a copy.
    let kept = job(1.0);
    let spare = kept.inputs.clone();
    pool.submit(kept).unwrap().blocking_recv().unwrap().unwrap();
    // Without a retry to keep them for, the backend takes them.
    let alone = job(2.0);
    let alone_at = first_element(&alone.inputs);
    pool.submit(alone).unwrap().blocking_recv().unwrap().unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        vec![("borrowed", first_element(&spare)), ("taken", alone_at)],
        "each run read its inputs where the request put them"
    );
    // The retry's run gets them back, still without a copy.
    let spare_at = first_element(&spare);
    assert_eq!(first_element(&spare.into_vec()), spare_at);
    pool.close();
}

/// Holds `self.0` bytes in its allocators; a run of model `boom` panics.
struct Holding(u64);

impl Backend for Holding {
    fn run(
        &mut self,
        model: &str,
        inputs: Vec<Tensor>,
        _: &[String],
        _: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        assert_ne!(model, "boom", "a bug in the backend");
        Ok(inputs)
    }
    crate::testing::fakes::lacks!(residency, generations, liveness, interrupts);
    fn arenas(&mut self) -> Option<&mut dyn Arenas> {
        Some(self)
    }
}

impl Arenas for Holding {
    fn arena_stats(&self) -> Option<ArenaStats> {
        Some(ArenaStats {
            reserved_bytes: self.0,
            active_bytes: self.0 / 2,
            ..ArenaStats::default()
        })
    }
    /// One arena: what it holds is what its runs are measured in.
    fn held_arena_stats(&self) -> Option<ArenaStats> {
        self.arena_stats()
    }
    fn refresh_arena_stats(&mut self) {}
    fn refresh_arena_stats_for(&mut self, _: &str) {}
}

#[test]
fn a_pools_arena_is_what_its_live_workers_hold_together() {
    let config = PoolConfig {
        workers: 2,
        ..crate::testing::config::pool("p", "host", &["m", "boom"])
    };
    let backends: Vec<Box<dyn Backend>> = vec![Box::new(Holding(100 << 20)), Box::new(Holding(20 << 20))];
    let pool = Pool::start(config, DeviceClass::Host, backends, None, PoolContext::default());
    let held = || {
        pool.arena_stats()
            .map(|s| (s.reserved_bytes >> 20, s.active_bytes >> 20))
    };
    assert_eq!(
        held(),
        Some((120, 60)),
        "both workers' arenas, not the last one to report"
    );
    // A run panics and its backend cannot be rebuilt: what it held is gone from the pool's.
    let boom = InferJob {
        model: "boom".into(),
        ..job(1.0)
    };
    let result = pool.submit(boom).unwrap().blocking_recv().unwrap();
    assert!(
        matches!(result, Err(PoolError::Backend(BackendError::Panicked(_)))),
        "{result:?}"
    );
    let left = held();
    assert!(
        left == Some((100, 50)) || left == Some((20, 10)),
        "one worker's left: {left:?}"
    );
    pool.want_arena_stats();
    assert!(pool.submit(job(1.0)).unwrap().blocking_recv().unwrap().is_ok());
    assert_eq!(held(), left, "its runs publish under its own slot");
    pool.shutdown(Duration::from_secs(1));
}

/// Its runs fail as a worker process's whose connection closed, and it says so until replaced.
struct Gone;

impl Backend for Gone {
    fn run(&mut self, _: &str, _: Vec<Tensor>, _: &[String], _: &RunMeta) -> Result<Vec<Tensor>, BackendError> {
        Err(BackendError::WorkerLost(
            "worker process 7 of pool `p` is gone: EOF".into(),
        ))
    }
    crate::testing::fakes::lacks!(residency, generations, arenas, interrupts);
    fn liveness(&self) -> Option<&dyn Liveness> {
        Some(self)
    }
}

impl Liveness for Gone {
    fn lost(&self) -> bool {
        true
    }
    fn worker_gone(&self) -> Option<String> {
        Some("worker process 7 of pool `p` is gone: EOF".into())
    }
}

#[test]
fn the_first_run_that_finds_the_worker_gone_opens_the_breaker() {
    let pool = Pool::start(
        config(4),
        DeviceClass::Simulated,
        vec![Box::new(Gone)],
        None,
        PoolContext::default(),
    );
    assert_eq!(pool.health().breaker_state(), BreakerState::Closed);
    let result = pool.submit(job(1.0)).unwrap().blocking_recv().unwrap();
    assert!(
        matches!(result, Err(PoolError::Backend(BackendError::WorkerLost(_)))),
        "{result:?}"
    );
    // Before any supervisor reaped the process: new work goes to the fallback at once.
    assert_eq!(pool.health().breaker_state(), BreakerState::Open);
    let why = pool.health().breaker_trip().map(|t| t.to_string()).unwrap_or_default();
    assert!(why.contains("worker process 7 of pool `p` is gone"), "{why}");
    pool.shutdown(Duration::from_secs(1));
}
