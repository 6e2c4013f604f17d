//! What a script sees: `req` and `state` as Rhai values, built from [`RequestInfo`] and
//! [`Snapshot`].
//!
//! Cost is the design constraint here. The policy runs once per request, before it is queued, and
//! a Rhai object map is a `BTreeMap` that Rhai deep-copies whenever it is passed to a script
//! function. Copying a whole snapshot (2 devices, 3 pools, 20 processes: ~200 values in ~30 maps)
//! costs several microseconds, more than the script itself. So:
//!
//! - `req` is a plain object map, built per request (it is small and changes every time) by
//!   filling in a copy of a map that already has the keys;
//! - `state` is a plain object map of eight entries, but its collections (`devices`, `pools`,
//!   `services`, `models`, `processes`) are read-only views ([`Table`], [`List`]) over data
//!   built once per snapshot and shared by reference count. Passing one to the script is a pointer copy; a script pays
//!   for a device or pool record only when it reads it (`state.pools[name]` hands out a copy of
//!   that one record as an ordinary object map);
//! - `state.params` is an ordinary object map: it is small, and a property read on a map costs
//!   half of an indexer call on a view, which matters for the constants a policy reads most.
//!
//! Rhai's own shared values (`Dynamic::into_shared`) would avoid the copy too, but Rhai takes a
//! write lock to read through them and gives up (10 ms sleeps, then an error) when another thread
//! holds it, so they must never be shared between concurrent evaluations.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, OnceLock};

use rhai::{Array, Dynamic, EvalAltResult, ImmutableString, Map, Position};

use crate::core::snapshot::{
    DeviceState, HostState, ModelState, PoolState, ProcessState, RequestInfo, ServiceState, Snapshot,
};

/// Operator constants from the config, visible to the script as `state.params`.
pub type Params = BTreeMap<String, serde_json::Value>;

/// A read-only name → value collection (`state.devices`, `state.pools`).
///
/// Scripts use it like an object map: `t[name]`, `t.name`, `name in t`, `t.get(name)` (`()` when
/// absent), `t.keys()`, `t.values()`, `t.len()`, `t.is_empty()`. Reading an entry returns a copy.
#[derive(Debug, Clone, Default)]
pub struct Table {
    entries: Arc<BTreeMap<ImmutableString, Dynamic>>,
    /// For `state.pools` and `state.services`: where an entry's live fields are read when the
    /// script reads it.
    live: Option<(Arc<dyn LiveLoad>, Live)>,
}

/// Which live fields a [`Table`]'s entries have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Live {
    /// A pool's load ([`LiveLoad::pool_load`]).
    Pools,
    /// A service's running requests and memory ([`LiveLoad::service_now`]).
    Services,
}

/// A service's running requests and memory as they are now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceNow {
    /// Its requests running, all pools together.
    pub running: u64,
    /// What it holds on each accelerator device.
    pub memory_bytes: BTreeMap<String, u64>,
}

/// A pool's load as it is now, not as it was at the last sample.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolLoadNow {
    /// Requests waiting.
    pub queue_depth: u64,
    /// Age of the oldest waiting request.
    pub queue_oldest_age_ms: u64,
    /// Requests running.
    pub inflight: u64,
    /// Allocator failures in the recent window.
    pub alloc_failures_recent: u64,
    /// Estimated time until a new request would finish.
    pub est_delay_ms: u64,
    /// The circuit breaker now.
    pub breaker: crate::core::snapshot::BreakerState,
    /// Text generations waiting for their prompt's run.
    pub sequences_waiting: u64,
    /// Text generations past their prompt, holding a KV cache.
    pub sequences_running: u64,
    /// Bytes of those KV caches.
    pub kv_cache_bytes: u64,
}

/// Where live pool load comes from (the server's pools). Reading it when a script reads a pool
/// keeps `state` current while the rest of the view is built once per sample: queues move with
/// every request, and rebuilding the view for each one was most of an evaluation's cost.
pub trait LiveLoad: Send + Sync + std::fmt::Debug {
    /// The load of `pool` now, or `None` when it is not known here.
    fn pool_load(&self, pool: &str) -> Option<PoolLoadNow>;

    /// What `service` runs and holds now, or `None` when it is not known here (the sample's
    /// figures stand).
    fn service_now(&self, _service: &str) -> Option<ServiceNow> {
        None
    }
}

impl Table {
    fn from_entries(entries: impl IntoIterator<Item = (ImmutableString, Dynamic)>) -> Self {
        Table {
            entries: Arc::new(entries.into_iter().collect()),
            live: None,
        }
    }

