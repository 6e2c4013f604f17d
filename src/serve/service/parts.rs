//! What a service is assembled from: the [`BackendFactory`] that builds its backends (ONNX
//! Runtime's, [`OrtFactory`], unless a test gives another), the memory sources, the simulated
//! devices and the clock.

use std::sync::Arc;

use crate::config::{Config, ConfigError, DeviceKind};
use crate::core::clock::{Clock, SystemClock};
use crate::device::MemorySource;
use crate::device::simulated::{SimulatedDevice, SimulatedSource};

use super::StartError;
use super::factory::BackendFactory;
use super::onnxruntime::OrtFactory;

/// What a service is assembled from.
pub struct Parts {
    /// Builds backends and reads model signatures.
    pub backends: Arc<dyn BackendFactory>,
    /// Memory sources the sampler reads (host, NVML, simulated devices).
    pub sources: Vec<Box<dyn MemorySource>>,
    /// Simulated devices (their arenas back the `simulated` pools).
    pub simulated: Vec<Arc<SimulatedDevice>>,
    /// Time source for queue stamps and ages.
    pub clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for Parts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parts")
            .field("sources", &self.sources.iter().map(|s| s.label()).collect::<Vec<_>>())
            .field("simulated", &self.simulated)
            .finish_non_exhaustive()
    }
}

impl Parts {
    /// Production parts: ONNX Runtime (loaded from the configured library), the simulated
    /// devices the config declares, the host and NVML memory sources, the system clock.
    pub fn onnxruntime(config: &Config) -> Result<Parts, StartError> {
        let rt = crate::runtime::onnx::runtime(config.onnxruntime_library.as_deref())?;
        let mut simulated = Vec::new();
        for device in &config.devices {
            if let DeviceKind::Simulated { capacity } = device.kind {
                // A process-isolated pool's worker holds the device's arena; we reach it there.
                let in_worker = config.pools.iter().any(|p| {
                    p.device == device.name
                        && p.provider == crate::config::Provider::Simulated
                        && p.isolation == crate::config::Isolation::Process
                });
                if in_worker {
                    tracing::info!(device = %device.name, capacity = %crate::core::human::human_bytes(capacity), "SIMULATED accelerator ready (held by its pool's worker process)");
                    simulated.push(Arc::new(SimulatedDevice::linked(&device.name, capacity)));
                    continue;
                }
                let opened =
                    SimulatedDevice::open(rt, &device.name, capacity).map_err(|message| ConfigError::Invalid {
                        file: config.source.clone(),
                        key: format!("devices.{}", device.name),
                        message,
                    })?;
                tracing::info!(device = %device.name, capacity = %crate::core::human::human_bytes(capacity), "SIMULATED accelerator ready");
                simulated.push(Arc::new(opened));
            }
        }
        let mut sources = crate::device::sources(config);
        sources.extend(
            simulated
                .iter()
                .map(|d| Box::new(SimulatedSource::new(Arc::clone(d))) as Box<dyn MemorySource>),
        );
        Ok(Parts {
            backends: Arc::new(OrtFactory::new(rt, config, simulated.clone())),
            sources,
            simulated,
            clock: Arc::new(SystemClock),
        })
    }
}
