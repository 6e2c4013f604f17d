//! Where a pool's worker processes come from: each started from vramguard's own binary with the
//! pool's spec, reached over Unix sockets in a folder of its own (owner-only), replaced when it
//! is lost; the one running now ([`Worker`], `worker.rs`) is watched through a control
//! connection, killed and reaped by its parent.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, mpsc};
use std::time::Duration;

use super::child::WorkerSpec;
use super::conn::Conn;
use super::wire::{self, Answer, Ask, SimChange, SimState};
use super::worker::{Worker, describe};
use crate::core::scratch::OwnDir;
use crate::device::simulated::{DeviceChange, DeviceLink, DeviceState};

/// How long a starting worker may take to say it is ready (ONNX Runtime's library loads; the
/// models load afterwards, per session).
const READY_WITHIN: Duration = Duration::from_secs(60);

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
    pub(super) spare: Mutex<Option<std::sync::Weak<Conn>>>,
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
        let worker = Arc::new(Worker::new(generation, socket, child, control, stdin));
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
            worker.tell(&Ask::Sim(SimChange {
                hang: true,
                ..SimChange::default()
            }))?;
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
