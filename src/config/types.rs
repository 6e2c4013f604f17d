//! The validated configuration: every cross-reference resolved, every value possible. The rest
//! of the crate reads only these types; `validate/` is the one way to get them.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::builtin::{BuiltinChatTemplate, BuiltinPolicy};
use crate::core::breaker::BreakerConfig;
use crate::core::cpus::CpuSet;
use crate::core::model::{BuiltinModel, ModelSource};
use crate::core::snapshot::{Decision, DeviceClass, ProviderKind};

/// A validated configuration: every cross-reference resolved, every value possible. Made by
/// [`RawConfig::validate`](crate::config::RawConfig::validate), or from a file by [`Config::load`].
#[derive(Debug, Clone)]
pub struct Config {
    /// Where it came from (a path or `<embedded default>`), for messages.
    pub source: String,
    /// HTTP server.
    pub server: ServerConfig,
    /// Explicit ONNX Runtime library path, if configured.
    pub onnxruntime_library: Option<PathBuf>,
    /// Devices.
    pub devices: Vec<DeviceConfig>,
    /// Models.
    pub models: Vec<ModelConfig>,
    /// Services: every `services[]` entry, then one for each model whose service has none.
    pub services: Vec<ServiceConfig>,
    /// Pools.
    pub pools: Vec<PoolConfig>,
    /// Host memory reserve in bytes.
    pub host_reserve: u64,
    /// The host tier and the optimized cache (`host.model_cache`, `host.optimized_cache`).
    pub host_tier: HostTierConfig,
    /// The sampler and exporter mode.
    pub exporter: ExporterConfig,
    /// The admission policy.
    pub policy: PolicyConfig,
    /// The executable process-isolated pools' workers start from (`None`: this program, or
    /// `VRAMGUARD_WORKER_EXE`). Not a config key: for programs that embed the library.
    pub worker_exe: Option<PathBuf>,
}

/// Where the policy script comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicySource {
    /// A file the operator edits (watched and reloadable).
    File(PathBuf),
    /// A policy shipped inside the binary (`builtin:default`, …).
    Builtin(BuiltinPolicy),
}

/// Validated `policy:`.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyConfig {
    /// The script.
    pub source: PolicySource,
    /// Decision when the script fails.
    pub fallback: Decision,
    /// File-watch period (`None`: not watched).
    pub watch_interval: Option<Duration>,
    /// `state.params`.
    pub params: BTreeMap<String, serde_json::Value>,
}

/// Validated `exporter:`.
#[derive(Debug, Clone)]
pub struct ExporterConfig {
    /// Listen address of `vramguard exporter`.
    pub listen: SocketAddr,
    /// Sampling period.
    pub sample_interval: Duration,
    /// Attribution rules in order.
    pub services: Vec<ServiceRule>,
}

/// How a rule recognises a process.
#[derive(Debug, Clone)]
pub enum ServiceMatch {
    /// Exact `comm`.
    ProcessName(String),
    /// Regex on the command line.
    Cmdline(regex::Regex),
    /// Regex on the cgroup path.
    Cgroup(regex::Regex),
}

/// A validated attribution rule.
#[derive(Debug, Clone)]
pub struct ServiceRule {
    /// Label value.
    pub service: String,
    /// Matcher.
    pub matcher: ServiceMatch,
}

/// Validated `server:`.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Listen address.
    pub listen: SocketAddr,
    /// Largest accepted body in bytes.
    pub body_limit: usize,
    /// Largest answer in bytes.
    pub max_response_bytes: usize,
    /// Environment variable with the admin token.
    pub admin_token_env: Option<String>,
    /// The admin API's Unix socket.
    pub admin_socket: AdminSocket,
    /// Shutdown grace period.
    pub shutdown_grace: Duration,
    /// The `idempotency-key` response cache.
    pub idempotency: IdempotencyConfig,
    /// Connection timeouts.
    pub timeouts: Timeouts,
    /// Most connections served at once.
    pub max_connections: usize,
    /// Most bytes of request bodies being received at once.
    pub max_receiving_bytes: u64,
    /// The CPUs vramguard's own threads run on; `None`: where it was started.
    pub cpus: Option<CpuSet>,
    /// The longest an idle CPU may take to wake up while requests are in flight; `None`: the
    /// kernel's choice.
    pub cpu_wake_latency: Option<Duration>,
}

