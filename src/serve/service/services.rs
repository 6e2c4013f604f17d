//! Each service's budgets at run time (`services[]`: `concurrency`, `device_memory`, `class`):
//! how many of its requests run, what it holds on each accelerator device, and whether one more
//! request may start now, must wait, or can never fit.
//!
//! A service's memory on a device is the weights of its models resident on that device's pools
//! (as measured, once per worker: what `vramguard_model_memory_bytes{kind="weights"}` shows)
//! plus the estimates of its requests running there. A request holds a [`Slot`] from the moment
//! it is let through to its answer (a generation, to its last token); dropping the slot gives
//! its share back and wakes the requests waiting for one.
//!
//! The decision itself ([`judge`]) is plain data in, plain data out, tested without a pool.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::config::{Config, ServiceClass, ServiceConfig};
use crate::core::human::human_bytes;
use crate::core::snapshot::{ServiceState, Snapshot};
use crate::pool::Pool;
use crate::pool::activity::{Activity, Progress};

use super::{Memory, ModelEntry, Service, memory_of, observe};

pub use crate::serve::metrics::WaitFor;

/// Every service's live state, in config order.
#[derive(Debug)]
pub struct Services {
    entries: Vec<Arc<Live>>,
    /// The weights each accelerator pool holds of each model, and whose they are.
    holdings: Vec<Holding>,
    /// The accelerator devices (every configured device), in config order.
    devices: Vec<String>,
    /// Notified whenever a slot is given back.
    changed: Arc<Notify>,
    /// The interactive requests accepted and not answered: a background service's requests
    /// wait while any of them waits.
    interactive: Arc<Activity>,
}

/// One service: its config and what it runs now.
#[derive(Debug)]
struct Live {
    config: ServiceConfig,
    /// Whether any model here belongs to it (a service that only names another runtime's
    /// processes, through `exporter.services`, is only watched).
    runs_here: bool,
    usage: Mutex<Usage>,
}

/// What a service's admitted requests hold.
#[derive(Debug, Default)]
struct Usage {
    /// Requests let through and not answered.
    running: u64,
    /// Their estimates, by accelerator device.
    bytes: BTreeMap<String, u64>,
}

/// The weights of one model on one accelerator pool.
#[derive(Debug)]
struct Holding {
    pool: Arc<Pool>,
    model: String,
    /// Index into [`Services::entries`].
    service: usize,
    device: String,
    bytes: u64,
}

/// A request's place in its service's budgets, held until it is answered.
#[derive(Debug)]
pub struct Slot {
    live: Arc<Live>,
    device: Option<String>,
    bytes: u64,
    changed: Arc<Notify>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        {
            let mut usage = self.live.usage.lock().unwrap_or_else(|e| e.into_inner());
            usage.running = usage.running.saturating_sub(1);
            if let Some(device) = &self.device
                && let Some(bytes) = usage.bytes.get_mut(device)
            {
                *bytes = bytes.saturating_sub(self.bytes);
            }
        }
        self.changed.notify_waiters();
    }
}

/// What one request asks of its service's budgets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ask<'a> {
    /// The accelerator device it would run on (`None`: the host or a remote server, where no
    /// `device_memory` budget applies).
    pub device: Option<&'a str>,
    /// What it would add there: its estimate, and its model's weights when the pool must load
    /// them.
    pub need_bytes: u64,
    /// Interactive requests waiting now (for the policy, a deferral or a pool's queue).
    pub interactive_waiting: u64,
    /// The device's headroom and the reserve, when the headroom is under it.
    pub headroom_short: Option<(u64, u64)>,
}

/// What a service holds now, as [`judge`] reads it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// Its requests running.
    pub running: u64,
    /// Its memory on the asked device: resident weights and running requests' estimates.
    pub bytes: u64,
    /// The part of `bytes` its running requests hold (given back as they finish).
    pub running_bytes: u64,
}

/// Why a request may not start now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeldBack {
    /// Not now, but once running work finishes (or interactive work and headroom allow); the
    /// reason names the service and the budget.
    Wait(WaitFor, String),
    /// Never while what is resident stays: the reason names the service and the budget.
    Refuse(String),
}

