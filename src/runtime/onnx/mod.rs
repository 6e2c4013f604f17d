//! ONNX Runtime: locating and loading the library, building sessions per provider, converting
//! tensors, and classifying runtime failures into [`BackendError`] (the one place that does it).

pub mod arena;
mod backend;
pub mod dense;
mod external;
pub mod facts;
mod generations;
mod graph;
pub mod kernels;
mod last_logits;
mod mapping;
mod optimized;
mod pooled;
mod positions;
mod proto;
mod session;
pub mod speech;

pub use backend::OrtBackend;
pub use external::{ExternalData, external_data};
pub use last_logits::last_position_logits;
pub use mapping::Mapping;
pub use optimized::{Cached, Form, OptimizedCache, cache_form};
pub use pooled::pooled_embedding;
pub use session::{HeldSession, SessionOptions, build_held, build_session, is_ort_format};

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use ort::environment::Environment;
use ort::ep;
use ort::memory::{AllocationDevice, Allocator, AllocatorType, MemoryInfo, MemoryType};
use ort::session::{RunOptions, Session, SessionInputValue};
use ort::value::{DynValue, TensorElementType, ValueType};

use crate::config::{CudaOptions, Provider};
use crate::core::backend::{AllocFailureKind, BackendError};
use crate::core::tensor::{DataType, Tensor, TensorData, TensorView, each_variant};

/// The ONNX Runtime release `make` installs into the project.
pub const PINNED_VERSION: &str = "1.31.1";

/// Where `make` installs the library, relative to the project root.
pub const PROJECT_LOCAL_LIBRARY: &str = ".deps/onnxruntime/onnxruntime/capi/libonnxruntime.so.1.31.1";

/// Why ONNX Runtime could not be brought up.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// No library at any of the places looked at.
    #[error(
        "ONNX Runtime library not found; looked at {tried}. Run `make deps` (installs onnxruntime=={PINNED_VERSION} into .deps/), set ORT_DYLIB_PATH, or set `onnxruntime.library` in the config"
    )]
    NotFound {
        /// Every path tried, in order.
        tried: String,
    },
    /// The library exists but could not be loaded or initialised.
    #[error("cannot load ONNX Runtime from {path}: {message}")]
    Load {
        /// The library path.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A second simulated capacity was requested in the same process.
    #[error("{0}")]
    Arena(String),
}

/// The loaded runtime: one per process, since ONNX Runtime's environment is process-global.
#[derive(Debug)]
pub struct OnnxRuntime {
    env: Environment,
    /// Library path it was loaded from.
    pub library: PathBuf,
    /// How that path was chosen: `onnxruntime.library`, `ORT_DYLIB_PATH` or `project-local install`.
    pub library_origin: &'static str,
    /// Version, e.g. `1.31.1`.
    pub version: String,
    simulated_arena: Mutex<Option<u64>>,
}

static RUNTIME: OnceLock<OnnxRuntime> = OnceLock::new();
static INIT: Mutex<()> = Mutex::new(());

/// Where the library was found, and how that place was chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibraryLocation {
    /// The library file.
    pub path: PathBuf,
    /// `onnxruntime.library`, `ORT_DYLIB_PATH` or `project-local install`.
    pub origin: &'static str,
}

