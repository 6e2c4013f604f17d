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
//!
//! `checks.rs` holds the checks of the installation (config, ONNX Runtime, CUDA, policy, host),
//! `devices.rs` those of NVIDIA devices and attribution, `server.rs` the running server's, and
//! `client.rs` the few GETs that ask it.

mod checks;
mod client;
mod devices;
mod server;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use serde::Serialize;
use serde_json::{Value, json};

use crate::cmd::exit::EXIT_FAILED;
use crate::config::Config;

use checks::{probe_cuda, probe_host};
use devices::{nvml_usage, probe_nvml, server_usage};
use server::probe_server;

pub use checks::{CudaFacts, check_config, check_cuda, check_host, check_onnxruntime, check_policy};
pub use client::{Failure, Response};
pub use devices::{DeviceUsage, check_attribution, check_nvml};
pub use server::{ServerProbe, Token, check_server};

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

#[cfg(test)]
mod tests;
