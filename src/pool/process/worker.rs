//! One running worker process as its parent sees it: reached over its socket, asked and told
//! on its control connection, killed and reaped. Started and replaced by its host (`host.rs`);
//! the session connections on it are `conn.rs`'s.

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, ChildStdin};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use super::wire::{self, Answer, Ask};

/// One running worker process.
#[derive(Debug)]
pub struct Worker {
    /// Its process id.
    pub pid: u32,
    /// Which of its host's workers it is (counting from 1).
    pub generation: u64,
    socket: PathBuf,
    child: Mutex<Child>,
    control: Mutex<UnixStream>,
    /// The pipe it watches: dropped, the worker exits.
    _stdin: ChildStdin,
    /// Killed on purpose by the `kill_worker` fault knob ([`Worker::signal_kill`]): its loss is
    /// the fault asked for, not a failure.
    injected: AtomicBool,
}

impl Worker {
    /// A new connection to it, its first frame sent.
    pub fn connect(&self, first: &Ask, blobs: &[&[u8]]) -> Result<UnixStream, String> {
        let mut stream =
            UnixStream::connect(&self.socket).map_err(|e| format!("cannot reach worker process {}: {e}", self.pid))?;
        wire::write_frame(&mut stream, first, blobs).map_err(|e| format!("worker process {}: {e}", self.pid))?;
        Ok(stream)
    }

    /// How it ended, if it has: `exited with status 1`, `killed by signal 9`.
    pub fn ended(&self) -> Option<String> {
        let status = self.child.lock().unwrap_or_else(|e| e.into_inner()).try_wait().ok()??;
        Some(describe(status))
    }

    /// Kill it (SIGKILL) and reap it.
    pub fn kill(&self) -> String {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let _ = child.kill();
        child.wait().map(describe).unwrap_or_else(|e| e.to_string())
    }

    /// Whether it was killed by the `kill_worker` fault knob.
    pub fn killed_on_purpose(&self) -> bool {
        self.injected.load(Ordering::Relaxed)
    }

    /// Send SIGKILL and return at once (a fault knob: it dies mid-run).
    #[allow(unsafe_code)]
    pub fn signal_kill(&self) {
        self.injected.store(true, Ordering::Relaxed);
        // SAFETY: kill(2) with a pid we started and have not reaped (reaping happens only under
        // the child's lock, after which `ended` reports it).
        unsafe {
            libc::kill(self.pid as i32, libc::SIGKILL);
        }
    }

    /// Start watching a worker process that said it is ready: `child`, which answers on
    /// `socket` and `control`, and exits when `stdin` closes.
    pub(super) fn new(
        generation: u64,
        socket: PathBuf,
        child: Child,
        control: UnixStream,
        stdin: ChildStdin,
    ) -> Worker {
        Worker {
            pid: child.id(),
            generation,
            socket,
            child: Mutex::new(child),
            control: Mutex::new(control),
            _stdin: stdin,
            injected: AtomicBool::new(false),
        }
    }

    /// Send on the control connection without waiting for an answer (it will not come: the
    /// worker is told to hang).
    pub(super) fn tell(&self, ask: &Ask) -> Result<(), String> {
        let mut control = self.control.lock().unwrap_or_else(|e| e.into_inner());
        wire::write_frame(&mut *control, ask, &[]).map_err(|e| e.to_string())
    }

    /// Ask on the control connection, waiting at most its timeout.
    pub(super) fn ask(&self, ask: &Ask) -> Result<Answer, String> {
        let mut control = self.control.lock().unwrap_or_else(|e| e.into_inner());
        wire::write_frame(&mut *control, ask, &[]).map_err(|e| format!("worker process {}: {e}", self.pid))?;
        let (answer, _) = wire::read_frame::<Answer>(&mut *control)
            .map_err(|e| format!("worker process {} did not answer: {e}", self.pid))?;
        Ok(answer)
    }
}

/// How a process ended: `exited with status 1`, `killed by signal 9`.
pub(super) fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => status.to_string(),
    }
}
