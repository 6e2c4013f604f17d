//! Configuration: parse YAML into raw structs (unknown keys are errors), then validate into
//! typed structs. Everything here runs before any port is bound, and every error names the file
//! and the key path.

mod builtin;
mod units;

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

// `config` depends on `model`, never the other way round: `ModelSource` lives beside the models it
// names and is re-exported here, where the validated config uses it.
pub use crate::core::model::ModelSource;
pub use builtin::{BuiltinChatTemplate, BuiltinPolicy};
pub use units::{ByteSize, HumanDuration, format_duration, format_size, parse_duration, parse_size};

use crate::core::model::BuiltinModel;
use crate::core::snapshot::Decision;

/// The embedded default configuration (simulated accelerator flavour); see [`Config::embedded`].
pub const DEFAULT_CONFIG_YAML: &str = include_str!("../../config/default.yaml");

/// What went wrong loading a configuration, always naming the file and, when known, the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{file}: cannot read: {source}")]
    Read {
        /// The file.
        file: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML did not match the schema (the message carries key path, line and column).
    #[error("{file}: {message}")]
    Parse {
        /// The file.
        file: String,
        /// serde_yaml's message: key path, what was expected, line and column.
        message: String,
    },
    /// A value parsed but is impossible.
    #[error("{file}: {key}: {message}")]
    Invalid {
        /// The file.
        file: String,
        /// Dotted key path, e.g. `pools[1].queue.capacity`.
        key: String,
        /// What was expected.
        message: String,
    },
}

// ---------------------------------------------------------------------------------------------
// Raw, serde-facing structs. They mirror the YAML exactly; `config default` serializes them.
// ---------------------------------------------------------------------------------------------

/// The YAML document as written by the operator.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// HTTP server settings.
    #[serde(default)]
    pub server: RawServer,
    /// Where ONNX Runtime comes from.
    #[serde(default)]
    pub onnxruntime: RawOnnxRuntime,
    /// Accelerator devices (NVIDIA GPUs found through NVML, or simulated ones).
    #[serde(default)]
    pub devices: Vec<RawDevice>,
    /// Models to serve (`serve` needs at least one; `exporter` ignores them).
    #[serde(default)]
    pub models: Vec<RawModel>,
    /// Worker pools, each bound to an execution provider and a device.
    #[serde(default)]
    pub pools: Vec<RawPool>,
    /// Host memory protection.
    #[serde(default)]
    pub host: RawHost,
    /// The memory sampler and `vramguard exporter`.
    #[serde(default)]
    pub exporter: RawExporter,
    /// The admission policy.
    #[serde(default)]
    pub policy: RawPolicy,
}

/// `policy:`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawPolicy {
    /// The Rhai script: a path (relative to the config file) or `builtin:<name>`.
    pub path: String,
    /// The decision used when the script fails (`{action: admit}`, `{action: reject, reason: …}`, …).
    pub fallback: Decision,
    /// How often the script file is checked for changes (`0` turns watching off).
    pub watch_interval: HumanDuration,
    /// Operator constants, visible to the script as `state.params`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub params: BTreeMap<String, serde_json::Value>,
}

impl Default for RawPolicy {
    fn default() -> Self {
        Self {
            path: "builtin:default".into(),
            fallback: Decision::Admit { pool: None },
            watch_interval: HumanDuration(Duration::from_secs(2)),
            params: BTreeMap::new(),
        }
    }
}

/// `exporter:`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawExporter {
    /// Listen address of `vramguard exporter` (monitoring-only mode).
    pub listen: String,
    /// How often devices, processes and host memory are sampled.
    pub sample_interval: HumanDuration,
    /// Rules mapping processes to a `service` label; the first match wins.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<RawServiceRule>,
}

impl Default for RawExporter {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9842".into(),
            sample_interval: HumanDuration(Duration::from_secs(1)),
            services: Vec::new(),
        }
    }
}

/// One entry of `exporter.services:`; exactly one matcher.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServiceRule {
    /// The `service` label value.
    pub service: String,
    /// Exact process name (`comm`, as `ps -o comm` shows it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_name: Option<String>,
    /// Regular expression searched in the full command line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
    /// Regular expression searched in the cgroup path (e.g. a systemd unit or container id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
}

/// `server:`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawServer {
    /// Listen address, e.g. `127.0.0.1:8080`.
    pub listen: String,
    /// Largest accepted request body.
    pub body_limit: ByteSize,
    /// Largest answer encoded (JSON text or binary tensors): with one answer per running
    /// request, at most (workers of all pools) × this is held in answers at once.
    pub max_response_bytes: ByteSize,
    /// Name of the environment variable holding the admin bearer token (admin over TCP).
    pub admin_token_env: Option<String>,
    /// The admin API's Unix socket (owner-only): a path, `off`, or absent for the default
    /// (`$RUNTIME_DIRECTORY/admin.sock` under systemd, else `$XDG_RUNTIME_DIR/vramguard/admin.sock`,
    /// else `/tmp/vramguard-$UID/admin.sock`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_socket: Option<String>,
    /// How long in-flight work may take to finish on shutdown.
    pub shutdown_grace: HumanDuration,
    /// Responses remembered for `idempotency-key` requests.
    pub idempotency: RawIdempotency,
    /// How long a client may take at each stage of a connection.
    pub timeouts: RawTimeouts,
    /// Most connections served at once; further ones wait in the listen backlog.
    pub max_connections: usize,
    /// Most bytes of request bodies being received at once, all connections together.
    pub max_receiving_bytes: ByteSize,
}

impl Default for RawServer {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            body_limit: ByteSize(64 << 20),
            max_response_bytes: ByteSize(256 << 20),
            admin_token_env: None,
            admin_socket: None,
            shutdown_grace: HumanDuration(Duration::from_secs(10)),
            idempotency: RawIdempotency::default(),
            timeouts: RawTimeouts::default(),
            // Below the 1024 open files a process gets by default (systemd's and most shells'
            // soft limit), leaving room for model files, logs and the sockets of the sampler.
            max_connections: 512,
            // Four bodies of the default `body_limit` at once.
            max_receiving_bytes: ByteSize(256 << 20),
        }
    }
}

/// `server.timeouts:`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawTimeouts {
    /// From the connection's start (or the first byte of a later request) to the end of the
    /// request headers.
    pub header_read: HumanDuration,
    /// Longest a request body may stall: no byte arriving while the server waits for one.
    pub body_read: HumanDuration,
    /// Longest a keep-alive connection may sit between requests.
    pub idle: HumanDuration,
}

impl Default for RawTimeouts {
    fn default() -> Self {
        // nginx waits 60 s for headers, 60 s between two reads of a body and 75 s on an idle
        // keep-alive connection. A client's headers leave in one write milliseconds after it
        // connects, so 20 s covers any congested link while cutting a slowloris's hold by three;
        // a body that brings no byte for 30 s is stuck, not slow (TCP retransmits sooner). Idle
        // stays at nginx's 75 s: clients' pools are tuned to it, and closing sooner only widens
        // the race where a client reuses a connection the server is closing.
        Self {
            header_read: HumanDuration(Duration::from_secs(20)),
            body_read: HumanDuration(Duration::from_secs(30)),
            idle: HumanDuration(Duration::from_secs(75)),
        }
    }
}

/// `server.idempotency:`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawIdempotency {
    /// Most keys held at once, running and stored; beyond it the oldest stored response is
    /// dropped, and when all are running a new key gets 503.
    pub max_entries: usize,
    /// How long after completion a key's response is replayed.
    pub ttl: HumanDuration,
}

