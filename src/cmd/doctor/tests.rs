//! The verdicts, from plain probed facts: no GPU, no ONNX Runtime, no server.

use super::server::client_url;
use super::*;
use crate::config::ServiceRule;
use crate::core::snapshot::{DeviceClass, ProcessState};
use crate::device::nvml::Inventory;
use crate::device::{HostMemory, Reading};

const MIB: u64 = 1 << 20;

fn process(pid: u32, service: &str, device: &str, used: u64) -> ProcessState {
    ProcessState {
        pid,
        name: format!("proc{pid}"),
        service: service.into(),
        device: device.into(),
        used_bytes: used,
    }
}

fn device(name: &str, used: u64, processes: Vec<ProcessState>) -> DeviceUsage {
    DeviceUsage {
        name: name.into(),
        kind: DeviceClass::Nvml,
        source: "NVML",
        total_bytes: 16 * GIB,
        used_bytes: used,
        processes,
    }
}

#[test]
fn attribution_reports_the_unattributed_remainder_per_service() {
    let check = check_attribution(&[device(
        "gpu0",
        6 * GIB,
        vec![
            process(10, "ollama", "gpu0", 4 * GIB),
            process(11, "other", "gpu0", GIB),
        ],
    )]);
    assert_eq!(check.status, Status::Ok, "{check:?}");
    assert_eq!(
        check.details,
        [
            "gpu0 (NVIDIA, from NVML): 6 GiB used = 5 GiB held by 2 process(es) (ollama 4 GiB, other 1 GiB) + 1 GiB unattributed"
        ]
    );
    assert_eq!(check.data["devices"][0]["unattributed_bytes"], GIB);
}

#[test]
fn attribution_beyond_the_device_total_fails() {
    let check = check_attribution(&[device("gpu0", GIB, vec![process(10, "other", "gpu0", 2 * GIB)])]);
    assert_eq!(check.status, Status::Fail);
    assert!(
        check.details[0].contains("processes hold 2 GiB, more than the 1 GiB"),
        "{check:?}"
    );
    assert!(check.fix.is_some());
}

#[test]
fn memory_no_process_accounts_for_is_a_warning() {
    let check = check_attribution(&[device("gpu0", 3 * GIB, vec![])]);
    assert_eq!(check.status, Status::Warn);
    assert!(check.fix.unwrap().contains("--pid=host"));
    // A driver's own few hundred MiB is not worth a warning.
    assert_eq!(
        check_attribution(&[device("gpu0", 300 * MIB, vec![])]).status,
        Status::Ok
    );
    assert_eq!(check_attribution(&[]).status, Status::Info);
}

#[test]
fn host_memory_below_the_reserve_fails() {
    let host = |available| {
        Ok(HostMemory {
            total_bytes: 16 * GIB,
            available_bytes: available,
            self_resident_bytes: 0,
        })
    };
    let ok = check_host(&host(10 * GIB), Some(2 * GIB));
    assert_eq!(ok.status, Status::Ok);
    assert_eq!(
        ok.summary,
        "10 GiB of 16 GiB available; host.reserve of 2 GiB leaves 8 GiB for CPU work"
    );
    let low = check_host(&host(GIB), Some(2 * GIB));
    assert_eq!(low.status, Status::Fail);
    assert!(low.summary.contains("below host.reserve of 2 GiB"), "{low:?}");
    assert!(low.fix.unwrap().contains("free host memory"));
    let impossible = check_host(&host(GIB), Some(32 * GIB));
    assert!(impossible.fix.unwrap().contains("lower it"));
    assert_eq!(check_host(&host(GIB), None).status, Status::Warn);
}

#[test]
fn a_cpu_only_build_is_fine_until_a_pool_needs_cuda() {
    let facts = |compiled_in: bool, gpus: u32, pools: &[&str], probe: Option<Result<(), String>>| CudaFacts {
        compiled_in: Some(Ok(compiled_in)),
        nvidia_devices: gpus,
        cuda_pools: pools.iter().map(|p| p.to_string()).collect(),
        probe: probe.map(|r| (0, r)),
    };
    let cpu_only = check_cuda(&facts(false, 0, &[], None));
    assert_eq!(cpu_only.status, Status::Info);
    assert!(cpu_only.summary.contains("CPU-only build"), "{cpu_only:?}");
    let needed = check_cuda(&facts(false, 1, &["gpu"], None));
    assert_eq!(needed.status, Status::Fail);
    assert!(
        needed.summary.contains("pool `gpu` needs the CUDA execution provider"),
        "{needed:?}"
    );
    assert!(needed.fix.unwrap().contains("onnxruntime-gpu"));
    assert_eq!(check_cuda(&facts(true, 1, &["gpu"], Some(Ok(())))).status, Status::Ok);
    let broken = check_cuda(&facts(
        true,
        1,
        &["gpu"],
        Some(Err("libcudnn.so.9: cannot open shared object file".into())),
    ));
    assert_eq!(broken.status, Status::Fail);
    assert_eq!(broken.details, ["libcudnn.so.9: cannot open shared object file"]);
    assert_eq!(check_cuda(&facts(true, 0, &["gpu"], None)).status, Status::Fail);
    let unloaded = CudaFacts {
        compiled_in: None,
        ..facts(false, 0, &[], None)
    };
    assert_eq!(check_cuda(&unloaded).status, Status::Warn);
}

