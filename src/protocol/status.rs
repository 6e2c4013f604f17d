//! The `/status` document: what a running server says about itself, for tools (`drill`,
//! `doctor`, scripts) and the status page. The server builds a [`StatusReport`] and serialises
//! it; clients deserialise the same type, so a field renamed on one side cannot go unnoticed on
//! the other. The JSON is the contract: every `Option` below that is `null` on the wire is
//! serialised as `null`, and only the device fields of a simulated accelerator are left out
//! where they do not apply.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::ServiceClass;
use crate::core::backend::ArenaStats;
use crate::core::snapshot::{BreakerState, Decision, DeviceClass, DeviceState, HostState, ProcessState, ProviderKind};
use crate::policy::recent::RecentDecision;

/// `GET /status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// The host tier: optimized model bytes kept in host memory, and its budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_tier: Option<HostTierStatus>,
    /// vramguard's version.
    pub version: String,
    /// The ONNX Runtime version loaded.
    pub onnxruntime: String,
    /// Where the config came from (its path, or `<embedded default>`).
    pub config: String,
    /// When the server started, seconds since the Unix epoch.
    pub started_unix: u64,
    /// True once a shutdown has begun (the server is draining).
    pub shutting_down: bool,
    /// Degraded mode, and where work goes meanwhile.
    pub degraded: DegradedStatus,
    /// Every pool, in config order.
    pub pools: Vec<PoolStatus>,
    /// Device memory by device name, as last sampled.
    pub devices: BTreeMap<String, DeviceStatus>,
    /// Host memory, as last sampled.
    pub host: HostState,
    /// Processes holding accelerator memory, as last sampled.
    pub processes: Vec<ProcessState>,
    /// How old the last sample is; `null` before the first one (a policy then has no memory
    /// figures to go by).
    pub sample_age_ms: Option<u64>,
    /// The admission policy serving now.
    pub policy: ServingPolicy,
    /// The policy's last decisions, newest first.
    pub recent_decisions: Vec<RecentDecision>,
    /// Every configured model, and where its sessions are loaded (absent from older servers).
    #[serde(default)]
    pub models: Vec<ModelStatus>,
    /// The models `make_room` unloaded lately, newest first.
    #[serde(default)]
    pub evictions: Vec<EvictionStatus>,
    /// Every service, in config order: its budgets and what it runs and holds now (absent
    /// from servers that predate service budgets).
    #[serde(default)]
    pub services: Vec<ServiceStatus>,
    /// Each speech model on each pool serving it: the audio transcribed there and how fast
    /// (absent from servers that predate speech).
    #[serde(default)]
    pub speech: Vec<SpeechStatus>,
}

/// A speech model on one pool: its transcriptions (and translations) whose last window ran
/// there, as `vramguard_audio_seconds_total` and `vramguard_audio_real_time_factor` count them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpeechStatus {
    /// The model.
    pub model: String,
    /// The pool.
    pub pool: String,
    /// Transcriptions answered.
    pub transcriptions: u64,
    /// Their seconds of audio.
    pub audio_seconds: f64,
    /// Their mean real-time factor: seconds from arrival to answer per second of audio (below
    /// 1: faster than it was spoken); `null` before the first.
    pub real_time_factor: Option<f64>,
}

/// One configured model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelStatus {
    /// Name.
    pub name: String,
    /// The service its memory belongs to.
    pub service: String,
    /// Eviction takes lower priorities first.
    pub priority: i64,
    /// `resident`, `pinned` or `on_demand`.
    pub residency: String,
    /// The model that may answer instead, with the client's leave.
    pub fallback_model: Option<String>,
    /// Each pool serving it.
    pub pools: Vec<ModelOnPool>,
    /// The graphs it runs, each with its weights and the pools it is resident on (one for a
    /// model of one graph; a Whisper's encoder and decoder).
    #[serde(default)]
    pub components: Vec<ComponentStatus>,
}

/// One component (graph) of a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComponentStatus {
    /// `model` for a model of one graph; `encoder` and `decoder` for a Whisper.
    pub name: String,
    /// The files its weights are read from.
    pub files: Vec<String>,
    /// Its weights: what one session of it holds (a pool holds one per worker).
    pub weights_bytes: u64,
    /// The pools it is resident on now.
    pub resident: Vec<String>,
}