    /// Whether `name` is an entry.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The entry names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(|k| k.as_str())
    }

    /// A copy of entry `name` for the script, with the live fields filled in now.
    fn read(&self, name: &str, value: &Dynamic) -> Dynamic {
        let mut value = value.clone();
        let live = match &self.live {
            Some((live, Live::Services)) => {
                if let Some(now) = live.service_now(name)
                    && let Some(mut map) = value.write_lock::<Map>()
                {
                    map.insert("running".into(), int(now.running));
                    map.insert("memory_bytes".into(), memory(&now.memory_bytes));
                }
                return value;
            }
            Some((live, Live::Pools)) => live,
            None => return value,
        };
        if let Some(now) = live.pool_load(name)
            && let Some(mut map) = value.write_lock::<Map>()
        {
            for (key, v) in [
                ("queue_depth", now.queue_depth),
                ("queue_oldest_age_ms", now.queue_oldest_age_ms),
                ("inflight", now.inflight),
                ("alloc_failures_recent", now.alloc_failures_recent),
                ("est_delay_ms", now.est_delay_ms),
                ("sequences_waiting", now.sequences_waiting),
                ("sequences_running", now.sequences_running),
                ("kv_cache_bytes", now.kv_cache_bytes),
            ] {
                if let Some(slot) = map.get_mut(key) {
                    *slot = int(v);
                }
            }
            if let Some(slot) = map.get_mut("breaker") {
                *slot = interned(now.breaker.label());
            }
        }
        value
    }

    /// `t[name]`: the entry, or the same error Rhai raises for a missing object-map property
    /// (the engine runs with `fail_on_invalid_map_property`, so a typo fails loudly).
    pub(crate) fn index(&mut self, name: &str) -> Result<Dynamic, Box<EvalAltResult>> {
        self.entries
            .get(name)
            .map(|v| self.read(name, v))
            .ok_or_else(|| EvalAltResult::ErrorPropertyNotFound(name.to_string(), Position::NONE).into())
    }

    /// `t.get(name)`: the entry or `()`, for optional entries (`state.params.get("x") ?? 5`).
    pub(crate) fn get(&mut self, name: &str) -> Dynamic {
        self.entries.get(name).map_or(Dynamic::UNIT, |v| self.read(name, v))
    }

    pub(crate) fn keys(&mut self) -> Array {
        self.entries.keys().map(|k| Dynamic::from(k.clone())).collect()
    }

    pub(crate) fn values(&mut self) -> Array {
        self.entries.iter().map(|(k, v)| self.read(k, v)).collect()
    }

    pub(crate) fn len(&mut self) -> i64 {
        to_int(self.entries.len() as u64)
    }

    pub(crate) fn is_empty(&mut self) -> bool {
        self.entries.is_empty()
    }

    /// Rendered like an object map, so `print(state.pools)` shows the data.
    pub(crate) fn render(&mut self) -> String {
        let mut out = String::from("#{");
        for (i, (k, v)) in self.entries.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            let _ = write!(out, "{sep}{k:?}: {}", self.read(k, v));
        }
        out.push('}');
        out
    }
}

/// A read-only array (`state.processes`).
///
/// Scripts use it like an array for reading: `l[i]` (negative counts from the end), `l.len()`,
/// `l.is_empty()`, `for x in l`, and `l.to_array()` for a copy that has every array method
/// (`filter`, `map`, `reduce`, `sort`…). Reading an element returns a copy.
#[derive(Debug, Clone, Default)]
pub struct List(Arc<[Dynamic]>);

impl List {
    pub(crate) fn index(&mut self, index: i64) -> Result<Dynamic, Box<EvalAltResult>> {
        let len = self.0.len();
        let position = if index < 0 {
            usize::try_from(index.unsigned_abs())
                .ok()
                .and_then(|back| len.checked_sub(back))
        } else {
            usize::try_from(index).ok()
        };
        position
            .and_then(|i| self.0.get(i))
            .cloned()
            .ok_or_else(|| EvalAltResult::ErrorArrayBounds(len, index, Position::NONE).into())
    }

    pub(crate) fn len(&mut self) -> i64 {
        to_int(self.0.len() as u64)
    }

    pub(crate) fn is_empty(&mut self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn copy_to_array(&mut self) -> Array {
        self.0.to_vec()
    }

    pub(crate) fn render(&mut self) -> String {
        let items: Vec<String> = self.0.iter().map(|v| v.to_string()).collect();
        format!("[{}]", items.join(", "))
    }
}

/// `for x in list` walks the shared elements, copying one at a time.
pub struct ListIter {
    items: Arc<[Dynamic]>,
    next: usize,
}

impl Iterator for ListIter {
    type Item = Dynamic;

