//! `vramguard doctor`: what a user runs when something looks wrong, and the first thing a bug
//! report should include. It probes the installation the way `serve` would use it and reports
//! one line per check (`ok`, `info`, `warn` or `fail`), with a fix for each problem:
//!
//! - `config`: the config file (or the embedded default) validates;
//! - `onnxruntime`: which library is found, from where, and its version;
//! - `cuda`: whether this ONNX Runtime build has the CUDA provider, and whether it loads;
//! - `nvml`: the NVIDIA driver, its devices and the processes on them; simulated devices are
//!   reported as SIMULATED;
//! - `attribution`: per-process memory adds up to no more than each device's used memory, and
//!   how much is left unattributed;
//! - `policy`: the configured policy compiles, passes its own test cases and decides for every
//!   model and pool of the config, as `serve` requires before it starts;
//! - `server`: a vramguard running at the config's address (or `--url`) is ready, and its admin
//!   endpoints accept this client;
//! - `host_memory`: available host memory against `host.reserve`.
//!
//! Probing (files, NVML, ONNX Runtime, sockets) happens in [`diagnose`]; every check is a plain
//! function of what was probed, so the verdicts are unit-tested without a GPU or a server. The
//! only thing doctor changes is a CUDA session it opens and drops when the CUDA provider can be
//! tried; it never loads the config's models (`vramguard config check` does).

pub mod http;

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use serde::Serialize;
use serde_json::{Value, json};

use crate::cmd::exit::EXIT_FAILED;
use crate::config::{Config, ConfigError, DeviceKind, Provider, ServiceRule};
use crate::core::snapshot::{DeviceClass, ProcessState};
use crate::device::host::HostSource;
use crate::device::nvml::{Inventory, NvmlSource};
use crate::device::{HostMemory, MemorySource, Reading};
use crate::runtime::onnx::{OnnxRuntime, PINNED_VERSION, RuntimeError};
use crate::telemetry::logging::human_bytes;

const GIB: u64 = 1 << 30;

/// How a check came out, from best to worst.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Checked and fine.
    Ok,
    /// Not applicable here, or nothing to check (e.g. no NVIDIA device on a machine whose
    /// config uses none); not a problem.
    Info,
    /// Something to look at, or something that could not be checked; not a failure.
    Warn,
    /// Broken: `serve` would refuse to start, or would not work as configured.
    Fail,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Info => "info",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

/// One check's outcome: a line for people, facts (`data`) for bug reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    /// Stable name: `config`, `onnxruntime`, `cuda`, `nvml`, `attribution`, `policy`,
    /// `server`, `host_memory`.
    pub name: &'static str,
    /// The verdict.
    pub status: Status,
    /// One line saying what was found.
    pub summary: String,
    /// Further lines (devices, processes, paths).
    pub details: Vec<String>,
    /// What to do about a `warn` or `fail`.
    pub fix: Option<String>,
    /// The facts behind the verdict, machine-readable.
    pub data: Value,
}

impl Check {
    fn new(name: &'static str, status: Status, summary: impl Into<String>) -> Check {
        Check {
            name,
            status,
            summary: summary.into(),
            details: Vec::new(),
            fix: None,
            data: Value::Null,
        }
    }

    fn detail(mut self, line: impl Into<String>) -> Check {
        self.details.push(line.into());
        self
    }

    fn fix(mut self, fix: impl Into<String>) -> Check {
        self.fix = Some(fix.into());
        self
    }

    fn data(mut self, data: Value) -> Check {
        self.data = data;
        self
    }
}

/// Every check, with what was run where.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// vramguard's version.
    pub vramguard: &'static str,
    /// The machine: OS, architecture, kernel release.
    pub platform: Value,
    /// The config file checked, or `<embedded default>`.
    pub config: String,
    /// The checks, in the order they are printed.
    pub checks: Vec<Check>,
    /// How many checks came out each way.
    pub counts: Counts,
}

/// Checks per status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// `ok`
    pub ok: usize,
    /// `info`
    pub info: usize,
    /// `warn`
    pub warn: usize,
    /// `fail`
    pub fail: usize,
}