/// Validated `server.timeouts:`; each is more than zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// From the connection's start (or a later request's first byte) to the end of its headers.
    pub header_read: Duration,
    /// Longest a request body may bring no byte.
    pub body_read: Duration,
    /// Longest a keep-alive connection may sit between requests.
    pub idle: Duration,
}

/// Where the admin API's Unix socket is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdminSocket {
    /// `server.admin_socket: off`.
    Off,
    /// Not configured: [`default_admin_socket`]. When another vramguard already serves there,
    /// this one runs without an admin socket (with a warning) rather than not at all.
    Default(PathBuf),
    /// Configured: binding it must succeed.
    At(PathBuf),
}

impl AdminSocket {
    /// The socket's path, unless it is off.
    pub fn path(&self) -> Option<&Path> {
        match self {
            AdminSocket::Off => None,
            AdminSocket::Default(p) | AdminSocket::At(p) => Some(p),
        }
    }
}

/// Validated `server.idempotency:`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdempotencyConfig {
    /// Most keys held at once, running and stored.
    pub max_entries: usize,
    /// How long after completion a key's response is replayed.
    pub ttl: Duration,
}

/// A device and what kind it is.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceConfig {
    /// Name.
    pub name: String,
    /// Kind and its parameters.
    pub kind: DeviceKind,
}

/// Device kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// An NVIDIA GPU found through NVML.
    Nvidia {
        /// NVML / CUDA device index.
        index: u32,
    },
    /// A simulated accelerator whose ONNX Runtime arena is capped at `capacity` bytes.
    Simulated {
        /// Capacity in bytes.
        capacity: u64,
    },
}

impl DeviceKind {
    /// The metric label value (`nvml` or `simulated`).
    pub fn label(&self) -> &'static str {
        match self {
            DeviceKind::Nvidia { .. } => "nvml",
            DeviceKind::Simulated { .. } => "simulated",
        }
    }
}

/// A model entry.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Name.
    pub name: String,
    /// Where the bytes come from.
    pub source: ModelSource,
    /// The context axis, if the model has one.
    pub context: Option<ContextAxis>,
    /// Whether requests allow their context to be cut unless they say otherwise.
    pub allow_shrink: bool,
    /// A configured memory profile (measured at start-up otherwise).
    pub profile: Option<ConfiguredProfile>,
    /// The tokenizer of a decoder that serves text generation.
    pub tokenizer: Option<TokenizerSource>,
    /// Where its chat template comes from, when it serves chat.
    pub chat_template: Option<ChatTemplateSource>,
    /// When its sessions exist on the pools that serve it.
    pub residency: Residency,
    /// How long without a request before a pool unloads it; `None`: never.
    pub idle_unload: Option<Duration>,
    /// Its optimized bytes are put into the host tier at start (`models[].host_tier: warm`).
    pub host_tier_warm: bool,
    /// The service its memory belongs to.
    pub service: String,
    /// Eviction takes lower priorities first.
    pub priority: i64,
    /// The model that may answer instead, with the client's leave.
    pub fallback_model: Option<String>,
    /// Whether requests allow the substitute unless they say otherwise.
    pub allow_substitute: bool,
    /// Whether an embeddings or rerank input longer than the model takes is cut unless the
    /// request says otherwise (`truncate`).
    pub auto_truncate: bool,
    /// The model that embeds this one's images (a dual encoder's vision tower).
    pub images: Option<String>,
    /// How long after a load eviction leaves it alone.
    pub min_residency: Duration,
    /// Dynamic batching across requests, when configured.
    pub batching: Option<Batching>,
}

/// `models[].batching`: requests for the model that arrive close together run as one batch,
/// as large as fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    /// The most rows one run takes (at least 1).
    pub max_batch: usize,
    /// How long a batch gathering behind the model's own runs holds back while other work
    /// waits in the pool's queue (longer than 0).
    pub max_delay: Duration,
}

/// Default `pools[].memory.idle_release` of a local pool (CPU or accelerator).
pub const DEFAULT_IDLE_RELEASE: Duration = Duration::from_secs(1);