/// A model on one pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelOnPool {
    /// Pool name.
    pub pool: String,
    /// Whether its sessions are loaded there now.
    pub resident: bool,
    /// When they were last built there (the server's start for those built then); `null` while
    /// not resident.
    pub loaded_unix: Option<u64>,
    /// Since its last request there (since the start when it had none); `null` on a remote pool.
    pub idle_ms: Option<u64>,
    /// Its requests running there.
    pub running: usize,
    /// Its requests queued there.
    pub queued: usize,
    /// Its weights there when loaded (every worker's sessions); 0 when it shares another
    /// model's loaded weights there, which that model's entry shows.
    pub weights_bytes: u64,
    /// The model whose loaded weights it shares there (identical graph files, one session),
    /// when it does; `null` otherwise.
    #[serde(default)]
    pub shares_weights_of: Option<String>,
}

/// A model `make_room` unloaded to admit another model's request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvictionStatus {
    /// When.
    pub at_unix: u64,
    /// The pool it was unloaded from.
    pub pool: String,
    /// That pool's device.
    pub device: String,
    /// The model unloaded.
    pub model: String,
    /// Its weights there.
    pub freed_bytes: u64,
    /// The model whose request it made room for.
    pub for_model: String,
    /// That request's id.
    pub for_request: String,
}

/// One service (`services[]`, or the implicit one of a model that names none).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceStatus {
    /// Its name.
    pub name: String,
    /// `interactive` or `background`.
    pub class: ServiceClass,
    /// Priority of its models unless they set their own.
    pub priority: i64,
    /// False for the implicit service of a model that names none.
    pub configured: bool,
    /// Its `device_memory` budget on each accelerator; `null`: none.
    pub device_memory_budget_bytes: Option<u64>,
    /// Most requests it runs at once; `null`: no limit.
    pub concurrency: Option<usize>,
    /// Its requests running now, all pools together.
    pub running: u64,
    /// What it holds on each accelerator device: for a service vramguard runs, its models'
    /// resident weights and its running requests' estimates; for another runtime's, what its
    /// processes use.
    pub memory: BTreeMap<String, u64>,
}

impl StatusReport {
    /// The pool called `name`.
    pub fn pool(&self, name: &str) -> Option<&PoolStatus> {
        self.pools.iter().find(|p| p.name == name)
    }
}

/// Whether the service is degraded. Every field but `active` and `fallbacks` is `null` while it
/// is not, so a reader finds the same keys either way.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DegradedStatus {
    /// Degraded now.
    pub active: bool,
    /// For people: which pool and why.
    pub reason: Option<String>,
    /// The cause, as the `reason` label of `vramguard_degraded_info` (`driver_fault`, …).
    pub cause: Option<String>,
    /// Since when, seconds since the Unix epoch.
    pub since_unix: Option<u64>,
    /// Where work goes while degraded; empty while not.
    pub fallbacks: Vec<FallbackStatus>,
}

/// A configured `fallback` while degraded: the limits a redirected request meets there and the
/// delay a new one should expect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FallbackStatus {
    /// The pool whose work moves.
    pub from: String,
    /// The pool it moves to.
    pub pool: String,
    /// That pool's longest context (`null`: no limit).
    pub max_context: Option<u64>,
    /// Its workers.
    pub concurrency: usize,
    /// Its queue capacity.
    pub queue_capacity: usize,
    /// Where a new request would stand: queued and running requests ahead of it, plus one.
    pub queue_position: usize,
    /// Its delay estimate for a new request (queue position × recent run time).
    pub estimated_delay_ms: u64,
}

/// Whether a pool takes work, as `/status` and the status page name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolAvailability {
    /// Its workers run and it takes work.
    Ready,
    /// It started, but takes no new work: the server is shutting down.
    Stopping,
    /// It could not start, or lost every backend; `reason` says why.
    Unavailable,
}