impl Default for RawIdempotency {
    fn default() -> Self {
        Self {
            max_entries: 10_000,
            ttl: HumanDuration(Duration::from_secs(600)),
        }
    }
}

/// `onnxruntime:`
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawOnnxRuntime {
    /// Path to `libonnxruntime.so*`; when absent `ORT_DYLIB_PATH`, then the project-local install.
    pub library: Option<PathBuf>,
}

/// One entry of `devices:`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDevice {
    /// Name used by pools and in metric labels.
    pub name: String,
    /// `nvidia` or `simulated`.
    pub kind: RawDeviceKind,
    /// NVIDIA device index (kind `nvidia`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    /// Memory capacity (kind `simulated`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<ByteSize>,
}

/// `devices[].kind:` as written; [`DeviceKind`] is the validated form with its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RawDeviceKind {
    /// An NVIDIA GPU found through NVML.
    Nvidia,
    /// A simulated accelerator.
    Simulated,
}

/// One entry of `models:`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModel {
    /// Name in URLs (`/v2/models/{name}`).
    pub name: String,
    /// A file path (relative to the config file) or `builtin:<name>`.
    pub path: String,
    /// The axis whose length is the context length, if the model has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<RawContext>,
    /// Whether a request that does not say (no `x-vramguard-allow-shrink` header, no
    /// `parameters.allow_shrink`) allows its context to be cut. Off by default: a shrink
    /// changes the answer.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_shrink: bool,
    /// Memory profile; when absent it is measured at start-up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_profile: Option<RawProfile>,
    /// A decoder's `tokenizer.json` (Hugging Face tokenizers format, relative to the config
    /// file): with it, the model serves text generation on `/v1/completions`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// The chat template behind `/v1/chat/completions`: `builtin:chatml`, a Jinja file, or a
    /// `tokenizer_config.json` holding `chat_template` (relative to the config file). Without
    /// it, the `tokenizer_config.json` next to the tokenizer, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
}

/// `models[].memory_profile:` bytes = weights + workspace + batch × (per_token·n + per_token_squared·n²)
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawProfile {
    /// Resident weights; measured at load when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<ByteSize>,
    /// Fixed bytes per run.
    #[serde(default)]
    pub workspace: ByteSize,
    /// Bytes per context token per batch item (per batch item without a context axis).
    #[serde(default)]
    pub per_token_bytes: f64,
    /// Bytes per squared context token per batch item.
    #[serde(default)]
    pub per_token_squared_bytes: f64,
}

/// `models[].context:`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawContext {
    /// Input tensor name.
    pub input: String,
    /// Axis index of the context dimension.
    pub axis: usize,
    /// Which end to keep when the context is shrunk: `start` or `end` (the default).
    #[serde(default = "default_keep")]
    pub keep: Keep,
}

fn default_keep() -> Keep {
    Keep::End
}

/// One entry of `pools:`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPool {
    /// Pool name (metric label, `x-vramguard-pool`).
    pub name: String,
    /// `cpu`, `cuda`, `simulated` or `remote`.
    pub provider: RawProvider,
    /// Base URL of the Open Inference Protocol server a `remote` pool forwards to
    /// (`http://host:port`, optionally with a path prefix).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Timeouts and health checks of a `remote` pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<RawRemote>,
    /// Device name from `devices:` (required for `cuda` and `simulated`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Names from `models:` this pool serves.
    pub models: Vec<String>,
    /// Longest context, in tokens, the pool accepts; absent means no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_context: Option<u64>,
    /// Worker threads, each with its own session per model.
    #[serde(default = "one")]
    pub workers: usize,
    /// ONNX Runtime intra-op threads per session (1 when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intra_threads: Option<usize>,
    /// The bounded queue in front of the workers.
    #[serde(default)]
    pub queue: RawQueue,
    /// CUDA execution provider options (provider `cuda`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda: Option<RawCuda>,
    /// Arena behaviour.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<RawPoolMemory>,
    /// When the circuit breaker opens and how long it stays open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breaker: Option<RawBreaker>,
    /// The pool a replayable request is retried on, once, after an allocator failure here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<String>,
}

/// `pools[].remote:`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawRemote {
    /// Longest one forwarded request may take when its client gave no deadline.
    pub timeout: HumanDuration,
    /// Longest a new connection to the remote may take.
    pub connect_timeout: HumanDuration,
    /// How often the remote's `/v2/health/ready` is asked.
    pub health_interval: HumanDuration,
    /// Longest one health check may take.
    pub health_timeout: HumanDuration,
}

impl Default for RawRemote {
    fn default() -> Self {
        Self {
            timeout: HumanDuration(Duration::from_secs(60)),
            connect_timeout: HumanDuration(Duration::from_secs(1)),
            health_interval: HumanDuration(Duration::from_secs(1)),
            health_timeout: HumanDuration(Duration::from_secs(1)),
        }
    }
}

/// `pools[].breaker:`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawBreaker {
    /// Allocator failures within `window` that open the breaker (a driver-class failure opens
    /// it at once).
    pub failures: u32,
    /// How far back failures count.
    pub window: HumanDuration,
    /// How long it stays open before one probe request may go through.
    pub cooldown: HumanDuration,
}

impl Default for RawBreaker {
    fn default() -> Self {
        let d = crate::core::breaker::BreakerConfig::default();
        Self {
            failures: d.failures,
            window: HumanDuration(d.window),
            cooldown: HumanDuration(d.cooldown),
        }
    }
}

/// `pools[].provider:` as written; [`Provider`] is the validated form with its options.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RawProvider {
    /// ONNX Runtime's CPU provider.
    Cpu,
    /// The CUDA provider on an NVIDIA device.
    Cuda,
    /// The CPU provider on the simulated device's capped arena.
    Simulated,
    /// Another Open Inference Protocol server (vramguard, Triton, KServe) over HTTP.
    Remote,
}

/// `pools[].memory:`
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawPoolMemory {
    /// Return the arena's free regions to the device after every run
    /// (`memory.enable_memory_arena_shrinkage`): lower reserved bytes, slightly slower runs.
    /// Default: on for `cpu` pools (host memory is what the host-RAM guard protects, and a
    /// burst of large requests would otherwise stay resident for good), off for accelerator
    /// pools (their arena is theirs to keep, and reserved vs active shows it).
    pub arena_shrinkage: Option<bool>,
}

fn one() -> usize {
    1
}

/// `pools[].queue:`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawQueue {
    /// Most requests waiting; beyond it new requests get 503.
    pub capacity: usize,
    /// Longest a request may wait before it is answered 503.
    pub max_wait: HumanDuration,
}

impl Default for RawQueue {
    fn default() -> Self {
        Self {
            capacity: 64,
            max_wait: HumanDuration(Duration::from_secs(30)),
        }
    }
}

/// `pools[].cuda:`
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawCuda {
    /// CUDA arena limit (`gpu_mem_limit`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_mem_limit: Option<ByteSize>,
    /// `next_power_of_two` (ONNX Runtime's default) or `same_as_requested`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arena_extend_strategy: Option<RawArenaExtendStrategy>,
}

/// `pools[].cuda.arena_extend_strategy:`, ONNX Runtime's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RawArenaExtendStrategy {
    /// Grow the arena in powers of two.
    NextPowerOfTwo,
    /// Grow the arena by exactly what is requested.
    SameAsRequested,
}

