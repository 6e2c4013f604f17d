//! The [`BackendFactory`] seam between a service and what runs its models: ONNX Runtime in
//! production (`onnxruntime.rs`), fakes in tests.

use std::sync::Arc;

use crate::config::{ModelConfig, PoolConfig};
use crate::core::backend::Backend;
use crate::core::model::ModelData;
use crate::runtime::estimate::MemoryProfile;
use crate::runtime::onnx::ModelSignature;

/// Builds what runs models: the seam between the service and ONNX Runtime.
pub trait BackendFactory: Send + Sync {
    /// The runtime's version, for `/v2` and `vramguard_build_info`.
    fn runtime_version(&self) -> String;
    /// Read a model's inputs and outputs.
    fn signature(&self, model: &ModelConfig, data: ModelData<'_>) -> Result<ModelSignature, String>;
    /// Measure what the model's runs need (called only when the config gives no profile).
    fn measure_profile(&self, model: &ModelConfig, data: ModelData<'_>, signature: &ModelSignature) -> MemoryProfile;
    /// Build one worker's backend for `pool`, holding `models` (name, graph and folder). An
    /// error makes the pool unavailable with that reason; it never falls back to another provider.
    fn backend(&self, pool: &PoolConfig, models: &[(String, ModelData<'_>)]) -> Result<Box<dyn Backend>, String>;
    /// The runtime that optimizes models for the host tier and the optimized cache (`None`:
    /// this factory's backends have none, and loads take the models' own bytes).
    fn optimizer(&self) -> Option<&'static crate::runtime::onnx::OnnxRuntime> {
        None
    }
    /// Whether `pool`'s backends serve a model from another's session when their weights are
    /// identical ([`Residency::share_model`](crate::core::backend::Residency::share_model)):
    /// the pool then holds one copy of them. `false` by default: each model has its own.
    fn shares_sessions(&self, pool: &PoolConfig) -> bool {
        let _ = pool;
        false
    }
    /// The worker processes of a process-isolated pool, once its first backend started one.
    fn worker_host(&self, pool: &str) -> Option<Arc<crate::pool::process::WorkerHost>> {
        let _ = pool;
        None
    }
}
