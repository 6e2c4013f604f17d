//! Loading and unloading while the pool serves: on demand, by the admin, when idle, to make room,
//! and shared between models of identical weights.

use std::sync::{Arc, Mutex, mpsc};

use super::*;
use crate::pool::Pool;
// The backend's capability, beside the models' `Residency` of the config.
use crate::core::backend::Residency as Loads;
use crate::core::backend::{Backend, BackendError, RunMeta};
use crate::core::snapshot::DeviceClass;
use crate::core::tensor::Tensor;
use crate::pool::metrics::ModelMetrics;

use crate::pool::{InferJob, PoolContext, RunCancel, RunMemory};

/// Runs only models it has loaded; runs of `slow` wait for the gate.
struct Sessions {
    loaded: HashSet<String>,
    gate: Arc<Mutex<mpsc::Receiver<()>>>,
    loads: Arc<Mutex<Vec<String>>>,
}

impl Backend for Sessions {
    fn run(
        &mut self,
        model: &str,
        inputs: Vec<Tensor>,
        _: &[String],
        _: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        if !self.loaded.contains(model) {
            return Err(BackendError::Runtime(format!("no session for `{model}`")));
        }
        if model == "slow" {
            self.gate.lock().unwrap().recv().unwrap();
        }
        Ok(inputs)
    }
    fn residency(&mut self) -> Option<&mut dyn Loads> {
        Some(self)
    }
    crate::testing::fakes::lacks!(generations, arenas, liveness, interrupts);
}

impl Loads for Sessions {
    fn load_model(&mut self, name: &str, _: crate::core::model::ModelData<'_>) -> Result<(), String> {
        self.loads.lock().unwrap().push(name.to_string());
        self.loaded.insert(name.to_string());
        Ok(())
    }
    fn unload_model(&mut self, name: &str) {
        self.loaded.remove(name);
    }
    fn share_model(&mut self, name: &str, with: &str) -> Result<(), String> {
        self.loads.lock().unwrap().push(format!("{name} shares {with}"));
        self.loaded.insert(name.to_string());
        Ok(())
    }
    fn release_memory(&mut self, _: &dyn Fn(&str) -> Option<Vec<Tensor>>) {}
}

fn setup(name: &str, residency: Residency) -> ModelSetup {
    ModelSetup {
        name: name.into(),
        residency,
        idle_unload: None,
        priority: 0,
        min_residency: Duration::ZERO,
        weights_bytes: 0,
        weights_group: Vec::new(),
        generates: false,
        probe: None,
        bytes: crate::core::model::ModelBytes::inline(Vec::new()),
        metrics: ModelMetrics::detached(),
    }
}

/// What eviction weighs as `model`'s work on `pool`: its jobs queued and running, and the
/// generations holding it.
fn busy(pool: &Pool, model: &str) -> usize {
    let resident = pool.residency().residents().into_iter().find(|r| r.model == model);
    resident.expect("resident").busy
}

fn job(model: &str) -> InferJob {
    InferJob {
        meta: RunMeta::default(),
        model: model.into(),
        inputs: Default::default(),
        outputs: vec![],
        op: Default::default(),
        estimate_bytes: None,
        memory: RunMemory::default(),
        probe: false,
        cancel: RunCancel::default(),
    }
}