/// Default `models[].min_residency`.
pub const DEFAULT_MIN_RESIDENCY: Duration = Duration::from_secs(30);

/// A validated `services[]` entry (or the implicit one of a model that names none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceConfig {
    /// Name.
    pub name: String,
    /// Budget in bytes on each accelerator, when it has one.
    pub device_memory: Option<u64>,
    /// Most requests running at once, when limited.
    pub concurrency: Option<usize>,
    /// Priority of its models unless they set their own.
    pub priority: i64,
    /// Interactive or background.
    pub class: ServiceClass,
    /// False for the implicit service of a model that names none.
    pub configured: bool,
}

impl ServiceConfig {
    /// A service nobody declared: no budget, no limit, priority 0, interactive.
    pub fn implicit_default() -> ServiceConfig {
        ServiceConfig {
            name: String::new(),
            device_memory: None,
            concurrency: None,
            priority: 0,
            class: ServiceClass::Interactive,
            configured: false,
        }
    }
}

/// `services[].class`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServiceClass {
    /// Served as it comes.
    #[default]
    Interactive,
    /// Deferred (bounded) while interactive requests wait or headroom is under the reserve.
    Background,
}

impl ServiceClass {
    /// As the config spells it.
    pub fn label(self) -> &'static str {
        match self {
            ServiceClass::Interactive => "interactive",
            ServiceClass::Background => "background",
        }
    }
}

/// The host tier (`host.model_cache`) and the optimized cache (`host.optimized_cache`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostTierConfig {
    /// Its budget in bytes; `None`: a quarter of the host's memory above the reserve.
    pub budget: Option<u64>,
    /// The optimized cache's folder.
    pub optimized_cache: PathBuf,
}

impl HostTierConfig {
    /// The budget on a host of `total` bytes that keeps `reserve` free.
    pub fn budget_on(&self, total: u64, reserve: u64) -> u64 {
        self.budget.unwrap_or(total.saturating_sub(reserve) / 4)
    }

    /// Where builtin models that are folders (`builtin:whisper`) are written: `builtin/` beside
    /// the optimized cache (`~/.cache/vramguard/builtin` by default), so that whatever keeps
    /// the cache away from the user's (a test's cache home, the drill's folder) keeps them too.
    pub fn builtin_models(&self) -> PathBuf {
        self.optimized_cache.with_file_name("builtin")
    }
}

/// Where the optimized cache goes when the config does not say: the user's cache folder
/// (`$XDG_CACHE_HOME`, else `~/.cache`), else a folder of the user's own under /tmp.
pub fn default_optimized_cache() -> PathBuf {
    let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = env("XDG_CACHE_HOME") {
        return optimized_cache_under(&dir);
    }
    if let Some(home) = env("HOME") {
        return optimized_cache_under(&home.join(".cache"));
    }
    PathBuf::from(format!("/tmp/vramguard-{}/optimized", current_uid().unwrap_or(0)))
}

/// The optimized cache's folder in the cache folder `cache_home` (what `$XDG_CACHE_HOME` names).
pub fn optimized_cache_under(cache_home: &std::path::Path) -> PathBuf {
    cache_home.join("vramguard/optimized")
}

/// When a model's sessions exist on a pool (`models[].residency`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Residency {
    /// Loaded at start; an operator's unload drops it, and its next request loads it again.
    #[default]
    Resident,
    /// Loaded at start and never unloaded: an unload request for it is refused.
    Pinned,
    /// Not loaded at start: its first request (or an operator's load) loads it.
    OnDemand,
}

impl Residency {
    /// As the config spells it.
    pub fn label(self) -> &'static str {
        match self {
            Residency::Resident => "resident",
            Residency::Pinned => "pinned",
            Residency::OnDemand => "on_demand",
        }
    }

    /// Whether its sessions are built when the pool starts.
    pub fn loaded_at_start(self) -> bool {
        self != Residency::OnDemand
    }
}

/// Where a model's chat template comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplateSource {
    /// `builtin:<name>`.
    Builtin(BuiltinChatTemplate),
    /// A Jinja file or a `tokenizer_config.json`.
    File(PathBuf),
}

