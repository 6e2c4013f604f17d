//! Building a session for a pool: its options per provider, from an ONNX graph (rewritten as
//! `positions.rs` says), from the optimized cache's mapped entry (a CPU pool's: loaded from its
//! file, its weights mapped) or from its ORT-format graph (a simulated pool's: its initializers
//! used where they lie, copied once into the device's arena); see `optimized.rs`.

use ort::ep;
use ort::session::{Session, builder::GraphOptimizationLevel, builder::SessionBuilder};

use super::{OnnxRuntime, external, positions};
use crate::config::{CudaOptions, Provider};
use crate::core::model::{ModelBytes, ModelData};

/// How a session should be built for a pool.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// Provider (and its options).
    pub provider: Provider,
    /// CUDA device index for `cuda` pools.
    pub device_index: u32,
    /// Intra-op threads.
    pub intra_threads: usize,
    /// Shrink the arena after every run (`memory.enable_memory_arena_shrinkage`).
    pub arena_shrinkage: bool,
    /// Log only fatal errors (measuring runs, where a refused input size is expected).
    pub quiet: bool,
}

impl SessionOptions {
    /// A quiet CPU session of one intra-op thread whose arena keeps its blocks: what benches
    /// and measurements run models in.
    pub fn quiet_cpu() -> SessionOptions {
        SessionOptions {
            provider: Provider::Cpu,
            device_index: 0,
            intra_threads: 1,
            arena_shrinkage: false,
            quiet: true,
        }
    }
}

/// Whether `bytes` are an ORT-format model: the flatbuffer's file identifier, `ORTM`.
pub fn is_ort_format(bytes: &[u8]) -> bool {
    bytes.get(4..8) == Some(b"ORTM".as_slice())
}

/// A session, and the bytes its initializers lie in when it uses them in place: they live as
/// long as it does (the session is dropped first: fields drop in order).
pub struct HeldSession {
    /// The session.
    pub session: Session,
    /// The ORT-format bytes it reads its weights from, when it does.
    pub keeps: Option<ModelBytes>,
}

// The builder's error type carries the builder back; only its message matters here.
fn msg<T>(e: ort::Error<T>) -> String {
    e.to_string()
}

/// A builder with `options`' provider, optimization level and threads.
pub(super) fn builder(rt: &OnnxRuntime, options: &SessionOptions) -> Result<SessionBuilder, String> {
    let mut builder = Session::builder(rt.env())
        .map_err(msg)?
        .with_optimization_level(GraphOptimizationLevel::Level3)
        .map_err(msg)?
        .with_intra_threads(options.intra_threads)
        .map_err(msg)?
        .with_inter_threads(1)
        .map_err(msg)?;
    if options.quiet {
        builder = builder.with_log_level(ort::logging::LogLevel::Fatal).map_err(msg)?;
    }
    Ok(match &options.provider {
        Provider::Cpu => builder
            .with_execution_providers([ep::CPU::default().with_arena_allocator(true).build()])
            .map_err(msg)?,
        // As on a GPU, a session's weights live in the device's memory: prepacking would keep
        // copies of them outside the capped arena (the originals freed), and the device would
        // seem to hold models it does not.
        Provider::Simulated => builder
            .with_execution_providers([ep::CPU::default().with_arena_allocator(true).build()])
            .map_err(msg)?
            .with_env_allocators()
            .map_err(msg)?
            .with_prepacking(false)
            .map_err(msg)?,
        Provider::Cuda(cuda) => builder
            .with_execution_providers([cuda_provider(cuda, options.device_index)])
            .map_err(|e| format!("CUDA execution provider unavailable: {e}"))?,
        Provider::Remote(_) => return Err("a remote pool runs its models on the remote server".into()),
    })
}

/// Commit `builder` on `model`, an ONNX graph: told where its external data lie, and a decoder
/// that rotates by slot given its rows' positions (see `positions.rs`; an ORT-format graph was
/// optimized from the rewritten one).
pub(super) fn build_with(builder: SessionBuilder, model: ModelData<'_>) -> Result<Session, String> {
    let rewritten = positions::with_position_ids(model.graph);
    with_folder(builder, &model)?
        .commit_from_memory(rewritten.as_deref().unwrap_or(model.graph))
        .map_err(msg)
}

/// `builder` told where `model`'s external data lie: a graph built from bytes has no path of
/// its own, and ONNX Runtime would look for them in the working directory, and refuse them.
fn with_folder(builder: SessionBuilder, model: &ModelData<'_>) -> Result<SessionBuilder, String> {
    match model.folder {
        Some(folder) => {
            let folder = folder
                .to_str()
                .ok_or_else(|| format!("the model's folder {} is not valid UTF-8", folder.display()))?;
            builder.with_config_entry(external::FOLDER_ENTRY, folder).map_err(msg)
        }
        None => Ok(builder),
    }
}