#[test]
fn on_demand_loads_on_every_backend_and_an_unload_waits_for_the_models_run() {
    let (open, gate) = mpsc::channel();
    let gate = Arc::new(Mutex::new(gate));
    let loads = Arc::new(Mutex::new(Vec::new()));
    let models = vec![
        setup("lazy", Residency::OnDemand),
        setup("slow", Residency::Resident),
        setup("fixed", Residency::Pinned),
    ];
    let backends: Vec<Box<dyn Backend>> = (0..2)
        .map(|_| {
            Box::new(Sessions {
                loaded: ["slow".to_string(), "fixed".to_string()].into(),
                gate: Arc::clone(&gate),
                loads: Arc::clone(&loads),
            }) as Box<dyn Backend>
        })
        .collect();
    let context = PoolContext {
        models: models.clone(),
        ..PoolContext::default()
    };
    let config = crate::testing::config::pool("p", "host", &["lazy", "slow", "fixed"]);
    let pool = Pool::start(config, DeviceClass::Host, backends, None, context);
    assert!(
        !pool.residency().is_resident("lazy")
            && pool.residency().is_resident("slow")
            && pool.residency().is_resident("fixed")
    );
    assert!(pool.submit(job("lazy")).unwrap().blocking_recv().unwrap().is_ok());
    assert!(pool.residency().is_resident("lazy"));
    assert_eq!(models[0].metrics.loads_on_demand.get(), 1);

    // `slow` runs on one backend; unloading it waits for that run while `lazy` keeps serving.
    let running = pool.submit(job("slow")).unwrap();
    let unloading = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || pool.residency().unload_model("slow"))
    };
    assert!(pool.submit(job("lazy")).unwrap().blocking_recv().unwrap().is_ok());
    assert!(!unloading.is_finished(), "the unload waits for the running request");
    open.send(()).unwrap();
    assert!(running.blocking_recv().unwrap().is_ok(), "the run was not interrupted");
    assert_eq!(unloading.join().unwrap(), Ok(ResidencyOutcome::Unloaded));
    assert!(!pool.residency().is_resident("slow"));
    assert_eq!(pool.residency().unload_model("slow"), Ok(ResidencyOutcome::Already));
    assert_eq!(
        pool.residency().unload_model("fixed"),
        Err(ResidencyError::Pinned { model: "fixed".into() })
    );
    assert_eq!(pool.residency().load_model("slow"), Ok(ResidencyOutcome::Loaded));
    let loads = loads.lock().unwrap().clone();
    assert_eq!(
        loads.iter().filter(|m| *m == "lazy").count(),
        2,
        "both backends: {loads:?}"
    );
    assert_eq!(
        loads.iter().filter(|m| *m == "slow").count(),
        2,
        "both backends: {loads:?}"
    );
    pool.shutdown(Duration::from_secs(5));
}

#[test]
fn a_model_without_requests_for_its_idle_unload_is_unloaded_and_a_health_check_is_no_request() {
    let (_open, gate) = mpsc::channel();
    let gate = Arc::new(Mutex::new(gate));
    let idle = |name, residency| ModelSetup {
        idle_unload: Some(Duration::from_secs(10)),
        ..setup(name, residency)
    };
    let models = vec![idle("quiet", Residency::Resident), idle("busy", Residency::Resident)];
    let backend = Sessions {
        loaded: ["quiet".to_string(), "busy".to_string()].into(),
        gate,
        loads: Arc::default(),
    };
    let clock = Arc::new(crate::core::clock::ManualClock::default());
    let context = PoolContext {
        models: models.clone(),
        clock: clock.clone(),
        ..PoolContext::default()
    };
    let config = crate::testing::config::pool("p", "host", &["quiet", "busy"]);
    let pool = Pool::start(config, DeviceClass::Host, vec![Box::new(backend)], None, context);
    assert_eq!(
        pool.residency().idle_check_interval(),
        Some(Duration::from_millis(2500))
    );

    clock.advance(Duration::from_secs(6));
    assert!(pool.submit(job("busy")).unwrap().blocking_recv().unwrap().is_ok());
    let probe = InferJob {
        probe: true,
        ..job("quiet")
    };
    assert!(pool.submit(probe).unwrap().blocking_recv().unwrap().is_ok());
    clock.advance(Duration::from_secs(4));
    assert!(
        pool.residency().unload_idle().is_empty(),
        "never early: 10 s is not more than 10 s"
    );
    clock.advance(Duration::from_millis(1));
    assert_eq!(
        pool.residency().unload_idle(),
        vec!["quiet".to_string()],
        "the probe did not count"
    );
    assert!(!pool.residency().is_resident("quiet") && pool.residency().is_resident("busy"));
    assert_eq!(models[0].metrics.unloads_idle.get(), 1);
    assert_eq!(models[0].metrics.resident.get(), 0);
    assert!(
        pool.residency().unload_idle().is_empty(),
        "once: it is no longer loaded"
    );

    assert!(pool.submit(job("quiet")).unwrap().blocking_recv().unwrap().is_ok());
    assert_eq!(models[0].metrics.loads_on_demand.get(), 1, "its next request loads it");
    clock.advance(Duration::from_secs(6));
    assert_eq!(pool.residency().unload_idle(), vec!["busy".to_string()]);
    assert_eq!(models[1].metrics.unloads_idle.get(), 1);
    assert_eq!(models[0].metrics.unloads_idle.get(), 1);
    pool.shutdown(Duration::from_secs(5));
}

