//! Memory mapped read-only, shared between processes: the optimized cache's weights file as
//! the host tier holds it (its pages are the page cache's, shared with every session and worker
//! process that maps the same file, so holding them costs the machine one copy however many map
//! it), and a sealed `memfd` holding an ORT-format graph, which a worker process maps
//! (`/proc/<pid>/fd/<fd>`) instead of being sent a copy over its socket.

#![allow(unsafe_code)]

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;

use crate::core::model::SharedBytes;

/// A read-only shared mapping of a whole file.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
    /// A sealed memfd's file, kept open so that another process can open it too.
    sealed: Option<File>,
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
        Mapping::map(&file, path)
    }

    /// `bytes` copied into a new memfd, sealed (no process can change, grow or shrink it
    /// afterwards), and mapped: [`SharedBytes::fd`] answers its descriptor.
    pub fn sealed(bytes: &[u8]) -> Result<Mapping, String> {
        // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1.
        let fd =
            unsafe { libc::memfd_create(c"vramguard-model".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a new descriptor nobody else owns.
        let mut file = unsafe { File::from_raw_fd(fd) };
        file.write_all(bytes)
            .map_err(|e| format!("writing the model's memfd: {e}"))?;
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on a descriptor this process owns, with an int argument.
        if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } < 0 {
            return Err(format!(
                "sealing the model's memfd: {}",
                std::io::Error::last_os_error()
            ));
        }
        let mut mapping = Mapping::map(&file, Path::new("the model's memfd"))?;
        mapping.sealed = Some(file);
        Ok(mapping)
    }

    fn map(file: &File, path: &Path) -> Result<Mapping, String> {
        let size = file.metadata().map_err(|e| format!("{}: {e}", path.display()))?.len();
        let len = usize::try_from(size).map_err(|_| format!("{} is too large to map", path.display()))?;
        if len == 0 {
            return Ok(Mapping {
                ptr: std::ptr::null_mut(),
                len: 0,
                sealed: None,
            });
        }
        // SAFETY: a private read-only mapping of `len` bytes of a file that long; the kernel
        // keeps it valid after `file` is closed, until `munmap` in `drop`.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                // Private and read-only, it still maps the file's own pages (nothing is ever
                // written to copy them); a sealed memfd refuses shared mappings before Linux 6.7.
                libc::MAP_PRIVATE,
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
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
            sealed: None,
        })
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

impl SharedBytes for Mapping {
    fn bytes(&self) -> &[u8] {
        Mapping::bytes(self)
    }

    fn fd(&self) -> Option<i32> {
        self.sealed.as_ref().map(AsRawFd::as_raw_fd)
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