/// `host:`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawHost {
    /// Host memory kept free for the system; the CPU path never plans into it.
    pub reserve: ByteSize,
}

impl Default for RawHost {
    fn default() -> Self {
        Self {
            reserve: ByteSize(2 << 30),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Validated configuration.
// ---------------------------------------------------------------------------------------------

/// A validated configuration: every cross-reference resolved, every value possible.
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
    /// Pools.
    pub pools: Vec<PoolConfig>,
    /// Host memory reserve in bytes.
    pub host_reserve: u64,
    /// The sampler and exporter mode.
    pub exporter: ExporterConfig,
    /// The admission policy.
    pub policy: PolicyConfig,
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
    /// The tokenizer file of a decoder that serves text generation.
    pub tokenizer: Option<PathBuf>,
    /// Where its chat template comes from, when it serves chat.
    pub chat_template: Option<ChatTemplateSource>,
}

/// Where a model's chat template comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplateSource {
    /// `builtin:<name>`.
    Builtin(BuiltinChatTemplate),
    /// A Jinja file or a `tokenizer_config.json`.
    File(PathBuf),
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
    pub fn kind(&self) -> crate::core::snapshot::ProviderKind {
        use crate::core::snapshot::ProviderKind;
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
    /// Longest context in tokens the pool accepts (`None`: no limit).
    pub max_context: Option<u64>,
    /// Its circuit breaker.
    pub breaker: crate::core::breaker::BreakerConfig,
    /// Where a replayable request goes, once, after an allocator failure here.
    pub fallback: Option<String>,
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
    /// Load and validate a config file for `serve`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Self::load_for(path, Mode::Serve)
    }

    /// Load and validate a config file for `mode`.
    pub fn load_for(path: &Path, mode: Mode) -> Result<Config, ConfigError> {
        let raw: RawConfig = read_yaml(path)?;
        let base = path.parent().unwrap_or(Path::new("."));
        raw.validate_for(&path.display().to_string(), base, mode)
    }

    /// What kind of device `device` is: an NVIDIA device, the simulated one, or the host that
    /// CPU pools run on.
    pub fn device_class(&self, device: &str) -> crate::core::snapshot::DeviceClass {
        use crate::core::snapshot::DeviceClass;
        match self.devices.iter().find(|d| d.name == device).map(|d| d.kind) {
            Some(DeviceKind::Nvidia { .. }) => DeviceClass::Nvml,
            Some(DeviceKind::Simulated { .. }) => DeviceClass::Simulated,
            None => DeviceClass::Host,
        }
    }

    /// What kind of device `pool` runs on: a remote pool's is another server's, whatever its
    /// `device` names.
    pub fn pool_class(&self, pool: &PoolConfig) -> crate::core::snapshot::DeviceClass {
        match pool.provider {
            Provider::Remote(_) => crate::core::snapshot::DeviceClass::Remote,
            _ => self.device_class(&pool.device),
        }
    }

    /// The embedded default; on a machine where NVML sees a GPU its accelerator is a CUDA pool.
    pub fn embedded(nvidia_gpu: bool) -> Config {
        embedded_raw(nvidia_gpu)
            .validate("<embedded default>", Path::new("."))
            .expect("the embedded default config is valid (checked by tests)")
    }
}

/// The embedded default as raw YAML structs, adapted to the machine.
pub fn embedded_raw(nvidia_gpu: bool) -> RawConfig {
    let mut raw: RawConfig = parse_yaml(DEFAULT_CONFIG_YAML, "<embedded default>")
        .expect("the embedded default config parses (checked by tests)");
    if nvidia_gpu {
        // Same names, so policies written for `gpu` work on both kinds of machine.
        for device in raw.devices.iter_mut().filter(|d| d.kind == RawDeviceKind::Simulated) {
            device.kind = RawDeviceKind::Nvidia;
            device.capacity = None;
            device.index = Some(0);
        }
        for pool in raw.pools.iter_mut().filter(|p| p.provider == RawProvider::Simulated) {
            pool.provider = RawProvider::Cuda;
            pool.cuda = Some(RawCuda {
                gpu_mem_limit: None,
                arena_extend_strategy: Some(RawArenaExtendStrategy::SameAsRequested),
            });
        }
    }
    raw
}

/// The one place YAML is parsed (serde_yaml is deprecated upstream; swapping it touches only this).
pub fn parse_yaml<T: serde::de::DeserializeOwned>(text: &str, file: &str) -> Result<T, ConfigError> {
    serde_yaml::from_str(text).map_err(|e| ConfigError::Parse {
        file: file.to_string(),
        message: e.to_string(),
    })
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

/// Read a YAML file into `T`; errors name the file (and, for schema errors, the key).
pub fn read_yaml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        file: file.clone(),
        source,
    })?;
    parse_yaml(&text, &file)
}

/// Serialize to YAML (used by `config default`).
pub fn to_yaml<T: Serialize>(value: &T) -> String {
    serde_yaml::to_string(value).expect("config structs always serialize")
}

struct Checker<'a> {
    file: &'a str,
}

impl Checker<'_> {
    fn err(&self, key: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            file: self.file.to_string(),
            key: key.into(),
            message: message.into(),
        }
    }

    fn unique_name<'n>(&self, seen: &mut HashSet<&'n str>, name: &'n str, key: String) -> Result<(), ConfigError> {
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            return Err(self.err(
                key,
                format!("expected a non-empty name of letters, digits, `-`, `_` or `.`, got `{name}`"),
            ));
        }
        if !seen.insert(name) {
            return Err(self.err(key, format!("`{name}` is defined twice")));
        }
        Ok(())
    }
}

impl RawConfig {
    /// Validate into a [`Config`] for `serve`; `base` resolves relative model paths.
    pub fn validate(&self, file: &str, base: &Path) -> Result<Config, ConfigError> {
        self.validate_for(file, base, Mode::Serve)
    }

