//! The exporter with fake sources: exact exposition lines, headroom, the usage ratio, a failing
//! source, the format negotiation.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::response::accepts_openmetrics;
use super::*;
use crate::config::{ServiceMatch, ServiceRule};
use crate::core::snapshot::{DeviceClass, DeviceState};
use crate::device::{DeviceMemory, DeviceProcess, HostMemory, MemorySource, Reading};
use crate::telemetry::metrics::ProcessMetrics;

#[test]
fn openmetrics_is_chosen_only_when_acceptable() {
    assert!(accepts_openmetrics("application/openmetrics-text;version=1.0.0"));
    assert!(accepts_openmetrics(
        " application/openmetrics-text; version=1.0.0; q=0.5"
    ));
    assert!(!accepts_openmetrics("application/openmetrics-text;q=0"));
    assert!(!accepts_openmetrics("application/openmetrics-text; q=0.0"));
    assert!(!accepts_openmetrics("text/plain;version=0.0.4"));
    assert!(!accepts_openmetrics("application/openmetrics-textile"));
}

/// An NVML-like source whose devices and processes the test sets.
struct Fake(Arc<std::sync::Mutex<Reading>>);

impl MemorySource for Fake {
    fn label(&self) -> &'static str {
        "nvml"
    }
    fn sample(&mut self, reading: &mut Reading) -> Result<(), String> {
        let fixed = self.0.lock().unwrap().clone();
        reading.devices.extend(fixed.devices);
        reading.processes.extend(fixed.processes);
        reading.host = fixed.host;
        Ok(())
    }
}

fn process(pid: u32, name: &str, cmdline: &str, cgroup: &str, used: u64) -> DeviceProcess {
    DeviceProcess {
        pid,
        device: "gpu0".into(),
        used_bytes: used,
        name: name.into(),
        cmdline: cmdline.into(),
        cgroup: cgroup.into(),
        service: None,
    }
}

fn rules() -> Vec<ServiceRule> {
    vec![
        ServiceRule {
            service: "ollama".into(),
            matcher: ServiceMatch::ProcessName("ollama".into()),
        },
        ServiceRule {
            service: "comfyui".into(),
            matcher: ServiceMatch::Cmdline(regex::Regex::new(r"ComfyUI/main\.py").unwrap()),
        },
        ServiceRule {
            service: "whisper".into(),
            matcher: ServiceMatch::Cgroup(regex::Regex::new(r"whisper\.service").unwrap()),
        },
    ]
}

#[test]
fn fake_devices_and_processes_become_exact_exposition_lines() {
    let fixed = Arc::new(std::sync::Mutex::new(Reading {
        devices: BTreeMap::from([(
            "gpu0".to_string(),
            DeviceMemory {
                kind: DeviceClass::Nvml,
                total_bytes: 24 << 30,
                used_bytes: 20 << 30,
            },
        )]),
        processes: vec![
            process(
                101,
                "ollama",
                "/usr/bin/ollama serve",
                "/system.slice/ollama.service",
                12 << 30,
            ),
            process(
                202,
                "python3",
                "python3 /opt/ComfyUI/main.py --listen",
                "/user.slice",
                6 << 30,
            ),
            process(
                303,
                "python3",
                "python3 -m whisper_server",
                "/system.slice/whisper.service",
                1 << 30,
            ),
            process(404, "blender", "blender -b scene.blend", "/user.slice", 512 << 20),
        ],
        host: Some(HostMemory {
            total_bytes: 64 << 30,
            available_bytes: 40 << 30,
            self_resident_bytes: 100 << 20,
        }),
    }));
    let (metrics, mut registry) = ProcessMetrics::new("1.31.1");
    let store = Arc::new(SnapshotStore::default());
    registry.register_collector(Box::new(LiveCollector::new(store.clone(), Vec::new(), Vec::new())));
    let mut sampler = Sampler::new(
        vec![Box::new(Fake(fixed.clone()))],
        rules(),
        2 << 30,
        metrics,
        store.clone(),
    );
    sampler.sample();
    let text = crate::telemetry::metrics::encode(&registry);
    for line in [
        "vramguard_device_memory_total_bytes{device=\"gpu0\",kind=\"nvml\"} 25769803776",
        "vramguard_device_memory_used_bytes{device=\"gpu0\",kind=\"nvml\"} 21474836480",
        "vramguard_device_memory_free_bytes{device=\"gpu0\",kind=\"nvml\"} 4294967296",
        "vramguard_process_device_memory_bytes{device=\"gpu0\",pid=\"101\",process=\"ollama\",service=\"ollama\"} 12884901888",
        "vramguard_process_device_memory_bytes{device=\"gpu0\",pid=\"202\",process=\"python3\",service=\"comfyui\"} 6442450944",
        "vramguard_process_device_memory_bytes{device=\"gpu0\",pid=\"303\",process=\"python3\",service=\"whisper\"} 1073741824",
        "vramguard_process_device_memory_bytes{device=\"gpu0\",pid=\"404\",process=\"blender\",service=\"other\"} 536870912",
        "vramguard_host_memory_available_bytes 42949672960",
        "vramguard_host_memory_total_bytes 68719476736",
        "vramguard_host_memory_reserve_bytes 2147483648",
        "vramguard_process_resident_memory_bytes 104857600",
        "# TYPE vramguard_process_device_memory_bytes gauge",
        "# UNIT vramguard_process_device_memory_bytes bytes",
    ] {
        assert!(text.contains(&format!("{line}\n")), "missing `{line}` in:\n{text}");
    }
    assert!(
        text.contains("vramguard_exporter_sample_duration_seconds_count{source=\"nvml\"} 1\n"),
        "{text}"
    );

    // Blender exits: its series is gone at the next sample, nothing stale remains.
    fixed.lock().unwrap().processes.retain(|p| p.pid != 404);
    sampler.sample();
    let text = crate::telemetry::metrics::encode(&registry);
    assert!(!text.contains("pid=\"404\""), "{text}");
    assert!(text.contains("pid=\"101\""));
    assert_eq!(store.latest().generation, 2);
    assert_eq!(store.latest().snapshot.processes.len(), 3);
}

