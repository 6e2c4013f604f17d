//! The raw, serde-facing structs: what the YAML parses into, mirroring it key for key (unknown
//! keys are errors) with the defaults an operator gets by leaving a key out. `config default`
//! serializes them; `validate/` turns them into the types of `types.rs`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::types::{HealthConfig, Keep, ServiceClass};
use crate::config::units::{ByteSize, HumanDuration};
use crate::core::breaker::BreakerConfig;
use crate::core::cpus::CpuList;
use crate::core::snapshot::Decision;

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
    /// Who the memory belongs to: budgets, concurrency, priority and class per service.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<RawService>,
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
    /// The CPUs vramguard's own threads run on (HTTP, policy, telemetry): a CPU list such as
    /// `0-3,6`; absent: wherever it was started. Pools choose theirs with `pools[].cpus`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<CpuList>,
    /// The longest an idle CPU may take to wake up while requests are in flight and for a
    /// second after (Linux's CPU latency QoS, `/dev/cpu_dma_latency`), e.g. `0us`; absent:
    /// the kernel's choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_wake_latency: Option<HumanDuration>,
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
            cpus: None,
            cpu_wake_latency: None,
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
    /// A decoder's or embedder's `tokenizer.json` (Hugging Face tokenizers format, relative to
    /// the config file), or `builtin:decoder` / `builtin:embedder` for a bundled model's: with
    /// it, a decoder serves text generation on `/v1/completions`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// The chat template behind `/v1/chat/completions`: `builtin:chatml`, a Jinja file, or a
    /// `tokenizer_config.json` holding `chat_template` (relative to the config file). Without
    /// it, the `tokenizer_config.json` next to the tokenizer, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    /// When its sessions exist: `resident` (loaded at start, may be unloaded), `pinned` (loaded
    /// at start, never unloaded) or `on_demand` (loaded by its first request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub residency: Option<RawResidency>,
    /// `warm`: an `on_demand` model's optimized bytes are put into the host tier at start, so
    /// its first load is a copy, not a load from its file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_tier: Option<RawHostTier>,
    /// Unload it from a pool after this long without a request there (`10m`); absent: never.
    /// Not for a `pinned` model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_unload: Option<HumanDuration>,
    /// The service its memory belongs to (a `services[]` name); default: its own name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// Eviction takes lower priorities first; default: its service's priority, else 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i64>,
    /// A smaller model that may answer instead when this one cannot run and the client allows
    /// a substitute (`x-vramguard-allow-substitute: true`, or `allow_substitute`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_model: Option<String>,
    /// Whether a request that does not say allows its `fallback_model` to answer. Off by
    /// default: another model changes the answer.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_substitute: bool,
    /// An embedder's, a text tower's or a reranker's: whether an input longer than the model
    /// takes is cut to it when the request does not say (`truncate`), as TEI's
    /// `--auto-truncate`. Off by default: a cut input's vector is of its start alone.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_truncate: bool,
    /// A dual encoder's vision tower (another `models[]` name), when this model is its text
    /// tower: an embeddings request for this model with images runs them there, so one model
    /// name answers texts and images.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images: Option<String>,
    /// After a load, how long the model is kept before eviction may take it (default `30s`),
    /// so two models that do not fit together cannot thrash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_residency: Option<HumanDuration>,
    /// Dynamic batching across requests: requests that arrive together run as one run of at
    /// most `max_batch` rows, as many as fit. Absent: each request runs alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batching: Option<RawBatching>,
}

/// `models[].batching:` as written.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBatching {
    /// The most rows (items along the model's batch axis) one run takes.
    pub max_batch: usize,
    /// How long a batch gathering behind the model's own runs holds back while other work
    /// waits in the pool's queue (`5ms`).
    pub max_delay: HumanDuration,
}

/// One entry of `services:`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawService {
    /// Its name, as `models[].service` and `exporter.services[].service` write it.
    pub name: String,
    /// Budget on each accelerator: weights, reserved arena and KV cache of its models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_memory: Option<ByteSize>,
    /// Its requests running at once, all pools together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<usize>,
    /// Priority of its models (their own `priority` wins); default 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i64>,
    /// `interactive` (default) or `background`: deferred while interactive work waits or the
    /// device's headroom is under the reserve.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<ServiceClass>,
}

/// `models[].residency:` as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RawResidency {
    /// Loaded at start; an operator may unload it.
    Resident,
    /// Loaded at start and never unloaded.
    Pinned,
    /// Loaded by its first request (or an operator's load).
    OnDemand,
}

/// `models[].host_tier`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RawHostTier {
    /// Put into the host tier at start.
    Warm,
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
    /// Its health checks (local pools; a remote pool's are under `remote`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<RawHealth>,
    /// The pool a replayable request is retried on, once, after an allocator failure here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<String>,
    /// Where its sessions run: `process` (a worker process of its own; the default for `cuda`
    /// and `simulated` pools) or `thread` (in vramguard's process; the default for `cpu`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation: Option<RawIsolation>,
    /// The CPUs its sessions run on: its worker process, or its worker threads (with the
    /// intra-op threads ONNX Runtime starts for them); absent: the CPUs vramguard started on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<CpuList>,
}

/// `pools[].isolation`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RawIsolation {
    /// A worker process of its own.
    Process,
    /// Worker threads in vramguard's process.
    Thread,
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
        let d = BreakerConfig::default();
        Self {
            failures: d.failures,
            window: HumanDuration(d.window),
            cooldown: HumanDuration(d.cooldown),
        }
    }
}

/// `pools[].health:`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawHealth {
    /// How long a pool stays idle before a probe inference checks it.
    pub interval: HumanDuration,
    /// Longest a probe inference may take before the check counts as failed.
    pub timeout: HumanDuration,
}

impl Default for RawHealth {
    fn default() -> Self {
        let d = HealthConfig::default();
        Self {
            interval: HumanDuration(d.interval),
            timeout: HumanDuration(d.timeout),
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
    /// Default: off (a pool under load reuses its blocks; `idle_release` returns them).
    pub arena_shrinkage: Option<bool>,
    /// Return the arena's free memory once the pool has had no run for this long (`1s`), and
    /// at once when host memory nears its reserve; `0s` never. Default: `1s` for every local
    /// pool: on the host, a burst of large requests would otherwise stay resident for good; on
    /// an accelerator, memory an idle pool's arena keeps is memory no other process on the
    /// device can have (another model, another runtime, the next request's pressure).
    pub idle_release: Option<HumanDuration>,
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
    /// The host tier's budget: optimized model bytes kept in host memory so that a model
    /// evicted or unloaded loads again from memory. Default: a quarter of the host's memory
    /// above `reserve`; `0`: no host tier.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_cache: Option<ByteSize>,
    /// The folder of the optimized cache (models optimized once, in the ORT format). Default:
    /// `$XDG_CACHE_HOME/vramguard/optimized`, else `~/.cache/vramguard/optimized`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub optimized_cache: Option<std::path::PathBuf>,
}

impl Default for RawHost {
    fn default() -> Self {
        Self {
            reserve: ByteSize(2 << 30),
            model_cache: None,
            optimized_cache: None,
        }
    }
}
