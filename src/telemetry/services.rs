//! Each service's accelerator memory and its budget, per device, encoded at scrape time:
//! `vramguard_service_memory_bytes{service,device}` and
//! `vramguard_service_memory_budget_bytes{service,device}`.
//!
//! A service vramguard runs (some model belongs to it) is measured by vramguard's own account
//! ([`OwnMemory`]: resident weights and running requests' estimates). Any other service, one
//! that `exporter.services` names for another runtime's processes (Ollama, ComfyUI…), is what
//! the exporter sees those processes use, summed by service and device: its budget is exported
//! and alerted on, not enforced. Every series exists from the first scrape, at 0 when nothing
//! is held.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::registry::Unit;

use crate::config::Config;
use crate::core::snapshot::Snapshot;
use crate::telemetry::exporter::SnapshotStore;
use crate::telemetry::exporter::family::{gauge_family, saturating_i64};

/// What vramguard holds for the services it runs.
pub trait OwnMemory: Send + Sync + std::fmt::Debug {
    /// Bytes `service` holds on each accelerator device, or `None` when it does not run here.
    fn memory_of(&self, service: &str) -> Option<BTreeMap<String, u64>>;
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServiceDevice {
    service: String,
    device: String,
}

/// One service to export: its name and `device_memory` budget.
#[derive(Debug, Clone)]
struct Row {
    name: String,
    budget: Option<u64>,
}

/// Encodes the service memory families on every scrape.
#[derive(Debug)]
pub struct ServicesCollector {
    rows: Vec<Row>,
    devices: Vec<String>,
    store: Arc<SnapshotStore>,
    own: Option<Arc<dyn OwnMemory>>,
}

impl ServicesCollector {
    /// Every service of `config` (declared or implicit) and every service `exporter.services`
    /// names, on `devices`, the others' memory read from the latest sample in `store`.
    pub fn new(config: &Config, devices: Vec<String>, store: Arc<SnapshotStore>) -> Self {
        let mut rows: Vec<Row> = config
            .services
            .iter()
            .map(|s| Row {
                name: s.name.clone(),
                budget: s.device_memory,
            })
            .collect();
        let mut seen: BTreeSet<String> = rows.iter().map(|r| r.name.clone()).collect();
        for rule in &config.exporter.services {
            if seen.insert(rule.service.clone()) {
                rows.push(Row {
                    name: rule.service.clone(),
                    budget: None,
                });
            }
        }
        ServicesCollector {
            rows,
            devices,
            store,
            own: None,
        }
    }

    /// Measure the services vramguard runs by `own` (`vramguard serve`).
    pub fn serving(mut self, own: Arc<dyn OwnMemory>) -> Self {
        self.own = Some(own);
        self
    }