#[test]
fn no_nvidia_driver_is_information_on_a_simulated_config_and_a_failure_on_an_nvidia_one() {
    let reason =
        Err("NVML unavailable (no NVIDIA driver?): libnvidia-ml.so.1: cannot open shared object file".to_string());
    let simulated = Config::embedded(false);
    let check = check_nvml(&reason, Some(&simulated), &[]);
    assert_eq!(check.status, Status::Info);
    assert!(
        check.summary.starts_with("no NVIDIA device: NVML unavailable"),
        "{check:?}"
    );
    assert_eq!(
        check.details,
        ["gpu0: SIMULATED accelerator of 512 MiB (from the config; no driver involved)"]
    );
    assert_eq!(check.data["simulated"][0]["name"], "gpu0");

    let nvidia = Config::embedded(true);
    let check = check_nvml(&reason, Some(&nvidia), &[]);
    assert_eq!(check.status, Status::Fail);
    assert!(
        check.summary.contains("names NVIDIA devices (gpu0), none usable: NVML"),
        "{check:?}"
    );
    assert!(check.fix.unwrap().contains("NVIDIA driver"));
}

/// A `/status` of a server degraded by its `gpu` pool, its `cpu` pool serving.
fn degraded_status() -> crate::protocol::status::StatusReport {
    use crate::core::snapshot::BreakerState;
    use crate::protocol::status::PoolAvailability;
    let mut status = crate::protocol::status::tests::report();
    status.config = "x.yaml".into();
    status.degraded.reason = Some("pool `gpu` is unavailable".into());
    status.pools.retain(|p| p.name == "gpu" || p.name == "cpu");
    let gpu = &mut status.pools[0];
    (gpu.breaker, gpu.state) = (BreakerState::Open, PoolAvailability::Unavailable);
    status.policy.last_error = None;
    status
}

#[test]
fn nothing_listening_is_a_warning_and_a_refused_token_a_failure() {
    let not_running = check_server(&ServerProbe::Unreachable {
        url: "http://127.0.0.1:8080".into(),
        failure: Failure::NotListening("connection refused".into()),
    });
    assert_eq!(not_running.status, Status::Warn);
    assert!(not_running.summary.contains("not running there"));

    let answered = |admin: u16, token: Token| ServerProbe::Answered {
        url: "http://127.0.0.1:8080".into(),
        ready: Response {
            status: 200,
            body: String::new(),
        },
        admin: Ok(Response {
            status: admin,
            body: if admin == 200 {
                r#"{"authorized": true, "auth": "socket"}"#.into()
            } else {
                r#"{"error": "admin endpoints need `Authorization: Bearer <token>`"}"#.into()
            },
        }),
        status: Ok(Response {
            status: 200,
            body: serde_json::to_string(&degraded_status()).unwrap(),
        }),
        token,
    };
    let ok = check_server(&answered(200, Token::NotConfigured));
    // Ready and authorized, but degraded: worth a look, not a failure.
    assert_eq!(ok.status, Status::Warn, "{ok:?}");
    assert!(
        ok.details.contains(&"DEGRADED: pool `gpu` is unavailable".to_string()),
        "{ok:?}"
    );
    assert!(
        ok.fix
            .as_ref()
            .unwrap()
            .contains("`POST /admin/pools/gpu/restore` brings it back"),
        "{ok:?}"
    );
    assert!(
        ok.details
            .contains(&"admin endpoints accept this client (through the admin socket)".to_string()),
        "{ok:?}"
    );

    let unset = check_server(&answered(401, Token::Unset("VG_TOKEN".into())));
    assert_eq!(unset.status, Status::Fail);
    assert!(unset.fix.as_ref().unwrap().contains("export VG_TOKEN="), "{unset:?}");
    let wrong = check_server(&answered(401, Token::Set("VG_TOKEN".into(), "nope".into())));
    assert!(
        wrong
            .details
            .contains(&"admin refused the token in $VG_TOKEN".to_string())
    );
}

