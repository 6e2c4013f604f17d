//! Which models' sessions a pool holds, and loading and unloading them while the pool serves.
//!
//! The pool keeps the set of models it *wants* loaded, with a generation number bumped on each
//! change (both under the queue's lock, `queue.rs`). Each backend remembers which models it has
//! and the generation it last matched; a worker brings an out-of-date backend up to the wanted
//! set before it runs a job on it, and an idle worker does so at once. So a load or an unload
//! reaches idle backends at once and busy ones as soon as their run ends, and a job always runs
//! on a backend that holds its model. A request for a model that is not wanted makes it wanted
//! (an on-demand load): the worker that takes the job loads it first, and that wait is the
//! request's cold start.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::config::{Provider, Residency};
use crate::pool::metrics::LoadSource;
use crate::pool::models::{ResidencyError, ResidencyOutcome};
use crate::pool::queue::Slot;
use crate::pool::shared::Pool;

/// How long an admin load or unload waits for the pool's runs before giving up.
const OPERATION_BOUND: Duration = Duration::from_secs(60);

impl Pool {
    /// The models whose sessions this pool's backends are built with at start.
    pub(super) fn start_set(&self) -> HashSet<String> {
        let remote = matches!(self.config.provider, Provider::Remote(_));
        self.config
            .models
            .iter()
            .filter(|m| remote || self.models.residency(m).loaded_at_start())
            .cloned()
            .collect()
    }

    /// Count the loads the pool started with (a model that shares another's session at start
    /// loaded nothing: it is resident, with no load of its own).
    pub(super) fn record_start_loads(&self) {
        let start = self.start_set();
        let setups: Vec<_> = self.models.setups.values().cloned().collect();
        let shares = super::shares::sharing_at_start(&setups, &start);
        for model in start {
            if let Some(metrics) = self.models.metrics(&model) {
                if !shares.contains_key(&model) {
                    metrics.loads_start.inc();
                }
                metrics.resident.set(1);
            }
        }
    }

    /// Count where the sessions its workers started with took their bytes from: one load per
    /// worker of each `(model, source)` (their seconds are not observed: a worker builds all
    /// its models at once).
    pub fn record_start_sources(&self, sources: &[(String, LoadSource)]) {
        for (model, source) in sources {
            if let Some(metrics) = self.models.metrics(model) {
                metrics.loads_from[source.index()].inc_by(self.config.slots() as u64);
            }
        }
    }

    /// True when `model`'s sessions are loaded here (every model of a remote pool is).
    pub fn is_resident(&self, model: &str) -> bool {
        match self.models.metrics(model) {
            Some(metrics) => metrics.resident.get() == 1,
            None => self.serves(model),
        }
    }

    /// True while `model` is being loaded here: wanted (by a load or a request), its sessions
    /// not built yet.
    pub fn is_loading(&self, model: &str) -> bool {
        !self.is_resident(model) && self.queue.is_wanted(model)
    }

    /// The admin's load: every backend builds `model`'s sessions (idle ones at once, busy ones
    /// after their run). Blocking: run it off the async runtime.
    pub fn load_model(&self, model: &str) -> Result<ResidencyOutcome, ResidencyError> {
        self.not_remote()?;
        // A model whose weights another loaded name holds here shares them: no load.
        let shared = self.shares_loaded(model);
        let Some(generation) = self.queue.want(model) else {
            return Ok(ResidencyOutcome::Already);
        };
        if let Some(metrics) = self.models.metrics(model).filter(|_| !shared) {
            metrics.loads_requested.inc();
        }
        // Loaded on purpose: its idle time starts now, not at its last request.
        self.models.touch(model, self.context.clock.now());
        self.await_backends(model, "load", generation)?;
        if self.is_resident(model) {
            Ok(ResidencyOutcome::Loaded)
        } else {
            Err(ResidencyError::Failed {
                pool: self.name().to_string(),
                model: model.to_string(),
                reason: "its sessions could not be built (see the log)".into(),
            })
        }
    }