    /// Validate into a [`Config`] for `mode`.
    pub fn validate_for(&self, file: &str, base: &Path, mode: Mode) -> Result<Config, ConfigError> {
        let c = Checker { file };
        let exporter = self.validate_exporter(&c)?;

        let listen: SocketAddr = self.server.listen.parse().map_err(|_| {
            c.err(
                "server.listen",
                format!(
                    "expected an address like `127.0.0.1:8080`, got `{}`",
                    self.server.listen
                ),
            )
        })?;
        if self.server.body_limit.bytes() < 1024 {
            return Err(c.err("server.body_limit", "must be at least 1KiB"));
        }
        if self.server.max_response_bytes.bytes() < 1024 {
            return Err(c.err("server.max_response_bytes", "must be at least 1KiB"));
        }
        let admin_socket = match self.server.admin_socket.as_deref().map(str::trim) {
            None => AdminSocket::Default(default_admin_socket()),
            Some("off") => AdminSocket::Off,
            Some("") => return Err(c.err("server.admin_socket", "expected a path, or `off`")),
            Some(path) => AdminSocket::At(PathBuf::from(path)),
        };
        if let Some(var) = &self.server.admin_token_env
            && var.trim().is_empty()
        {
            return Err(c.err("server.admin_token_env", "expected an environment variable name"));
        }
        let idempotency = &self.server.idempotency;
        if !(1..=1_000_000).contains(&idempotency.max_entries) {
            return Err(c.err(
                "server.idempotency.max_entries",
                format!("expected 1 to 1000000, got {}", idempotency.max_entries),
            ));
        }
        // Clients retry within minutes; a day covers any sane retry schedule, and past it a
        // key that still replays is more likely a client reusing keys by mistake.
        if !(Duration::from_secs(1)..=Duration::from_secs(24 * 3600)).contains(&idempotency.ttl.get()) {
            return Err(c.err(
                "server.idempotency.ttl",
                format!("expected 1s to 24h, got {}", idempotency.ttl),
            ));
        }

        let timeouts = self.validate_timeouts(&c)?;
        let max_connections = self.server.max_connections;
        if !(1..=1_000_000).contains(&max_connections) {
            return Err(c.err(
                "server.max_connections",
                format!("expected 1 to 1000000, got {max_connections}"),
            ));
        }
        let receiving = self.server.max_receiving_bytes;
        if receiving < self.server.body_limit {
            return Err(c.err(
                "server.max_receiving_bytes",
                format!(
                    "must be at least server.body_limit ({}), or a body of the largest allowed size could never be received; got {receiving}",
                    self.server.body_limit
                ),
            ));
        }
        if receiving.bytes() > 1 << 40 {
            return Err(c.err(
                "server.max_receiving_bytes",
                format!("expected at most 1TiB, got {receiving}"),
            ));
        }

        let mut names = HashSet::new();
        let mut devices = Vec::new();
        for (i, d) in self.devices.iter().enumerate() {
            let key = format!("devices[{i}]");
            c.unique_name(&mut names, &d.name, format!("{key}.name"))?;
            if d.name == HOST_DEVICE {
                return Err(c.err(format!("{key}.name"), "`host` is reserved for CPU pools"));
            }
            let kind = match d.kind {
                RawDeviceKind::Nvidia => {
                    if d.capacity.is_some() {
                        return Err(c.err(
                            format!("{key}.capacity"),
                            "only simulated devices take a capacity; an NVIDIA device reports its own",
                        ));
                    }
                    DeviceKind::Nvidia {
                        index: d.index.unwrap_or(0),
                    }
                }
                RawDeviceKind::Simulated => {
                    if d.index.is_some() {
                        return Err(c.err(format!("{key}.index"), "simulated devices take no index"));
                    }
                    let capacity = d.capacity.map(ByteSize::bytes).ok_or_else(|| {
                        c.err(
                            format!("{key}.capacity"),
                            "a simulated device needs a capacity, e.g. `1GiB`",
                        )
                    })?;
                    if capacity < (1 << 20) {
                        return Err(c.err(format!("{key}.capacity"), "must be at least 1MiB"));
                    }
                    DeviceKind::Simulated { capacity }
                }
            };
            devices.push(DeviceConfig {
                name: d.name.clone(),
                kind,
            });
        }
        // ONNX Runtime allows one environment allocator per memory kind, and the simulated arena
        // is that allocator, so a process can host one simulated device.
        if devices
            .iter()
            .filter(|d| matches!(d.kind, DeviceKind::Simulated { .. }))
            .count()
            > 1
        {
            return Err(c.err(
                "devices",
                "at most one simulated device per process (it is ONNX Runtime's shared CPU arena)",
            ));
        }

        if self.models.is_empty() && mode == Mode::Serve {
            return Err(c.err("models", "at least one model is needed"));
        }
        let mut model_names = HashSet::new();
        let mut models = Vec::new();
        for (i, m) in self.models.iter().enumerate() {
            let key = format!("models[{i}]");
            c.unique_name(&mut model_names, &m.name, format!("{key}.name"))?;
            let source = if let Some(builtin) = m.path.strip_prefix("builtin:") {
                ModelSource::Builtin(BuiltinModel::from_name(builtin).ok_or_else(|| {
                    c.err(
                        format!("{key}.path"),
                        format!(
                            "no builtin model `{builtin}`; builtin models are: {}",
                            BuiltinModel::ALL.map(|b| b.name()).join(", ")
                        ),
                    )
                })?)
            } else {
                let path = base.join(&m.path);
                if !path.is_file() {
                    return Err(c.err(
                        format!("{key}.path"),
                        format!("model file `{}` does not exist", path.display()),
                    ));
                }
                ModelSource::File(path)
            };
            let context = m.context.as_ref().map(|ctx| ContextAxis {
                input: ctx.input.clone(),
                axis: ctx.axis,
                keep: ctx.keep,
            });
            let profile = match &m.memory_profile {
                None => None,
                Some(p) => {
                    for (field, v) in [
                        ("per_token_bytes", p.per_token_bytes),
                        ("per_token_squared_bytes", p.per_token_squared_bytes),
                    ] {
                        if !v.is_finite() || v < 0.0 {
                            return Err(c.err(
                                format!("{key}.memory_profile.{field}"),
                                format!("expected a non-negative number of bytes, got {v}"),
                            ));
                        }
                    }
                    Some(ConfiguredProfile {
                        weights_bytes: p.weights.map(ByteSize::bytes),
                        workspace_bytes: p.workspace.bytes(),
                        per_token_bytes: p.per_token_bytes,
                        per_token_squared_bytes: p.per_token_squared_bytes,
                    })
                }
            };
            let tokenizer = match &m.tokenizer {
                None => None,
                Some(file) => {
                    let path = base.join(file);
                    if !path.is_file() {
                        return Err(c.err(
                            format!("{key}.tokenizer"),
                            format!("tokenizer file `{}` does not exist", path.display()),
                        ));
                    }
                    Some(path)
                }
            };
            let chat_template = match &m.chat_template {
                None => None,
                Some(spec) => {
                    if tokenizer.is_none() {
                        return Err(c.err(
                            format!("{key}.chat_template"),
                            "a chat template needs `tokenizer` too: chat is text generation",
                        ));
                    }
                    Some(match spec.strip_prefix("builtin:") {
                        Some(name) => {
                            ChatTemplateSource::Builtin(BuiltinChatTemplate::from_name(name).ok_or_else(|| {
                                c.err(
                                    format!("{key}.chat_template"),
                                    format!(
                                        "unknown builtin chat template `{name}`; builtin: {}",
                                        BuiltinChatTemplate::ALL.map(|t| t.name()).join(", ")
                                    ),
                                )
                            })?)
                        }
                        None => {
                            let path = base.join(spec);
                            if !path.is_file() {
                                return Err(c.err(
                                    format!("{key}.chat_template"),
                                    format!("chat template file `{}` does not exist", path.display()),
                                ));
                            }
                            ChatTemplateSource::File(path)
                        }
                    })
                }
            };
            models.push(ModelConfig {
                name: m.name.clone(),
                source,
                context,
                allow_shrink: m.allow_shrink,
                profile,
                tokenizer,
                chat_template,
            });
        }

        if self.pools.is_empty() && mode == Mode::Serve {
            return Err(c.err("pools", "at least one pool is needed"));
        }
        let mut pool_names = HashSet::new();
        let mut pools = Vec::new();
        for (i, p) in self.pools.iter().enumerate() {
            let key = format!("pools[{i}]");
            c.unique_name(&mut pool_names, &p.name, format!("{key}.name"))?;
            let device_kind = |provider: &str, want: &str| -> Result<(String, DeviceKind), ConfigError> {
                let name = p.device.as_deref().ok_or_else(|| {
                    c.err(
                        format!("{key}.device"),
                        format!("a `{provider}` pool needs a {want} device"),
                    )
                })?;
                let device = devices.iter().find(|d| d.name == name).ok_or_else(|| {
                    c.err(
                        format!("{key}.device"),
                        format!("no device named `{name}` in `devices`"),
                    )
                })?;
                Ok((name.to_string(), device.kind))
            };
            if p.cuda.is_some() && p.provider != RawProvider::Cuda {
                return Err(c.err(format!("{key}.cuda"), "only `cuda` pools take CUDA options"));
            }
            if p.provider != RawProvider::Remote {
                if p.url.is_some() {
                    return Err(c.err(format!("{key}.url"), "only `remote` pools take a url"));
                }
                if p.remote.is_some() {
                    return Err(c.err(format!("{key}.remote"), "only `remote` pools take remote options"));
                }
            }
            let (provider, device) = match p.provider {
                RawProvider::Cpu => {
                    if let Some(d) = p.device.as_deref().filter(|d| *d != HOST_DEVICE) {
                        return Err(c.err(
                            format!("{key}.device"),
                            format!("a `cpu` pool runs on `host`, not `{d}`"),
                        ));
                    }
                    (Provider::Cpu, HOST_DEVICE.to_string())
                }
                RawProvider::Cuda => {
                    let (name, kind) = device_kind("cuda", "nvidia")?;
                    if !matches!(kind, DeviceKind::Nvidia { .. }) {
                        return Err(c.err(format!("{key}.device"), format!("`{name}` is not an `nvidia` device")));
                    }
                    let raw = p.cuda.clone().unwrap_or_default();
                    (
                        Provider::Cuda(CudaOptions {
                            gpu_mem_limit: raw.gpu_mem_limit.map(ByteSize::bytes),
                            same_as_requested: raw.arena_extend_strategy
                                == Some(RawArenaExtendStrategy::SameAsRequested),
                        }),
                        name,
                    )
                }
                RawProvider::Simulated => {
                    let (name, kind) = device_kind("simulated", "simulated")?;
                    if !matches!(kind, DeviceKind::Simulated { .. }) {
                        return Err(c.err(format!("{key}.device"), format!("`{name}` is not a `simulated` device")));
                    }
                    (Provider::Simulated, name)
                }
                RawProvider::Remote => self.validate_remote(&c, &key, p)?,
            };
            if p.models.is_empty() {
                return Err(c.err(format!("{key}.models"), "a pool must serve at least one model"));
            }
            for (j, m) in p.models.iter().enumerate() {
                if !model_names.contains(m.as_str()) {
                    return Err(c.err(
                        format!("{key}.models[{j}]"),
                        format!("no model named `{m}` in `models`"),
                    ));
                }
            }
            if !(1..=256).contains(&p.workers) {
                return Err(c.err(
                    format!("{key}.workers"),
                    format!("expected 1 to 256, got {}", p.workers),
                ));
            }
            let intra_threads = p.intra_threads.unwrap_or(1);
            if !(1..=256).contains(&intra_threads) {
                return Err(c.err(
                    format!("{key}.intra_threads"),
                    format!("expected 1 to 256, got {intra_threads}"),
                ));
            }
            if !(1..=1_000_000).contains(&p.queue.capacity) {
                return Err(c.err(
                    format!("{key}.queue.capacity"),
                    format!("expected 1 to 1000000, got {}", p.queue.capacity),
                ));
            }
            if p.queue.max_wait.get().is_zero() {
                return Err(c.err(format!("{key}.queue.max_wait"), "must be longer than 0"));
            }
            if p.max_context == Some(0) {
                return Err(c.err(
                    format!("{key}.max_context"),
                    "expected at least 1 token; leave it out for no limit",
                ));
            }
            let raw_breaker = p.breaker.clone().unwrap_or_default();
            if raw_breaker.failures == 0 {
                return Err(c.err(
                    format!("{key}.breaker.failures"),
                    "expected at least 1 failure to open the breaker",
                ));
            }
            if raw_breaker.window.get().is_zero() {
                return Err(c.err(format!("{key}.breaker.window"), "must be longer than 0"));
            }
            let shrink = p
                .memory
                .as_ref()
                .and_then(|m| m.arena_shrinkage)
                .unwrap_or(matches!(provider, Provider::Cpu));
            pools.push(PoolConfig {
                name: p.name.clone(),
                provider,
                device,
                models: p.models.clone(),
                workers: p.workers,
                intra_threads,
                queue_capacity: p.queue.capacity,
                max_wait: p.queue.max_wait.get(),
                arena_shrinkage: shrink,
                max_context: p.max_context,
                breaker: crate::core::breaker::BreakerConfig {
                    failures: raw_breaker.failures,
                    window: raw_breaker.window.get(),
                    cooldown: raw_breaker.cooldown.get(),
                },
                fallback: p.fallback.clone(),
            });
        }
        // A fallback must be another pool that serves everything this one does, so a retry
        // never lands where the model is missing.
        for (i, p) in pools.iter().enumerate() {
            let Some(name) = &p.fallback else { continue };
            let key = format!("pools[{i}].fallback");
            let target = pools
                .iter()
                .find(|q| &q.name == name)
                .ok_or_else(|| c.err(key.clone(), format!("no pool named `{name}` in `pools`")))?;
            if target.name == p.name {
                return Err(c.err(key, "a pool cannot be its own fallback"));
            }
            if let Some(m) = p.models.iter().find(|m| !target.models.contains(m)) {
                return Err(c.err(
                    key,
                    format!("pool `{name}` does not serve model `{m}`, which `{}` serves", p.name),
                ));
            }
        }
        for m in &models {
            if !pools.iter().any(|p| p.models.contains(&m.name)) {
                let i = models.iter().position(|x| x.name == m.name).unwrap_or(0);
                return Err(c.err(
                    format!("models[{i}]"),
                    format!("model `{}` is served by no pool", m.name),
                ));
            }
        }

        Ok(Config {
            source: file.to_string(),
            server: ServerConfig {
                listen,
                body_limit: usize::try_from(self.server.body_limit.bytes()).unwrap_or(usize::MAX),
                max_response_bytes: usize::try_from(self.server.max_response_bytes.bytes()).unwrap_or(usize::MAX),
                admin_token_env: self.server.admin_token_env.clone(),
                admin_socket,
                shutdown_grace: self.server.shutdown_grace.get(),
                idempotency: IdempotencyConfig {
                    max_entries: idempotency.max_entries,
                    ttl: idempotency.ttl.get(),
                },
                timeouts,
                max_connections,
                max_receiving_bytes: receiving.bytes(),
            },
            onnxruntime_library: self.onnxruntime.library.as_ref().map(|p| base.join(p)),
            devices,
            models,
            pools,
            host_reserve: self.host.reserve.bytes(),
            exporter,
            policy: self.validate_policy(&c, base)?,
        })
    }