    fn next(&mut self) -> Option<Dynamic> {
        let item = self.items.get(self.next).cloned();
        self.next += 1;
        item
    }
}

impl IntoIterator for List {
    type Item = Dynamic;
    type IntoIter = ListIter;

    fn into_iter(self) -> ListIter {
        ListIter { items: self.0, next: 0 }
    }
}

/// The script's `state` without `params`, built once per [`Snapshot`] and reused for every
/// request evaluated against that snapshot (cloning it is a few reference-count increments).
///
/// Build a new one whenever the snapshot changes (the server's `Service::policy_view` keeps one
/// per sample, keyed on the sample's generation); with [`StateView::with_live_load`] its pools
/// stay current between samples.
#[derive(Debug, Clone)]
pub struct StateView {
    /// The `state` map, complete but for `params`, which belongs to the [`Script`](super::Script).
    map: Map,
    pools: Table,
    services: Table,
    /// The same state as it came, for the compiled evaluation (`compiled.rs`), which reads it
    /// where it is instead of through `map`.
    snapshot: Arc<Snapshot>,
    live: Option<Arc<dyn LiveLoad>>,
}

impl StateView {
    /// Convert a snapshot into the script's representation.
    pub fn new(snapshot: &Snapshot) -> Self {
        let devices = Table::from_entries(snapshot.devices.iter().map(|(name, d)| (name.into(), device(d))));
        let pools = Table::from_entries(snapshot.pools.iter().map(|(name, p)| (name.into(), pool(p))));
        let processes = List(snapshot.processes.iter().map(process).collect());
        let services = Table::from_entries(snapshot.services.iter().map(|(name, s)| (name.into(), service(s))));
        let models = Table::from_entries(snapshot.models.iter().map(|(name, m)| (name.into(), model(m))));
        let map = [
            ("devices", Dynamic::from(devices)),
            ("pools", Dynamic::from(pools.clone())),
            ("services", Dynamic::from(services.clone())),
            ("host", host(&snapshot.host)),
            ("processes", Dynamic::from(processes)),
            ("degraded", Dynamic::from_bool(snapshot.degraded)),
            ("models", Dynamic::from(models)),
            ("params", Dynamic::UNIT),
        ]
        .into_iter()
        .map(|(k, v)| (k.into(), v))
        .collect();
        StateView {
            map,
            pools,
            services,
            snapshot: Arc::new(snapshot.clone()),
            live: None,
        }
    }

    /// The same view whose pools read their load (and services what they run and hold) from
    /// `live` whenever a script reads them, so one view per sample serves every request until
    /// the next sample.
    pub fn with_live_load(mut self, live: Arc<dyn LiveLoad>) -> Self {
        self.live = Some(Arc::clone(&live));
        self.pools.live = Some((Arc::clone(&live), Live::Pools));
        self.services.live = Some((live, Live::Services));
        for (key, table) in [("pools", &self.pools), ("services", &self.services)] {
            if let Some(slot) = self.map.get_mut(key) {
                *slot = Dynamic::from(table.clone());
            }
        }
        self
    }

    /// Whether the snapshot has a pool called `name` (decisions naming another pool are refused).
    pub fn has_pool(&self, name: &str) -> bool {
        self.pools.contains(name)
    }

    /// The pool names, for error messages.
    pub fn pool_names(&self) -> impl Iterator<Item = &str> {
        self.pools.names()
    }

    /// The snapshot the view was made from.
    pub(crate) fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    /// Where its pools' and services' live figures come from, when they are read live.
    pub(crate) fn live(&self) -> Option<&dyn LiveLoad> {
        self.live.as_deref()
    }