/// Build a session for `model` under `options`, its external data read from its folder whatever
/// the working directory (bytes alone, `&[u8]`, are a graph held only in memory). CUDA
/// registration failure is an error, never a silent fallback to the CPU provider.
pub fn build_session<'m>(
    rt: &OnnxRuntime,
    model: impl Into<ModelData<'m>>,
    options: &SessionOptions,
) -> Result<Session, String> {
    build_held(rt, model.into(), options).map(|held| {
        // Only an ORT-format graph handed over with its owner is used in place; these callers
        // keep no owner, so the session owns its weights.
        debug_assert!(held.keeps.is_none());
        held.session
    })
}

/// [`build_session`], and for an ORT-format graph on a CPU or simulated pool handed over with
/// the shared bytes it lies in ([`ModelData::owned_by`]), a session that uses its initializers
/// there (`session.use_ort_model_bytes_for_initializers`): on a CPU pool no second copy of the
/// weights in host memory; on a simulated one a single copy in the device's arena. A CUDA
/// pool's session copies them to its device, as from ONNX. A CPU pool's mapped entry
/// ([`ModelData::file`]) is loaded from its file, its weights mapped (see `build_mapped`).
pub fn build_held(rt: &OnnxRuntime, model: ModelData<'_>, options: &SessionOptions) -> Result<HeldSession, String> {
    let mut builder = builder(rt, options)?;
    if let Some(file) = model.file {
        return build_mapped(builder, file, &options.provider).map(|session| HeldSession { session, keeps: None });
    }
    if !is_ort_format(model.graph) {
        return build_with(builder, model).map(|session| HeldSession { session, keeps: None });
    }
    builder = with_folder(builder, &model)?;
    // On the simulated device too: from bytes in place, ONNX Runtime copies the initializers
    // into the device's capped arena once, as from ONNX (16 MiB for a 16 MiB model); from a copy
    // of the bytes it held them twice there (32 MiB: the loaded graph's tensors, allocated from
    // the device's arena since its sessions use the environment's allocators, and the
    // session's own), so a model that fits from ONNX would not fit from the host tier.
    let in_place = match (&options.provider, model.owned_by()) {
        (Provider::Cpu | Provider::Simulated, Some(owner)) => Some(owner.clone()),
        _ => None,
    };
    if in_place.is_some() {
        for key in [
            "session.use_ort_model_bytes_directly",
            "session.use_ort_model_bytes_for_initializers",
        ] {
            builder = builder.with_config_entry(key, "1").map_err(msg)?;
        }
    }
    // SAFETY (of the bytes' lifetime, which ONNX Runtime reads for as long as the session
    // lives when told to use them in place): `keeps` holds the shared bytes `model.graph` is
    // (checked by `owned_by`), and drops after the session.
    let session = builder.commit_from_memory(model.graph).map_err(msg)?;
    Ok(HeldSession {
        session,
        keeps: in_place,
    })
}

/// A CPU session of the optimized cache's mapped entry whose graph is `file`: loaded from its
/// path, so ONNX Runtime maps the weights file beside it and uses its weights and pre-packed
/// buffers where they lie, shared with every session that maps it. Optimized already, for this
/// CPU (the entry's key says so): optimizing again would only take time.
fn build_mapped(builder: SessionBuilder, file: &std::path::Path, provider: &Provider) -> Result<Session, String> {
    if !matches!(provider, Provider::Cpu) {
        // A device holds its weights itself: mapped host pages would be weights it does not
        // hold (simulated pools take the ORT form, see `optimized::cache_form`).
        return Err(format!(
            "a mapped optimized graph is for CPU pools, not `{}` ones",
            provider.label()
        ));
    }
    builder
        .with_optimization_level(GraphOptimizationLevel::Disable)
        .map_err(msg)?
        .commit_from_file(file)
        .map_err(msg)
}

fn cuda_provider(cuda: &CudaOptions, device_index: u32) -> ep::ExecutionProviderDispatch {
    let mut provider = ep::CUDA::default()
        .with_device_id(device_index as i32)
        .with_arena_extend_strategy(if cuda.same_as_requested {
            ep::ArenaExtendStrategy::SameAsRequested
        } else {
            ep::ArenaExtendStrategy::NextPowerOfTwo
        });
    if let Some(limit) = cuda.gpu_mem_limit {
        provider = provider.with_memory_limit(usize::try_from(limit).unwrap_or(usize::MAX));
    }
    provider.build().error_on_failure()
}