    /// A `remote` pool: a plain-HTTP base URL, no device, no ONNX Runtime settings (the remote
    /// server has its own), timeouts that bound something.
    fn validate_remote(&self, c: &Checker, key: &str, p: &RawPool) -> Result<(Provider, String), ConfigError> {
        let onnxruntime_only = [
            ("device", p.device.is_some()),
            ("intra_threads", p.intra_threads.is_some()),
            ("memory", p.memory.is_some()),
        ];
        if let Some((field, _)) = onnxruntime_only.iter().find(|(_, given)| *given) {
            return Err(c.err(
                format!("{key}.{field}"),
                "a `remote` pool runs on the remote server, which has its own devices and ONNX Runtime settings; remove it",
            ));
        }
        let raw = p.url.as_deref().ok_or_else(|| {
            c.err(
                format!("{key}.url"),
                "a `remote` pool needs the url of the server it forwards to (http://host:port)",
            )
        })?;
        let bad = |why: &str| c.err(format!("{key}.url"), format!("`{raw}` {why}"));
        let uri: axum::http::Uri = raw
            .parse()
            .map_err(|_| bad("is not a URL; expected http://host:port"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(bad(
                    "uses https, which remote pools do not speak; put them on a private network or a TLS-terminating sidecar and use http",
                ));
            }
            _ => return Err(bad("is not an http:// URL")),
        }
        let authority = uri.authority().ok_or_else(|| bad("has no host"))?;
        if authority.as_str().contains('@') {
            return Err(bad("carries credentials, which would end up in logs and metrics"));
        }
        if uri.query().is_some() {
            return Err(bad(
                "has a query; the base URL is the server's, requests go to <url>/v2/...",
            ));
        }
        let options = p.remote.clone().unwrap_or_default();
        for (field, d) in [
            ("timeout", options.timeout),
            ("connect_timeout", options.connect_timeout),
            ("health_interval", options.health_interval),
            ("health_timeout", options.health_timeout),
        ] {
            if d.get().is_zero() {
                return Err(c.err(format!("{key}.remote.{field}"), "must be longer than 0"));
            }
        }
        let url = format!("http://{authority}{}", uri.path().trim_end_matches('/'));
        Ok((
            Provider::Remote(RemoteOptions {
                url,
                timeout: options.timeout.get(),
                connect_timeout: options.connect_timeout.get(),
                health_interval: options.health_interval.get(),
                health_timeout: options.health_timeout.get(),
            }),
            authority.to_string(),
        ))
    }