/// One pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolStatus {
    /// Its name.
    pub name: String,
    /// The execution provider (`cpu`, `cuda`, `simulated`, `remote`).
    pub provider: ProviderKind,
    /// Its device (`host` for CPU pools, `host:port` for remote ones).
    pub device: String,
    /// What kind of memory that device is.
    pub device_kind: DeviceClass,
    /// True on the simulated accelerator, so no reader mistakes it for a GPU.
    pub simulated: bool,
    /// Whether it takes work.
    pub state: PoolAvailability,
    /// Why it is unavailable; `null` otherwise.
    pub reason: Option<String>,
    /// The models it serves.
    pub models: Vec<String>,
    /// Worker count.
    pub workers: usize,
    /// Requests waiting.
    pub queue_depth: usize,
    /// The queue's capacity.
    pub queue_capacity: usize,
    /// Age of the oldest waiting request.
    pub queue_oldest_age_ms: u64,
    /// Requests running.
    pub inflight: usize,
    /// Estimated time until a new request would finish.
    pub estimated_delay_ms: u64,
    /// Its circuit breaker.
    pub breaker: BreakerState,
    /// What opened the breaker, while it is not closed; `null` otherwise.
    pub breaker_reason: Option<String>,
    /// Longest context it accepts (`null`: no limit).
    pub max_context: Option<u64>,
    /// Where a replayable request goes after an allocator failure here; `null` for none.
    pub fallback: Option<String>,
    /// Allocator failures in the breaker's window.
    pub alloc_failures_recent: u64,
    /// Its ONNX Runtime arena; `null` where there is none to read (remote pools, a pool that
    /// did not start).
    pub arena: Option<ArenaStatus>,
    /// Where its sessions run: `process` (a worker process of its own) or `thread`.
    #[serde(default)]
    pub isolation: String,
    /// Its worker process's pid, while one runs; `null` for `thread` isolation (and while a
    /// lost worker is being replaced).
    #[serde(default)]
    pub worker_pid: Option<u32>,
    /// The CPUs its sessions run on (`pools[].cpus`, or those vramguard started on), as a CPU
    /// list (`0-3,6`); `null` for a remote pool.
    #[serde(default)]
    pub cpus: Option<String>,
}

/// A pool's arena, as ONNX Runtime's allocator reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArenaStatus {
    /// Bytes reserved from the device.
    pub reserved_bytes: u64,
    /// Bytes held by live tensors.
    pub active_bytes: u64,
    /// Peak of `active_bytes`.
    pub peak_active_bytes: u64,
    /// The arena's cap; `null` when it has none.
    pub limit_bytes: Option<u64>,
    /// Times it grew.
    pub extensions: u64,
    /// Times it shrank.
    pub shrinkages: u64,
}

impl From<ArenaStats> for ArenaStatus {
    fn from(s: ArenaStats) -> ArenaStatus {
        ArenaStatus {
            reserved_bytes: s.reserved_bytes,
            active_bytes: s.active_bytes,
            peak_active_bytes: s.peak_active_bytes,
            limit_bytes: s.limit_bytes,
            extensions: s.extensions,
            shrinkages: s.shrinkages,
        }
    }
}

/// One device's memory: the sampled figures and, on the simulated accelerator only, the
/// external pressure applied to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceStatus {
    /// The sampled figures, at the top level of the device's object.
    #[serde(flatten)]
    pub memory: DeviceState,
    /// True on the simulated accelerator; the key is absent on any other device.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub simulated: bool,
    /// The simulated accelerator's external pressure; absent on any other device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pressure_bytes: Option<u64>,
}