    /// The admin's unload: waits for `model`'s queued and running requests here, then every
    /// backend drops its sessions (idle ones at once, busy ones after their run). Other models'
    /// requests go on. Blocking: run it off the async runtime.
    pub fn unload_model(&self, model: &str) -> Result<ResidencyOutcome, ResidencyError> {
        self.not_remote()?;
        if self.models.residency(model) == Residency::Pinned {
            return Err(ResidencyError::Pinned {
                model: model.to_string(),
            });
        }
        let until = Instant::now() + OPERATION_BOUND;
        let generation = match self.queue.unwant(model, until) {
            Ok(Some(generation)) => generation,
            Ok(None) => return Ok(ResidencyOutcome::Already),
            Err(()) => return Err(self.timeout(model, "unload")),
        };
        if let Some(metrics) = self.models.metrics(model) {
            metrics.resident.set(0);
            metrics.unloads_requested.inc();
        }
        self.await_backends(model, "unload", generation)?;
        Ok(ResidencyOutcome::Unloaded)
    }

    /// Unload every model that had no request here for its `idle_unload`, as an admin unload
    /// would (a model with jobs queued or running is not idle); returns the models unloaded.
    /// Blocking: run it off the async runtime.
    pub fn unload_idle(&self) -> Vec<String> {
        if matches!(self.config.provider, Provider::Remote(_)) {
            return Vec::new();
        }
        let now = self.context.clock.now();
        let mut unloaded = Vec::new();
        for model in self.models.idle_at(now) {
            let Some(idle) = self.models.setups.get(model).and_then(|s| s.idle_unload) else {
                continue;
            };
            if self.models.residency(model) == Residency::Pinned {
                continue;
            }
            let still_idle = || {
                self.models
                    .idle_for(model, self.models.millis(self.context.clock.now()), idle)
            };
            let Some(generation) = self.queue.unwant_idle(model, still_idle) else {
                continue;
            };
            if let Some(metrics) = self.models.metrics(model) {
                metrics.resident.set(0);
                metrics.unloads_idle.inc();
            }
            tracing::info!(pool = self.name(), %model, idle_unload = ?idle, "unloading an idle model");
            if let Err(e) = self.await_backends(model, "idle unload", generation) {
                tracing::warn!(pool = self.name(), %model, error = %e, "idle unload still under way");
            }
            unloaded.push(model.to_string());
        }
        unloaded
    }

    /// How often [`Pool::unload_idle`] should run: a quarter of the shortest `idle_unload`
    /// (between 50 ms and 10 s), so a model goes at most that late; `None` when no model here
    /// has one.
    pub fn idle_check_interval(&self) -> Option<Duration> {
        if matches!(self.config.provider, Provider::Remote(_)) {
            return None;
        }
        self.models
            .shortest_idle_unload()
            .map(|d| (d / 4).clamp(Duration::from_millis(50), Duration::from_secs(10)))
    }

    fn not_remote(&self) -> Result<(), ResidencyError> {
        match self.config.provider {
            Provider::Remote(_) => Err(ResidencyError::Remote {
                pool: self.name().to_string(),
            }),
            _ => Ok(()),
        }
    }

    pub(super) fn await_backends(
        &self,
        model: &str,
        what: &'static str,
        generation: u64,
    ) -> Result<(), ResidencyError> {
        if self
            .queue
            .await_generation(generation, Instant::now() + OPERATION_BOUND)
        {
            Ok(())
        } else {
            Err(self.timeout(model, what))
        }
    }

    fn timeout(&self, model: &str, what: &'static str) -> ResidencyError {
        ResidencyError::Timeout {
            pool: self.name().to_string(),
            model: model.to_string(),
            what,
            waited: OPERATION_BOUND,
        }
    }

    /// A job for `model` made it wanted: an on-demand load.
    pub(super) fn record_on_demand(&self, model: &str) {
        // (Not whether it is resident itself: a worker may have loaded it since.)
        if self.shares_loaded(model) {
            // It will share what another name holds here: no load.
            return;
        }
        if let Some(metrics) = self.models.metrics(model) {
            metrics.loads_on_demand.inc();
        }
    }