/// A `/status` this doctor cannot read (another version's document) is said, not dropped.
#[test]
fn an_unreadable_status_document_is_a_warning() {
    let probe = ServerProbe::Answered {
        url: "http://127.0.0.1:8080".into(),
        ready: Response {
            status: 200,
            body: String::new(),
        },
        admin: Ok(Response {
            status: 200,
            body: r#"{"authorized": true, "auth": "socket"}"#.into(),
        }),
        status: Ok(Response {
            status: 200,
            body: r#"{"version": "9.9.9"}"#.into(),
        }),
        token: Token::NotConfigured,
    };
    let check = check_server(&probe);
    assert_eq!(check.status, Status::Warn, "{check:?}");
    assert!(
        check
            .details
            .iter()
            .any(|l| l.starts_with("its /status could not be read (")
                && l.ends_with("another version than this doctor?")),
        "{check:?}"
    );
}

#[test]
fn listen_addresses_become_urls_a_client_can_reach() {
    assert_eq!(
        client_url("0.0.0.0:8080".parse().unwrap()).unwrap(),
        "http://127.0.0.1:8080"
    );
    assert_eq!(client_url("[::]:9000".parse().unwrap()).unwrap(), "http://[::1]:9000");
    assert_eq!(
        client_url("10.0.0.5:80".parse().unwrap()).unwrap(),
        "http://10.0.0.5:80"
    );
    assert!(
        client_url("127.0.0.1:0".parse().unwrap())
            .unwrap_err()
            .contains("--url")
    );
}

#[test]
fn the_text_report_has_one_line_per_check_and_counts() {
    let report = Report::new(
        "x.yaml".into(),
        vec![
            Check::new("config", Status::Ok, "x.yaml: valid"),
            Check::new("host_memory", Status::Fail, "1 GiB available")
                .detail("more")
                .fix("free memory"),
        ],
    );
    assert!(!report.passed());
    let text = report.to_text();
    let lines: Vec<&str> = text.lines().skip(1).collect();
    assert_eq!(
        lines,
        [
            "ok    config       x.yaml: valid",
            "fail  host_memory  1 GiB available",
            "                   more",
            "                   fix: free memory",
            "1 ok, 0 info, 0 warn, 1 failed",
        ]
    );
}

/// What NVML would report on a machine with one GPU: `ollama` and a process from another PID
/// namespace on it.
fn nvml_reading() -> (Inventory, Reading) {
    use crate::device::nvml::NvidiaDevice;
    use crate::device::{DeviceMemory, DeviceProcess};
    let inventory = Inventory {
        driver_version: "550.54.15".into(),
        devices: vec![NvidiaDevice {
            index: 0,
            name: "gpu0".into(),
            product: "NVIDIA H200".into(),
        }],
    };
    let mut reading = Reading::default();
    reading.devices.insert(
        "gpu0".into(),
        DeviceMemory {
            kind: DeviceClass::Nvml,
            total_bytes: 140 * GIB,
            used_bytes: 10 * GIB,
        },
    );
    for (pid, name, used) in [(4242, "ollama", 8 * GIB), (77, "", GIB)] {
        reading.processes.push(DeviceProcess {
            pid,
            device: "gpu0".into(),
            used_bytes: used,
            name: name.into(),
            ..DeviceProcess::default()
        });
    }
    (inventory, reading)
}

#[test]
fn nvml_lists_devices_and_processes_and_attribution_uses_the_service_rules() {
    let rules = [ServiceRule {
        service: "chat".into(),
        matcher: crate::config::ServiceMatch::ProcessName("ollama".into()),
    }];
    let nvml = Ok(nvml_reading());
    let config = Config::embedded(true);
    let check = check_nvml(&nvml, Some(&config), &rules);
    assert_eq!(check.status, Status::Ok, "{check:?}");
    assert_eq!(check.summary, "driver 550.54.15, 1 device(s)");
    assert_eq!(
        check.details,
        [
            "gpu0 (index 0, NVIDIA H200): 10 GiB of 140 GiB used, 2 process(es)",
            "  pid 4242 ollama: 8 GiB (service chat)",
            "  pid 77 (not visible from here: another PID namespace?): 1 GiB (service other)",
        ]
    );
    assert_eq!(check.data["processes"][0]["service"], "chat");

    let attribution = check_attribution(&nvml_usage(&nvml.as_ref().unwrap().1, &rules));
    assert_eq!(attribution.status, Status::Ok);
    assert_eq!(
        attribution.details,
        [
            "gpu0 (NVIDIA, from NVML): 10 GiB used = 9 GiB held by 2 process(es) (chat 8 GiB, other 1 GiB) + 1 GiB unattributed"
        ]
    );
}

#[test]
fn a_configured_nvidia_index_nvml_does_not_report_fails() {
    let mut raw = crate::config::embedded_raw(true);
    raw.devices[0].index = Some(1);
    let config = raw.validate("<test>", std::path::Path::new(".")).unwrap();
    let check = check_nvml(&Ok(nvml_reading()), Some(&config), &[]);
    assert_eq!(check.status, Status::Fail);
    assert_eq!(
        check.summary,
        "the config names `gpu0` (index 1) but NVML sees 1 device(s)"
    );
}