    /// `(service, device, bytes)` for every service on every device.
    fn memory(&self, snapshot: &Snapshot) -> Vec<(ServiceDevice, i64)> {
        let mut rows = Vec::new();
        for row in &self.rows {
            let held = match self.own.as_ref().and_then(|o| o.memory_of(&row.name)) {
                Some(own) => own,
                None => seen_in(snapshot, &row.name, &self.devices),
            };
            for device in &self.devices {
                let bytes = held.get(device).copied().unwrap_or(0);
                rows.push((labels(&row.name, device), saturating_i64(bytes)));
            }
        }
        rows
    }
}

/// What the processes attributed to `service` use on each of `devices` in `snapshot` (every
/// device listed, 0 where they use nothing): the account of a service vramguard does not run.
pub fn seen_in(snapshot: &Snapshot, service: &str, devices: &[String]) -> BTreeMap<String, u64> {
    let mut seen: BTreeMap<String, u64> = devices.iter().map(|d| (d.clone(), 0)).collect();
    for p in snapshot.processes.iter().filter(|p| p.service == service) {
        if let Some(bytes) = seen.get_mut(&p.device) {
            *bytes += p.used_bytes;
        }
    }
    seen
}

fn labels(service: &str, device: &str) -> ServiceDevice {
    ServiceDevice {
        service: service.to_string(),
        device: device.to_string(),
    }
}

impl Collector for ServicesCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sample = self.store.latest();
        gauge_family(
            &mut encoder,
            "service_memory",
            "Accelerator memory each service holds: for services vramguard runs, its models' resident weights and its running requests' estimates; for others, what their processes use",
            Some(&Unit::Bytes),
            self.memory(&sample.snapshot),
        )?;
        let budgets = self
            .rows
            .iter()
            .filter_map(|r| r.budget.map(|b| (r, b)))
            .flat_map(|(r, b)| {
                self.devices
                    .iter()
                    .map(move |d| (labels(&r.name, d), saturating_i64(b)))
            });
        gauge_family(
            &mut encoder,
            "service_memory_budget",
            "Each service's device_memory budget, on every accelerator device",
            Some(&Unit::Bytes),
            budgets,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::snapshot::ProcessState;
    use prometheus_client::registry::Registry;

    #[derive(Debug)]
    struct Ours;

    impl OwnMemory for Ours {
        fn memory_of(&self, service: &str) -> Option<BTreeMap<String, u64>> {
            (service == "chat").then(|| BTreeMap::from([("gpu0".to_string(), 700)]))
        }
    }

    fn config() -> Config {
        let yaml = "services:\n  - {name: chat, device_memory: 1KiB}\n  - {name: ollama, device_memory: 2KiB}\n\
                    exporter:\n  services:\n    - {service: ollama, process_name: ollama}\n    - {service: comfyui, process_name: python3}\n\
                    devices:\n  - {name: gpu0, kind: nvidia, index: 0}\n  - {name: gpu1, kind: nvidia, index: 1}\n";
        let raw: crate::config::RawConfig = crate::config::parse_yaml(yaml, "test.yaml").expect("parses");
        raw.validate_for("test.yaml", std::path::Path::new("."), crate::config::Mode::Exporter)
            .expect("valid")
    }

    fn collector() -> ServicesCollector {
        let devices = vec!["gpu0".to_string(), "gpu1".to_string()];
        ServicesCollector::new(&config(), devices, Arc::default()).serving(Arc::new(Ours))
    }

    #[test]
    fn ours_by_account_others_summed_from_their_processes_on_every_device() {
        let process = |service: &str, device: &str, used_bytes| ProcessState {
            service: service.into(),
            device: device.into(),
            used_bytes,
            ..ProcessState::default()
        };
        let snapshot = Snapshot {
            processes: vec![
                process("ollama", "gpu0", 100),
                process("ollama", "gpu0", 20),
                process("ollama", "gpu1", 5),
                // vramguard's own process is not the chat service's account.
                process("chat", "gpu0", 99999),
            ],
            ..Snapshot::default()
        };
        let memory: Vec<(String, String, i64)> = collector()
            .memory(&snapshot)
            .into_iter()
            .map(|(l, v)| (l.service, l.device, v))
            .collect();
        let row = |s: &str, d: &str, v| (s.to_string(), d.to_string(), v);
        assert_eq!(
            memory,
            vec![
                row("chat", "gpu0", 700),
                row("chat", "gpu1", 0),
                row("ollama", "gpu0", 120),
                row("ollama", "gpu1", 5),
                row("comfyui", "gpu0", 0),
                row("comfyui", "gpu1", 0),
            ]
        );
    }

    #[test]
    fn budgets_are_exported_on_every_device_from_the_first_scrape() {
        let mut registry = Registry::with_prefix("vramguard");
        registry.register_collector(Box::new(collector()));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        for line in [
            "vramguard_service_memory_bytes{service=\"comfyui\",device=\"gpu1\"} 0",
            "vramguard_service_memory_budget_bytes{service=\"chat\",device=\"gpu0\"} 1024",
            "vramguard_service_memory_budget_bytes{service=\"chat\",device=\"gpu1\"} 1024",
            "vramguard_service_memory_budget_bytes{service=\"ollama\",device=\"gpu1\"} 2048",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
        assert!(!text.contains("budget_bytes{service=\"comfyui\""), "{text}");
    }
}