    fn validate_timeouts(&self, c: &Checker) -> Result<Timeouts, ConfigError> {
        let t = &self.server.timeouts;
        // Zero would close every connection at once; past a day a timeout no longer bounds
        // anything an operator would wait for.
        let check = |key: &str, d: HumanDuration| {
            if (Duration::from_millis(1)..=Duration::from_secs(24 * 3600)).contains(&d.get()) {
                Ok(d.get())
            } else {
                Err(c.err(
                    format!("server.timeouts.{key}"),
                    format!("expected 1ms to 24h, got {d}"),
                ))
            }
        };
        Ok(Timeouts {
            header_read: check("header_read", t.header_read)?,
            body_read: check("body_read", t.body_read)?,
            idle: check("idle", t.idle)?,
        })
    }

    fn validate_policy(&self, c: &Checker, base: &Path) -> Result<PolicyConfig, ConfigError> {
        let p = &self.policy;
        let source = match p.path.strip_prefix("builtin:") {
            Some(name) => PolicySource::Builtin(BuiltinPolicy::from_name(name).ok_or_else(|| {
                c.err(
                    "policy.path",
                    format!(
                        "no builtin policy `{name}`; builtin policies are: {}",
                        BuiltinPolicy::ALL.map(BuiltinPolicy::name).join(", ")
                    ),
                )
            })?),
            None => {
                let path = base.join(&p.path);
                if !path.is_file() {
                    return Err(c.err(
                        "policy.path",
                        format!("policy file `{}` does not exist", path.display()),
                    ));
                }
                PolicySource::File(path)
            }
        };
        match &p.fallback {
            Decision::Defer { ms } if *ms == 0 => {
                return Err(c.err("policy.fallback.ms", "a fallback deferral must wait longer than 0"));
            }
            Decision::ShrinkContext { tokens } if *tokens == 0 => {
                return Err(c.err(
                    "policy.fallback.tokens",
                    "a fallback shrink must keep at least one token",
                ));
            }
            Decision::Admit { pool: Some(pool) } | Decision::Redirect { pool }
                if !self.pools.iter().any(|x| &x.name == pool) =>
            {
                return Err(c.err("policy.fallback.pool", format!("no pool named `{pool}` in `pools`")));
            }
            _ => {}
        }
        for (key, value) in &p.params {
            if !(value.is_number() || value.is_boolean() || value.is_string()) {
                return Err(c.err(
                    format!("policy.params.{key}"),
                    "expected a number, a boolean or a string",
                ));
            }
        }
        let interval = p.watch_interval.get();
        Ok(PolicyConfig {
            source,
            fallback: p.fallback.clone(),
            watch_interval: (!interval.is_zero()).then_some(interval),
            params: p.params.clone(),
        })
    }

