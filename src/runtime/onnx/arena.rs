//! The one place that calls ONNX Runtime's C API directly, for what the `ort` crate does not
//! wrap: registering a capped arena as the environment's CPU allocator (the simulated
//! accelerator) and reading allocator statistics (`AllocatorGetStats`).
//!
//! Every function here checks the returned `OrtStatus`, converts it to an error and releases it,
//! and releases every object it creates.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_char};
use std::ptr;

use ort::AsPointer;
use ort::environment::Environment;
use ort::sys::{OrtAllocator, OrtAllocatorType, OrtMemType, OrtMemoryInfo, OrtStatusPtr};

pub use crate::core::backend::ArenaStats;

/// Turn an `OrtStatus` into a `Result`, releasing it.
fn check(status: OrtStatusPtr, what: &str) -> Result<(), String> {
    if status.0.is_null() {
        return Ok(());
    }
    let api = ort::api();
    // SAFETY: a non-null status is a valid OrtStatus until released below; the message pointer is
    // a NUL-terminated string owned by the status, copied before the release.
    let message = unsafe {
        let msg = (api.GetErrorMessage)(status.0);
        let text = if msg.is_null() {
            String::from("(no message)")
        } else {
            CStr::from_ptr(msg).to_string_lossy().into_owned()
        };
        (api.ReleaseStatus)(status.0);
        text
    };
    Err(format!("{what}: {message}"))
}

/// CPU memory info for the arena allocator, released on drop.
struct CpuMemoryInfo(*mut OrtMemoryInfo);

impl CpuMemoryInfo {
    fn new() -> Result<Self, String> {
        let mut info = ptr::null_mut();
        // SAFETY: `info` is a valid out-pointer; on success it holds a new OrtMemoryInfo.
        check(
            unsafe {
                (ort::api().CreateCpuMemoryInfo)(
                    OrtAllocatorType::OrtArenaAllocator,
                    OrtMemType::OrtMemTypeDefault,
                    &mut info,
                )
            },
            "CreateCpuMemoryInfo",
        )?;
        Ok(Self(info))
    }
}

impl Drop for CpuMemoryInfo {
    fn drop(&mut self) {
        // SAFETY: created by CreateCpuMemoryInfo and released exactly once.
        unsafe { (ort::api().ReleaseMemoryInfo)(self.0) }
    }
}

/// Register a BFC arena capped at `max_bytes` as `env`'s shared CPU allocator. Sessions built
/// with `session.use_env_allocators=1` then allocate from it, so a run that needs more than the
/// cap fails inside ONNX Runtime (`BFCArena::AllocateRawInternal`) exactly as a full GPU would.
pub fn register_capped_cpu_arena(env: &Environment, max_bytes: u64) -> Result<(), String> {
    let info = CpuMemoryInfo::new()?;
    let keys: [CString; 2] = [CString::from(c"max_mem"), CString::from(c"arena_extend_strategy")];
    let key_ptrs: [*const c_char; 2] = [keys[0].as_ptr(), keys[1].as_ptr()];
    // Extend by what is requested (1 = kSameAsRequested) so reserved bytes track real demand
    // instead of doubling past the simulated capacity.
    let values: [usize; 2] = [usize::try_from(max_bytes).unwrap_or(usize::MAX), 1];
    let api = ort::api();
    let mut cfg = ptr::null_mut();
    // SAFETY: key and value arrays have the same length and outlive the call.
    check(
        unsafe { (api.CreateArenaCfgV2)(key_ptrs.as_ptr(), values.as_ptr(), keys.len(), &mut cfg) },
        "CreateArenaCfgV2",
    )?;
    // SAFETY: env, memory info and arena config are valid; ONNX Runtime copies the config.
    let registered = check(
        unsafe { (api.CreateAndRegisterAllocator)(env.ptr().cast_mut(), info.0, cfg) },
        "CreateAndRegisterAllocator",
    );
    // SAFETY: created above, released exactly once.
    unsafe { (api.ReleaseArenaCfg)(cfg) };
    registered
}

