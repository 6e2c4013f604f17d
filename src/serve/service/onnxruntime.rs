//! The production [`BackendFactory`]: ONNX Runtime sessions on the configured execution
//! provider, model signatures read from a CPU session, memory profiles measured from ONNX
//! Runtime's own arena peaks.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::config::{Config, DeviceKind, Isolation, ModelConfig, PoolConfig, Provider};
use crate::core::backend::Backend;
use crate::core::model::ModelData;
use crate::device::faults::FaultInjecting;
use crate::device::simulated::SimulatedDevice;
use crate::pool::process::{ProcessBackend, WorkerHost, WorkerSpec};
use crate::runtime::estimate::{self, MemoryProfile};
use crate::runtime::onnx::{self, ModelSignature, OnnxRuntime, OrtBackend, SessionOptions};

use super::factory::BackendFactory;

/// Builds ONNX Runtime backends.
#[derive(Debug)]
pub struct OrtFactory {
    rt: &'static OnnxRuntime,
    /// NVIDIA device index per configured device name.
    nvidia: Vec<(String, u32)>,
    /// Simulated devices, whose injected faults their pools' backends honour.
    simulated: Vec<Arc<SimulatedDevice>>,
    /// Where process-isolated pools' workers start from, or why they cannot.
    worker_exe: Result<PathBuf, String>,
    /// Process-isolated pools' worker processes, by pool.
    hosts: Mutex<HashMap<String, Arc<WorkerHost>>>,
}

/// The executable a process-isolated pool's worker starts from: `config.worker_exe`, else
/// `VRAMGUARD_WORKER_EXE`, else this program when it is vramguard.
fn worker_exe(config: &Config) -> Result<PathBuf, String> {
    if let Some(exe) = &config.worker_exe {
        return Ok(exe.clone());
    }
    if let Some(exe) = std::env::var_os("VRAMGUARD_WORKER_EXE") {
        return Ok(PathBuf::from(exe));
    }
    let me = std::env::current_exe().map_err(|e| format!("cannot find this program's path: {e}"))?;
    match me.file_name().and_then(|n| n.to_str()) {
        Some("vramguard") => Ok(me),
        _ => Err(format!(
            "{} is not vramguard, which process-isolated pools start their workers from: set VRAMGUARD_WORKER_EXE to the vramguard binary, or give the pool `isolation: thread`",
            me.display()
        )),
    }
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
        OrtFactory {
            rt,
            nvidia,
            simulated,
            worker_exe: worker_exe(config),
            hosts: Mutex::new(HashMap::new()),
        }
    }

    /// `pool`'s worker host, made and its first worker started on first use; a simulated
    /// device it runs on is reached through it from then on.
    fn host(&self, pool: &PoolConfig, device_index: u32) -> Result<Arc<WorkerHost>, String> {
        let mut hosts = self.hosts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(host) = hosts.get(&pool.name) {
            return Ok(Arc::clone(host));
        }
        let exe = self.worker_exe.clone()?;
        let simulated = self
            .simulated
            .iter()
            .find(|d| d.name == pool.device && pool.provider == Provider::Simulated);
        let spec = WorkerSpec {
            pool: pool.name.clone(),
            provider: pool.provider.label().to_string(),
            cuda: match &pool.provider {
                Provider::Cuda(o) => Some((o.gpu_mem_limit, o.same_as_requested)),
                _ => None,
            },
            device_index,
            intra_threads: pool.intra_threads,
            arena_shrinkage: pool.arena_shrinkage,
            simulated: simulated.map(|d| (d.name.clone(), d.capacity)),
            onnxruntime_library: self.rt.library.clone(),
            cpus: pool.cpus.clone(),
            logs: crate::telemetry::logging::worker_logs(),
        };
        let host = WorkerHost::new(spec, exe, pool.health.timeout)?;
        host.start()?;
        if let Some(device) = simulated {
            device.attach(Arc::clone(&host) as Arc<dyn crate::device::simulated::DeviceLink>);
        }
        hosts.insert(pool.name.clone(), Arc::clone(&host));
        Ok(host)
    }

    /// A CPU session: signatures and profiles are read on the CPU, so they are known even when
    /// every accelerator pool is unavailable.
    fn probe(&self, data: ModelData<'_>, quiet: bool) -> Result<ort::session::Session, String> {
        let options = SessionOptions {
            provider: Provider::Cpu,
            device_index: 0,
            intra_threads: 1,
            arena_shrinkage: false,
            quiet,
        };
        onnx::build_session(self.rt, data, &options).map_err(|e| format!("ONNX Runtime cannot load it: {e}"))
    }
}

impl BackendFactory for OrtFactory {
    fn runtime_version(&self) -> String {
        self.rt.version.clone()
    }

    fn optimizer(&self) -> Option<&'static OnnxRuntime> {
        Some(self.rt)
    }

    fn worker_host(&self, pool: &str) -> Option<Arc<WorkerHost>> {
        self.hosts.lock().unwrap_or_else(|e| e.into_inner()).get(pool).cloned()
    }

    fn signature(&self, _model: &ModelConfig, data: ModelData<'_>) -> Result<ModelSignature, String> {
        onnx::signature(&self.probe(data, false)?)
    }

    fn measure_profile(&self, model: &ModelConfig, data: ModelData<'_>, signature: &ModelSignature) -> MemoryProfile {
        // Each measuring session is a fresh CPU session with its own arena, read through it.
        let mut open = || -> Result<(ort::session::Session, ort::memory::Allocator), String> {
            let session = self.probe(data, true)?;
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
        estimate::measure(&mut open, signature, model.context.as_ref(), data.stored_bytes())
    }

    /// Sessions in this process share; a worker process builds each model's own (its wire
    /// has no way to ask it to share), and a remote server holds its own.
    fn shares_sessions(&self, pool: &PoolConfig) -> bool {
        pool.isolation == Isolation::Thread && !matches!(pool.provider, Provider::Remote(_))
    }

    fn backend(&self, pool: &PoolConfig, models: &[(String, ModelData<'_>)]) -> Result<Box<dyn Backend>, String> {
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
        if pool.isolation == Isolation::Process && !matches!(pool.provider, Provider::Remote(_)) {
            let host = self.host(pool, device_index)?;
            return Ok(Box::new(ProcessBackend::open(&host, models)?));
        }
        let options = SessionOptions {
            provider: pool.provider.clone(),
            device_index,
            intra_threads: pool.intra_threads,
            arena_shrinkage: pool.arena_shrinkage,
            quiet: false,
        };
        // The intra-op threads a session starts keep the CPUs of the thread that built it.
        let load = || OrtBackend::load(self.rt, models, &options);
        let loaded = match &pool.cpus {
            Some(cpus) => cpus.while_applied(load)?,
            None => load(),
        };
        let backend: Box<dyn Backend> = Box::new(loaded?);
        match self.simulated.iter().find(|d| d.name == pool.device) {
            Some(device) if pool.provider == Provider::Simulated => {
                device.check_capacity(&format!("pool `{}` loading its models", pool.name))?;
                Ok(Box::new(FaultInjecting::new(backend, Arc::clone(device))))
            }
            _ => Ok(backend),
        }
    }
}