    /// Bring `slot`'s backend up to the `wanted` models of `generation`; returns how long each
    /// model it loaded took, or why it failed. Runs on a worker thread, outside the queue's
    /// lock.
    pub(super) fn reconcile(
        &self,
        slot: &mut Slot,
        wanted: &HashSet<String>,
        generation: u64,
    ) -> HashMap<String, Result<Duration, String>> {
        let mut loads = HashMap::new();
        for model in slot.loaded.difference(wanted).cloned().collect::<Vec<_>>() {
            if let Some(residency) = slot.backend.residency() {
                residency.unload_model(&model);
            }
            slot.loaded.remove(&model);
            tracing::info!(pool = self.name(), %model, "sessions dropped");
        }
        for model in wanted.difference(&slot.loaded).cloned().collect::<Vec<_>>() {
            if self.share_in(slot, &model) {
                continue;
            }
            let started = Instant::now();
            let mut source = LoadSource::disk;
            let result = match self.models.setups.get(&model) {
                Some(setup) => {
                    let bytes = match &self.context.tier {
                        Some(tier) => {
                            let (bytes, from) = tier.fetch(&model, setup.priority, &setup.bytes, &self.config.provider);
                            source = from;
                            bytes
                        }
                        None => setup.bytes.clone(),
                    };
                    slot.backend
                        .loader(&model)
                        .and_then(|residency| residency.load_model(&model, bytes.data()))
                }
                None => Err(format!("pool `{}` has no bytes of `{model}`", self.name())),
            };
            let took = started.elapsed();
            match &result {
                Ok(()) => {
                    slot.loaded.insert(model.clone());
                    tracing::info!(pool = self.name(), %model, seconds = took.as_secs_f64(), ?source, "sessions built");
                    if let Some(metrics) = self.models.metrics(&model) {
                        metrics.load_duration.observe(took.as_secs_f64());
                        metrics.loads_from[source.index()].inc();
                        metrics.load_seconds_from[source.index()].observe(took.as_secs_f64());
                        self.models.load_took(&model, source, took);
                        if self.queue.is_wanted(&model) {
                            metrics.resident.set(1);
                            self.models.loaded(&model, self.context.clock.now());
                        }
                    }
                }
                Err(reason) => {
                    tracing::error!(pool = self.name(), %model, %reason, "loading the model failed");
                    if self.queue.drop_failed(&model)
                        && let Some(metrics) = self.models.metrics(&model)
                    {
                        metrics.resident.set(0);
                        metrics.unloads_failed.inc();
                    }
                }
            }
            loads.insert(model, result.map(|()| took));
        }
        slot.generation = generation;
        self.refresh_after_change(slot);
        loads
    }

    /// Allocator statistics after sessions came or went: what the weights now hold.
    fn refresh_after_change(&self, slot: &mut Slot) {
        self.refresh_stats(slot.id, slot.backend.as_mut());
    }

    /// Record `model`'s cold start: a job waited `waited` for its load.
    pub(super) fn record_cold_start(&self, model: &str, waited: Duration) {
        if let Some(metrics) = self.models.metrics(model) {
            metrics.cold_start.observe(waited.as_secs_f64());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex, mpsc};

    use super::*;
    // The backend's capability, beside the models' `Residency` of the config.
    use crate::core::backend::Residency as Loads;
    use crate::core::backend::{Backend, BackendError, RunMeta};
    use crate::core::snapshot::DeviceClass;
    use crate::core::tensor::Tensor;
    use crate::pool::metrics::ModelMetrics;
    use crate::pool::models::ModelSetup;
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
        assert!(!pool.is_resident("lazy") && pool.is_resident("slow") && pool.is_resident("fixed"));
        assert!(pool.submit(job("lazy")).unwrap().blocking_recv().unwrap().is_ok());
        assert!(pool.is_resident("lazy"));
        assert_eq!(models[0].metrics.loads_on_demand.get(), 1);

        // `slow` runs on one backend; unloading it waits for that run while `lazy` keeps serving.
        let running = pool.submit(job("slow")).unwrap();
        let unloading = {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || pool.unload_model("slow"))
        };
        assert!(pool.submit(job("lazy")).unwrap().blocking_recv().unwrap().is_ok());
        assert!(!unloading.is_finished(), "the unload waits for the running request");
        open.send(()).unwrap();
        assert!(running.blocking_recv().unwrap().is_ok(), "the run was not interrupted");
        assert_eq!(unloading.join().unwrap(), Ok(ResidencyOutcome::Unloaded));
        assert!(!pool.is_resident("slow"));
        assert_eq!(pool.unload_model("slow"), Ok(ResidencyOutcome::Already));
        assert_eq!(
            pool.unload_model("fixed"),
            Err(ResidencyError::Pinned { model: "fixed".into() })
        );
        assert_eq!(pool.load_model("slow"), Ok(ResidencyOutcome::Loaded));
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
        assert_eq!(pool.idle_check_interval(), Some(Duration::from_millis(2500)));