/// Where a decoder's tokenizer comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerSource {
    /// `builtin:<model>`: the tokenizer shipped with a builtin model.
    Builtin(BuiltinModel),
    /// A `tokenizer.json` (Hugging Face tokenizers format).
    File(PathBuf),
}

impl TokenizerSource {
    /// The file's folder, where Hugging Face puts a `tokenizer_config.json` beside it.
    pub fn file(&self) -> Option<&Path> {
        match self {
            TokenizerSource::Builtin(_) => None,
            TokenizerSource::File(path) => Some(path),
        }
    }
}

/// As the config names it, which is how messages and the log name a loaded tokenizer.
impl fmt::Display for TokenizerSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizerSource::Builtin(model) => write!(f, "builtin:{}", model.name()),
            TokenizerSource::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// As the config names it, which is how messages and the log name a loaded template.
impl fmt::Display for ChatTemplateSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChatTemplateSource::Builtin(template) => write!(f, "builtin:{template}"),
            ChatTemplateSource::File(path) => write!(f, "{}", path.display()),
        }
    }
}

impl fmt::Display for PolicySource {
    /// How a policy is named in errors, logs, `/status` and `vramguard_policy_info{path}`: the
    /// file's path, or `builtin:<name>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicySource::Builtin(policy) => write!(f, "builtin:{policy}"),
            PolicySource::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// A memory profile from the config.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfiguredProfile {
    /// Resident weights, if given.
    pub weights_bytes: Option<u64>,
    /// Fixed bytes per run.
    pub workspace_bytes: u64,
    /// Bytes per token (per batch item).
    pub per_token_bytes: f64,
    /// Bytes per squared token (per batch item).
    pub per_token_squared_bytes: f64,
}

/// Which end of the context survives a shrink.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Keep {
    /// Keep the first tokens.
    Start,
    /// Keep the most recent tokens.
    End,
}

/// The axis of one input whose length is the context length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextAxis {
    /// Input tensor name.
    pub input: String,
    /// Axis index.
    pub axis: usize,
    /// Which end to keep.
    pub keep: Keep,
}

/// Execution provider of a pool.
#[derive(Debug, Clone, PartialEq)]
pub enum Provider {
    /// ONNX Runtime's CPU provider with its own (uncapped) arena.
    Cpu,
    /// The CUDA provider on an NVIDIA device.
    Cuda(CudaOptions),
    /// CPU provider whose allocations come from the simulated device's capped arena.
    Simulated,
    /// Requests forwarded to another Open Inference Protocol server.
    Remote(RemoteOptions),
}

impl Provider {
    /// Which provider, without its options.
    pub fn kind(&self) -> ProviderKind {
        match self {
            Provider::Cpu => ProviderKind::Cpu,
            Provider::Cuda(_) => ProviderKind::Cuda,
            Provider::Simulated => ProviderKind::Simulated,
            Provider::Remote(_) => ProviderKind::Remote,
        }
    }

    /// Label value: `cpu`, `cuda`, `simulated` or `remote`.
    pub fn label(&self) -> &'static str {
        self.kind().label()
    }
}

/// CUDA provider options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// `gpu_mem_limit` in bytes.
    pub gpu_mem_limit: Option<u64>,
    /// Extend the arena by exactly what is requested (instead of powers of two).
    pub same_as_requested: bool,
}

/// Where and how a `remote` pool forwards its requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteOptions {
    /// Base URL without a trailing slash: `http://host:port` or `http://host:port/prefix`.
    pub url: String,
    /// Longest one forwarded request may take when its client gave no deadline.
    pub timeout: Duration,
    /// Longest a new connection may take.
    pub connect_timeout: Duration,
    /// How often `/v2/health/ready` is asked.
    pub health_interval: Duration,
    /// Longest one health check may take.
    pub health_timeout: Duration,
}