    fn validate_exporter(&self, c: &Checker) -> Result<ExporterConfig, ConfigError> {
        let e = &self.exporter;
        let listen: SocketAddr = e.listen.parse().map_err(|_| {
            c.err(
                "exporter.listen",
                format!("expected an address like `127.0.0.1:9842`, got `{}`", e.listen),
            )
        })?;
        let interval = e.sample_interval.get();
        if interval < Duration::from_millis(100) || interval > Duration::from_secs(3600) {
            return Err(c.err("exporter.sample_interval", "expected 100ms to 1h"));
        }
        let mut services = Vec::new();
        for (i, rule) in e.services.iter().enumerate() {
            let key = format!("exporter.services[{i}]");
            if rule.service.trim().is_empty() {
                return Err(c.err(format!("{key}.service"), "expected a service name"));
            }
            let regex = |field: &str, pattern: &str| {
                regex::Regex::new(pattern)
                    .map_err(|e| c.err(format!("{key}.{field}"), format!("invalid regular expression: {e}")))
            };
            let matcher = match (&rule.process_name, &rule.cmdline, &rule.cgroup) {
                (Some(name), None, None) => ServiceMatch::ProcessName(name.clone()),
                (None, Some(pattern), None) => ServiceMatch::Cmdline(regex("cmdline", pattern)?),
                (None, None, Some(pattern)) => ServiceMatch::Cgroup(regex("cgroup", pattern)?),
                _ => {
                    return Err(c.err(key, "give exactly one of `process_name`, `cmdline` or `cgroup`"));
                }
            };
            services.push(ServiceRule {
                service: rule.service.clone(),
                matcher,
            });
        }
        Ok(ExporterConfig {
            listen,
            sample_interval: interval,
            services,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(yaml: &str) -> Result<Config, ConfigError> {
        parse_yaml::<RawConfig>(yaml, "test.yaml")?.validate("test.yaml", Path::new("."))
    }

    const BASE: &str = "
models:
  - name: enc
    path: builtin:encoder
pools:
  - name: cpu
    provider: cpu
    models: [enc]
";

    #[test]
    fn embedded_default_is_valid_on_both_kinds_of_machine() {
        let sim = Config::embedded(false);
        assert!(sim.pools.iter().any(|p| p.provider == Provider::Simulated));
        let gpu = Config::embedded(true);
        assert!(gpu.pools.iter().any(|p| matches!(p.provider, Provider::Cuda(_))));
        assert!(gpu.pools.iter().all(|p| p.provider != Provider::Simulated));
        assert_eq!(
            sim.pools.iter().map(|p| &p.name).collect::<Vec<_>>(),
            gpu.pools.iter().map(|p| &p.name).collect::<Vec<_>>()
        );
        // Lossless first: out of the box no request's context is cut unless the client asks.
        assert!(sim.models.iter().all(|m| !m.allow_shrink));
    }

    #[test]
    fn the_example_config_validates_and_uses_every_section() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/example.yaml");
        let cfg = Config::load(&path).unwrap();
        assert_eq!(cfg.devices.len(), 2);
        assert_eq!(cfg.server.admin_token_env.as_deref(), Some("VRAMGUARD_ADMIN_TOKEN"));
        assert_eq!(cfg.server.idempotency.ttl, Duration::from_secs(600));
        // The example shows the connection limits' defaults, so its comments explain them.
        let defaults = check(BASE).unwrap().server;
        assert_eq!(cfg.server.timeouts, defaults.timeouts);
        assert_eq!(cfg.server.max_connections, defaults.max_connections);
        assert_eq!(cfg.server.max_receiving_bytes, defaults.max_receiving_bytes);
        let providers: Vec<&str> = cfg.pools.iter().map(|p| p.provider.label()).collect();
        assert_eq!(providers, ["cuda", "simulated", "cpu", "remote"]);
        let kinds: Vec<&str> = cfg.pools.iter().map(|p| cfg.pool_class(p).label()).collect();
        assert_eq!(kinds, ["nvml", "simulated", "host", "remote"]);
        let limits: Vec<Option<u64>> = cfg.pools.iter().map(|p| p.max_context).collect();
        assert_eq!(limits, [Some(4096), None, None, None]);
        assert_eq!(cfg.exporter.services.len(), 3);
        assert_eq!(cfg.exporter.sample_interval, Duration::from_secs(1));
        assert_eq!(
            cfg.models[0].context,
            Some(ContextAxis {
                input: "input".into(),
                axis: 1,
                keep: Keep::End
            })
        );
        let allow_shrink: Vec<bool> = cfg.models.iter().map(|m| m.allow_shrink).collect();
        assert_eq!(allow_shrink, [false, false]);
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let cfg = check(BASE).unwrap();
        assert_eq!(cfg.server.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(cfg.pools[0].device, HOST_DEVICE);
        assert_eq!(cfg.pools[0].queue_capacity, 64);
        assert_eq!(cfg.pools[0].max_context, None);
        assert_eq!(
            cfg.server.idempotency,
            IdempotencyConfig {
                max_entries: 10_000,
                ttl: Duration::from_secs(600)
            }
        );
        assert!(!cfg.models[0].allow_shrink);
        let allowed = BASE.replace("builtin:encoder", "builtin:encoder\n    allow_shrink: true");
        assert!(check(&allowed).unwrap().models[0].allow_shrink);
    }

    #[test]
    fn idempotency_bounds_are_checked_with_their_key() {
        let cfg = check(&format!(
            "server:\n  idempotency: {{max_entries: 50, ttl: 30s}}\n{BASE}"
        ))
        .unwrap();
        assert_eq!(cfg.server.idempotency.max_entries, 50);
        assert_eq!(cfg.server.idempotency.ttl, Duration::from_secs(30));
        let err = check(&format!("server:\n  idempotency: {{max_entries: 0}}\n{BASE}"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "test.yaml: server.idempotency.max_entries: expected 1 to 1000000, got 0"
        );
        let err = check(&format!("server:\n  idempotency: {{ttl: 2d}}\n{BASE}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("server.idempotency.ttl") && err.contains("`2d`"), "{err}");
        let err = check(&format!("server:\n  idempotency: {{ttl: 25h}}\n{BASE}"))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "test.yaml: server.idempotency.ttl: expected 1s to 24h, got 25h");
        let err = check(&format!("server:\n  idempotency: {{max_entires: 5}}\n{BASE}"))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("test.yaml: server.idempotency: unknown field `max_entires`"),
            "{err}"
        );
    }

    #[test]
    fn connection_limits_default_near_nginx_and_refuse_zero_with_their_key() {
        let server = check(BASE).unwrap().server;
        assert_eq!(
            server.timeouts,
            Timeouts {
                header_read: Duration::from_secs(20),
                body_read: Duration::from_secs(30),
                idle: Duration::from_secs(75),
            }
        );
        assert_eq!(server.max_connections, 512);
        assert_eq!(server.max_receiving_bytes, 256 << 20);
        let cfg = check(&format!(
            "server:\n  timeouts: {{header_read: 500ms, idle: 2m}}\n  max_connections: 8\n{BASE}"
        ))
        .unwrap();
        assert_eq!(cfg.server.timeouts.header_read, Duration::from_millis(500));
        assert_eq!(cfg.server.timeouts.body_read, Duration::from_secs(30));
        assert_eq!(cfg.server.timeouts.idle, Duration::from_secs(120));
        assert_eq!(cfg.server.max_connections, 8);
        for key in ["header_read", "body_read", "idle"] {
            let err = check(&format!("server:\n  timeouts: {{{key}: 0}}\n{BASE}"))
                .unwrap_err()
                .to_string();
            assert_eq!(
                err,
                format!("test.yaml: server.timeouts.{key}: expected 1ms to 24h, got 0ms")
            );
        }
        let err = check(&format!("server:\n  timeouts: {{idle: 48h}}\n{BASE}"))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "test.yaml: server.timeouts.idle: expected 1ms to 24h, got 48h");
        let err = check(&format!("server:\n  max_connections: 0\n{BASE}"))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "test.yaml: server.max_connections: expected 1 to 1000000, got 0");
        let err = check(&format!("server:\n  max_receiving_bytes: 1MiB\n{BASE}"))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("test.yaml: server.max_receiving_bytes: must be at least server.body_limit (64MiB)"),
            "{err}"
        );
        let err = check(&format!("server:\n  timeouts: {{header: 5s}}\n{BASE}"))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("test.yaml: server.timeouts: unknown field `header`"),
            "{err}"
        );
    }

    #[test]
    fn unknown_keys_are_refused_with_their_path_and_line() {
        let err = check(&format!("{BASE}    wrokers: 2\n")).unwrap_err().to_string();
        assert!(err.starts_with("test.yaml: pools[0]: unknown field `wrokers`"), "{err}");
        assert!(err.contains("line 9"), "{err}");
    }