    /// The `state` argument for one evaluation.
    pub(crate) fn to_dynamic(&self, params: &Dynamic) -> Dynamic {
        let mut state = self.map.clone();
        if let Some(slot) = state.get_mut("params") {
            *slot = params.clone();
        }
        Dynamic::from_map(state)
    }
}

/// The `req` argument for one evaluation.
///
/// Cloning a map that already has every key and then filling in the values costs less than half
/// of inserting eleven keys into a fresh map (each insert searches and may split a node).
pub(crate) fn request(req: &RequestInfo) -> Dynamic {
    static TEMPLATE: OnceLock<(Map, Map)> = OnceLock::new();
    let (request_keys, estimate_keys) = TEMPLATE.get_or_init(|| {
        let keys = |names: &[&str]| names.iter().map(|k| ((*k).into(), Dynamic::UNIT)).collect::<Map>();
        (
            keys(&[
                "id",
                "model",
                "pool",
                "service",
                "context_tokens",
                "max_new_tokens",
                "batch",
                "priority",
                "replayable",
                "allow_shrink",
                "deadline_ms",
                "estimate",
                "dims",
                "load_bytes",
                "evictable_bytes",
            ]),
            keys(&[
                "weights_bytes",
                "context_bytes",
                "workspace_bytes",
                "total_bytes",
                "source",
            ]),
        )
    });
    let mut estimate = estimate_keys.clone();
    for (key, slot) in estimate.iter_mut() {
        *slot = match key.as_str() {
            "weights_bytes" => int(req.estimate.weights_bytes),
            "context_bytes" => int(req.estimate.context_bytes),
            "workspace_bytes" => int(req.estimate.workspace_bytes),
            "source" => interned(req.estimate.source.label()),
            _ => int(req.estimate.total_bytes),
        };
    }
    let mut map = request_keys.clone();
    let mut estimate = Some(estimate);
    for (key, slot) in map.iter_mut() {
        *slot = match key.as_str() {
            "id" => string(&req.id),
            "model" => interned(&req.model),
            "pool" => interned(&req.pool),
            "service" => interned(&req.service),
            "context_tokens" => int(req.context_tokens),
            "max_new_tokens" => int(req.max_new_tokens),
            "batch" => int(req.batch),
            "priority" => Dynamic::from_int(req.priority),
            "replayable" => Dynamic::from_bool(req.replayable),
            "allow_shrink" => Dynamic::from_bool(req.allow_shrink),
            "deadline_ms" => int(req.deadline_ms),
            "load_bytes" => int(req.load_bytes),
            "evictable_bytes" => int(req.evictable_bytes),
            "dims" => ints(&req.dims),
            _ => estimate.take().map_or(Dynamic::UNIT, Dynamic::from_map),
        };
    }
    Dynamic::from_map(map)
}

/// Convert operator constants; `_bytes` keys accept sizes (`64MiB`) and `_ms` keys durations
/// (`2s`), so the config reads like the rest of it while scripts always get integers.
pub(crate) fn params(params: &Params) -> Result<Dynamic, String> {
    let mut entries = Vec::with_capacity(params.len());
    for (key, value) in params {
        let converted = match value {
            serde_json::Value::String(text) if key.ends_with("_bytes") => {
                let bytes = crate::config::parse_size(text).map_err(|e| format!("params.{key}: {e}"))?;
                int(bytes)
            }
            serde_json::Value::String(text) if key.ends_with("_ms") => {
                let duration = crate::config::parse_duration(text).map_err(|e| format!("params.{key}: {e}"))?;
                int(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX))
            }
            other => json(other),
        };
        entries.push((key.as_str().into(), converted));
    }
    Ok(Dynamic::from_map(entries.into_iter().collect()))
}

fn json(value: &serde_json::Value) -> Dynamic {
    match value {
        serde_json::Value::Null => Dynamic::UNIT,
        serde_json::Value::Bool(b) => Dynamic::from_bool(*b),
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(i) => Dynamic::from_int(i),
            // Beyond i64 (or fractional): scripts compare floats with integers fine.
            None => Dynamic::from_float(n.as_f64().unwrap_or(f64::MAX)),
        },
        serde_json::Value::String(s) => string(s),
        serde_json::Value::Array(items) => Dynamic::from_array(items.iter().map(json).collect()),
        serde_json::Value::Object(entries) => {
            Dynamic::from_map(entries.iter().map(|(k, v)| (k.as_str().into(), json(v))).collect())
        }
    }
}

fn device(d: &DeviceState) -> Dynamic {
    record([
        ("kind", string(d.kind.label())),
        ("total_bytes", int(d.total_bytes)),
        ("used_bytes", int(d.used_bytes)),
        ("free_bytes", int(d.free_bytes)),
        ("reserved_bytes", int(d.reserved_bytes)),
        ("active_bytes", int(d.active_bytes)),
        ("headroom_bytes", int(d.headroom_bytes)),
    ])
}

