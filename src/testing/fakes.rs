//! Fakes at the inference seam: a [`BackendFactory`] that never loads ONNX Runtime, so a whole
//! service (policy, lifecycle, pools, metrics) runs on backends a test or bench writes itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::config::{Config, ModelConfig, PoolConfig};
use crate::core::backend::Backend;
use crate::core::clock::SystemClock;
use crate::core::model::ModelData;
use crate::core::tensor::{DataType, Tensor, TensorData};
use crate::runtime::estimate::MemoryProfile;
use crate::runtime::onnx::{ModelSignature, TensorSpec};
use crate::serve::lifecycle::Request;
use crate::serve::service::{BackendFactory, Parts, Service};

/// What builds a pool's backend, or refuses to (the message a real factory would give).
type MakeBackend = dyn Fn(&PoolConfig) -> Result<Box<dyn Backend>, String> + Send + Sync;

/// A factory whose every model takes one FP32 `input` of shape `[-1, -1, 4]` and gives one
/// `pooled` of the same shape, with a fixed memory profile (the weights are the model file's
/// size, 1 KiB of workspace, 1 KiB a token), and whose backends come from a closure. It counts
/// the backends it built, so a test sees a worker's backend rebuilt after a panic.
pub struct FakeFactory {
    make: Box<MakeBackend>,
    built: AtomicUsize,
}

impl FakeFactory {
    /// Backends from `make`, called once a worker with the worker's pool.
    pub fn new(make: impl Fn(&PoolConfig) -> Result<Box<dyn Backend>, String> + Send + Sync + 'static) -> Self {
        FakeFactory {
            make: Box::new(make),
            built: AtomicUsize::new(0),
        }
    }

    /// How many backends were built (refusals not counted).
    pub fn built(&self) -> usize {
        self.built.load(Ordering::SeqCst)
    }
}

impl BackendFactory for FakeFactory {
    fn runtime_version(&self) -> String {
        "fake".into()
    }

    fn signature(&self, _model: &ModelConfig, _data: ModelData<'_>) -> Result<ModelSignature, String> {
        let spec = |name: &str| TensorSpec {
            name: name.into(),
            datatype: DataType::Fp32,
            shape: vec![-1, -1, 4],
            symbols: vec![],
        };
        Ok(ModelSignature {
            inputs: vec![spec("input")],
            outputs: vec![spec("pooled")],
        })
    }

    fn measure_profile(&self, model: &ModelConfig, data: ModelData<'_>, signature: &ModelSignature) -> MemoryProfile {
        let profile = crate::config::ConfiguredProfile {
            weights_bytes: Some(data.stored_bytes()),
            workspace_bytes: 1024,
            per_token_bytes: 1024.0,
            per_token_squared_bytes: 0.0,
        };
        MemoryProfile::configured(&profile, data.stored_bytes(), model.context.as_ref(), signature)
    }

    fn backend(&self, pool: &PoolConfig, _models: &[(String, ModelData<'_>)]) -> Result<Box<dyn Backend>, String> {
        let backend = (self.make)(pool)?;
        self.built.fetch_add(1, Ordering::SeqCst);
        Ok(backend)
    }
}

/// An `encoder` request that fits [`FakeFactory`]'s signature: `seq` tokens of 4 values, all
/// `value` (a fake backend may read its first value as an instruction).
pub fn encoder_request(seq: usize, value: f32) -> Request {
    let input = Tensor {
        name: "input".into(),
        shape: vec![1, seq as i64, 4],
        data: TensorData::Fp32(vec![value; seq * 4]),
    };
    super::request("encoder", vec![input])
}

/// The service `config` describes, assembled on `backends` with no memory source, no simulated
/// device and the system clock: what `Service::start` builds, minus ONNX Runtime and hardware.
pub fn service(config: Config, backends: Arc<dyn BackendFactory>) -> Service {
    let parts = Parts {
        backends,
        sources: Vec::new(),
        simulated: Vec::new(),
        clock: Arc::new(SystemClock),
    };
    Service::assemble(config, parts).unwrap_or_else(|e| panic!("the service assembles: {e}"))
}

/// A backend that answers every run with its inputs, and has none of the capabilities.
pub struct Echo;

impl Backend for Echo {
    fn run(
        &mut self,
        _: &str,
        inputs: Vec<Tensor>,
        _: &[String],
        _: &crate::core::backend::RunMeta,
    ) -> Result<Vec<Tensor>, crate::core::backend::BackendError> {
        Ok(inputs)
    }

    lacks!(residency, generations, arenas, liveness, interrupts);
}

/// The accessors of the [`Backend`] capabilities a fake lacks, each answering `None`:
/// `lacks!(residency, generations, arenas, liveness, interrupts)` inside its `impl Backend`.
/// A fake still names each capability it goes without, as every backend must; this only spares
/// it the three lines of each.
#[macro_export]
#[doc(hidden)]
macro_rules! __backend_lacks {
    ($($capability:ident),+ $(,)?) => {
        $($crate::testing::fakes::lacks!(@one $capability);)+
    };
    (@one residency) => {
        fn residency(&mut self) -> Option<&mut dyn $crate::core::backend::Residency> {
            None
        }
    };
    (@one generations) => {
        fn generations(&mut self) -> Option<&mut dyn $crate::core::backend::Generations> {
            None
        }
    };
    (@one arenas) => {
        fn arenas(&mut self) -> Option<&mut dyn $crate::core::backend::Arenas> {
            None
        }
    };
    (@one liveness) => {
        fn liveness(&self) -> Option<&dyn $crate::core::backend::Liveness> {
            None
        }
    };
    (@one interrupts) => {
        fn interrupts(&mut self) -> Option<&mut dyn $crate::core::backend::Interrupts> {
            None
        }
    };
}

pub use __backend_lacks as lacks;
