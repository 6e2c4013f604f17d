//! The process's allocators: hot memory reused between requests, freed memory returned to the
//! operating system soon after a burst.
//!
//! Two allocators serve the process, and both are set up here, once, at start:
//! - **Rust's allocations** (request bodies, decoded tensors, answers) go to mimalloc, the
//!   binary's global allocator (`src/main.rs`), with `purge_delay` 0 and `arena_eager_commit` 0
//!   (memory its arenas no longer use is returned at once; an arena is committed as it is used,
//!   not when reserved). A request's large buffers are reused from one request to the next:
//!   with the bundled encoder at seq 1024, 3–4 page faults per request against 145–183 with glibc
//!   below (it maps and unmaps every block over 256 KiB) and 6–8 with jemalloc (`dirty_decay_ms`
//!   1000, `muzzy_decay_ms` 0); `docs/performance-log.md` has the table (2026-12-02), and why CPU
//!   time per request could not tell them apart on a 2-core VM.
//!   mimalloc's defaults (a 1 s purge delay, applied only when the process allocates again) left
//!   85 MiB resident for good after the burst of `tests/it/memory.rs`; with these options it is
//!   back within 16 MiB. An operator's `MIMALLOC_PURGE_DELAY` or `MIMALLOC_ARENA_EAGER_COMMIT`
//!   in the environment is kept.
//! - **ONNX Runtime's** (its arena's chunks, which a pool returns when idle: see
//!   `pools[].memory.idle_release`) and other C and C++ libraries' go to glibc's malloc. glibc
//!   serves large blocks with `mmap` only up to a threshold that it raises each time such a block
//!   is freed, so after one burst every later large block comes from the heap and stays resident
//!   after it is freed. Fixing the thresholds turns that adjustment off: blocks above 256 KiB are
//!   mapped and unmapped with each use, and the heap's free top is trimmed above 256 KiB. Without
//!   them, 86 MiB stayed resident after the same burst.

/// glibc: blocks at least this large are mapped on their own and returned when freed.
pub const MMAP_THRESHOLD: usize = 256 << 10;
/// glibc: free memory above this at the heap's top is returned.
pub const TRIM_THRESHOLD: usize = 256 << 10;

/// mimalloc's options set at start: (its `mi_option_t`, the environment variable that overrides
/// it, the value). The numbers are mimalloc v3's (`mimalloc.h`, `mi_option_e`), of the
/// `libmimalloc-sys` version pinned in `Cargo.toml`.
const MIMALLOC_OPTIONS: [(libmimalloc_sys::mi_option_t, &std::ffi::CStr, std::ffi::c_long); 2] = [
    (PURGE_DELAY, c"MIMALLOC_PURGE_DELAY", 0),
    (ARENA_EAGER_COMMIT, c"MIMALLOC_ARENA_EAGER_COMMIT", 0),
];
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
const ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;

/// mimalloc's options are set before `main`, from the executable's `.init_array` as a C
/// constructor is: mimalloc reserves its first arena at the first allocation, which the Rust
/// runtime makes before `main`, and an arena reserved with eager commit kept 26–32 MiB more
/// resident after the burst (and 10 MiB more at rest) than one reserved after the options.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
#[used]
#[unsafe(link_section = ".init_array")]
static SET_MIMALLOC_OPTIONS: extern "C" fn() = set_mimalloc_options;

#[allow(unsafe_code)]
extern "C" fn set_mimalloc_options() {
    for (option, variable, value) in MIMALLOC_OPTIONS {
        // SAFETY: getenv reads the environment, which nothing changes while the process starts
        // (std::env would allocate, before the options are set). mi_option_set stores an
        // option's value and may be called at any time.
        unsafe {
            if libc::getenv(variable.as_ptr()).is_null() {
                libmimalloc_sys::mi_option_set(option, value);
            }
        }
    }
}

/// Set both allocators up. Call once, first, before the process starts its threads.
pub fn set_up_allocators() {
    // On Linux the constructor above set mimalloc's options before `main` (rustc keeps a
    // `#[used]` static linked); elsewhere they hold from here on.
    #[cfg(not(target_os = "linux"))]
    set_mimalloc_options();
    set_glibc_thresholds();
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn set_glibc_thresholds() {
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
fn set_glibc_thresholds() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(unsafe_code)]
    fn get(option: libmimalloc_sys::mi_option_t) -> std::ffi::c_long {
        // SAFETY: mi_option_get reads an option's value; any option number is accepted.
        unsafe { libmimalloc_sys::mi_option_get(option) }
    }

    /// The constructor ran before the tests (this test binary links it too): both options hold
    /// their values, where the environment does not set them, and not mimalloc's defaults
    /// (purge_delay 1000 ms, arena_eager_commit 2).
    #[test]
    fn mimallocs_options_are_set_before_main() {
        for (option, variable, value) in MIMALLOC_OPTIONS {
            if std::env::var_os(variable.to_str().unwrap()).is_none() {
                assert_eq!(get(option), value, "{variable:?}");
            }
        }
    }
}