fn pool(p: &PoolState) -> Dynamic {
    record([
        ("provider", string(p.provider.label())),
        ("device", string(&p.device)),
        ("breaker", string(p.breaker.label())),
        ("queue_depth", int(p.queue_depth)),
        ("queue_oldest_age_ms", int(p.queue_oldest_age_ms)),
        ("inflight", int(p.inflight)),
        ("concurrency", int(p.concurrency)),
        ("alloc_failures_recent", int(p.alloc_failures_recent)),
        ("est_delay_ms", int(p.est_delay_ms)),
        ("max_context", int(p.max_context)),
        ("sequences_waiting", int(p.sequences_waiting)),
        ("sequences_running", int(p.sequences_running)),
        ("kv_cache_bytes", int(p.kv_cache_bytes)),
    ])
}

fn service(s: &ServiceState) -> Dynamic {
    record([
        ("class", string(&s.class)),
        ("priority", Dynamic::from_int(s.priority)),
        ("running", int(s.running)),
        ("concurrency", int(s.concurrency)),
        ("budget_bytes", int(s.budget_bytes)),
        ("memory_bytes", memory(&s.memory_bytes)),
    ])
}

/// Bytes by device, as a plain object map.
fn memory(bytes: &BTreeMap<String, u64>) -> Dynamic {
    ints(bytes)
}

/// A sorted map of numbers as an object map. Inserted one by one: collecting an iterator into a
/// `BTreeMap` first gathers it in a `Vec` and sorts it, an allocation and a pass these maps
/// (already sorted, a handful of keys, built per request) do not need.
fn ints(values: &BTreeMap<String, u64>) -> Dynamic {
    let mut map = Map::new();
    for (k, v) in values {
        map.insert(k.as_str().into(), int(*v));
    }
    Dynamic::from_map(map)
}

fn model(m: &ModelState) -> Dynamic {
    let pools = m.pools.iter().map(|(name, p)| {
        let on = record([
            ("resident", Dynamic::from_bool(p.resident)),
            ("busy", int(p.busy)),
            ("idle_ms", int(p.idle_ms)),
            ("loaded_ms_ago", int(p.loaded_ms_ago)),
            ("weights_bytes", int(p.weights_bytes)),
            ("host_tier", Dynamic::from_bool(p.host_tier)),
            ("reload_ms", int(p.reload_ms)),
        ]);
        (name.into(), on)
    });
    record([
        ("priority", Dynamic::from_int(m.priority)),
        ("residency", string(&m.residency)),
        ("pools", Dynamic::from(Table::from_entries(pools))),
    ])
}

fn host(h: &HostState) -> Dynamic {
    record([
        ("mem_available_bytes", int(h.mem_available_bytes)),
        ("mem_total_bytes", int(h.mem_total_bytes)),
        ("reserve_bytes", int(h.reserve_bytes)),
    ])
}

fn process(p: &ProcessState) -> Dynamic {
    record([
        ("pid", int(u64::from(p.pid))),
        ("name", string(&p.name)),
        ("service", string(&p.service)),
        ("device", string(&p.device)),
        ("used_bytes", int(p.used_bytes)),
    ])
}

fn record<const N: usize>(fields: [(&str, Dynamic); N]) -> Dynamic {
    Dynamic::from_map(fields.into_iter().map(|(k, v)| (k.into(), v)).collect())
}

fn string(s: &str) -> Dynamic {
    Dynamic::from(ImmutableString::from(s))
}

/// Most names a thread keeps for [`interned`]: more than a config has models, pools, services and
/// labels, so a name outside them (never expected) is just built afresh.
const MAX_NAMES: usize = 64;

thread_local! {
    /// The names this thread has handed to scripts, each built once.
    static NAMES: std::cell::RefCell<Vec<ImmutableString>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A string from a small, fixed set (a model, pool or service name, a breaker or estimate-source
/// label) for the script. Every request carries the same few: building each one afresh cost an
/// allocation and a free per string per evaluation; a copy of a kept one is a reference count.
fn interned(s: &str) -> Dynamic {
    let kept = NAMES.with(|names| {
        let mut names = names.try_borrow_mut().ok()?;
        if let Some(found) = names.iter().find(|n| n.as_str() == s) {
            return Some(found.clone());
        }
        let made = ImmutableString::from(s);
        if names.len() < MAX_NAMES {
            names.push(made.clone());
        }
        Some(made)
    });
    Dynamic::from(kept.unwrap_or_else(|| ImmutableString::from(s)))
}

fn int(v: u64) -> Dynamic {
    Dynamic::from_int(to_int(v))
}

/// Rhai integers are `i64`; byte counts past 8 EiB do not occur, so saturate rather than wrap.
fn to_int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