/// Find the library: config key, then `ORT_DYLIB_PATH`, then the project-local install (next to
/// the working directory, the executable's project, or the source tree it was built from).
pub fn locate_library(configured: Option<&Path>) -> Result<LibraryLocation, RuntimeError> {
    const PROJECT_LOCAL: &str = "project-local install";
    let mut candidates: Vec<(&'static str, PathBuf)> = Vec::new();
    if let Some(p) = configured {
        candidates.push(("onnxruntime.library", p.to_path_buf()));
    }
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        candidates.push(("ORT_DYLIB_PATH", PathBuf::from(p)));
    }
    let mut roots = vec![PathBuf::from(".")];
    if let Ok(exe) = std::env::current_exe() {
        // target/{debug,release}/vramguard (or target/*/deps/test-binary) → project root
        roots.extend(exe.ancestors().skip(2).take(3).map(Path::to_path_buf));
    }
    roots.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    for root in roots {
        candidates.push((PROJECT_LOCAL, root.join(PROJECT_LOCAL_LIBRARY)));
    }
    // An explicit choice that is wrong must not be papered over by a fallback.
    if let Some(&(origin, ref path)) = candidates.first()
        && origin != PROJECT_LOCAL
    {
        return if path.is_file() {
            Ok(LibraryLocation {
                path: path.clone(),
                origin,
            })
        } else {
            Err(RuntimeError::NotFound {
                tried: format!("{} (from {origin}), which does not exist", path.display()),
            })
        };
    }
    candidates
        .iter()
        .find(|(_, p)| p.is_file())
        .map(|&(origin, ref path)| LibraryLocation {
            path: path.clone(),
            origin,
        })
        .ok_or_else(|| RuntimeError::NotFound {
            tried: candidates
                .iter()
                .map(|(_, p)| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// Load ONNX Runtime once per process (later calls return the same runtime).
pub fn runtime(configured: Option<&Path>) -> Result<&'static OnnxRuntime, RuntimeError> {
    if let Some(rt) = RUNTIME.get() {
        return Ok(rt);
    }
    let _guard = INIT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(rt) = RUNTIME.get() {
        return Ok(rt);
    }
    let LibraryLocation {
        path: library,
        origin: library_origin,
    } = locate_library(configured)?;
    let load_err = |message: String| RuntimeError::Load {
        path: library.clone(),
        message,
    };
    let env = ort::init_from(&library)
        .map_err(|e| load_err(e.to_string()))?
        .with_name("vramguard")
        .with_telemetry(false)
        .build()
        .map_err(|e| load_err(e.to_string()))?;
    let version = version_from_build_info(ort::info())
        .or_else(|| version_from_file_name(&library))
        .unwrap_or_else(|| "unknown".into());
    tracing::info!(library = %library.display(), %version, "ONNX Runtime loaded");
    Ok(RUNTIME.get_or_init(|| OnnxRuntime {
        env,
        library,
        library_origin,
        version,
        simulated_arena: Mutex::new(None),
    }))
}

fn version_from_build_info(info: &str) -> Option<String> {
    // "ORT Build Info: git-branch=rel-1.31.1, git-commit-id=…"
    let branch = info.split("git-branch=").nth(1)?;
    let branch = branch.split([',', ' ']).next()?;
    let version = branch.strip_prefix("rel-")?;
    version.chars().next()?.is_ascii_digit().then(|| version.to_string())
}

fn version_from_file_name(path: &Path) -> Option<String> {
    let name = path.file_name()?.to_str()?;
    let version = name.split(".so.").nth(1)?;
    (!version.is_empty()).then(|| version.to_string())
}

impl OnnxRuntime {
    /// The environment sessions are created under.
    pub fn env(&self) -> &Environment {
        &self.env
    }

    /// Make sure the simulated device's capped arena is registered with `capacity` bytes.
    /// ONNX Runtime holds one such allocator per process, so a different capacity is an error.
    pub fn ensure_simulated_arena(&self, capacity: u64) -> Result<(), RuntimeError> {
        let mut current = self.simulated_arena.lock().unwrap_or_else(|e| e.into_inner());
        match *current {
            Some(existing) if existing == capacity => Ok(()),
            Some(existing) => Err(RuntimeError::Arena(format!(
                "this process already has a simulated arena of {existing} bytes; ONNX Runtime allows one, so a second capacity ({capacity} bytes) cannot be set"
            ))),
            None => {
                arena::register_capped_cpu_arena(&self.env, capacity).map_err(RuntimeError::Arena)?;
                *current = Some(capacity);
                Ok(())
            }
        }
    }
}

/// Classify an ONNX Runtime failure. ONNX Runtime reports allocator and CUDA failures only as
/// text (its error codes say `Fail`/`RuntimeException`), so the patterns live here and nowhere else.
pub fn classify(message: &str) -> BackendError {
    const OOM: &[&str] = &[
        "BFCArena::AllocateRawInternal",
        "Failed to allocate memory",
        "out of memory",
        "cudaErrorMemoryAllocation",
        "CUDA_ERROR_OUT_OF_MEMORY",
        "bad_alloc",
    ];
    const DRIVER: &[&str] = &[
        "cudaErrorDevicesUnavailable",
        "cudaErrorLaunchFailure",
        "cudaErrorIllegalAddress",
        "cudaErrorUnknown",
        "cudaErrorNoDevice",
        "CUDA_ERROR_LAUNCH_FAILED",
        "driver shutting down",
        "GPU is lost",
        "device-side assert",
    ];
    // Shape and type errors that the inputs' values cause (the model itself ran on other inputs
    // at start-up): the client's to fix, answered 400, not counted as failures.
    const INVALID_INPUT: &[&str] = &[
        "Invalid rank",
        "Got invalid dimensions",
        "Unexpected input data type",
        "cannot be reshaped",
        "Invalid input shape",
        "Attempting to broadcast an axis by a dimension other than 1",
        // A position past what the model embeds (a prompt plus max_tokens too long for it).
        "out of data bounds",
    ];
    let message = message.to_string();
    if message.contains("terminate flag") {
        BackendError::Cancelled
    } else if OOM.iter().any(|p| message.contains(p)) {
        BackendError::Allocation {
            kind: AllocFailureKind::Oom,
            message,
        }
    } else if DRIVER.iter().any(|p| message.contains(p)) {
        BackendError::Allocation {
            kind: AllocFailureKind::Driver,
            message,
        }
    } else if INVALID_INPUT.iter().any(|p| message.contains(p)) {
        BackendError::InvalidInput(message)
    } else {
        BackendError::Runtime(message)
    }
}

/// The useful part of an ONNX Runtime message for a client or operator: its first line, without
/// the node preamble and the source file and function that precede an arena failure.
pub fn concise(message: &str) -> String {
    let line = message.lines().next().unwrap_or(message);
    let line = line
        .find("Status Message: ")
        .map_or(line, |i| &line[i + "Status Message: ".len()..]);
    // "/onnxruntime_src/…/bfc_arena.cc:360 void* onnxruntime::BFCArena::… Available memory of …"
    match line.find("Available memory") {
        Some(i) => line[i..].trim().to_string(),
        None => line.trim().to_string(),
    }
}

pub use crate::core::signature::{ModelSignature, TensorSpec};

fn datatype_of(t: TensorElementType) -> Option<DataType> {
    Some(match t {
        TensorElementType::Bool => DataType::Bool,
        TensorElementType::Uint8 => DataType::Uint8,
        TensorElementType::Int8 => DataType::Int8,
        TensorElementType::Int16 => DataType::Int16,
        TensorElementType::Int32 => DataType::Int32,
        TensorElementType::Int64 => DataType::Int64,
        TensorElementType::Float16 => DataType::Fp16,
        TensorElementType::Float32 => DataType::Fp32,
        TensorElementType::Float64 => DataType::Fp64,
        _ => return None,
    })
}

fn spec(name: &str, ty: &ValueType) -> Result<TensorSpec, String> {
    match ty {
        ValueType::Tensor {
            ty,
            shape,
            dimension_symbols,
        } => Ok(TensorSpec {
            name: name.to_string(),
            datatype: datatype_of(*ty).ok_or_else(|| format!("`{name}` has unsupported element type {ty:?}"))?,
            shape: shape.iter().copied().collect(),
            symbols: dimension_symbols.iter().map(|s| s.to_string()).collect(),
        }),
        other => Err(format!("`{name}` is not a tensor ({other:?})")),
    }
}

/// The arena `session` allocates its runs (and the outputs bound to its device) from, when it
/// has one: the CUDA device's for CUDA pools, the host's otherwise. Beside the session builder
/// because both the backend's sessions and the graphs that move its caches are read through it.
fn arena_allocator(session: &Session, options: &SessionOptions) -> Option<Allocator> {
    let info = match &options.provider {
        Provider::Cuda(_) => MemoryInfo::new(
            AllocationDevice::CUDA,
            options.device_index as i32,
            AllocatorType::Arena,
            MemoryType::Default,
        ),
        _ => MemoryInfo::new(AllocationDevice::CPU, 0, AllocatorType::Arena, MemoryType::Default),
    };
    info.and_then(|info| Allocator::new(session, info)).ok()
}

/// Whether this ONNX Runtime build has the CUDA execution provider compiled in: the CPU-only
/// `onnxruntime` wheel has not, `onnxruntime-gpu` has. Compiled in is not yet loadable (its
/// CUDA and cuDNN libraries may be missing): [`probe_cuda`] tells.
pub fn cuda_compiled_in(_rt: &OnnxRuntime) -> Result<bool, String> {
    use ort::ep::ExecutionProvider;
    ep::CUDA::is_available().map_err(|e| e.to_string())
}

/// Open a session of the smallest bundled model with the CUDA provider on `device_index`, as a
/// `cuda` pool would: proves that the provider library, CUDA and cuDNN load and that the device
/// takes a session. The session (and its CUDA context) is dropped at once.
pub fn probe_cuda(rt: &OnnxRuntime, device_index: u32) -> Result<(), String> {
    let options = SessionOptions {
        provider: Provider::Cuda(CudaOptions {
            gpu_mem_limit: None,
            same_as_requested: true,
        }),
        device_index,
        intra_threads: 1,
        arena_shrinkage: false,
        quiet: false,
    };
    build_session(rt, crate::core::model::BuiltinModel::Classifier.bytes(), &options).map(drop)
}

/// Read a session's signature.
pub fn signature(session: &Session) -> Result<ModelSignature, String> {
    Ok(ModelSignature {
        inputs: session
            .inputs()
            .iter()
            .map(|o| spec(o.name(), o.dtype()))
            .collect::<Result<_, _>>()?,
        outputs: session
            .outputs()
            .iter()
            .map(|o| spec(o.name(), o.dtype()))
            .collect::<Result<_, _>>()?,
    })
}

fn to_value(tensor: Tensor) -> ort::Result<DynValue> {
    let shape = tensor.shape;
    Ok(each_variant!(tensor.data, v => ort::value::Tensor::from_array((shape, v))?.into_dyn()))
}

fn from_value(name: &str, value: &DynValue) -> Result<Tensor, String> {
    macro_rules! extract {
        ($t:ty, $variant:ident) => {{
            let (shape, data) = value.try_extract_tensor::<$t>().map_err(|e| e.to_string())?;
            (shape.iter().copied().collect(), TensorData::$variant(data.to_vec()))
        }};
    }
    let dtype = value
        .dtype()
        .tensor_type()
        .and_then(datatype_of)
        .ok_or_else(|| format!("output `{name}` has an unsupported type {:?}", value.dtype()))?;
    let (shape, data) = match dtype {
        DataType::Bool => extract!(bool, Bool),
        DataType::Uint8 => extract!(u8, Uint8),
        DataType::Int8 => extract!(i8, Int8),
        DataType::Int16 => extract!(i16, Int16),
        DataType::Int32 => extract!(i32, Int32),
        DataType::Int64 => extract!(i64, Int64),
        DataType::Fp16 => extract!(half::f16, Fp16),
        DataType::Fp32 => extract!(f32, Fp32),
        DataType::Fp64 => extract!(f64, Fp64),
    };
    Ok(Tensor {
        name: name.to_string(),
        shape,
        data,
    })
}

/// Run `session` on `inputs`, returning the outputs named in `wanted` (all when empty), in the
/// order asked for.
pub fn run(
    session: &mut Session,
    inputs: Vec<Tensor>,
    wanted: &[String],
    options: Option<&RunOptions>,
) -> Result<Vec<Tensor>, BackendError> {
    let values = inputs
        .into_iter()
        .map(|t| {
            let name = t.name.clone();
            to_value(t).map(|v| (name, SessionInputValue::from(v)))
        })
        .collect::<ort::Result<Vec<_>>>()
        .map_err(|e| classify(&e.to_string()))?;
    run_values(session, values, wanted, options)
}

/// [`run`] on inputs borrowed from bytes that lie elsewhere (a worker's shared memory): each
/// is handed to ONNX Runtime where it lies when its bytes are aligned for their type (on a
/// little-endian machine), and decoded first otherwise.
pub fn run_views(
    session: &mut Session,
    inputs: &[TensorView<'_>],
    wanted: &[String],
    options: Option<&RunOptions>,
) -> Result<Vec<Tensor>, BackendError> {
    let values = inputs
        .iter()
        .map(|view| view_value(view).map(|v| (view.name.to_string(), v)))
        .collect::<Result<Vec<_>, BackendError>>()?;
    run_values(session, values, wanted, options)
}

/// One borrowed input as ONNX Runtime takes it: in place, or decoded.
#[allow(unsafe_code)]
fn view_value<'a>(view: &TensorView<'a>) -> Result<SessionInputValue<'a>, BackendError> {
    let bytes = view.bytes;
    macro_rules! in_place {
        ($t:ty) => {{
            if cfg!(target_endian = "little") && bytes.as_ptr().align_offset(std::mem::align_of::<$t>()) == 0 {
                // SAFETY: the bytes are aligned for `$t` (checked), whole elements (the wire's
                // decoding checked their length against the shape), every bit pattern is a
                // valid `$t`, and the slice borrows them for as long as the view does.
                let data = unsafe {
                    std::slice::from_raw_parts(bytes.as_ptr().cast::<$t>(), bytes.len() / std::mem::size_of::<$t>())
                };
                let shape: Vec<i64> = view.shape.to_vec();
                return ort::value::TensorRef::from_array_view((shape, data))
                    .map(SessionInputValue::from)
                    .map_err(|e| classify(&e.to_string()));
            }
        }};
    }
    match view.datatype {
        // BOOL bytes must be checked (0 or 1): decoded below.
        DataType::Bool => {}
        DataType::Uint8 => in_place!(u8),
        DataType::Int8 => in_place!(i8),
        DataType::Int16 => in_place!(i16),
        DataType::Int32 => in_place!(i32),
        DataType::Int64 => in_place!(i64),
        DataType::Fp16 => in_place!(half::f16),
        DataType::Fp32 => in_place!(f32),
        DataType::Fp64 => in_place!(f64),
    }
    let tensor = view.to_tensor().map_err(BackendError::InvalidInput)?;
    to_value(tensor)
        .map(SessionInputValue::from)
        .map_err(|e| classify(&e.to_string()))
}

fn run_values(
    session: &mut Session,
    values: Vec<(String, SessionInputValue<'_>)>,
    wanted: &[String],
    options: Option<&RunOptions>,
) -> Result<Vec<Tensor>, BackendError> {
    let outputs = match options {
        Some(options) => session.run_with_options(values, options),
        None => session.run(values),
    }
    .map_err(|e| classify(&e.to_string()))?;
    let mut result = Vec::new();
    if wanted.is_empty() {
        for (name, value) in outputs.iter() {
            result.push(from_value(name, &value).map_err(BackendError::Runtime)?);
        }
    } else {
        for name in wanted {
            let value = outputs
                .get(name)
                .ok_or_else(|| BackendError::Runtime(format!("model produced no output `{name}`")))?;
            result.push(from_value(name, value).map_err(BackendError::Runtime)?);
        }
    }
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_and_cuda_failures_are_allocation_errors() {
        let bfc = "Non-zero status code returned while running MatMul node. Name:'n' Status Message: \
                   BFCArena::AllocateRawInternal Available memory of 1024 is smaller than requested bytes of 4096";
        assert!(matches!(
            classify(bfc),
            BackendError::Allocation {
                kind: AllocFailureKind::Oom,
                ..
            }
        ));
        let cuda = "CUDA failure 2: out of memory ; GPU=0";
        assert!(matches!(
            classify(cuda),
            BackendError::Allocation {
                kind: AllocFailureKind::Oom,
                ..
            }
        ));
        let reset = "CUDA error cudaErrorDevicesUnavailable: all CUDA-capable devices are busy";
        assert!(matches!(
            classify(reset),
            BackendError::Allocation {
                kind: AllocFailureKind::Driver,
                ..
            }
        ));
        assert!(matches!(
            classify("Invalid rank for input: x"),
            BackendError::InvalidInput(_)
        ));
        let reshape = "Non-zero status code returned while running Reshape node. Name:'r' Status Message: \
                       The input tensor cannot be reshaped to the requested shape. Input shape:{0,4}, requested shape:{-1,0}";
        assert!(matches!(classify(reshape), BackendError::InvalidInput(_)));
        let broadcast = "Non-zero status code returned while running Add node. Name:'a' Status Message: \
                         Attempting to broadcast an axis by a dimension other than 1. 3 by 5";
        assert!(matches!(classify(broadcast), BackendError::InvalidInput(_)));
        assert!(matches!(classify("something else"), BackendError::Runtime(_)));
    }

    #[test]
    fn messages_are_trimmed_to_the_useful_part() {
        let msg = "Non-zero status code returned while running FusedMatMul node. Name:'scores' Status Message: \
                   /onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:360 void* onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*) \
                   Available memory of 45416192 is smaller than requested bytes of 67108864\n";
        assert_eq!(
            concise(msg),
            "Available memory of 45416192 is smaller than requested bytes of 67108864"
        );
        let alloc = "/onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:360 void* f() Available memory of 1 is smaller than requested bytes of 2";
        assert_eq!(
            concise(alloc),
            "Available memory of 1 is smaller than requested bytes of 2"
        );
        assert_eq!(concise("plain\nsecond"), "plain");
    }

    #[test]
    fn version_comes_from_build_info_or_file_name() {
        assert_eq!(
            version_from_build_info("ORT Build Info: git-branch=rel-1.31.1, git-commit-id=abc").as_deref(),
            Some("1.31.1")
        );
        assert_eq!(version_from_build_info("ORT Build Info: git-branch=main"), None);
        assert_eq!(
            version_from_file_name(Path::new("/x/libonnxruntime.so.1.31.1")).as_deref(),
            Some("1.31.1")
        );
    }

    #[test]
    fn an_explicit_library_path_that_is_missing_is_reported_not_replaced() {
        let err = locate_library(Some(Path::new("/nonexistent/libonnxruntime.so"))).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("/nonexistent/libonnxruntime.so (from onnxruntime.library)"),
            "{text}"
        );
        assert!(text.contains("make deps"), "{text}");
    }
}
