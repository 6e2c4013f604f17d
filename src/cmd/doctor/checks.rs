//! The checks of the installation itself: the config, ONNX Runtime and its CUDA provider, the
//! policy, host memory. Each is a plain function of what was probed.

use serde_json::{Value, json};

use super::{Check, Status};
use crate::config::{Config, ConfigError, DeviceKind, Provider};
use crate::core::human::human_bytes;
use crate::core::snapshot::DeviceClass;
use crate::device::host::HostSource;
use crate::device::{HostMemory, MemorySource, Reading};
use crate::runtime::onnx::{OnnxRuntime, PINNED_VERSION, RuntimeError};

/// `config`: the file validates (schema, values, cross-references, model files exist).
pub fn check_config(label: &str, config: &Result<Config, ConfigError>) -> Check {
    match config {
        Ok(c) => {
            let mut check = Check::new(
                "config",
                Status::Ok,
                format!(
                    "{label}: valid ({}, {}, {})",
                    counted(c.models.len(), "model"),
                    counted(c.pools.len(), "pool"),
                    counted(c.devices.len(), "device")
                ),
            );
            for pool in &c.pools {
                let device = match c.device_class(&pool.device) {
                    DeviceClass::Simulated => format!("{} (SIMULATED)", pool.device),
                    _ => pool.device.clone(),
                };
                check = check.detail(format!(
                    "pool {}: {} on {device}, models {}",
                    pool.name,
                    pool.provider.label(),
                    pool.models.join(", ")
                ));
            }
            let pools: Vec<Value> = c
                .pools
                .iter()
                .map(|p| json!({"name": p.name, "provider": p.provider.label(), "device": p.device, "models": p.models}))
                .collect();
            check
                .detail("models are not loaded here: `vramguard config check FILE` loads them")
                .data(json!({"source": c.source, "valid": true, "models": c.models.len(), "pools": pools,
                             "listen": c.server.listen.to_string()}))
        }
        Err(error) => Check::new("config", Status::Fail, error.to_string())
            .fix("correct that key: config/example.yaml documents every key, and `vramguard config default` prints a valid config")
            .data(json!({"source": label, "valid": false, "error": error.to_string()})),
    }
}

/// `3 pools`, `1 pool`.
fn counted(n: usize, noun: &str) -> String {
    format!("{n} {noun}{}", if n == 1 { "" } else { "s" })
}

/// `onnxruntime`: the library, where it was found, its version.
pub fn check_onnxruntime(runtime: &Result<&OnnxRuntime, RuntimeError>, config_valid: bool) -> Check {
    let fix = format!(
        "run `make deps` in the source tree (installs onnxruntime=={PINNED_VERSION} into .deps/), or set ORT_DYLIB_PATH (or `onnxruntime.library` in the config) to the libonnxruntime.so of that release"
    );
    let check = match runtime {
        Ok(rt) => {
            // The absolute path: a bug report is read elsewhere, where `./.deps` means nothing.
            let library = std::fs::canonicalize(&rt.library).unwrap_or_else(|_| rt.library.clone());
            let check = Check::new(
                "onnxruntime",
                Status::Ok,
                format!("{} from {} ({})", rt.version, library.display(), rt.library_origin),
            );
            let check = if rt.version == PINNED_VERSION {
                check
            } else {
                check.detail(format!("vramguard is built and tested against {PINNED_VERSION}"))
            };
            check.data(
                json!({"library": library, "origin": rt.library_origin, "version": rt.version,
                              "tested_version": PINNED_VERSION}),
            )
        }
        Err(RuntimeError::NotFound { tried }) => Check::new("onnxruntime", Status::Fail, "library not found")
            .detail(format!("looked at {tried}"))
            .fix(fix)
            .data(json!({"error": "not found", "tried": tried})),
        Err(error) => Check::new("onnxruntime", Status::Fail, error.to_string())
            .fix(fix)
            .data(json!({"error": error.to_string()})),
    };
    if config_valid {
        check
    } else {
        check.detail("`onnxruntime.library` was not read: the config is invalid")
    }
}

/// What was learnt about the CUDA execution provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaFacts {
    /// Whether the loaded ONNX Runtime has it compiled in; `None` when none loaded.
    pub compiled_in: Option<Result<bool, String>>,
    /// NVIDIA devices NVML reports.
    pub nvidia_devices: u32,
    /// Pools of the config that use it.
    pub cuda_pools: Vec<String>,
    /// The device index a session was tried on, and how that went.
    pub probe: Option<(u32, Result<(), String>)>,
}

