//! Plain data shared by the exporter and the policy: one [`Snapshot`] of memory and load
//! (what `/metrics` exports and what a policy script sees as `state`), a [`RequestInfo`] (the
//! script's `req`) and the [`Decision`] a policy returns. No behaviour lives here.

use std::collections::BTreeMap;
use std::fmt;

use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};
use serde::{Deserialize, Serialize};

/// Everything known about memory and load at one instant.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Snapshot {
    /// Accelerator devices by name.
    pub devices: BTreeMap<String, DeviceState>,
    /// Worker pools by name.
    pub pools: BTreeMap<String, PoolState>,
    /// Host memory.
    pub host: HostState,
    /// Processes holding accelerator memory (every device).
    pub processes: Vec<ProcessState>,
    /// True while the service runs in degraded mode (e.g. the GPU pool's breaker is open).
    pub degraded: bool,
    /// The services whose memory vramguard accounts for, by name (`state.services`).
    pub services: BTreeMap<String, ServiceState>,
    /// Every model the pools serve, and where its sessions are loaded.
    pub models: BTreeMap<String, ModelState>,
}

/// One service: its budgets and what it holds now (`state.services[name]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServiceState {
    /// `interactive` or `background`.
    pub class: String,
    /// Priority of its models unless they set their own.
    pub priority: i64,
    /// Its requests running now (admitted to a pool, not answered yet), all pools together.
    pub running: u64,
    /// Most requests it may run at once (0: no limit).
    pub concurrency: u64,
    /// Its `device_memory` budget on each accelerator (0: none).
    pub budget_bytes: u64,
    /// What it holds on each accelerator device: resident weights and running requests'
    /// estimates.
    pub memory_bytes: BTreeMap<String, u64>,
}

impl Default for ServiceState {
    fn default() -> Self {
        ServiceState {
            class: "interactive".into(),
            priority: 0,
            running: 0,
            concurrency: 0,
            budget_bytes: 0,
            memory_bytes: BTreeMap::new(),
        }
    }
}

/// One model, as eviction and the policy see it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelState {
    /// Eviction takes lower priorities first.
    pub priority: i64,
    /// `resident`, `pinned` or `on_demand`.
    pub residency: String,
    /// Each pool serving it.
    pub pools: BTreeMap<String, ModelOnPoolState>,
}

/// One model on one pool.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelOnPoolState {
    /// Its sessions are loaded there.
    pub resident: bool,
    /// Its requests queued or running there: a model with any is never evicted.
    pub busy: u64,
    /// Milliseconds since its last request there (since the start when it had none).
    pub idle_ms: u64,
    /// Milliseconds since its sessions were last built there (since the start for those built
    /// then).
    pub loaded_ms_ago: u64,
    /// Its weights there when loaded.
    pub weights_bytes: u64,
    /// Its optimized bytes are in the host tier: a reload there is a copy, not a load.
    pub host_tier: bool,
    /// Milliseconds a reload there is expected to take, from the last load from where its
    /// bytes would come now (0: not known yet).
    pub reload_ms: u64,
}

/// One device's memory.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeviceState {
    /// `nvml` or `simulated`.
    pub kind: DeviceClass,
    /// Capacity.
    pub total_bytes: u64,
    /// In use by every process (driver's view; for simulated devices: our arena plus pressure).
    pub used_bytes: u64,
    /// `total - used`.
    pub free_bytes: u64,
    /// Reserved by vramguard's ONNX Runtime arenas on this device.
    pub reserved_bytes: u64,
    /// Held by live tensors in those arenas.
    pub active_bytes: u64,
    /// What a new request of ours can still get: free memory plus our reserved-but-idle arena
    /// bytes (`free + reserved - active`), which the arena reuses before asking the device.
    pub headroom_bytes: u64,
}

/// One pool's state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolState {
    /// `cpu`, `cuda` or `simulated`.
    pub provider: ProviderKind,
    /// Device name (`host` for CPU pools).
    pub device: String,
    /// `closed`, `half_open` or `open`.
    pub breaker: BreakerState,
    /// Requests waiting.
    pub queue_depth: u64,
    /// Age of the oldest waiting request.
    pub queue_oldest_age_ms: u64,
    /// Requests running.
    pub inflight: u64,
    /// Worker count (requests it can run at once).
    pub concurrency: u64,
    /// Allocator failures in the recent window.
    pub alloc_failures_recent: u64,
    /// Estimated time until a new request would finish.
    pub est_delay_ms: u64,
    /// Longest context this pool accepts (0: no limit).
    pub max_context: u64,
    /// Text generations waiting for their prompt's run.
    pub sequences_waiting: u64,
    /// Text generations past their prompt, holding a KV cache here.
    pub sequences_running: u64,
    /// Bytes of those KV caches.
    pub kv_cache_bytes: u64,
}