impl Report {
    fn new(config: String, checks: Vec<Check>) -> Report {
        let mut counts = Counts::default();
        for check in &checks {
            match check.status {
                Status::Ok => counts.ok += 1,
                Status::Info => counts.info += 1,
                Status::Warn => counts.warn += 1,
                Status::Fail => counts.fail += 1,
            }
        }
        Report {
            vramguard: env!("CARGO_PKG_VERSION"),
            platform: platform(),
            config,
            checks,
            counts,
        }
    }

    /// True when no check failed.
    pub fn passed(&self) -> bool {
        self.counts.fail == 0
    }

    /// The report for people: a header, one line per check with indented details and fix, and
    /// a count.
    pub fn to_text(&self) -> String {
        let mut text = format!(
            "vramguard doctor {} ({} {}, kernel {}), config {}\n",
            self.vramguard,
            self.platform["os"].as_str().unwrap_or("?"),
            self.platform["arch"].as_str().unwrap_or("?"),
            self.platform["kernel"].as_str().unwrap_or("?"),
            self.config
        );
        let indent = " ".repeat(19);
        for check in &self.checks {
            text += &format!("{:<4}  {:<11}  {}\n", check.status.label(), check.name, check.summary);
            for line in &check.details {
                text += &format!("{indent}{line}\n");
            }
            if let Some(fix) = &check.fix {
                text += &format!("{indent}fix: {fix}\n");
            }
        }
        let c = self.counts;
        text += &format!("{} ok, {} info, {} warn, {} failed\n", c.ok, c.info, c.warn, c.fail);
        text
    }
}

fn platform() -> Value {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "unknown".into(), |s| s.trim().to_string());
    json!({"os": std::env::consts::OS, "arch": std::env::consts::ARCH, "kernel": kernel})
}

/// What `vramguard doctor` was asked.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Config file; the embedded default without it.
    pub config: Option<PathBuf>,
    /// The running server to ask; the config's `server.listen` without it.
    pub url: Option<String>,
    /// Print JSON instead of text.
    pub json: bool,
}

/// `vramguard doctor`: print the report (text, or JSON with `--json`) on stdout; exit 0 when no
/// check failed, [`EXIT_FAILED`] otherwise.
pub fn run(options: &Options) -> ExitCode {
    let report = diagnose(options);
    let text = if options.json {
        serde_json::to_string_pretty(&report).expect("a report is plain data with string keys") + "\n"
    } else {
        report.to_text()
    };
    let _ = std::io::stdout().write_all(text.as_bytes());
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_FAILED)
    }
}

/// Probe everything, then judge it.
pub fn diagnose(options: &Options) -> Report {
    let (label, config) = match &options.config {
        Some(path) => (path.display().to_string(), Config::load(path)),
        None => (
            "<embedded default>".to_string(),
            Ok(Config::embedded(crate::device::nvidia_gpu_present())),
        ),
    };
    let valid = config.as_ref().ok();

    let runtime = crate::runtime::onnx::runtime(valid.and_then(|c| c.onnxruntime_library.as_deref()));
    let nvml = probe_nvml(valid);
    let nvidia_count = nvml.as_ref().map_or(0, |(inventory, _)| inventory.devices.len() as u32);
    let cuda = probe_cuda(runtime.as_ref().ok().copied(), valid, nvidia_count);
    let server = probe_server(options.url.as_deref(), valid);
    let host = probe_host();

    let rules = valid.map_or(&[][..], |c| &c.exporter.services[..]);
    let mut devices = nvml
        .as_ref()
        .map_or_else(|_| Vec::new(), |(_, reading)| nvml_usage(reading, rules));
    devices.extend(server_usage(&server, &devices));

    let checks = vec![
        check_config(&label, &config),
        check_onnxruntime(&runtime, valid.is_some()),
        check_cuda(&cuda),
        check_nvml(&nvml, valid, rules),
        check_attribution(&devices),
        check_policy(valid),
        check_server(&server),
        check_host(&host, valid.map(|c| c.host_reserve)),
    ];
    Report::new(label, checks)
}

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

