//! A file mapped read-only: the optimized cache's weights as the host tier holds them. The
//! pages are the page cache's, shared with every session and worker process that maps the same
//! file, so holding them costs the machine one copy however many map it.

#![allow(unsafe_code)]

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

/// A read-only shared mapping of a whole file.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is read-only and owned by this value, unmapped only in `drop`; reading
// it from several threads at once is sound.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mapping({} bytes)", self.len)
    }
}

impl Mapping {
    /// Map `path` whole. An empty file maps as no bytes.
    pub fn of(path: &Path) -> Result<Mapping, String> {
        let file = File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        let size = file.metadata().map_err(|e| format!("{}: {e}", path.display()))?.len();
        let len = usize::try_from(size).map_err(|_| format!("{} is too large to map", path.display()))?;
        if len == 0 {
            return Ok(Mapping {
                ptr: std::ptr::null_mut(),
                len: 0,
            });
        }
        // SAFETY: a private read-only mapping of `len` bytes of a file that long; the kernel
        // keeps it valid after `file` is closed, until `munmap` in `drop`.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!(
                "cannot map {}: {}",
                path.display(),
                std::io::Error::last_os_error()
            ));
        }
        Ok(Mapping { ptr: ptr.cast(), len })
    }

    /// Its bytes.
    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` maps `len` readable bytes for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        self.len as u64
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: `ptr` and `len` are the mapping made in `of`, unmapped only here.
            unsafe {
                libc::munmap(self.ptr.cast(), self.len);
            }
        }
    }
}