/// Whether `service`, holding `held`, may start a request asking `ask`. Refusals come first (a
/// request that can never fit is told at once), then the reasons to wait: its `concurrency`,
/// its `device_memory` when its own running requests would free enough, and for a background
/// service, waiting interactive requests and a device short of its reserve.
pub fn judge(service: &ServiceConfig, held: Held, ask: &Ask<'_>) -> Result<(), HeldBack> {
    let name = &service.name;
    if let (Some(budget), Some(device)) = (service.device_memory, ask.device) {
        let would = held.bytes.saturating_add(ask.need_bytes);
        if would > budget {
            let why = format!(
                "service `{name}` would use {} on {device}, over its device_memory budget of {}",
                human_bytes(would),
                human_bytes(budget)
            );
            if would.saturating_sub(held.running_bytes) > budget {
                return Err(HeldBack::Refuse(why));
            }
            return Err(HeldBack::Wait(WaitFor::device_memory, why));
        }
    }
    if let Some(limit) = service.concurrency
        && held.running >= limit as u64
    {
        return Err(HeldBack::Wait(
            WaitFor::concurrency,
            format!(
                "service `{name}` has {} requests running, at its concurrency of {limit}",
                held.running
            ),
        ));
    }
    if service.class == ServiceClass::Background {
        if ask.interactive_waiting > 0 {
            return Err(HeldBack::Wait(
                WaitFor::background,
                format!(
                    "background service `{name}` gives way to {} waiting interactive requests",
                    ask.interactive_waiting
                ),
            ));
        }
        if let (Some((headroom, reserve)), Some(device)) = (ask.headroom_short, ask.device) {
            return Err(HeldBack::Wait(
                WaitFor::background,
                format!(
                    "background service `{name}` waits while {device} has {} of headroom, under its reserve of {}",
                    human_bytes(headroom),
                    human_bytes(reserve)
                ),
            ));
        }
    }
    Ok(())
}

impl Services {
    /// Every service of `config`, with the weights each accelerator pool holds of its models.
    pub(super) fn new(config: &Config, models: &[ModelEntry], pools: &[Arc<Pool>]) -> Services {
        let entries: Vec<Arc<Live>> = config
            .services
            .iter()
            .map(|s| {
                Arc::new(Live {
                    config: s.clone(),
                    runs_here: models.iter().any(|m| m.config.service == s.name),
                    usage: Mutex::default(),
                })
            })
            .collect();
        let mut holdings = Vec::new();
        for pool in pools {
            let Some(Memory::Device(device)) = memory_of(pool) else {
                continue;
            };
            for entry in models.iter().filter(|m| pool.serves(&m.config.name)) {
                let Some(service) = entries.iter().position(|s| s.config.name == entry.config.service) else {
                    continue;
                };
                holdings.push(Holding {
                    pool: Arc::clone(pool),
                    model: entry.config.name.clone(),
                    service,
                    device: device.to_string(),
                    bytes: observe::weights_on(pool, entry),
                });
            }
        }
        Services {
            entries,
            holdings,
            devices: config.devices.iter().map(|d| d.name.clone()).collect(),
            changed: Arc::new(Notify::new()),
            interactive: Arc::new(Activity::default()),
        }
    }

    /// The service called `name`.
    fn find(&self, name: &str) -> Option<(usize, &Arc<Live>)> {
        self.entries.iter().enumerate().find(|(_, s)| s.config.name == name)
    }

    /// The config of the service called `name`.
    pub fn config(&self, name: &str) -> Option<&ServiceConfig> {
        self.find(name).map(|(_, s)| &s.config)
    }

    /// Every service's config, in config order.
    pub fn configs(&self) -> impl Iterator<Item = &ServiceConfig> {
        self.entries.iter().map(|s| &s.config)
    }

    /// Notified whenever a request gives its slot back.
    pub fn changed(&self) -> &Notify {
        &self.changed
    }

    /// Interactive requests waiting now.
    pub fn interactive_waiting(&self) -> u64 {
        self.interactive.waiting()
    }

    /// Weights of the service at `index` resident on `device`'s pools now. Weights that
    /// models share on a pool are charged once, to the first of them resident there.
    fn resident_on(&self, index: usize, device: &str) -> u64 {
        self.holdings
            .iter()
            .filter(|h| h.service == index && h.device == device && h.pool.residency().weights_charged(&h.model) > 0)
            .map(|h| h.bytes)
            .sum()
    }

    /// Let one request of `service` through, or say why not ([`judge`]); the check and the
    /// count are one step, so concurrent requests cannot both take the last place. An unknown
    /// service (none is configured for the model) has no budgets.
    pub fn enter(&self, service: &str, ask: &Ask<'_>) -> Result<Option<Slot>, HeldBack> {
        let Some((index, live)) = self.find(service) else {
            return Ok(None);
        };
        let resident = ask.device.map_or(0, |d| self.resident_on(index, d));
        let mut usage = live.usage.lock().unwrap_or_else(|e| e.into_inner());
        let running_bytes = ask.device.and_then(|d| usage.bytes.get(d).copied()).unwrap_or(0);
        let held = Held {
            running: usage.running,
            bytes: resident.saturating_add(running_bytes),
            running_bytes,
        };
        judge(&live.config, held, ask)?;
        usage.running += 1;
        if let Some(device) = ask.device {
            *usage.bytes.entry(device.to_string()).or_insert(0) += ask.need_bytes;
        }
        Ok(Some(Slot {
            live: Arc::clone(live),
            device: ask.device.map(str::to_string),
            bytes: ask.need_bytes,
            changed: Arc::clone(&self.changed),
        }))
    }