#[test]
fn headroom_counts_free_memory_plus_idle_arena_bytes() {
    let fixed = Arc::new(std::sync::Mutex::new(Reading {
        devices: BTreeMap::from([(
            "gpu0".to_string(),
            DeviceMemory {
                kind: DeviceClass::Nvml,
                total_bytes: 1000,
                used_bytes: 1200,
            },
        )]),
        ..Reading::default()
    }));
    let (metrics, _registry) = ProcessMetrics::new("x");
    let store = Arc::new(SnapshotStore::default());
    let mut sampler = Sampler::new(vec![Box::new(Fake(fixed))], Vec::new(), 0, metrics, store.clone());
    sampler.sample();
    let device = store.latest().snapshot.devices["gpu0"].clone();
    // A driver reading above capacity is clamped, never an underflow.
    assert_eq!(
        (device.used_bytes, device.free_bytes, device.headroom_bytes),
        (1000, 0, 0)
    );
}

#[test]
fn usage_ratio_is_the_fullest_accelerator_and_full_while_saturated() {
    let device = |kind, total_bytes, used_bytes| DeviceState {
        kind,
        total_bytes,
        used_bytes,
        ..DeviceState::default()
    };
    let devices = [
        device(DeviceClass::Nvml, 1000, 250),
        device(DeviceClass::Simulated, 400, 300),
        // Host memory is not an accelerator's, however full.
        device(DeviceClass::Host, 100, 100),
        // A device that reports no capacity says nothing.
        device(DeviceClass::Nvml, 0, 10),
    ];
    assert_eq!(accelerator_usage_ratio(&devices, false), 0.75);
    assert_eq!(accelerator_usage_ratio(&devices, true), 1.0);
    assert_eq!(accelerator_usage_ratio(&devices[..1], false), 0.25);
    // Nothing to fill: a CPU-only replica.
    assert_eq!(accelerator_usage_ratio(&devices[2..], false), 0.0);
    assert_eq!(accelerator_usage_ratio([], true), 1.0);
    // A driver reading above capacity is clamped.
    assert_eq!(
        accelerator_usage_ratio(&[device(DeviceClass::Nvml, 10, 12)], false),
        1.0
    );
}

#[test]
fn a_failing_source_is_counted_and_the_rest_still_sampled() {
    struct Broken;
    impl MemorySource for Broken {
        fn label(&self) -> &'static str {
            "nvml"
        }
        fn sample(&mut self, _: &mut Reading) -> Result<(), String> {
            Err("GPU is lost".into())
        }
    }
    let (metrics, registry) = ProcessMetrics::new("x");
    let store = Arc::new(SnapshotStore::default());
    let mut sampler = Sampler::new(
        vec![Box::new(Broken), Box::new(crate::device::host::HostSource)],
        Vec::new(),
        0,
        metrics,
        store.clone(),
    );
    sampler.sample();
    assert!(store.latest().snapshot.host.mem_total_bytes > 0);
    let text = crate::telemetry::metrics::encode(&registry);
    assert!(
        text.contains("vramguard_exporter_errors_total{source=\"nvml\"} 1\n"),
        "{text}"
    );
}