/// Host memory.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HostState {
    /// `MemAvailable`.
    pub mem_available_bytes: u64,
    /// `MemTotal`.
    pub mem_total_bytes: u64,
    /// Configured reserve the CPU path must not plan into.
    pub reserve_bytes: u64,
}

/// A process holding accelerator memory.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProcessState {
    /// Process id.
    pub pid: u32,
    /// Executable name.
    pub name: String,
    /// Service label from the attribution rules (`other` when none matched).
    pub service: String,
    /// Device name.
    pub device: String,
    /// Device memory it uses.
    pub used_bytes: u64,
}

/// What a request is expected to need, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Estimate {
    /// Model weights (already resident when the model is loaded on the pool).
    pub weights_bytes: u64,
    /// Working memory that grows with the context length (and batch).
    pub context_bytes: u64,
    /// Fixed per-run workspace.
    pub workspace_bytes: u64,
    /// Sum of the above.
    pub total_bytes: u64,
    /// Where the estimate came from.
    pub source: EstimateSource,
}

/// Where a request's estimate came from (`req.estimate.source` in a policy).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EstimateSource {
    /// The profile measured at start-up (or its refit over what runs took).
    #[default]
    Profile,
    /// Raised to what a run no larger in any dimension was seen to take.
    Observed,
    /// `models[].memory_profile` in the config.
    Config,
    /// A decoder's KV cache, read from its graph.
    KvCache,
    /// The profile could not be measured: weights only.
    WeightsOnly,
}

impl EstimateSource {
    /// The label (`profile`, `observed`, `config`, `kv_cache`, `weights_only`).
    pub fn label(self) -> &'static str {
        match self {
            EstimateSource::Profile => "profile",
            EstimateSource::Observed => "observed",
            EstimateSource::Config => "config",
            EstimateSource::KvCache => "kv_cache",
            EstimateSource::WeightsOnly => "weights_only",
        }
    }
}

/// The request as a policy sees it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RequestInfo {
    /// Request id (`x-request-id`).
    pub id: String,
    /// Model name.
    pub model: String,
    /// The pool the router would use (the first ready pool serving the model).
    pub pool: String,
    /// The service the model's memory belongs to (`models[].service`).
    pub service: String,
    /// Length of the model's context axis in this request (0 without one).
    pub context_tokens: u64,
    /// Tokens to generate (0 for tensor models).
    pub max_new_tokens: u64,
    /// Batch size (first axis of the context input; 1 when unknown).
    pub batch: u64,
    /// `x-vramguard-priority` (0 by default; higher is more important).
    pub priority: i64,
    /// False when `x-vramguard-replayable: false` was sent.
    pub replayable: bool,
    /// True when the client allows its context to be cut (`x-vramguard-allow-shrink: true`,
    /// `parameters.allow_shrink`, or the model's `allow_shrink` default). Cutting a context
    /// changes the answer, so without it a `shrink_context` decision is not carried out.
    pub allow_shrink: bool,
    /// `x-vramguard-deadline-ms`, 0 when absent.
    pub deadline_ms: u64,
    /// What it is expected to need.
    pub estimate: Estimate,
    /// The input's size along each dynamic axis of the model (`height`, `width`, `seq`…), as
    /// the estimate read it.
    pub dims: BTreeMap<String, u64>,
    /// Bytes of weights `pool` must load before it can run this request (its sessions on every
    /// worker); 0 when they are loaded there.
    pub load_bytes: u64,
    /// Bytes `make_room(pool)` could free for this request on `pool`'s device now: the weights
    /// of idle, unpinned models of no higher priority, loaded longer than their
    /// `min_residency` ago (0 on a CPU or remote pool).
    pub evictable_bytes: u64,
}

/// A policy's decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case", deny_unknown_fields)]
pub enum Decision {
    /// Queue it, on `pool` or (when `None`) on the request's pool.
    Admit {
        /// Pool to use instead of the request's pool.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pool: Option<String>,
    },
    /// Wait `ms` without holding a worker, then decide again.
    Defer {
        /// Milliseconds to wait.
        ms: u64,
    },
    /// Cut the context axis to `tokens`, then admit.
    ShrinkContext {
        /// New context length.
        tokens: u64,
    },
    /// Run on another pool.
    Redirect {
        /// Pool name.
        pool: String,
    },
    /// Unload idle, unpinned models of no higher priority on `pool`'s device until the request
    /// fits there (`bytes` free, or its estimate when not given), then admit it on `pool`.
    MakeRoom {
        /// The accelerator pool to admit it on.
        pool: String,
        /// Headroom to reach on the pool's device; its estimate when absent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bytes: Option<u64>,
    },
    /// Refuse with 503 and the reason.
    Reject {
        /// Why.
        reason: String,
    },
}