/// Statistics of a session's allocator. For a session using the environment's allocators (the
/// simulated device) this is the shared capped arena; otherwise the session's own CPU arena.
pub fn allocator_stats(allocator: &ort::memory::Allocator) -> Result<ArenaStats, String> {
    let allocator: *const OrtAllocator = allocator.ptr();
    let api = ort::api();
    let mut kvps = ptr::null_mut();
    // SAFETY: `allocator` is a live allocator; `kvps` receives a new OrtKeyValuePairs.
    check(
        unsafe { (api.AllocatorGetStats)(allocator, &mut kvps) },
        "AllocatorGetStats",
    )?;
    let mut stats = ArenaStats::default();
    let mut keys: *const *const c_char = ptr::null();
    let mut values: *const *const c_char = ptr::null();
    let mut count = 0usize;
    // SAFETY: kvps is valid until released; keys/values point at `count` NUL-terminated strings
    // owned by kvps, all read before the release.
    unsafe {
        (api.GetKeyValuePairs)(kvps, &mut keys, &mut values, &mut count);
        for i in 0..count {
            let key = CStr::from_ptr(*keys.add(i)).to_string_lossy();
            let value: u64 = CStr::from_ptr(*values.add(i)).to_string_lossy().parse().unwrap_or(0);
            match key.as_ref() {
                "TotalAllocated" => stats.reserved_bytes = value,
                "InUse" => stats.active_bytes = value,
                "MaxInUse" => stats.peak_active_bytes = value,
                "NumAllocs" => stats.allocations = value,
                "NumReserves" => stats.reserves = value,
                "NumArenaExtensions" => stats.extensions = value,
                "NumArenaShrinkages" => stats.shrinkages = value,
                "Limit" => stats.limit_bytes = (value > 0).then_some(value),
                _ => {}
            }
        }
        (api.ReleaseKeyValuePairs)(kvps);
    }
    Ok(stats)
}

/// Bytes held in an arena on behalf of a workload outside vramguard (the simulated device's
/// external pressure). It is a real allocation from the arena, so runs that no longer fit fail
/// inside ONNX Runtime, exactly as when another process takes GPU memory.
pub struct ArenaHold {
    allocator: ort::memory::Allocator,
    block: Option<(std::ptr::NonNull<std::ffi::c_void>, u64)>,
}

// SAFETY: the block pointer is owned by this value and only used through `&mut self` (callers
// keep it behind a Mutex); ONNX Runtime allocators are thread-safe and `Allocator` is Send.
unsafe impl Send for ArenaHold {}

impl std::fmt::Debug for ArenaHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaHold").field("bytes", &self.bytes()).finish()
    }
}

impl ArenaHold {
    /// Hold nothing yet, allocating from `allocator` when asked.
    pub fn new(allocator: ort::memory::Allocator) -> Self {
        Self { allocator, block: None }
    }

    /// Bytes currently held.
    pub fn bytes(&self) -> u64 {
        self.block.map_or(0, |(_, n)| n)
    }

    /// Statistics of the arena this hold allocates from.
    pub fn stats(&self) -> Result<ArenaStats, String> {
        allocator_stats(&self.allocator)
    }

    fn release(&mut self) {
        if let Some((ptr, _)) = self.block.take() {
            // SAFETY: `ptr` came from `self.allocator.alloc` and is freed exactly once.
            unsafe { self.allocator.free(ptr.as_ptr()) };
        }
    }

    fn hold(&mut self, bytes: u64) -> Result<(), String> {
        if bytes == 0 {
            return Ok(());
        }
        let len = usize::try_from(bytes).map_err(|_| format!("{bytes} bytes is too large"))?;
        let block = self.allocator.alloc::<u8>(len).map_err(|e| e.to_string())?;
        let ptr = std::ptr::NonNull::new(block.into_raw()).ok_or("the arena returned a null block")?;
        self.block = Some((ptr, bytes));
        Ok(())
    }

    /// Hold exactly `bytes` (0 releases). If the arena cannot give that much, the previous hold
    /// is restored when possible and the arena's own message is returned.
    pub fn set(&mut self, bytes: u64) -> Result<(), String> {
        let previous = self.bytes();
        self.release();
        match self.hold(bytes) {
            Ok(()) => Ok(()),
            Err(e) => {
                if self.hold(previous).is_err() {
                    self.block = None;
                }
                Err(e)
            }
        }
    }
}

impl Drop for ArenaHold {
    fn drop(&mut self) {
        self.release();
    }
}