    /// Requests of `service` running now.
    pub fn running(&self, service: &str) -> u64 {
        self.find(service)
            .map_or(0, |(_, s)| s.usage.lock().unwrap_or_else(|e| e.into_inner()).running)
    }

    /// What `service` holds on each accelerator device now (every device listed, 0 where it
    /// holds nothing); `None` for a service no model here belongs to.
    pub fn memory(&self, service: &str) -> Option<BTreeMap<String, u64>> {
        let (index, live) = self.find(service)?;
        if !live.runs_here {
            return None;
        }
        let usage = live.usage.lock().unwrap_or_else(|e| e.into_inner());
        let memory = self
            .devices
            .iter()
            .map(|d| {
                let running = usage.bytes.get(d).copied().unwrap_or(0);
                (d.clone(), self.resident_on(index, d).saturating_add(running))
            })
            .collect();
        Some(memory)
    }

    /// What `service` holds on each accelerator device: vramguard's account of a service it
    /// runs, else what `snapshot` shows its processes use (another runtime's service).
    pub fn memory_or_seen(&self, service: &str, snapshot: &Snapshot) -> BTreeMap<String, u64> {
        self.memory(service)
            .unwrap_or_else(|| crate::telemetry::services::seen_in(snapshot, service, &self.devices))
    }

    /// Every service as `state.services` shows it now, another runtime's by `snapshot`.
    pub fn states(&self, config: &Config, snapshot: &Snapshot) -> BTreeMap<String, ServiceState> {
        let mut states = crate::policy::configured_services(config);
        for (name, state) in &mut states {
            state.running = self.running(name);
            state.memory_bytes = self.memory_or_seen(name, snapshot);
        }
        states
    }
}

impl crate::telemetry::services::OwnMemory for Services {
    fn memory_of(&self, service: &str) -> Option<BTreeMap<String, u64>> {
        self.memory(service)
    }
}

impl Service {
    /// A request for `model` was accepted: counted among the service's requests, and among
    /// the interactive ones when its model's service is interactive; idle CPUs wake within
    /// `server.cpu_wake_latency` until it is answered.
    pub fn accept(&self, model: &str) -> Progress {
        let interactive = self
            .model(model)
            .and_then(|m| self.services.config(&m.config.service))
            .is_none_or(|s| s.class == ServiceClass::Interactive);
        let progress = self
            .activity
            .accept_also(interactive.then_some(&self.services.interactive));
        if let Some(limit) = &self.wake_limit {
            progress.hold(Box::new(limit.busy()));
        }
        progress
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::fakes::{self, Echo, FakeFactory};

    #[test]
    fn a_service_holds_its_resident_weights_per_worker_and_its_running_requests_until_answered() {
        let yaml = "devices: [{name: gpu0, kind: nvidia, index: 0}]\n\
                    services: [{name: chat, device_memory: 1GiB, concurrency: 2}]\n\
                    models:\n\
                    - {name: enc, path: 'builtin:encoder', service: chat}\n\
                    - {name: other, path: 'builtin:encoder'}\n\
                    pools:\n\
                    - {name: gpu, provider: cuda, device: gpu0, models: [enc, other], workers: 2}\n\
                    - {name: cpu, provider: cpu, models: [enc]}\n";
        // No memory source reads the device here: a policy that reads none.
        let script = crate::testing::Scratch::new();
        let yaml = format!("{yaml}{}", script.policy(crate::testing::ADMIT_ALL));
        let factory = Arc::new(FakeFactory::new(|_| Ok(Box::new(Echo))));
        let service = fakes::service(crate::testing::config::validated(&yaml), factory);
        let services = &service.services;
        // Two workers on the device each build their sessions; the CPU pool's are the host's.
        let weights = 2 * service.model("enc").unwrap().profile.weights_bytes;
        let on_gpu = |bytes| Some(BTreeMap::from([("gpu0".to_string(), bytes)]));
        assert_eq!(services.memory("chat"), on_gpu(weights));
        assert_eq!(
            services.memory("other"),
            on_gpu(weights),
            "the implicit service of a model"
        );
        assert_eq!(services.memory("nobody"), None);

        let ask = |device| Ask {
            device,
            need_bytes: 1000,
            ..Ask::default()
        };
        let first = services
            .enter("chat", &ask(Some("gpu0")))
            .unwrap()
            .expect("chat has budgets");
        let second = services.enter("chat", &ask(None)).unwrap().expect("chat has budgets");
        assert_eq!(services.running("chat"), 2);
        assert_eq!(
            services.memory("chat"),
            on_gpu(weights + 1000),
            "only the device's request counts there"
        );
        assert!(matches!(services.enter("chat", &ask(None)), Err(HeldBack::Wait(..))));
        let states = services.states(&service.config, &Snapshot::default());
        assert_eq!((states["chat"].running, states["chat"].budget_bytes), (2, 1 << 30));
        assert_eq!(states["chat"].memory_bytes, on_gpu(weights + 1000).unwrap());

        drop(first);
        assert_eq!(services.running("chat"), 1);
        assert_eq!(services.memory("chat"), on_gpu(weights));
        drop(second);
        assert_eq!(services.running("chat"), 0);

        // A model that is not loaded holds nothing.
        service
            .pool("gpu")
            .unwrap()
            .residency()
            .unload_model("enc")
            .expect("unloads");
        assert_eq!(services.memory("chat"), on_gpu(0));
        assert_eq!(services.memory("other"), on_gpu(weights));
    }

    fn service(device_memory: Option<u64>, concurrency: Option<usize>, class: ServiceClass) -> ServiceConfig {
        ServiceConfig {
            name: "chat".into(),
            device_memory,
            concurrency,
            class,
            ..ServiceConfig::implicit_default()
        }
    }

    const GIB: u64 = 1 << 30;

    fn on_sim(need_bytes: u64) -> Ask<'static> {
        Ask {
            device: Some("sim0"),
            need_bytes,
            ..Ask::default()
        }
    }