impl Decision {
    /// What kind of decision it is.
    pub fn action(&self) -> Action {
        match self {
            Decision::Admit { .. } => Action::Admit,
            Decision::Defer { .. } => Action::Defer,
            Decision::ShrinkContext { .. } => Action::ShrinkContext,
            Decision::Redirect { .. } => Action::Redirect,
            Decision::MakeRoom { .. } => Action::MakeRoom,
            Decision::Reject { .. } => Action::Reject,
        }
    }
}

/// The kind of a [`Decision`], as the `action` label, `x-vramguard-decision` and
/// `parameters.decision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// `admit`
    Admit,
    /// `defer`
    Defer,
    /// `shrink_context`
    ShrinkContext,
    /// `redirect`
    Redirect,
    /// `make_room`
    MakeRoom,
    /// `reject`
    Reject,
}

impl Action {
    /// Every action.
    pub const ALL: [Action; 6] = [
        Action::Admit,
        Action::Defer,
        Action::ShrinkContext,
        Action::Redirect,
        Action::MakeRoom,
        Action::Reject,
    ];

    /// The label value: `admit`, `defer`, `shrink_context`, `redirect`, `make_room` or `reject`.
    pub fn label(self) -> &'static str {
        match self {
            Action::Admit => "admit",
            Action::Defer => "defer",
            Action::ShrinkContext => "shrink_context",
            Action::Redirect => "redirect",
            Action::MakeRoom => "make_room",
            Action::Reject => "reject",
        }
    }

    /// The action a [`label`](Action::label) names.
    pub fn from_label(label: &str) -> Option<Action> {
        Action::ALL.into_iter().find(|a| a.label() == label)
    }
}

impl EncodeLabelValue for Action {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        fmt::Write::write_str(encoder, self.label())
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// The execution provider a pool runs on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderKind {
    /// ONNX Runtime's CPU execution provider.
    #[default]
    Cpu,
    /// ONNX Runtime's CUDA execution provider.
    Cuda,
    /// The CPU provider on the simulated accelerator's capped arena.
    Simulated,
    /// Another Open Inference Protocol server, over HTTP.
    Remote,
}

impl ProviderKind {
    /// The label value: `cpu`, `cuda`, `simulated` or `remote`.
    pub fn label(self) -> &'static str {
        match self {
            ProviderKind::Cpu => "cpu",
            ProviderKind::Cuda => "cuda",
            ProviderKind::Simulated => "simulated",
            ProviderKind::Remote => "remote",
        }
    }
}

/// Whether a pool takes work, as the policy sees it: `closed` (it does), `half_open` (trying
/// again after failures), `open` (it does not).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    /// Takes work.
    #[default]
    Closed,
    /// Takes a trial request.
    HalfOpen,
    /// Takes no work.
    Open,
}

impl BreakerState {
    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::HalfOpen => "half_open",
            BreakerState::Open => "open",
        }
    }
}

/// What kind of device memory a pool or reading lives on: the `kind` label of device metrics
/// (`nvml`, `simulated`) and `host` for CPU pools.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceClass {
    /// An NVIDIA device read through NVML.
    #[default]
    Nvml,
    /// The simulated accelerator.
    Simulated,
    /// Host memory (CPU pools).
    Host,
    /// Another server's (remote pools): nothing of it is sampled here.
    Remote,
}

impl DeviceClass {
    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            DeviceClass::Nvml => "nvml",
            DeviceClass::Simulated => "simulated",
            DeviceClass::Host => "host",
            DeviceClass::Remote => "remote",
        }
    }
}

impl EncodeLabelValue for DeviceClass {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        fmt::Write::write_str(encoder, self.label())
    }
}

impl fmt::Display for DeviceClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// Written the way a policy script would produce it: `admit()`, `admit("cpu")`, `defer(50)`,
/// `shrink_context(256)`, `redirect("cpu")`, `reject("reason")`; used in logs and test reports.
impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decision::Admit { pool: None } => f.write_str("admit()"),
            Decision::Admit { pool: Some(pool) } => write!(f, "admit({pool:?})"),
            Decision::Defer { ms } => write!(f, "defer({ms})"),
            Decision::ShrinkContext { tokens } => write!(f, "shrink_context({tokens})"),
            Decision::Redirect { pool } => write!(f, "redirect({pool:?})"),
            Decision::MakeRoom { pool, bytes: None } => write!(f, "make_room({pool:?})"),
            Decision::MakeRoom {
                pool,
                bytes: Some(bytes),
            } => write!(f, "make_room({pool:?}, {bytes})"),
            Decision::Reject { reason } => write!(f, "reject({reason:?})"),
        }
    }
}