/// The policy serving now (also the `policy` of `POST /admin/policy/reload`'s answer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServingPolicy {
    /// The script's path, or `builtin:<name>`.
    pub path: String,
    /// `file`, or `builtin:<name>`.
    pub source: String,
    /// Hex SHA-256 of the script now serving.
    pub sha256: String,
    /// When it was loaded, seconds since the Unix epoch.
    pub loaded_at_unix: u64,
    /// How many of its test cases passed before it was accepted.
    pub cases: usize,
    /// Why the latest reload was refused (the previous script keeps serving); `null` after a
    /// good one.
    pub last_error: Option<String>,
    /// The decision taken when the script fails.
    pub fallback: Decision,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::core::snapshot::Action;

    // Long: one literal of every shape `/status` can take, kept whole so that it reads as the
    // document it stands for.
    /// A report with every shape `/status` can take: degraded with a fallback, a simulated
    /// and an NVIDIA device, a pool with an arena and one without, an unavailable pool.
    pub(crate) fn report() -> StatusReport {
        let pool = |name: &str, kind: DeviceClass| PoolStatus {
            name: name.into(),
            provider: if kind == DeviceClass::Simulated {
                ProviderKind::Simulated
            } else {
                ProviderKind::Cpu
            },
            device: if kind == DeviceClass::Simulated { "sim0" } else { "host" }.into(),
            device_kind: kind,
            simulated: kind == DeviceClass::Simulated,
            state: PoolAvailability::Ready,
            reason: None,
            models: vec!["encoder".into()],
            workers: 2,
            queue_depth: 1,
            queue_capacity: 64,
            queue_oldest_age_ms: 12,
            inflight: 2,
            estimated_delay_ms: 40,
            breaker: BreakerState::Closed,
            breaker_reason: None,
            max_context: None,
            fallback: None,
            alloc_failures_recent: 0,
            arena: None,
            isolation: "thread".into(),
            worker_pid: None,
            cpus: Some("0-3".into()),
        };
        let gpu = PoolStatus {
            breaker: BreakerState::Open,
            breaker_reason: Some("a driver-class failure".into()),
            fallback: Some("cpu".into()),
            alloc_failures_recent: 1,
            arena: Some(ArenaStatus {
                reserved_bytes: 1 << 20,
                active_bytes: 1 << 19,
                peak_active_bytes: 1 << 21,
                limit_bytes: Some(96 << 20),
                extensions: 1,
                shrinkages: 0,
            }),
            ..pool("gpu", DeviceClass::Simulated)
        };
        let down = PoolStatus {
            state: PoolAvailability::Unavailable,
            reason: Some("no CUDA".into()),
            max_context: Some(2048),
            ..pool("cuda", DeviceClass::Nvml)
        };
        let memory = |kind| DeviceState {
            kind,
            total_bytes: 96 << 20,
            used_bytes: 10 << 20,
            free_bytes: 86 << 20,
            reserved_bytes: 1 << 20,
            active_bytes: 1 << 19,
            headroom_bytes: 87 << 20,
        };
        StatusReport {
            host_tier: None,
            version: "0.1.0".into(),
            onnxruntime: "1.31.1".into(),
            config: "drill.yaml".into(),
            started_unix: 1_796_110_640,
            shutting_down: false,
            degraded: DegradedStatus {
                active: true,
                reason: Some("pool `gpu` circuit breaker is open".into()),
                cause: Some("breaker_open".into()),
                since_unix: Some(1_796_110_649),
                fallbacks: vec![FallbackStatus {
                    from: "gpu".into(),
                    pool: "cpu".into(),
                    max_context: None,
                    concurrency: 1,
                    queue_capacity: 64,
                    queue_position: 1,
                    estimated_delay_ms: 0,
                }],
            },
            pools: vec![gpu, pool("cpu", DeviceClass::Host), down],
            devices: BTreeMap::from([
                (
                    "sim0".to_string(),
                    DeviceStatus {
                        memory: memory(DeviceClass::Simulated),
                        simulated: true,
                        pressure_bytes: Some(8 << 20),
                    },
                ),
                (
                    "gpu0".to_string(),
                    DeviceStatus {
                        memory: memory(DeviceClass::Nvml),
                        simulated: false,
                        pressure_bytes: None,
                    },
                ),
            ]),
            host: HostState {
                mem_available_bytes: 8 << 30,
                mem_total_bytes: 16 << 30,
                reserve_bytes: 1 << 30,
            },
            processes: vec![ProcessState {
                pid: 42,
                name: "vramguard".into(),
                service: "vramguard".into(),
                device: "sim0".into(),
                used_bytes: 1 << 20,
            }],
            sample_age_ms: None,
            policy: ServingPolicy {
                path: "builtin:default".into(),
                source: "builtin:default".into(),
                sha256: "8beb".into(),
                loaded_at_unix: 1_796_110_640,
                cases: 29,
                last_error: None,
                fallback: Decision::Admit { pool: None },
            },
            recent_decisions: vec![RecentDecision {
                unix_ms: 1_796_110_649_520,
                request_id: "r1".into(),
                model: "encoder".into(),
                action: Action::Redirect,
                decision: "redirect(\"cpu\")".into(),
                pool: "cpu".into(),
                fallback: false,
                outcome: Some("ok".into()),
                answered_by: Some("cpu".into()),
            }],
            models: vec![ModelStatus {
                name: "encoder".into(),
                service: "encoder".into(),
                priority: 5,
                residency: "resident".into(),
                fallback_model: None,
                pools: vec![ModelOnPool {
                    pool: "gpu".into(),
                    resident: true,
                    loaded_unix: Some(1_796_110_640),
                    idle_ms: Some(1200),
                    running: 1,
                    queued: 0,
                    weights_bytes: 4 << 20,
                    shares_weights_of: None,
                }],
                components: vec![ComponentStatus {
                    name: "model".into(),
                    files: vec!["builtin:encoder".into()],
                    weights_bytes: 4 << 20,
                    resident: vec!["gpu".into()],
                }],
            }],
            evictions: vec![EvictionStatus {
                at_unix: 1_796_110_648,
                pool: "gpu".into(),
                device: "sim0".into(),
                model: "speech".into(),
                freed_bytes: 8 << 20,
                for_model: "encoder".into(),
                for_request: "r0".into(),
            }],
            services: vec![ServiceStatus {
                name: "chat".into(),
                class: ServiceClass::Interactive,
                priority: 5,
                configured: true,
                device_memory_budget_bytes: Some(6 << 30),
                concurrency: None,
                running: 1,
                memory: BTreeMap::from([("sim0".to_string(), 3 << 20)]),
            }],
            speech: vec![SpeechStatus {
                model: "whisper".into(),
                pool: "gpu".into(),
                transcriptions: 2,
                audio_seconds: 150.0,
                real_time_factor: Some(0.02),
            }],
        }
    }

    #[test]
    fn a_built_report_round_trips() {
        let report = report();
        let json = serde_json::to_value(&report).unwrap();
        let back: StatusReport = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back, report);
        assert_eq!(serde_json::to_value(&back).unwrap(), json);
    }

    #[test]
    fn the_json_keeps_the_documented_shapes() {
        let json = serde_json::to_value(report()).unwrap();
        // Simulated-only device keys are absent elsewhere; the figures sit beside them.
        assert_eq!(json["devices"]["sim0"]["simulated"], true);
        assert_eq!(json["devices"]["sim0"]["pressure_bytes"], 8 << 20);
        assert_eq!(json["devices"]["sim0"]["kind"], "simulated");
        assert_eq!(json["devices"]["sim0"]["total_bytes"], 96 << 20);
        let gpu0 = json["devices"]["gpu0"].as_object().unwrap();
        assert!(!gpu0.contains_key("simulated") && !gpu0.contains_key("pressure_bytes"));
        // Absent facts are null, not missing.
        assert!(json["sample_age_ms"].is_null() && json.as_object().unwrap().contains_key("sample_age_ms"));
        let cpu = json["pools"][1].as_object().unwrap();
        for key in ["reason", "breaker_reason", "max_context", "fallback", "arena"] {
            assert!(cpu[key].is_null(), "{key}: {}", cpu[key]);
        }
        assert_eq!(json["pools"][0]["breaker"], "open");
        assert_eq!(json["pools"][0]["provider"], "simulated");
        assert_eq!(json["pools"][2]["state"], "unavailable");
        assert!(json["pools"][0]["arena"]["limit_bytes"].is_u64());
        assert_eq!(json["policy"]["fallback"], serde_json::json!({"action": "admit"}));
        assert!(json["policy"]["last_error"].is_null());
        assert_eq!(json["recent_decisions"][0]["action"], "redirect");
        assert_eq!(
            json["services"][0],
            serde_json::json!({"name": "chat", "class": "interactive", "priority": 5, "configured": true,
                "device_memory_budget_bytes": 6u64 << 30, "concurrency": null, "running": 1,
                "memory": {"sim0": 3 << 20}})
        );
        // A model's components, and whose weights it shares on each pool (null: its own).
        assert_eq!(
            json["models"][0]["components"],
            serde_json::json!([{"name": "model", "files": ["builtin:encoder"], "weights_bytes": 4 << 20,
                "resident": ["gpu"]}])
        );
        let on_gpu = json["models"][0]["pools"][0].as_object().unwrap();
        assert!(on_gpu["shares_weights_of"].is_null());
        // Not degraded: the same keys, null.
        let calm = serde_json::to_value(DegradedStatus::default()).unwrap();
        assert_eq!(
            calm,
            serde_json::json!({"active": false, "reason": null, "cause": null, "since_unix": null, "fallbacks": []})
        );
    }
}

/// `/status`'s `host_tier`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostTierStatus {
    /// What it holds.
    pub bytes: u64,
    /// `host.model_cache`.
    pub budget_bytes: u64,
    /// The models whose optimized bytes it holds.
    pub models: Vec<String>,
}