/// What the loaded ONNX Runtime says of CUDA, and whether a session opens on the device the
/// first CUDA pool uses.
pub(super) fn probe_cuda(runtime: Option<&OnnxRuntime>, config: Option<&Config>, nvidia_devices: u32) -> CudaFacts {
    let cuda_pools: Vec<&crate::config::PoolConfig> = config
        .map(|c| {
            c.pools
                .iter()
                .filter(|p| matches!(p.provider, Provider::Cuda(_)))
                .collect()
        })
        .unwrap_or_default();
    let compiled_in = runtime.map(crate::runtime::onnx::cuda_compiled_in);
    let probe = match (runtime, &compiled_in) {
        (Some(rt), Some(Ok(true))) if nvidia_devices > 0 => {
            // The device the first CUDA pool uses, as `serve` would open it.
            let index = cuda_pools
                .first()
                .and_then(|pool| {
                    config?.devices.iter().find_map(|d| match d.kind {
                        DeviceKind::Nvidia { index } if d.name == pool.device => Some(index),
                        _ => None,
                    })
                })
                .unwrap_or(0);
            Some((index, crate::runtime::onnx::probe_cuda(rt, index)))
        }
        _ => None,
    };
    CudaFacts {
        compiled_in,
        nvidia_devices,
        cuda_pools: cuda_pools.iter().map(|p| p.name.clone()).collect(),
        probe,
    }
}

/// `cuda`: a CPU-only build is fine unless a pool needs CUDA; a GPU build must load.
pub fn check_cuda(facts: &CudaFacts) -> Check {
    let data = json!({
        "compiled_in": facts.compiled_in.as_ref().and_then(|r| r.as_ref().ok()),
        "nvidia_devices": facts.nvidia_devices,
        "cuda_pools": facts.cuda_pools,
        "probe": facts.probe.as_ref().map(|(index, r)| json!({"device_index": index, "error": r.as_ref().err()})),
    });
    let needed = !facts.cuda_pools.is_empty();
    let names = facts
        .cuda_pools
        .iter()
        .map(|p| format!("`{p}`"))
        .collect::<Vec<_>>()
        .join(", ");
    // "pool `gpu` needs", "pools `a`, `b` need"
    let (pools, need) = if facts.cuda_pools.len() == 1 {
        (format!("pool {names}"), "needs")
    } else {
        (format!("pools {names}"), "need")
    };
    let gpu_wheel = format!(
        "install the onnxruntime-gpu=={PINNED_VERSION} wheel (its capi/ folder has libonnxruntime_providers_cuda.so) and point ORT_DYLIB_PATH at its libonnxruntime.so"
    );
    let check = match (&facts.compiled_in, &facts.probe) {
        (None, _) => Check::new("cuda", Status::Warn, "not checked: ONNX Runtime did not load")
            .fix("fix the `onnxruntime` check first"),
        (Some(Err(e)), _) => Check::new(
            "cuda",
            Status::Warn,
            format!("ONNX Runtime cannot list its providers: {e}"),
        ),
        (Some(Ok(false)), _) if needed => Check::new(
            "cuda",
            Status::Fail,
            format!("this ONNX Runtime is a CPU-only build, but {pools} {need} the CUDA execution provider"),
        )
        .fix(gpu_wheel),
        (Some(Ok(false)), _) if facts.nvidia_devices > 0 => Check::new(
            "cuda",
            Status::Info,
            "this ONNX Runtime is a CPU-only build (no CUDA execution provider); no pool needs one, though an NVIDIA GPU is present",
        )
        .detail(format!("to use the GPU: {gpu_wheel}, and give a pool `provider: cuda`")),
        (Some(Ok(false)), _) => Check::new(
            "cuda",
            Status::Info,
            "this ONNX Runtime is a CPU-only build (no CUDA execution provider); no pool needs one",
        ),
        (Some(Ok(true)), None) if needed => Check::new(
            "cuda",
            Status::Fail,
            format!("the CUDA execution provider is built in, but there is no NVIDIA device for {pools}"),
        )
        .fix("see the `nvml` check"),
        (Some(Ok(true)), None) => Check::new(
            "cuda",
            Status::Info,
            "the CUDA execution provider is built in; no NVIDIA device to load it on, and no pool needs it",
        ),
        (Some(Ok(true)), Some((index, Ok(())))) => Check::new(
            "cuda",
            Status::Ok,
            format!("the CUDA execution provider loads: a session opened on NVIDIA device {index}"),
        ),
        (Some(Ok(true)), Some((index, Err(e)))) => Check::new(
            "cuda",
            if needed { Status::Fail } else { Status::Warn },
            format!("the CUDA execution provider is built in but does not load on NVIDIA device {index}"),
        )
        .detail(e.clone())
        .fix("the provider needs the CUDA and cuDNN libraries of its release on the loader path (LD_LIBRARY_PATH); the message above names the one missing"),
    };
    check.data(data)
}