fn probe_cuda(runtime: Option<&OnnxRuntime>, config: Option<&Config>, nvidia_devices: u32) -> CudaFacts {
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

fn probe_nvml(config: Option<&Config>) -> Result<(Inventory, Reading), String> {
    let names = config.map(crate::device::nvidia_names).unwrap_or_default();
    let mut source = NvmlSource::open(names)?;
    let inventory = source.inventory()?;
    let mut reading = Reading::default();
    source.sample(&mut reading)?;
    Ok((inventory, reading))
}

/// `nvml`: the driver, its devices and the processes on them; simulated devices as such.
pub fn check_nvml(
    nvml: &Result<(Inventory, Reading), String>,
    config: Option<&Config>,
    rules: &[ServiceRule],
) -> Check {
    let configured_nvidia: Vec<(String, u32)> = config
        .map(|c| {
            c.devices
                .iter()
                .filter_map(|d| match d.kind {
                    DeviceKind::Nvidia { index } => Some((d.name.clone(), index)),
                    DeviceKind::Simulated { .. } => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let simulated: Vec<(String, u64)> = config
        .map(|c| {
            c.devices
                .iter()
                .filter_map(|d| match d.kind {
                    DeviceKind::Simulated { capacity } => Some((d.name.clone(), capacity)),
                    DeviceKind::Nvidia { .. } => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let simulated_lines: Vec<String> = simulated
        .iter()
        .map(|(name, capacity)| {
            format!(
                "{name}: SIMULATED accelerator of {} (from the config; no driver involved)",
                human_bytes(*capacity)
            )
        })
        .collect();
    let simulated_data: Vec<Value> = simulated
        .iter()
        .map(|(name, capacity)| json!({"name": name, "capacity_bytes": capacity}))
        .collect();
    let mut check = match nvml {
        Err(reason) if configured_nvidia.is_empty() => {
            Check::new("nvml", Status::Info, format!("no NVIDIA device: {reason}")).data(json!({
                "available": false, "reason": reason, "simulated": simulated_data}))
        }
        Err(reason) => Check::new(
            "nvml",
            Status::Fail,
            format!(
                "the config names NVIDIA devices ({}), none usable: {reason}",
                configured_nvidia.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ")
            ),
        )
        .fix("install the NVIDIA driver (libnvidia-ml.so.1 comes with it); in a container, start it with the NVIDIA Container Toolkit (`--gpus all`)")
        .data(json!({"available": false, "reason": reason, "simulated": simulated_data})),
        Ok((inventory, reading)) => {
            let count = inventory.devices.len() as u32;
            let missing: Vec<String> = configured_nvidia
                .iter()
                .filter(|(_, index)| *index >= count)
                .map(|(name, index)| format!("`{name}` (index {index})"))
                .collect();
            let mut check = if !missing.is_empty() {
                Check::new(
                    "nvml",
                    Status::Fail,
                    format!(
                        "the config names {} but NVML sees {count} device(s)",
                        missing.join(", ")
                    ),
                )
                .fix("correct `devices[].index` (indices count from 0, in `nvidia-smi -L` order)")
            } else if count == 0 {
                Check::new(
                    "nvml",
                    Status::Warn,
                    format!("driver {} answers but reports no device", inventory.driver_version),
                )
                .fix("check `nvidia-smi`; in a container, pass the devices in (`--gpus all`)")
            } else {
                Check::new(
                    "nvml",
                    Status::Ok,
                    format!("driver {}, {count} device(s)", inventory.driver_version),
                )
            };
            let usage = nvml_usage(reading, rules);
            for device in &inventory.devices {
                let Some(on_it) = usage.iter().find(|u| u.name == device.name) else {
                    continue;
                };
                check = check.detail(format!(
                    "{} (index {}, {}): {} of {} used, {} process(es)",
                    device.name,
                    device.index,
                    device.product,
                    human_bytes(on_it.used_bytes),
                    human_bytes(on_it.total_bytes),
                    on_it.processes.len()
                ));
                for p in &on_it.processes {
                    let name = if p.name.is_empty() {
                        "(not visible from here: another PID namespace?)"
                    } else {
                        p.name.as_str()
                    };
                    check = check.detail(format!(
                        "  pid {} {name}: {} (service {})",
                        p.pid,
                        human_bytes(p.used_bytes),
                        p.service
                    ));
                }
            }
            let processes: Vec<&ProcessState> = usage.iter().flat_map(|u| &u.processes).collect();
            let devices: Vec<Value> = inventory
                .devices
                .iter()
                .map(|d| {
                    let memory = reading.devices.get(&d.name);
                    json!({"name": d.name, "index": d.index, "product": d.product,
                           "total_bytes": memory.map(|m| m.total_bytes), "used_bytes": memory.map(|m| m.used_bytes)})
                })
                .collect();
            check.data(json!({"available": true, "driver_version": inventory.driver_version,
                              "devices": devices, "processes": processes, "simulated": simulated_data}))
        }
    };
    for line in simulated_lines {
        check = check.detail(line);
    }
    check
}

/// One device's memory and the processes holding it, from NVML or a running server.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceUsage {
    /// Device name.
    pub name: String,
    /// NVIDIA or simulated.
    pub kind: DeviceClass,
    /// Where the figures come from: `NVML` or `the running server`.
    pub source: &'static str,
    /// Capacity.
    pub total_bytes: u64,
    /// Used, as the device (or the simulated arena) reports it.
    pub used_bytes: u64,
    /// Processes on it, attributed to services.
    pub processes: Vec<ProcessState>,
}

fn nvml_usage(reading: &Reading, rules: &[ServiceRule]) -> Vec<DeviceUsage> {
    reading
        .devices
        .iter()
        .map(|(name, memory)| DeviceUsage {
            name: name.clone(),
            kind: memory.kind,
            source: "NVML",
            total_bytes: memory.total_bytes,
            used_bytes: memory.used_bytes,
            processes: reading
                .processes
                .iter()
                .filter(|p| &p.device == name)
                .map(|p| ProcessState {
                    pid: p.pid,
                    name: p.name.clone(),
                    service: crate::telemetry::exporter::attribute(rules, p),
                    device: p.device.clone(),
                    used_bytes: p.used_bytes,
                })
                .collect(),
        })
        .collect()
}

/// Devices the running server reports (its `/status`) that this process does not see itself:
/// simulated devices live only in the server.
fn server_usage(server: &ServerProbe, seen: &[DeviceUsage]) -> Vec<DeviceUsage> {
    let Some(status) = server.status() else {
        return Vec::new();
    };
    let processes: Vec<ProcessState> = serde_json::from_value(status["processes"].clone()).unwrap_or_default();
    let Some(devices) = status["devices"].as_object() else {
        return Vec::new();
    };
    devices
        .iter()
        .filter(|(name, _)| !seen.iter().any(|d| &d.name == *name))
        .map(|(name, d)| DeviceUsage {
            name: name.clone(),
            kind: serde_json::from_value(d["kind"].clone()).unwrap_or_default(),
            source: "the running server",
            total_bytes: d["total_bytes"].as_u64().unwrap_or(0),
            used_bytes: d["used_bytes"].as_u64().unwrap_or(0),
            processes: processes.iter().filter(|p| &p.device == name).cloned().collect(),
        })
        .collect()
}

/// `attribution`: on each device, what processes hold adds up to at most what is used; the
/// rest is unattributed (driver and context overhead, or processes NVML cannot name).
pub fn check_attribution(devices: &[DeviceUsage]) -> Check {
    if devices.is_empty() {
        return Check::new(
            "attribution",
            Status::Info,
            "nothing to attribute: no NVIDIA device here, and no running server reports a simulated one",
        )
        .data(json!({"devices": []}));
    }
    let mut status = Status::Ok;
    let mut fix = None;
    let mut lines = Vec::new();
    let mut data = Vec::new();
    for device in devices {
        let attributed: u64 = device.processes.iter().map(|p| p.used_bytes).sum();
        let mut by_service: std::collections::BTreeMap<&str, u64> = std::collections::BTreeMap::new();
        for p in &device.processes {
            *by_service.entry(p.service.as_str()).or_default() += p.used_bytes;
        }
        let services = by_service
            .iter()
            .map(|(s, b)| format!("{s} {}", human_bytes(*b)))
            .collect::<Vec<_>>()
            .join(", ");
        let kind = if device.kind == DeviceClass::Simulated {
            "SIMULATED"
        } else {
            "NVIDIA"
        };
        let unattributed = device.used_bytes.saturating_sub(attributed);
        if attributed > device.used_bytes {
            status = Status::Fail;
            fix = Some("report this output: the per-process figures exceed the device total, so they cannot be trusted (MIG or vGPU partitions are one known cause)".to_string());
            lines.push(format!(
                "{} ({kind}, from {}): processes hold {}, more than the {} the device has in use",
                device.name,
                device.source,
                human_bytes(attributed),
                human_bytes(device.used_bytes)
            ));
        } else {
            lines.push(format!(
                "{} ({kind}, from {}): {} used = {} held by {} process(es){} + {} unattributed",
                device.name,
                device.source,
                human_bytes(device.used_bytes),
                human_bytes(attributed),
                device.processes.len(),
                if services.is_empty() {
                    String::new()
                } else {
                    format!(" ({services})")
                },
                human_bytes(unattributed)
            ));
            if device.processes.is_empty() && device.used_bytes > GIB && status < Status::Warn {
                status = Status::Warn;
                fix = Some("NVML names no process although memory is in use: in a container, share the host's PID namespace (`--pid=host`) so vramguard can see who holds it".to_string());
            }
        }
        data.push(
            json!({"device": device.name, "kind": device.kind, "source": device.source,
                         "total_bytes": device.total_bytes, "used_bytes": device.used_bytes,
                         "attributed_bytes": attributed, "unattributed_bytes": unattributed,
                         "processes": device.processes, "by_service": by_service}),
        );
    }
    let summary = match status {
        Status::Fail => "per-process memory exceeds the device total".to_string(),
        Status::Warn => "memory in use that no process accounts for".to_string(),
        _ => format!(
            "per-process memory is within each device's total on {} device(s)",
            devices.len()
        ),
    };
    let mut check = Check::new("attribution", status, summary).data(json!({"devices": data}));
    check.details = lines;
    check.fix = fix;
    check
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
    let origin = crate::policy::origin(&source);
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

/// Whether doctor has the admin token the config names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Token {
    /// The config names no `server.admin_token_env`: admin is on the socket only.
    NotConfigured,
    /// The config names this variable, but it is unset or empty here.
    Unset(String),
    /// The variable is set; its value is sent as the bearer token.
    Set(String, String),
}

/// What asking the running server gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerProbe {
    /// No address to ask (a bad `--url`, or `server.listen` with port 0).
    NoAddress(String),
    /// The address did not answer.
    Unreachable {
        /// The base URL.
        url: String,
        /// Why.
        failure: http::Failure,
    },
    /// A server answered.
    Answered {
        /// The base URL.
        url: String,
        /// `GET /v2/health/ready`.
        ready: http::Response,
        /// `GET /admin` with the token, if any.
        admin: Result<http::Response, http::Failure>,
        /// `GET /status`.
        status: Result<http::Response, http::Failure>,
        /// The token situation.
        token: Token,
    },
}

impl ServerProbe {
    /// The server's `/status` document, when it gave one.
    fn status(&self) -> Option<Value> {
        match self {
            ServerProbe::Answered { status: Ok(r), .. } if r.status == 200 => serde_json::from_str(&r.body).ok(),
            _ => None,
        }
    }
}

/// The address a local client reaches `listen` at: unspecified addresses (`0.0.0.0`, `::`)
/// through loopback.
fn client_url(listen: SocketAddr) -> Result<String, String> {
    if listen.port() == 0 {
        return Err(format!(
            "server.listen is {listen}: the port is chosen at start, so pass --url"
        ));
    }
    let ip = match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    Ok(format!("http://{}", SocketAddr::new(ip, listen.port())))
}

fn probe_server(url: Option<&str>, config: Option<&Config>) -> ServerProbe {
    // An invalid config has no address of its own: the embedded default's is the best guess.
    let listen = config.map_or_else(|| Config::embedded(false).server.listen, |c| c.server.listen);
    let url = match url.map_or_else(|| client_url(listen), |u| Ok(u.to_string())) {
        Ok(url) => url,
        Err(reason) => return ServerProbe::NoAddress(reason),
    };
    let target = match http::Target::parse(&url) {
        Ok(target) => target,
        Err(reason) => return ServerProbe::NoAddress(reason),
    };
    let url = target.url("");
    let token = match config.and_then(|c| c.server.admin_token_env.clone()) {
        None => Token::NotConfigured,
        Some(var) => match std::env::var(&var) {
            Ok(value) if !value.trim().is_empty() => Token::Set(var, value),
            _ => Token::Unset(var),
        },
    };
    let ready = match http::get(&target, "/v2/health/ready", None) {
        Ok(ready) => ready,
        Err(failure) => return ServerProbe::Unreachable { url, failure },
    };
    let bearer = match &token {
        Token::Set(_, value) => Some(value.as_str()),
        _ => None,
    };
    // The admin socket when this host has it (the default way in), else TCP with the token.
    let socket = config.and_then(|c| c.server.admin_socket.path().map(std::path::Path::to_path_buf));
    let admin = match socket.filter(|s| s.exists()) {
        Some(socket) => http::get_unix(&socket, "/admin"),
        None => http::get(&target, "/admin", bearer),
    };
    ServerProbe::Answered {
        url,
        ready,
        admin,
        status: http::get(&target, "/status", None),
        token,
    }
}

fn error_of(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_string))
        .unwrap_or_else(|| body.trim().chars().take(200).collect())
}

/// `server`: a running vramguard is ready and its admin endpoints accept this client. Nothing
/// running is a warning, not a failure: doctor also runs before the first start.
pub fn check_server(probe: &ServerProbe) -> Check {
    let (url, ready, admin, status, token) = match probe {
        ServerProbe::NoAddress(reason) => {
            return Check::new("server", Status::Warn, format!("not checked: {reason}"))
                .fix("pass --url http://HOST:PORT of the running server")
                .data(json!({"running": null, "reason": reason}));
        }
        ServerProbe::Unreachable {
            url,
            failure: http::Failure::NotListening(e),
        } => {
            return Check::new(
                "server",
                Status::Warn,
                format!("nothing answers at {url}: vramguard is not running there"),
            )
            .detail(e.clone())
            .fix("start it (`vramguard serve`, or `systemctl start vramguard`), or pass --url where it runs")
            .data(json!({"url": url, "running": false, "error": e}));
        }
        ServerProbe::Unreachable {
            url,
            failure: http::Failure::Other(e),
        } => {
            return Check::new("server", Status::Fail, format!("{url} does not answer: {e}"))
                .fix("check that vramguard (and not another program) listens there and is not hung; its log says more")
                .data(json!({"url": url, "running": null, "error": e}));
        }
        ServerProbe::Answered {
            url,
            ready,
            admin,
            status,
            token,
        } => (url, ready, admin, status, token),
    };
    let mut worst = Status::Ok;
    let mut lines = Vec::new();
    let mut fixes = Vec::new();

    let is_ready = ready.status == 200;
    if !is_ready {
        worst = worst.max(Status::Fail);
        lines.push(format!("not ready ({}): {}", ready.status, error_of(&ready.body)));
        fixes.push("see /status for each pool's state and reason".to_string());
    }
    let status_doc: Option<Value> = match status {
        Ok(r) if r.status == 200 => serde_json::from_str(&r.body).ok(),
        _ => None,
    };
    if let Some(doc) = &status_doc {
        lines.push(format!(
            "vramguard {} serving {}, ONNX Runtime {}",
            doc["version"].as_str().unwrap_or("?"),
            doc["config"].as_str().unwrap_or("?"),
            doc["onnxruntime"].as_str().unwrap_or("?")
        ));
        if doc["degraded"]["active"] == true {
            worst = worst.max(Status::Warn);
            lines.push(format!(
                "DEGRADED: {}",
                doc["degraded"]["reason"].as_str().unwrap_or("(no reason given)")
            ));
            let down: Vec<String> = doc["pools"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["breaker"] != "closed" || p["state"] != "ready")
                .filter_map(|p| p["name"].as_str())
                .map(|name| format!("`POST /admin/pools/{name}/restore`"))
                .collect();
            let restore = if down.is_empty() {
                "`POST /admin/pools/{pool}/restore`".to_string()
            } else {
                down.join(", ")
            };
            fixes.push(format!("once the cause is gone, {restore} brings it back"));
        }
        if let Some(error) = doc["policy"]["last_error"].as_str() {
            worst = worst.max(Status::Warn);
            lines.push(format!("the last policy reload was refused: {error}"));
            fixes.push("fix the policy file; the previous script keeps serving until then".to_string());
        }
    }
    let admin_result = match admin {
        Ok(r) if r.status == 200 => {
            let via = serde_json::from_str::<Value>(&r.body)
                .ok()
                .and_then(|v| v["auth"].as_str().map(str::to_string));
            let how = match (via.as_deref(), token) {
                (Some("socket"), _) => "through the admin socket".to_string(),
                (_, Token::Set(var, _)) => format!("with the bearer token from ${var}"),
                (via, _) => format!("as `{}`", via.unwrap_or("unknown")),
            };
            lines.push(format!("admin endpoints accept this client ({how})"));
            "authorized"
        }
        Ok(r) if r.status == 401 => {
            worst = worst.max(Status::Fail);
            match token {
                Token::Set(var, _) => {
                    lines.push(format!("admin refused the token in ${var}"));
                    fixes.push(format!("set ${var} to the token the server was started with"));
                }
                Token::Unset(var) => {
                    lines.push(format!("admin needs a bearer token, and ${var} is not set here"));
                    fixes.push(format!("export {var}=<the server's token> and run doctor again"));
                }
                Token::NotConfigured => {
                    lines.push(
                        "admin needs a bearer token, and this config names no server.admin_token_env".to_string(),
                    );
                    fixes.push(
                        "run doctor with the server's config (--config FILE) and its token variable set".to_string(),
                    );
                }
            }
            "unauthorized"
        }
        Ok(r) if r.status == 403 => {
            worst = worst.max(Status::Warn);
            lines.push(format!("admin refused this client: {}", error_of(&r.body)));
            fixes.push("run doctor on the server's host, or set server.admin_token_env and its variable".to_string());
            "forbidden"
        }
        Ok(r) => {
            worst = worst.max(Status::Warn);
            lines.push(format!(
                "GET /admin answered {} ({}): admin access not checked (a server older than this doctor?)",
                r.status,
                error_of(&r.body)
            ));
            "unknown"
        }
        Err(http::Failure::NotListening(e) | http::Failure::Other(e)) => {
            worst = worst.max(Status::Warn);
            lines.push(format!("GET /admin failed: {e}"));
            "unknown"
        }
    };
    let summary = match (is_ready, worst) {
        (false, _) => format!("vramguard at {url} is not ready"),
        (true, Status::Ok) => format!("vramguard at {url} is ready, admin reachable"),
        (true, _) => format!("vramguard at {url} is ready, with problems"),
    };
    let data = json!({
        "url": url,
        "running": true,
        "ready": is_ready,
        "admin": admin_result,
        "token_env": match token { Token::NotConfigured => None, Token::Unset(v) | Token::Set(v, _) => Some(v) },
        "status": status_doc.as_ref().map(|d| json!({"version": d["version"], "config": d["config"],
                                                     "onnxruntime": d["onnxruntime"], "degraded": d["degraded"],
                                                     "policy": d["policy"]})),
    });
    let mut check = Check::new("server", worst, summary).data(data);
    check.details = lines;
    if !fixes.is_empty() {
        check.fix = Some(fixes.join("; "));
    }
    check
}

fn probe_host() -> Result<HostMemory, String> {
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

#[cfg(test)]
mod tests;
