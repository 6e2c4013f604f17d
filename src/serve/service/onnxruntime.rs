//! The production [`BackendFactory`]: ONNX Runtime sessions on the configured execution
//! provider, model signatures read from a CPU session, memory profiles measured from ONNX
//! Runtime's own arena peaks.

use std::sync::Arc;

use crate::config::{Config, DeviceKind, ModelConfig, PoolConfig, Provider};
use crate::core::backend::Backend;
use crate::device::simulated::{FaultInjecting, SimulatedDevice};
use crate::runtime::estimate::{self, MemoryProfile};
use crate::runtime::onnx::{self, ModelSignature, OnnxRuntime, OrtBackend, SessionOptions};

use super::BackendFactory;

/// Builds ONNX Runtime backends.
#[derive(Debug)]
pub struct OrtFactory {
    rt: &'static OnnxRuntime,
    /// NVIDIA device index per configured device name.
    nvidia: Vec<(String, u32)>,
    /// Simulated devices, whose injected faults their pools' backends honour.
    simulated: Vec<Arc<SimulatedDevice>>,
}

impl OrtFactory {
    /// A factory over a loaded ONNX Runtime, for the devices `config` declares.
    pub fn new(rt: &'static OnnxRuntime, config: &Config, simulated: Vec<Arc<SimulatedDevice>>) -> OrtFactory {
        let nvidia = config
            .devices
            .iter()
            .filter_map(|d| match d.kind {
                DeviceKind::Nvidia { index } => Some((d.name.clone(), index)),
                DeviceKind::Simulated { .. } => None,
            })
            .collect();
        OrtFactory { rt, nvidia, simulated }
    }

    /// A CPU session: signatures and profiles are read on the CPU, so they are known even when
    /// every accelerator pool is unavailable.
    fn probe(&self, bytes: &[u8], quiet: bool) -> Result<ort::session::Session, String> {
        let options = SessionOptions {
            provider: Provider::Cpu,
            device_index: 0,
            intra_threads: 1,
            arena_shrinkage: false,
            quiet,
        };
        onnx::build_session(self.rt, bytes, &options).map_err(|e| format!("ONNX Runtime cannot load it: {e}"))
    }
}

impl BackendFactory for OrtFactory {
    fn runtime_version(&self) -> String {
        self.rt.version.clone()
    }

    fn signature(&self, _model: &ModelConfig, bytes: &[u8]) -> Result<ModelSignature, String> {
        onnx::signature(&self.probe(bytes, false)?)
    }

    fn measure_profile(&self, model: &ModelConfig, bytes: &[u8], signature: &ModelSignature) -> MemoryProfile {
        // Each measuring session is a fresh CPU session with its own arena, read through it.
        let mut open = || -> Result<(ort::session::Session, ort::memory::Allocator), String> {
            let session = self.probe(bytes, true)?;
            let info = ort::memory::MemoryInfo::new(
                ort::memory::AllocationDevice::CPU,
                0,
                ort::memory::AllocatorType::Arena,
                ort::memory::MemoryType::Default,
            )
            .map_err(|e| e.to_string())?;
            let allocator = ort::memory::Allocator::new(&session, info).map_err(|e| e.to_string())?;
            Ok((session, allocator))
        };
        estimate::measure(&mut open, signature, model.context.as_ref(), bytes.len() as u64)
    }

    fn backend(&self, pool: &PoolConfig, models: &[(String, &[u8])]) -> Result<Box<dyn Backend>, String> {
        let mut device_index = 0;
        if let Provider::Cuda(_) = &pool.provider
            && let Some((_, index)) = self.nvidia.iter().find(|(name, _)| *name == pool.device)
        {
            device_index = *index;
            match crate::device::nvidia_device_count() {
                Ok(n) if device_index < n => {}
                Ok(n) => return Err(format!("NVIDIA device {device_index} does not exist (NVML sees {n})")),
                Err(reason) => return Err(reason),
            }
        }
        let options = SessionOptions {
            provider: pool.provider.clone(),
            device_index,
            intra_threads: pool.intra_threads,
            arena_shrinkage: pool.arena_shrinkage,
            quiet: false,
        };
        let backend: Box<dyn Backend> = Box::new(OrtBackend::load(self.rt, models, &options)?);
        match self.simulated.iter().find(|d| d.name == pool.device) {
            Some(device) if pool.provider == Provider::Simulated => {
                device.check_capacity(&format!("pool `{}` loading its models", pool.name))?;
                Ok(Box::new(FaultInjecting::new(backend, Arc::clone(device))))
            }
            _ => Ok(backend),
        }
    }
}