/// `policy`: what `serve` requires of the configured policy before it binds a port (it
/// compiles, passes its own test cases, and decides without error for every model and pool of
/// the config), with the config's state estimated instead of measured.
pub fn check_policy(config: Option<&Config>) -> Check {
    let Some(config) = config else {
        return Check::new("policy", Status::Warn, "not checked: the config is invalid")
            .fix("fix the `config` check first");
    };
    let source = config.policy.source.clone();
    let origin = source.to_string();
    let handle = match crate::policy::PolicyHandle::load(source, crate::policy::settings_for(config)) {
        Ok(handle) => handle,
        Err(error) => {
            return Check::new("policy", Status::Fail, error.to_string())
                .fix(policy_fix(config))
                .data(json!({"origin": origin, "error": error.to_string()}));
        }
    };
    let cases = handle.current().cases;
    let requests = crate::policy::smoke_requests(config, |_| true, crate::policy::configured_estimate);
    let snapshot = crate::policy::configured_snapshot(config);
    let data = json!({"origin": origin, "sha256": handle.status().sha256, "cases": cases, "requests": requests.len()});
    match crate::policy::smoke_test(&handle.current().script, &requests, &snapshot) {
        Err(error) => Check::new(
            "policy",
            Status::Fail,
            format!("{origin} fails with this config: {error}"),
        )
        .fix(policy_fix(config))
        .data(data),
        Ok(()) if cases == 0 => Check::new(
            "policy",
            Status::Warn,
            format!("{origin}: compiles and decides for {} requests, but has no test cases", requests.len()),
        )
        .fix("add cases in tests/ beside the script (see policies/tests/); `serve` loads it untested")
        .data(data),
        Ok(()) => Check::new(
            "policy",
            Status::Ok,
            format!(
                "{origin}: compiles, passes its {cases} test cases, decides for all {} model/pool requests of this config",
                requests.len()
            ),
        )
        .data(data),
    }
}

/// How to fix a policy that `serve` would refuse, by where it comes from.
fn policy_fix(config: &Config) -> String {
    match &config.policy.source {
        crate::config::PolicySource::File(script) => format!(
            "correct what the message names: the script, one of its test cases (tests/ beside it) or a `policy.params` value; `vramguard policy check --config {} {}` repeats the check",
            config.source,
            script.display()
        ),
        crate::config::PolicySource::Builtin(_) => {
            "correct the `policy.params` value the message names (what each param means is at the top of policies/<name>.rhai)".to_string()
        }
    }
}

/// Host memory now.
pub(super) fn probe_host() -> Result<HostMemory, String> {
    let mut reading = Reading::default();
    HostSource.sample(&mut reading)?;
    reading
        .host
        .ok_or_else(|| "the host source gave no reading".to_string())
}

/// `host_memory`: the CPU path plans only into memory above `host.reserve`; with less
/// available than the reserve it takes nothing.
pub fn check_host(host: &Result<HostMemory, String>, reserve: Option<u64>) -> Check {
    let host = match host {
        Ok(host) => host,
        Err(e) => {
            return Check::new("host_memory", Status::Fail, format!("cannot read host memory: {e}"))
                .fix("vramguard needs /proc/meminfo (with systemd: do not set ProcSubset=pid)");
        }
    };
    let data = json!({"total_bytes": host.total_bytes, "available_bytes": host.available_bytes,
                      "reserve_bytes": reserve});
    let available = format!(
        "{} of {} available",
        human_bytes(host.available_bytes),
        human_bytes(host.total_bytes)
    );
    let Some(reserve) = reserve else {
        return Check::new(
            "host_memory",
            Status::Warn,
            format!("{available}; host.reserve unknown: the config is invalid"),
        )
        .data(data);
    };
    if host.available_bytes < reserve {
        Check::new(
            "host_memory",
            Status::Fail,
            format!(
                "{available}, below host.reserve of {}: the CPU path takes no work",
                human_bytes(reserve)
            ),
        )
        .fix(if reserve >= host.total_bytes {
            "host.reserve is at least all of the host's memory: lower it"
        } else {
            "free host memory (what else runs here?) or lower host.reserve"
        })
        .data(data)
    } else {
        Check::new(
            "host_memory",
            Status::Ok,
            format!(
                "{available}; host.reserve of {} leaves {} for CPU work",
                human_bytes(reserve),
                human_bytes(host.available_bytes - reserve)
            ),
        )
        .data(data)
    }
}
