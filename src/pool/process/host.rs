//! A pool's worker process as its parent sees it: started from vramguard's own binary with the
//! pool's spec, reached over Unix sockets in a folder of its own (owner-only), watched through
//! a control connection, killed and reaped by its parent, replaced when it is lost.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, mpsc};
use std::time::Duration;

use super::child::WorkerSpec;
use super::wire::{self, Answer, Ask, SimChange, SimState};
use crate::core::scratch::OwnDir;
use crate::device::simulated::{DeviceChange, DeviceLink, DeviceState};

/// How long a starting worker may take to say it is ready (ONNX Runtime's library loads; the
/// models load afterwards, per session).
const READY_WITHIN: Duration = Duration::from_secs(60);

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

    /// Ask on the control connection, waiting at most its timeout.
    fn ask(&self, ask: &Ask) -> Result<Answer, String> {
        let mut control = self.control.lock().unwrap_or_else(|e| e.into_inner());
        wire::write_frame(&mut *control, ask, &[]).map_err(|e| format!("worker process {}: {e}", self.pid))?;
        let (answer, _) = wire::read_frame::<Answer>(&mut *control)
            .map_err(|e| format!("worker process {} did not answer: {e}", self.pid))?;
        Ok(answer)
    }
}

fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => status.to_string(),
    }
}

/// Where a pool's worker processes come from, and the one running now.
#[derive(Debug)]
pub struct WorkerHost {
    /// The pool's name.
    pub pool: String,
    spec: WorkerSpec,
    exe: PathBuf,
    dir: OwnDir,
    /// How long the control connection waits for an answer (`health.timeout`).
    timeout: Duration,
    current: RwLock<Option<Arc<Worker>>>,
    started: AtomicU64,
    /// The simulated pressure asked for, held again by each new worker.
    pressure: AtomicU64,
    /// Serialises starting and replacing workers.
    pub(crate) lifecycle: Mutex<()>,
    /// The last session connection with a lane free: the next lane opened joins it.
    pub(super) spare: Mutex<Option<std::sync::Weak<super::conn::Conn>>>,
}

impl WorkerHost {
    /// A host for `spec`'s pool, its workers started from `exe`, its sockets in a new
    /// owner-only folder.
    pub fn new(spec: WorkerSpec, exe: PathBuf, timeout: Duration) -> Result<Arc<WorkerHost>, String> {
        crate::core::scratch::sweep_unkinded();
        let dir = OwnDir::new("workers").map_err(|e| {
            let temp = std::env::temp_dir();
            format!(
                "cannot create a folder for the worker's sockets in {}: {e}",
                temp.display()
            )
        })?;
        Ok(Arc::new(WorkerHost {
            pool: spec.pool.clone(),
            spec,
            exe,
            dir,
            timeout,
            current: RwLock::new(None),
            started: AtomicU64::new(0),
            pressure: AtomicU64::new(0),
            lifecycle: Mutex::new(()),
            spare: Mutex::new(None),
        }))
    }

    /// How long its control connection waits for an answer.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The worker running now.
    pub fn current(&self) -> Option<Arc<Worker>> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Its process id.
    pub fn pid(&self) -> Option<u32> {
        self.current().map(|w| w.pid)
    }

    /// Start a worker and make it the current one (the caller holds `lifecycle`, or is the
    /// first start).
    pub fn start(&self) -> Result<Arc<Worker>, String> {
        let generation = self.started.fetch_add(1, Ordering::Relaxed) + 1;
        let socket = self.dir.path().join(format!("worker-{generation}.sock"));
        let mut command = Command::new(&self.exe);
        command
            // Its logs go to this process's stderr: one format for both.
            .arg("--log-format")
            .arg(if self.spec.logs.json { "json" } else { "human" })
            .arg("worker")
            .arg("--socket")
            .arg(&socket)
            .arg("--parent")
            .arg(std::process::id().to_string())
            .arg("--pool")
            .arg(&self.pool)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(filter) = &self.spec.logs.filter
            && std::env::var_os("RUST_LOG").is_none()
        {
            command.env("RUST_LOG", filter);
        }
        let mut child = spawn_from_keeper(command)
            .map_err(|e| format!("cannot start a worker process from {}: {e}", self.exe.display()))?;
        let mut stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let ready = stdin
            .write_all(super::child::spec_line(&self.spec).as_bytes())
            .map_err(|e| e.to_string())
            .and_then(|()| wait_ready(stdout, child.id()));
        if let Err(why) = ready {
            let _ = child.kill();
            let ended = child.wait().map(describe).unwrap_or_default();
            return Err(format!("the worker process did not start ({ended}): {why}"));
        }
        let pid = child.id();
        let control = connect_control(&socket, self.timeout).inspect_err(|_| {
            let _ = child.kill();
            let _ = child.wait();
        })?;
        let worker = Arc::new(Worker {
            pid,
            generation,
            socket,
            child: Mutex::new(child),
            control: Mutex::new(control),
            _stdin: stdin,
            injected: AtomicBool::new(false),
        });
        let pressure = self.pressure.load(Ordering::Relaxed);
        if pressure > 0
            && let Err(why) = change(
                &worker,
                &SimChange {
                    pressure: Some(pressure),
                    ..SimChange::default()
                },
            )
        {
            tracing::warn!(pool = %self.pool, %why, "the new worker could not hold the simulated pressure again");
        }
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(&worker));
        tracing::info!(pool = %self.pool, pid, generation, "worker process started");
        Ok(worker)
    }

    /// Take the current worker away (it is lost or being replaced): nothing new reaches it.
    pub fn take(&self) -> Option<Arc<Worker>> {
        self.current.write().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Ask the current worker whether it is there: its simulated device's state.
    pub fn ping(&self) -> Result<Option<SimState>, String> {
        let worker = self.current().ok_or("no worker process is running")?;
        match worker.ask(&Ask::Ping)? {
            Answer::Sim(state) => Ok(state),
            other => Err(format!("the worker answered {other:?} to a ping")),
        }
    }

    /// Stop the current worker (at shutdown): killed and reaped.
    pub fn stop(&self) {
        if let Some(worker) = self.take() {
            worker.kill();
        }
    }

    /// Stop the current worker and remove the sockets' folder: the pool is done with workers.
    /// Called at shutdown, which does not wait for the last reference to go (the supervisor's
    /// thread holds one until its next tick).
    pub fn close(&self) {
        self.stop();
        self.dir.remove();
    }
}