#[test]
fn eviction_never_takes_a_model_with_work_running_or_a_pinned_one() {
    let (open, gate) = mpsc::channel();
    let gate = Arc::new(Mutex::new(gate));
    let models = vec![
        setup("slow", Residency::Resident),
        setup("idle", Residency::Resident),
        setup("fixed", Residency::Pinned),
    ];
    let backend = Sessions {
        loaded: ["slow".to_string(), "idle".to_string(), "fixed".to_string()].into(),
        gate,
        loads: Arc::default(),
    };
    let context = PoolContext {
        models: models.clone(),
        ..PoolContext::default()
    };
    let config = crate::testing::config::pool("p", "host", &["slow", "idle", "fixed"]);
    let pool = Pool::start(config, DeviceClass::Host, vec![Box::new(backend)], None, context);
    let running = pool.submit(job("slow")).unwrap();
    let queued = pool.submit(job("idle")).unwrap();
    let busy = |model: &str| busy(&pool, model);
    assert_eq!((busy("slow"), busy("idle")), (1, 1), "running and queued both count");
    assert!(!pool.residency().evict("slow"), "running");
    assert!(!pool.residency().evict("idle"), "queued behind it");
    assert!(!pool.residency().evict("fixed"), "pinned");
    open.send(()).unwrap();
    assert!(running.blocking_recv().unwrap().is_ok() && queued.blocking_recv().unwrap().is_ok());
    assert!(pool.residency().evict("idle"));
    assert!(
        !pool.residency().is_resident("idle")
            && pool.residency().is_resident("slow")
            && pool.residency().is_resident("fixed")
    );
    assert_eq!(models[1].metrics.unloads_evicted.get(), 1);
    assert_eq!(models[1].metrics.resident.get(), 0);
    assert!(!pool.residency().evict("idle"), "already gone");
    assert_eq!(
        pool.residency()
            .residents()
            .iter()
            .map(|r| r.model.as_str())
            .collect::<HashSet<_>>(),
        HashSet::from(["slow", "fixed"])
    );
}

