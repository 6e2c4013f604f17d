//! Freed heap memory goes back to the operating system.
//!
//! glibc's malloc serves large blocks with `mmap` only up to a threshold that it raises each
//! time such a block is freed, so after one burst of large requests (bodies, tensors, JSON
//! answers) every later large block comes from the heap and stays resident after it is freed:
//! measured here, a burst of four 4 MiB requests with 40 MB JSON answers left the server at
//! 1.2 GB resident for good (50 MB at start). Fixing the thresholds turns that adjustment off:
//! blocks above 256 KiB are mapped and unmapped with each use, and the heap's free top is
//! trimmed above 256 KiB. The same burst then leaves ~70 MB (with the CPU arena's shrinkage,
//! see `pools[].memory.arena_shrinkage`).

/// Blocks at least this large are mapped on their own and returned when freed.
pub const MMAP_THRESHOLD: usize = 256 << 10;
/// Free memory above this at the heap's top is returned.
pub const TRIM_THRESHOLD: usize = 256 << 10;

/// Set the allocator's thresholds (glibc only; other C libraries keep their own behaviour).
/// Call once, before the process starts its threads.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn return_freed_memory() {
    // SAFETY: mallopt only changes allocator parameters; it is called before other threads
    // allocate, with parameters and values glibc documents.
    let ok = unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int) == 1
    };
    if !ok {
        tracing::warn!("could not set malloc thresholds; freed memory may stay resident after large requests");
    }
}

/// Nothing to do outside glibc.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn return_freed_memory() {}