impl Drop for WorkerHost {
    fn drop(&mut self) {
        self.close();
    }
}

/// Start `command` from the one thread that forks every worker process and lives as long as
/// vramguard does.
///
/// A worker asks for SIGKILL when its parent dies (`PR_SET_PDEATHSIG`), and Linux sends that
/// signal when the *thread* that forked it exits, not the process. Workers are started from
/// threads that come and go: a restore runs on one of tokio's blocking threads, which exits
/// after 10 s idle, and a worker forked there would be killed with it, counted as lost and
/// replaced for no reason. Forking from a thread that never exits keeps the signal for the
/// death it is meant for: vramguard's.
fn spawn_from_keeper(command: Command) -> std::io::Result<Child> {
    type Order = (Command, mpsc::Sender<std::io::Result<Child>>);
    static KEEPER: OnceLock<mpsc::Sender<Order>> = OnceLock::new();
    let keeper = KEEPER.get_or_init(|| {
        let (orders, taken) = mpsc::channel::<Order>();
        let started = std::thread::Builder::new()
            .name("worker-spawner".into())
            .spawn(move || {
                for (mut command, reply) in taken {
                    let _ = reply.send(command.spawn());
                }
            });
        if let Err(e) = started {
            // Every order then fails with the error below, naming the cause in the log.
            tracing::error!(error = %e, "cannot start the thread that starts worker processes");
        }
        orders
    });
    let (reply, answer) = mpsc::channel();
    let gone = || std::io::Error::other("the thread that starts worker processes is gone");
    keeper.send((command, reply)).map_err(|_| gone())?;
    answer.recv().map_err(|_| gone())?
}

fn wait_ready(stdout: std::process::ChildStdout, pid: u32) -> Result<(), String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let read = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(read.map(|_| line));
    });
    match rx.recv_timeout(READY_WITHIN) {
        Ok(Ok(line)) if line.trim() == "ready" => Ok(()),
        Ok(Ok(line)) => Err(format!("worker process {pid} said {:?} instead of ready", line.trim())),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "worker process {pid} was not ready within {}s",
            READY_WITHIN.as_secs()
        )),
    }
}

fn connect_control(socket: &Path, timeout: Duration) -> Result<UnixStream, String> {
    let mut stream =
        UnixStream::connect(socket).map_err(|e| format!("cannot reach the worker at {}: {e}", socket.display()))?;
    stream.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    stream.set_write_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    wire::write_frame(&mut stream, &Ask::Control, &[]).map_err(|e| e.to_string())?;
    Ok(stream)
}

fn change(worker: &Worker, change: &SimChange) -> Result<Option<SimState>, String> {
    match worker.ask(&Ask::Sim(change.clone()))? {
        Answer::Sim(state) => Ok(state),
        Answer::Refused(why) => Err(why),
        other => Err(format!("the worker answered {other:?}")),
    }
}

fn device_state(state: SimState) -> DeviceState {
    DeviceState {
        pressure: state.pressure,
        fail_next: state.fail_next,
        pass_first: state.pass_first,
        driver_reset: state.driver_reset,
        arena: state.arena.map(Into::into),
    }
}

impl DeviceLink for WorkerHost {
    fn state(&self) -> Result<DeviceState, String> {
        self.ping()?
            .map(device_state)
            .ok_or_else(|| "the worker has no simulated device".into())
    }

    fn change(&self, wanted: DeviceChange) -> Result<DeviceState, String> {
        if let Some(bytes) = wanted.pressure {
            self.pressure.store(bytes, Ordering::Relaxed);
        }
        let worker = self
            .current()
            .ok_or("the pool's worker process is not running (it is being replaced)")?;
        if wanted.hang {
            // It will not answer: the heartbeat finds it hung and replaces it.
            let mut control = worker.control.lock().unwrap_or_else(|e| e.into_inner());
            let hang = Ask::Sim(SimChange {
                hang: true,
                ..SimChange::default()
            });
            wire::write_frame(&mut *control, &hang, &[]).map_err(|e| e.to_string())?;
            return Ok(DeviceState::default());
        }
        let state = change(
            &worker,
            &SimChange {
                pressure: wanted.pressure,
                fail_next: wanted.fail_next,
                pass_first: wanted.pass_first,
                driver_reset: wanted.driver_reset == Some(true),
                hang: wanted.hang,
            },
        )?;
        state
            .map(device_state)
            .ok_or_else(|| "the worker has no simulated device".into())
    }

    fn process(&self) -> Option<(u32, String)> {
        Some((self.pid()?, format!("vramguard worker {}", self.pool)))
    }
}