#[test]
fn models_of_identical_weights_share_one_session_counted_once_and_kept_while_one_needs_it() {
    let (_open, gate) = mpsc::channel();
    let loads = Arc::new(Mutex::new(Vec::new()));
    let group = |name, residency| ModelSetup {
        weights_bytes: 100,
        weights_group: vec!["a".into(), "b".into(), "c".into()],
        ..setup(name, residency)
    };
    let models = vec![
        group("a", Residency::Resident),
        group("b", Residency::Resident),
        group("c", Residency::OnDemand),
    ];
    // As `serve` builds it: `a`'s session, which `b` shares.
    let backend = Sessions {
        loaded: ["a".to_string(), "b".to_string()].into(),
        gate: Arc::new(Mutex::new(gate)),
        loads: Arc::clone(&loads),
    };
    let context = PoolContext {
        models: models.clone(),
        ..PoolContext::default()
    };
    let config = crate::testing::config::pool("p", "host", &["a", "b", "c"]);
    let pool = Pool::start(config, DeviceClass::Host, vec![Box::new(backend)], None, context);
    let loaded = |i: usize| models[i].metrics.loads_start.get() + models[i].metrics.loads_on_demand.get();
    assert_eq!((loaded(0), loaded(1)), (1, 0), "one load at start");
    assert!(
        pool.residency().is_resident("a") && pool.residency().is_resident("b") && !pool.residency().is_resident("c")
    );
    assert_eq!(pool.residency().shares_weights_of("b"), Some("a"));
    assert_eq!(
        (pool.residency().weights_shown("a"), pool.residency().weights_shown("b")),
        (100, 0)
    );
    assert_eq!(
        (
            pool.residency().weights_charged("a"),
            pool.residency().weights_charged("b")
        ),
        (100, 0)
    );
    assert_eq!(pool.residency().weights_freed_by("a"), 0, "`b` keeps the session");
    assert!(pool.residency().holds_weights_of("c"), "a request of `c` loads nothing");

    // `c` on demand joins the session: no load, no build.
    assert!(pool.submit(job("c")).unwrap().blocking_recv().unwrap().is_ok());
    assert!(pool.residency().is_resident("c") && loaded(2) == 0);
    assert_eq!(loads.lock().unwrap().as_slice(), ["c shares a"]);

    // `a` goes: the others keep the weights, now charged to `b`.
    assert_eq!(pool.residency().unload_model("a"), Ok(ResidencyOutcome::Unloaded));
    assert!(
        !pool.residency().is_resident("a") && pool.residency().is_resident("b") && pool.residency().is_resident("c")
    );
    assert_eq!(
        (
            pool.residency().weights_charged("a"),
            pool.residency().weights_charged("b")
        ),
        (0, 100)
    );
    assert_eq!(pool.residency().load_model("a"), Ok(ResidencyOutcome::Loaded));
    assert_eq!(models[0].metrics.loads_requested.get(), 0, "it shared `b`'s again");
    assert_eq!(loads.lock().unwrap().last().map(String::as_str), Some("a shares b"));

    // The last name of the group to go takes the weights with it.
    for model in ["a", "b"] {
        assert_eq!(pool.residency().unload_model(model), Ok(ResidencyOutcome::Unloaded));
    }
    assert_eq!(pool.residency().weights_freed_by("c"), 100);
    assert!(pool.residency().evict("c"));
    assert!(!pool.residency().holds_weights_of("a"));
    assert!(pool.submit(job("a")).unwrap().blocking_recv().unwrap().is_ok());
    assert_eq!(
        models[0].metrics.loads_on_demand.get(),
        1,
        "a load: nothing was there to share"
    );
    assert_eq!(loads.lock().unwrap().last().map(String::as_str), Some("a"));
    pool.shutdown(Duration::from_secs(5));
}

#[test]
fn a_decoder_is_never_evicted_while_a_generation_is_under_way_between_its_runs() {
    let (_open, gate) = mpsc::channel();
    let decoder = ModelSetup {
        generates: true,
        ..setup("decoder", Residency::Resident)
    };
    let models = vec![decoder, setup("encoder", Residency::Resident)];
    let backend = Sessions {
        loaded: ["decoder".to_string(), "encoder".to_string()].into(),
        gate: Arc::new(Mutex::new(gate)),
        loads: Arc::default(),
    };
    let context = PoolContext {
        models: models.clone(),
        ..PoolContext::default()
    };
    let config = crate::testing::config::pool("p", "host", &["decoder", "encoder"]);
    let pool = Pool::start(config, DeviceClass::Host, vec![Box::new(backend)], None, context);
    let generation = crate::pool::batch::sequences::Waiting::on(&pool.sequences);
    let busy = |model: &str| busy(&pool, model);
    assert_eq!((busy("decoder"), busy("encoder")), (1, 0));
    assert!(!pool.residency().evict("decoder"), "its KV cache is held between runs");
    drop(generation);
    assert!(pool.residency().evict("decoder"));
}