    #[test]
    fn impossible_values_name_the_key() {
        let err = check(&format!("{BASE}    queue: {{capacity: 0}}\n"))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "test.yaml: pools[0].queue.capacity: expected 1 to 1000000, got 0");
        let err = check(&BASE.replace("[enc]", "[nope]")).unwrap_err().to_string();
        assert_eq!(err, "test.yaml: pools[0].models[0]: no model named `nope` in `models`");
        let err = check(&BASE.replace("builtin:encoder", "builtin:bert"))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("test.yaml: models[0].path: no builtin model `bert`"),
            "{err}"
        );
        let err = check(&BASE.replace("builtin:encoder", "missing.onnx"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("models[0].path: model file `./missing.onnx` does not exist"),
            "{err}"
        );
    }

    #[test]
    fn max_context_is_a_positive_number_of_tokens() {
        let cfg = check(&format!("{BASE}    max_context: 2048\n")).unwrap();
        assert_eq!(cfg.pools[0].max_context, Some(2048));
        let err = check(&format!("{BASE}    max_context: 0\n")).unwrap_err().to_string();
        assert_eq!(
            err,
            "test.yaml: pools[0].max_context: expected at least 1 token; leave it out for no limit"
        );
        let err = check(&format!("{BASE}    max_context: -1\n")).unwrap_err().to_string();
        assert!(
            err.starts_with("test.yaml: pools[0].max_context: invalid type: integer `-1`, expected u64 at line 9"),
            "{err}"
        );
    }

    #[test]
    fn sizes_and_durations_in_the_wrong_shape_are_explained() {
        let err = check(&format!("server:\n  body_limit: huge\n{BASE}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("server.body_limit") && err.contains("`huge`"), "{err}");
        let err = check(&format!("{BASE}    queue: {{max_wait: soon}}\n"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("pools[0].queue.max_wait") && err.contains("`soon`"),
            "{err}"
        );
    }

    #[test]
    fn words_from_a_closed_set_are_refused_with_the_accepted_ones_and_the_line() {
        let err = check(&BASE.replace("provider: cpu", "provider: gpu"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "test.yaml: pools[0].provider: unknown variant `gpu`, expected one of `cpu`, `cuda`, `simulated`, `remote` \
             at line 7 column 15"
        );
        let err = check(&format!("devices: [{{name: d, kind: amd}}]\n{BASE}"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "test.yaml: devices[0].kind: unknown variant `amd`, expected `nvidia` or `simulated` at line 1 column 27"
        );
        let err = check(&BASE.replace(
            "builtin:encoder",
            "builtin:encoder\n    context: {input: input, axis: 1, keep: End}",
        ))
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with(
                "test.yaml: models[0].context.keep: unknown variant `End`, expected `start` or `end` at line 5"
            ),
            "{err}"
        );
        let cuda = BASE.replace(
            "provider: cpu",
            "provider: cuda\n    device: g\n    cuda: {arena_extend_strategy: lots}",
        );
        let err = check(&format!("devices: [{{name: g, kind: nvidia}}]\n{cuda}"))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(
                "test.yaml: pools[0].cuda.arena_extend_strategy: unknown variant `lots`, \
                 expected `next_power_of_two` or `same_as_requested`"
            ),
            "{err}"
        );
        let err = check(&format!("policy: {{fallback: {{action: admitt}}}}\n{BASE}"))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("test.yaml: policy.fallback.action: unknown variant `admitt`, expected one of `admit`"),
            "{err}"
        );
    }

    #[test]
    fn pools_must_match_their_device_kind() {
        let yaml = "
devices:
  - {name: sim0, kind: simulated, capacity: 64MiB}
models:
  - {name: enc, path: 'builtin:encoder'}
pools:
  - {name: gpu, provider: cuda, device: sim0, models: [enc]}
";
        let err = check(yaml).unwrap_err().to_string();
        assert_eq!(err, "test.yaml: pools[0].device: `sim0` is not an `nvidia` device");
        let err = check(&yaml.replace("capacity: 64MiB", "capacity: 1KiB"))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "test.yaml: devices[0].capacity: must be at least 1MiB");
    }

    #[test]
    fn a_remote_pool_needs_a_plain_http_url_and_no_onnxruntime_settings() {
        let pool = |extra: &str| {
            check(&format!(
                "models: [{{name: enc, path: 'builtin:encoder'}}]\npools:\n  - {{name: far, provider: remote, models: [enc]{extra}}}\n"
            ))
        };
        let err = |extra: &str| pool(extra).unwrap_err().to_string();
        let ok = pool(", url: 'http://10.0.0.2:8080/kserve/', remote: {timeout: 5s}").unwrap();
        let far = &ok.pools[0];
        assert_eq!(far.device, "10.0.0.2:8080");
        assert_eq!(ok.pool_class(far), crate::core::snapshot::DeviceClass::Remote);
        let Provider::Remote(options) = &far.provider else {
            panic!("{:?}", far.provider)
        };
        assert_eq!(options.url, "http://10.0.0.2:8080/kserve");
        assert_eq!(options.timeout, Duration::from_secs(5));
        assert_eq!(options.health_interval, Duration::from_secs(1));
        assert_eq!(
            err(""),
            "test.yaml: pools[0].url: a `remote` pool needs the url of the server it forwards to (http://host:port)"
        );
        assert!(err(", url: 'https://h:1'").starts_with("test.yaml: pools[0].url: `https://h:1` uses https"));
        assert!(err(", url: 'ftp://h:1'").starts_with("test.yaml: pools[0].url: `ftp://h:1` is not an http:// URL"));
        assert!(err(", url: 'http://u:p@h:1'").contains("carries credentials"));
        let device = err(", url: 'http://h:1', device: sim0");
        assert!(
            device.starts_with("test.yaml: pools[0].device: a `remote` pool runs on the remote server"),
            "{device}"
        );
        assert!(err(", url: 'http://h:1', intra_threads: 2").starts_with("test.yaml: pools[0].intra_threads: "));
        assert!(
            err(", url: 'http://h:1', memory: {arena_shrinkage: true}").starts_with("test.yaml: pools[0].memory: ")
        );
        assert_eq!(
            err(", url: 'http://h:1', remote: {health_interval: 0}"),
            "test.yaml: pools[0].remote.health_interval: must be longer than 0"
        );
        let local = BASE.replace("provider: cpu", "provider: cpu\n    url: 'http://h:1'");
        assert_eq!(
            check(&local).unwrap_err().to_string(),
            "test.yaml: pools[0].url: only `remote` pools take a url"
        );
    }

    #[test]
    fn service_rules_need_exactly_one_valid_matcher() {
        let err = check(&format!("exporter:\n  services: [{{service: x}}]\n{BASE}"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "test.yaml: exporter.services[0]: give exactly one of `process_name`, `cmdline` or `cgroup`"
        );
        let err = check(&format!(
            "exporter:\n  services: [{{service: x, cmdline: '('}}]\n{BASE}"
        ))
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("test.yaml: exporter.services[0].cmdline: invalid regular expression"),
            "{err}"
        );
    }

    #[test]
    fn exporter_mode_needs_no_models_or_pools() {
        let raw: RawConfig = parse_yaml("devices: []\n", "e.yaml").unwrap();
        assert!(raw.validate_for("e.yaml", Path::new("."), Mode::Exporter).is_ok());
        let err = raw.validate("e.yaml", Path::new(".")).unwrap_err().to_string();
        assert_eq!(err, "e.yaml: models: at least one model is needed");
    }

    #[test]
    fn duplicate_names_are_refused() {
        let err = check(&format!("{BASE}  - name: cpu\n    provider: cpu\n    models: [enc]\n"))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "test.yaml: pools[1].name: `cpu` is defined twice");
    }

    #[test]
    fn builtin_names_are_checked_against_what_the_binary_ships() {
        let cfg = check(&format!("policy: {{path: 'builtin:latency-first'}}\n{BASE}")).unwrap();
        assert_eq!(cfg.policy.source, PolicySource::Builtin(BuiltinPolicy::LatencyFirst));
        let err = check(&format!("policy: {{path: 'builtin:fastest'}}\n{BASE}"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "test.yaml: policy.path: no builtin policy `fastest`; builtin policies are: default, latency-first, availability-first"
        );
        let tokenizer = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        let chat = |template: &str| {
            check(&BASE.replace(
                "builtin:encoder",
                &format!(
                    "builtin:encoder\n    tokenizer: '{}'\n    chat_template: '{template}'",
                    tokenizer.display()
                ),
            ))
        };
        let cfg = chat("builtin:chatml").unwrap();
        let template = cfg.models[0].chat_template.as_ref().expect("a chat template");
        assert_eq!(template, &ChatTemplateSource::Builtin(BuiltinChatTemplate::Chatml));
        assert_eq!(template.to_string(), "builtin:chatml");
        assert_eq!(
            chat("builtin:llama").unwrap_err().to_string(),
            "test.yaml: models[0].chat_template: unknown builtin chat template `llama`; builtin: chatml"
        );
    }
}