        clock.advance(Duration::from_secs(6));
        assert!(pool.submit(job("busy")).unwrap().blocking_recv().unwrap().is_ok());
        let probe = InferJob {
            probe: true,
            ..job("quiet")
        };
        assert!(pool.submit(probe).unwrap().blocking_recv().unwrap().is_ok());
        clock.advance(Duration::from_secs(4));
        assert!(pool.unload_idle().is_empty(), "never early: 10 s is not more than 10 s");
        clock.advance(Duration::from_millis(1));
        assert_eq!(pool.unload_idle(), vec!["quiet".to_string()], "the probe did not count");
        assert!(!pool.is_resident("quiet") && pool.is_resident("busy"));
        assert_eq!(models[0].metrics.unloads_idle.get(), 1);
        assert_eq!(models[0].metrics.resident.get(), 0);
        assert!(pool.unload_idle().is_empty(), "once: it is no longer loaded");

        assert!(pool.submit(job("quiet")).unwrap().blocking_recv().unwrap().is_ok());
        assert_eq!(models[0].metrics.loads_on_demand.get(), 1, "its next request loads it");
        clock.advance(Duration::from_secs(6));
        assert_eq!(pool.unload_idle(), vec!["busy".to_string()]);
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
        let busy = |model: &str| pool.residents().into_iter().find(|r| r.model == model).unwrap().busy;
        assert_eq!((busy("slow"), busy("idle")), (1, 1), "running and queued both count");
        assert!(!pool.evict("slow"), "running");
        assert!(!pool.evict("idle"), "queued behind it");
        assert!(!pool.evict("fixed"), "pinned");
        open.send(()).unwrap();
        assert!(running.blocking_recv().unwrap().is_ok() && queued.blocking_recv().unwrap().is_ok());
        assert!(pool.evict("idle"));
        assert!(!pool.is_resident("idle") && pool.is_resident("slow") && pool.is_resident("fixed"));
        assert_eq!(models[1].metrics.unloads_evicted.get(), 1);
        assert_eq!(models[1].metrics.resident.get(), 0);
        assert!(!pool.evict("idle"), "already gone");
        assert_eq!(
            pool.residents()
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
        assert!(pool.is_resident("a") && pool.is_resident("b") && !pool.is_resident("c"));
        assert_eq!(pool.shares_weights_of("b"), Some("a"));
        assert_eq!((pool.weights_shown("a"), pool.weights_shown("b")), (100, 0));
        assert_eq!((pool.weights_charged("a"), pool.weights_charged("b")), (100, 0));
        assert_eq!(pool.weights_freed_by("a"), 0, "`b` keeps the session");
        assert!(pool.holds_weights_of("c"), "a request of `c` loads nothing");

        // `c` on demand joins the session: no load, no build.
        assert!(pool.submit(job("c")).unwrap().blocking_recv().unwrap().is_ok());
        assert!(pool.is_resident("c") && loaded(2) == 0);
        assert_eq!(loads.lock().unwrap().as_slice(), ["c shares a"]);

        // `a` goes: the others keep the weights, now charged to `b`.
        assert_eq!(pool.unload_model("a"), Ok(ResidencyOutcome::Unloaded));
        assert!(!pool.is_resident("a") && pool.is_resident("b") && pool.is_resident("c"));
        assert_eq!((pool.weights_charged("a"), pool.weights_charged("b")), (0, 100));
        assert_eq!(pool.load_model("a"), Ok(ResidencyOutcome::Loaded));
        assert_eq!(models[0].metrics.loads_requested.get(), 0, "it shared `b`'s again");
        assert_eq!(loads.lock().unwrap().last().map(String::as_str), Some("a shares b"));

        // The last name of the group to go takes the weights with it.
        for model in ["a", "b"] {
            assert_eq!(pool.unload_model(model), Ok(ResidencyOutcome::Unloaded));
        }
        assert_eq!(pool.weights_freed_by("c"), 100);
        assert!(pool.evict("c"));
        assert!(!pool.holds_weights_of("a"));
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
        let busy = |model: &str| pool.residents().into_iter().find(|r| r.model == model).unwrap().busy;
        assert_eq!((busy("decoder"), busy("encoder")), (1, 0));
        assert!(!pool.evict("decoder"), "its KV cache is held between runs");
        drop(generation);
        assert!(pool.evict("decoder"));
    }
}