/// A validated pool.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolConfig {
    /// Name.
    pub name: String,
    /// Provider.
    pub provider: Provider,
    /// Device name (`host` for CPU pools, the server's `host:port` for remote pools).
    pub device: String,
    /// Served model names.
    pub models: Vec<String>,
    /// Worker threads.
    pub workers: usize,
    /// Intra-op threads per session.
    pub intra_threads: usize,
    /// Queue capacity.
    pub queue_capacity: usize,
    /// Longest queue wait.
    pub max_wait: Duration,
    /// Shrink the arena after every run.
    pub arena_shrinkage: bool,
    /// Return the arena's free memory after this long without a run (`None`: never).
    pub idle_release: Option<Duration>,
    /// Longest context in tokens the pool accepts (`None`: no limit).
    pub max_context: Option<u64>,
    /// Its circuit breaker.
    pub breaker: BreakerConfig,
    /// Its health checks (a local pool's probe inferences).
    pub health: HealthConfig,
    /// Where a replayable request goes, once, after an allocator failure here.
    pub fallback: Option<String>,
    /// Where its sessions run.
    pub isolation: Isolation,
    /// The CPUs its sessions run on; `None`: those vramguard started on.
    pub cpus: Option<CpuSet>,
}

impl PoolConfig {
    /// How many backends the pool's queue hands jobs to: one per worker, or two per worker of
    /// a pool in a worker process, where each worker's sessions take frames on two lanes (the
    /// next run's frame waits in the socket while one runs, so the worker never sleeps between
    /// runs; it still runs one at a time per worker).
    pub fn slots(&self) -> usize {
        self.workers * self.lanes()
    }

    /// Backends per worker: see [`slots`](Self::slots).
    pub fn lanes(&self) -> usize {
        match (self.isolation, &self.provider) {
            (Isolation::Process, Provider::Remote(_)) | (Isolation::Thread, _) => 1,
            (Isolation::Process, _) => 2,
        }
    }
}

/// Where a pool's sessions run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    /// In a worker process of its own: a crash, a hang or a sticky driver fault takes that
    /// process, never vramguard's.
    Process,
    /// On worker threads in vramguard's process.
    Thread,
}

/// When a local pool's health is checked by a probe inference of each of its models at its
/// smallest input: after a restore or the breaker's cooldown (the half-open breaker's probe), and
/// once the pool has been idle for `interval`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    /// Idle time after which a check runs.
    pub interval: Duration,
    /// Longest a check's run may take before it counts as failed.
    pub timeout: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            timeout: Duration::from_secs(5),
        }
    }
}

/// The device name CPU pools report.
pub const HOST_DEVICE: &str = "host";

/// Which command a config is for: `serve` needs models and pools, `exporter` only devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `vramguard serve`
    Serve,
    /// `vramguard exporter`
    Exporter,
}

impl Config {
    /// What kind of device `device` is: an NVIDIA device, the simulated one, or the host that
    /// CPU pools run on.
    pub fn device_class(&self, device: &str) -> DeviceClass {
        match self.devices.iter().find(|d| d.name == device).map(|d| d.kind) {
            Some(DeviceKind::Nvidia { .. }) => DeviceClass::Nvml,
            Some(DeviceKind::Simulated { .. }) => DeviceClass::Simulated,
            None => DeviceClass::Host,
        }
    }

    /// What kind of device `pool` runs on: a remote pool's is another server's, whatever its
    /// `device` names.
    pub fn pool_class(&self, pool: &PoolConfig) -> DeviceClass {
        match pool.provider {
            Provider::Remote(_) => DeviceClass::Remote,
            _ => self.device_class(&pool.device),
        }
    }
}

/// This process's user id (the owner of `/proc/self`), without a C call.
pub fn current_uid() -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").map(|m| m.uid()).ok()
}

/// Where the admin socket goes when the config does not say: systemd's runtime directory for
/// the unit (`RuntimeDirectory=`), else the user's runtime directory, else a folder of the
/// user's own under /tmp (created owner-only when the socket is bound).
pub fn default_admin_socket() -> PathBuf {
    let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = env("RUNTIME_DIRECTORY") {
        // systemd may list several folders, separated by `:`; the first is ours.
        let first = dir.to_string_lossy().split(':').next().unwrap_or_default().to_string();
        return PathBuf::from(first).join("admin.sock");
    }
    if let Some(dir) = env("XDG_RUNTIME_DIR") {
        return dir.join("vramguard/admin.sock");
    }
    let uid = current_uid().unwrap_or(0);
    PathBuf::from(format!("/tmp/vramguard-{uid}/admin.sock"))
}
