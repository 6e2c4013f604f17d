//! Triton's model-configuration extension: `GET /v2/models/{model}/config`, the model's
//! configuration in the fields of Triton's `config.pbtxt` that its clients read, each filled in
//! from what vramguard knows of the model: its ONNX signature, the pools that serve it, its
//! configured residency.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde_json::{Map, Value, json};

use crate::config::{DeviceKind, Provider};
use crate::core::signature::TensorSpec;
use crate::serve::ran::RanOn;
use crate::serve::service::{ModelEntry, Service};

use super::super::error::ApiError;
use super::super::oip::{ModelPath, configured};
use super::super::state::AppState;

/// `GET /v2/models/{model}/config`.
pub(super) async fn model_config(
    State(state): State<Arc<AppState>>,
    ModelPath(model): ModelPath,
) -> Result<Json<Value>, ApiError> {
    let entry = configured(&state, &model)?;
    Ok(Json(config_of(&state.service, entry)))
}

/// The configuration of `entry`, as Triton writes one.
///
/// `max_batch_size` is 0: vramguard never combines requests into one run, so Triton's batch
/// dimension does not apply, and `dims` are the model's whole shapes. A model whose first axis
/// is `-1` still takes a batch in one request's tensors.
fn config_of(service: &Service, entry: &ModelEntry) -> Value {
    let name = &entry.config.name;
    let pools = service.pools_serving(name);
    let mut parameters = Map::new();
    let mut parameter = |key: String, value: String| {
        parameters.insert(key, json!({"string_value": value}));
    };
    parameter("source".into(), entry.config.source.to_string());
    parameter("residency".into(), entry.config.residency.label().into());
    if let Some(context) = &entry.config.context {
        parameter("context.input".into(), context.input.clone());
        parameter("context.axis".into(), context.axis.to_string());
    }
    for pool in &pools {
        let at = |what: &str| format!("pool.{}.{what}", pool.pool);
        parameter(at("provider"), pool.provider.label().into());
        parameter(at("device"), pool.device.clone());
        parameter(at("simulated"), pool.simulated.to_string());
    }
    json!({
        "name": name,
        "platform": "onnxruntime_onnx",
        "backend": "onnxruntime",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": 0,
        "input": tensors(&entry.signature.inputs),
        "output": tensors(&entry.signature.outputs),
        "instance_group": pools.iter().map(|p| instance_group(service, p)).collect::<Vec<_>>(),
        "model_transaction_policy": {"decoupled": false},
        "parameters": parameters,
    })
}

/// Triton's `input` or `output` entries: name, `TYPE_…` datatype and dims (`-1` where dynamic).
fn tensors(specs: &[TensorSpec]) -> Vec<Value> {
    specs
        .iter()
        .map(|s| json!({"name": s.name, "data_type": format!("TYPE_{}", s.datatype.name()), "dims": s.shape}))
        .collect()
}

/// A pool serving the model as one of Triton's instance groups: `count` is how many requests it
/// runs at once (its workers). A CUDA pool's and a simulated accelerator's are `KIND_GPU` (the
/// simulated one says so in the config's `parameters`: `pool.{name}.simulated`), a CPU pool's
/// `KIND_CPU`, a remote pool's `KIND_MODEL` (its server places the runs).
fn instance_group(service: &Service, pool: &RanOn) -> Value {
    let kind = match pool.provider {
        Provider::Cpu => "KIND_CPU",
        Provider::Cuda(_) | Provider::Simulated => "KIND_GPU",
        Provider::Remote(_) => "KIND_MODEL",
    };
    let mut group = json!({"name": pool.pool, "kind": kind, "count": pool.concurrency});
    let gpu = service
        .config
        .devices
        .iter()
        .find(|d| d.name == pool.device)
        .and_then(|d| match d.kind {
            DeviceKind::Nvidia { index } => Some(index),
            DeviceKind::Simulated { .. } => None,
        });
    if let (Provider::Cuda(_), Some(index)) = (&pool.provider, gpu) {
        group["gpus"] = json!([index]);
    }
    group
}
