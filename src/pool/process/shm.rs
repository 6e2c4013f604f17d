//! Shared memory for a run's tensors: a session connection's two regions, one the pool writes
//! a run's inputs into and one the worker writes its outputs into, so a large tensor crosses
//! as one copy in and one copy out of a mapping both processes see, with no bytes through the
//! socket (a Unix socket's buffer is ~200 KiB: a larger frame is a ping-pong of wake-ups).
//!
//! A region is a `memfd` the pool creates and the worker opens through
//! `/proc/<pool's pid>/fd/<fd>` (only the pool's own user, and its child, may). The two take
//! turns: the pool touches a region only before it sends a run and after the answer, the
//! worker only in between, so neither reads what the other is writing.

#![allow(unsafe_code)]

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};

/// The smallest region made: most tensors above the inline threshold fit at once.
const MIN_REGION: usize = 1 << 20;
/// The largest: a run's tensors beyond this cross inline, through the socket.
pub const MAX_REGION: usize = 1 << 30;
/// Tensors smaller than this cross inline: the frame is one write anyway.
pub const SHARED_FROM: usize = 16 << 10;

/// A shared mapping of a memfd.
pub struct Region {
    file: File,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is owned by the region and unmapped only in `drop`; the pointer is
// used only through `&self`/`&mut self`, so moving the region between threads is sound.
unsafe impl Send for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Region(fd {}, {} bytes)", self.file.as_raw_fd(), self.len)
    }
}

impl Region {
    /// A new region of at least `need` bytes (a power of two, at least 1 MiB), or `None` when
    /// `need` is over [`MAX_REGION`].
    pub fn create(need: usize) -> Result<Option<Region>, String> {
        if need > MAX_REGION {
            return Ok(None);
        }
        let len = need.max(MIN_REGION).next_power_of_two();
        // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1.
        let fd = unsafe { libc::memfd_create(c"vramguard-tensors".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a new descriptor nobody else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len as u64)
            .map_err(|e| format!("sizing shared memory: {e}"))?;
        map(file, len).map(Some)
    }

    /// Open the region `fd` of process `pid` (the pool), `len` bytes long.
    pub fn open(pid: u32, fd: i32, len: u64) -> Result<Region, String> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| format!("cannot open the pool's shared memory {path}: {e}"))?;
        let size = file.metadata().map_err(|e| format!("{path}: {e}"))?.len();
        let fits = usize::try_from(len)
            .ok()
            .filter(|&l| l as u64 <= size && l <= MAX_REGION);
        let fits = fits.ok_or_else(|| format!("{path} has {size} bytes, not the {len} announced"))?;
        map(file, fits)
    }

    /// Its descriptor, for the worker to open.
    pub fn fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Its bytes. The other process does not write them meanwhile: see the module's rule.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` bytes for as long as `self` lives; by the protocol the
        // other process writes only while this one waits for its answer.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Its bytes, to write. The other process does not read them meanwhile.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes this the only view in this process.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `len` are the mapping made in `map`, unmapped only here.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

fn map(file: File, len: usize) -> Result<Region, String> {
    // SAFETY: a shared read-write mapping of `len` bytes of a file at least that long; the
    // kernel picks the address.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(format!("mmap of {len} bytes: {}", std::io::Error::last_os_error()));
    }
    Ok(Region {
        file,
        ptr: ptr.cast(),
        len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_opened_through_proc_shares_its_bytes() {
        let mut ours = Region::create(100).unwrap().unwrap();
        assert_eq!(ours.len(), MIN_REGION);
        let mut theirs = Region::open(std::process::id(), ours.fd(), ours.len() as u64).unwrap();
        ours.bytes_mut()[..5].copy_from_slice(b"hello");
        assert_eq!(&theirs.bytes()[..5], b"hello");
        theirs.bytes_mut()[MIN_REGION - 1] = 7;
        assert_eq!(ours.bytes()[MIN_REGION - 1], 7);
        assert!(Region::create(MAX_REGION + 1).unwrap().is_none());
        // A length the file does not have is refused, not mapped past its end.
        assert!(Region::open(std::process::id(), ours.fd(), (MIN_REGION * 2) as u64).is_err());
    }
}