    #[test]
    fn over_its_device_memory_a_request_waits_for_its_own_running_work_or_is_refused() {
        let chat = service(Some(6 * GIB), None, ServiceClass::Interactive);
        let five = Held {
            running: 1,
            bytes: 5 * GIB,
            running_bytes: GIB,
        };
        assert_eq!(judge(&chat, five, &on_sim(GIB)), Ok(()), "exactly the budget fits");
        // 6.2 GiB: the running request's 1 GiB, once given back, leaves room.
        let need = GIB + GIB / 5;
        match judge(&chat, five, &on_sim(need)) {
            Err(HeldBack::Wait(_, why)) => assert_eq!(
                why,
                "service `chat` would use 6.2 GiB on sim0, over its device_memory budget of 6 GiB"
            ),
            other => panic!("{other:?}"),
        }
        // Its weights alone leave no room: waiting would not help.
        let weights = Held {
            running: 1,
            bytes: 5 * GIB,
            running_bytes: GIB / 2,
        };
        assert!(matches!(
            judge(&chat, weights, &on_sim(2 * GIB)),
            Err(HeldBack::Refuse(_))
        ));
        // Off the accelerator no device budget applies.
        let cpu = Ask {
            device: None,
            need_bytes: 100 * GIB,
            ..Ask::default()
        };
        assert_eq!(judge(&chat, weights, &cpu), Ok(()));
    }

    #[test]
    fn at_its_concurrency_a_request_waits() {
        let chat = service(None, Some(2), ServiceClass::Interactive);
        let held = |running| Held {
            running,
            ..Held::default()
        };
        assert_eq!(judge(&chat, held(1), &on_sim(1)), Ok(()));
        assert_eq!(
            judge(&chat, held(2), &on_sim(1)),
            Err(HeldBack::Wait(
                WaitFor::concurrency,
                "service `chat` has 2 requests running, at its concurrency of 2".into()
            ))
        );
    }

    #[test]
    fn a_background_request_gives_way_to_interactive_work_and_a_short_reserve() {
        let batch = service(None, None, ServiceClass::Background);
        let waiting = Ask {
            interactive_waiting: 1,
            ..on_sim(1)
        };
        assert!(matches!(
            judge(&batch, Held::default(), &waiting),
            Err(HeldBack::Wait(..))
        ));
        let short = Ask {
            headroom_short: Some((GIB / 2, GIB)),
            ..on_sim(1)
        };
        match judge(&batch, Held::default(), &short) {
            Err(HeldBack::Wait(_, why)) => {
                assert!(why.contains("512 MiB of headroom, under its reserve of 1 GiB"), "{why}")
            }
            other => panic!("{other:?}"),
        }
        // The same request on the CPU pool is not held back by a device's headroom.
        let on_cpu = Ask { device: None, ..short };
        assert_eq!(judge(&batch, Held::default(), &on_cpu), Ok(()));
        // An interactive service ignores both.
        let chat = service(None, None, ServiceClass::Interactive);
        assert_eq!(judge(&chat, Held::default(), &waiting), Ok(()));
        assert_eq!(judge(&chat, Held::default(), &short), Ok(()));
    }
}
