//! The worker process (`vramguard worker`, started by vramguard itself, never by users): it
//! owns ONNX Runtime's environment and one pool's sessions, and serves them over a Unix socket.
//! Each session connection is one of the pool's workers (its own sessions, its own thread
//! here); a control connection answers the heartbeat and changes the simulated device; an
//! interrupt connection per session stops its run in progress.
//!
//! It never outlives its parent: the kernel kills it when the parent dies
//! (`PR_SET_PDEATHSIG`), and it exits when its standard input (a pipe the parent holds) ends.

use std::collections::HashMap;
use std::io::{BufRead, Read};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::shm::Region;
use super::wire::{self, Answer, Ask, ModelHead, SimChange, SimState, WireError};
use crate::config::{CudaOptions, Provider};
use crate::core::backend::{ArenaStats, Backend, BackendError, Interrupt, RunMeta};
use crate::core::cpus::CpuSet;
use crate::core::tensor::TensorView;
use crate::device::faults::FaultInjecting;
use crate::device::simulated::SimulatedDevice;
use crate::pool::RunOp;
use crate::pool::patience::Patience;
use crate::runtime::onnx::{OnnxRuntime, OrtBackend, SessionOptions};

/// The largest buffer a session connection keeps between frames.
const KEEP_BUFFER: usize = 64 << 20;

/// What a worker is started with: its pool's provider and session options, on its standard
/// input as one line of JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerSpec {
    /// The pool it serves (for its log lines and its process listing).
    pub pool: String,
    /// `cpu`, `cuda` or `simulated`.
    pub provider: String,
    /// CUDA's `gpu_mem_limit` and `same_as_requested`.
    pub cuda: Option<(Option<u64>, bool)>,
    /// CUDA device index.
    pub device_index: u32,
    /// Intra-op threads per session.
    pub intra_threads: usize,
    /// Shrink the arena after every run.
    pub arena_shrinkage: bool,
    /// The simulated device the pool runs on: its name and capacity.
    pub simulated: Option<(String, u64)>,
    /// Where ONNX Runtime's library is.
    pub onnxruntime_library: PathBuf,
    /// The CPUs the process runs on (every thread it starts, ONNX Runtime's included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<CpuSet>,
    /// How it logs; given on its command line and in its environment, before it reads this.
    #[serde(skip)]
    pub logs: WorkerLogs,
}

/// How a worker logs: to its parent's stderr, in its parent's format, at the filter its parent
/// chose for its workers.
#[derive(Debug, Clone, Default)]
pub struct WorkerLogs {
    /// JSON lines (`--log-format json`) rather than human lines.
    pub json: bool,
    /// Its `RUST_LOG` where the parent's environment sets none (`None`: the worker's default,
    /// only what goes wrong inside it).
    pub filter: Option<String>,
}

impl WorkerSpec {
    fn session_options(&self) -> Result<SessionOptions, String> {
        let provider = match self.provider.as_str() {
            "cpu" => Provider::Cpu,
            "simulated" => Provider::Simulated,
            "cuda" => {
                let (gpu_mem_limit, same_as_requested) = self.cuda.unwrap_or((None, false));
                Provider::Cuda(CudaOptions {
                    gpu_mem_limit,
                    same_as_requested,
                })
            }
            other => return Err(format!("a worker cannot run provider `{other}`")),
        };
        Ok(SessionOptions {
            provider,
            device_index: self.device_index,
            intra_threads: self.intra_threads,
            arena_shrinkage: self.arena_shrinkage,
            quiet: false,
        })
    }
}

/// What a session connection holds: its sessions, its runs' state, the buffer its answers'
/// outputs are written into, and each lane's shared memory for large inputs and outputs, once
/// the pool sends it.
struct Held {
    backend: Box<dyn Backend>,
    runs: Arc<Mutex<Runs>>,
    out: Vec<u8>,
    regions: [(Option<Region>, Option<Region>); wire::LANES],
}

/// Where a run's outputs go: the connection's shared region when it has one they fit in, else
/// inline into the answer's buffer.
struct Output<'a> {
    inline: &'a mut Vec<u8>,
    region: Option<&'a mut Region>,
}

/// One session connection's run state, for its interrupts: the run going now and the runs an
/// interrupt was sent for (its two lanes number their runs from one sequence, and a lane's
/// frame may go out after the other's later-numbered one), under one lock with the terminate
/// flag's changes.
#[derive(Default)]
struct Runs {
    running: u64,
    interrupted: std::collections::BTreeSet<u64>,
    handle: Option<Interrupt>,
}

impl Runs {
    /// Note a stop for run `seq`; the oldest are forgotten (a run numbered that long ago has
    /// started, or its lane has gone on to later numbers).
    fn interrupt(&mut self, seq: u64) {
        self.interrupted.insert(seq);
        while self.interrupted.len() > 64 {
            self.interrupted.pop_first();
        }
    }
}

/// The worker's state, shared by its connections.
struct Worker {
    /// The pool's process: the shared memory regions are its descriptors.
    parent: u32,
    rt: &'static OnnxRuntime,
    options: SessionOptions,
    device: Option<Arc<SimulatedDevice>>,
    sessions: Mutex<HashMap<u64, Arc<Mutex<Runs>>>>,
    next_session: AtomicU64,
    /// `hang_worker`: every answer stops from now on.
    hung: AtomicBool,
    /// A driver fault poisoned the process, as a sticky CUDA error does: every run fails.
    poisoned: AtomicBool,
}

/// Run the worker until its parent goes: `socket` is where it listens, `parent` the pid that
/// started it.
#[allow(unsafe_code)]
pub fn serve(socket: &Path, parent: u32) -> Result<(), String> {
    // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number and changes only this process.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
    }
    // The parent may have died before the line above: then nobody would ever kill us.
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } as u32 != parent {
        return Err("the parent process is gone".into());
    }
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    stdin
        .read_line(&mut line)
        .map_err(|e| format!("cannot read the worker's spec: {e}"))?;
    let spec: WorkerSpec = serde_json::from_str(&line).map_err(|e| format!("the worker's spec is not valid: {e}"))?;
    drop(stdin);
    // Before any other thread starts: they inherit it.
    if let Some(cpus) = &spec.cpus {
        cpus.apply_to_this_thread()?;
    }
    std::thread::Builder::new()
        .name("parent-watch".into())
        .spawn(|| {
            // The parent holds the other end: when it closes (the parent exits), so do we.
            let mut sink = [0u8; 64];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
            std::process::exit(0);
        })
        .map_err(|e| e.to_string())?;
    let rt = crate::runtime::onnx::runtime(Some(&spec.onnxruntime_library)).map_err(|e| e.to_string())?;
    let device = match &spec.simulated {
        Some((name, capacity)) => Some(Arc::new(SimulatedDevice::open(rt, name, *capacity)?)),
        None => None,
    };
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket).map_err(|e| format!("cannot listen on {}: {e}", socket.display()))?;
    let worker = Arc::new(Worker {
        parent,
        rt,
        options: spec.session_options()?,
        device,
        sessions: Mutex::new(HashMap::new()),
        next_session: AtomicU64::new(1),
        hung: AtomicBool::new(false),
        poisoned: AtomicBool::new(false),
    });
    tracing::info!(pool = %spec.pool, pid = std::process::id(), "worker ready");
    println!("ready");
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let worker = Arc::clone(&worker);
        let _ = std::thread::Builder::new()
            .name(format!("{}-conn", spec.pool))
            .spawn(move || worker.connection(stream));
    }
    Ok(())
}

impl Worker {
    /// Serve one connection by its first frame.
    fn connection(&self, mut stream: UnixStream) {
        let Ok((ask, payload)) = wire::read_frame::<Ask>(&mut stream) else {
            return;
        };
        match ask {
            Ask::Open { models } => self.session(stream, &models, &payload),
            Ask::Control => self.control(stream),
            Ask::Interrupt { session, .. } => self.interrupts(stream, session),
            other => {
                let _ = reply(
                    &mut stream,
                    &Answer::Refused(format!("a connection cannot start with {other:?}")),
                    &[],
                );
            }
        }
    }

    fn wrap(&self, backend: OrtBackend) -> Box<dyn Backend> {
        match &self.device {
            Some(device) => Box::new(FaultInjecting::new(Box::new(backend), Arc::clone(device))),
            None => Box::new(backend),
        }
    }

    /// A session connection: build its sessions, then run what it asks until it closes.
    fn session(&self, mut stream: UnixStream, models: &[ModelHead], payload: &[u8]) {
        let mut at = 0;
        let mut blobs = Vec::new();
        for head in models {
            match wire::take(payload, &mut at, head.bytes)
                .and_then(|graph| Ok((graph, head.owned(graph, self.parent)?)))
            {
                Ok((graph, owned)) => blobs.push((head, graph, owned)),
                Err(why) => {
                    let _ = reply(&mut stream, &Answer::Refused(why), &[]);
                    return;
                }
            }
        }
        let files: Vec<_> = blobs
            .iter()
            .map(|(head, graph, owned)| {
                let data = owned.as_ref().map_or_else(|| head.data(graph), |bytes| bytes.data());
                (head.name.clone(), data)
            })
            .collect();
        let built = OrtBackend::load(self.rt, &files, &self.options).and_then(|backend| {
            if let Some(device) = &self.device {
                device.check_capacity("loading the pool's models")?;
            }
            Ok(self.wrap(backend))
        });
        let mut backend = match built {
            Ok(backend) => backend,
            Err(why) => {
                let _ = reply(&mut stream, &Answer::Refused(why), &[]);
                return;
            }
        };
        drop(files);
        drop(blobs);
        let id = self.next_session.fetch_add(1, Ordering::Relaxed);
        let runs = Arc::new(Mutex::new(Runs {
            handle: backend.interrupts().map(|interrupts| interrupts.interrupt_handle()),
            ..Runs::default()
        }));
        self.sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, Arc::clone(&runs));
        if reply(&mut stream, &Answer::Done { session: Some(id) }, &[]).is_err() {
            return;
        }
        // Read through a buffer: a small frame is one read, not one per part.
        let mut reader = std::io::BufReader::with_capacity(64 << 10, stream);
        // A run's input bytes and its outputs' bytes, their allocations kept from run to run (a
        // fresh large one costs a page fault per page).
        let mut payload = Vec::new();
        let mut held = Held {
            backend,
            runs: Arc::clone(&runs),
            out: Vec::new(),
            regions: Default::default(),
        };
        // The pool's next frame often follows soon after an answer: wait for it on this core
        // about as long as frames took to come lately before sleeping (see `Patience`).
        let mut patience = Patience::default();
        loop {
            let answered = std::time::Instant::now();
            if reader.buffer().is_empty() {
                wire::spin_until_readable(reader.get_ref(), patience.look());
            }
            let Ok(ask) = wire::read_frame_into::<Ask>(&mut reader, &mut payload) else {
                break;
            };
            patience.saw(answered.elapsed());
            let stream = reader.get_mut();
            self.wait_if_hung();
            let sent = self.answer(stream, &mut held, ask, &payload);
            if sent.is_err() {
                break;
            }
            // A model file's bytes (a load) are not kept for the runs after it.
            for buffer in [&mut payload, &mut held.out] {
                if buffer.capacity() > KEEP_BUFFER {
                    *buffer = Vec::new();
                }
            }
        }
        self.sessions.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
    }

    /// Answer one frame of a session connection.
    fn answer(&self, stream: &mut UnixStream, held: &mut Held, ask: Ask, payload: &[u8]) -> std::io::Result<()> {
        match ask {
            Ask::Run {
                model,
                outputs,
                inputs,
                stats,
                shared,
                lane,
                seq,
                op,
            } => {
                let (to_worker, from_worker) = match held.regions.get_mut(lane) {
                    Some((to, from)) => (to.as_ref(), from.as_mut()),
                    None => (None, None),
                };
                let input = match shared {
                    false => Some(payload),
                    true => to_worker.map(Region::bytes),
                };
                match input {
                    Some(input) => self.run(
                        stream,
                        held.backend.as_mut(),
                        (&held.runs, seq),
                        (&model, &outputs, &inputs, stats, op),
                        (
                            input,
                            Output {
                                inline: &mut held.out,
                                region: from_worker,
                            },
                        ),
                    ),
                    None => reply(
                        stream,
                        &Answer::Failed(WireError::Runtime(format!(
                            "a run in lane {lane}'s shared memory before any was given"
                        ))),
                        &[],
                    ),
                }
            }
            Ask::Region {
                lane,
                to_worker,
                fd,
                len,
            } => match (held.regions.get_mut(lane), Region::open(self.parent, fd, len)) {
                (Some((to, from)), Ok(region)) => {
                    *(if to_worker { to } else { from }) = Some(region);
                    reply(stream, &Answer::Done { session: None }, &[])
                }
                (None, _) => reply(stream, &Answer::Refused(format!("there is no lane {lane}")), &[]),
                (_, Err(why)) => reply(stream, &Answer::Refused(why), &[]),
            },
            Ask::Stats { model } => {
                let (last, held) = fresh_stats(held.backend.as_mut(), model.as_deref());
                let answer = Answer::Stats {
                    last: last.map(Into::into),
                    held: held.map(Into::into),
                };
                reply(stream, &answer, &[])
            }
            Ask::Load { model } => {
                let answer = match wire::take(payload, &mut 0, model.bytes) {
                    Ok(graph) => match held.backend.loader(&model.name).and_then(|residency| {
                        let owned = model.owned(graph, self.parent)?;
                        let data = owned.as_ref().map_or_else(|| model.data(graph), |bytes| bytes.data());
                        residency.load_model(&model.name, data)
                    }) {
                        Ok(()) => Answer::Done { session: None },
                        Err(why) => Answer::Refused(why),
                    },
                    Err(why) => Answer::Refused(why),
                };
                reply(stream, &answer, &[])
            }
            Ask::Unload { name } => {
                if let Some(residency) = held.backend.residency() {
                    residency.unload_model(&name);
                }
                reply(stream, &Answer::Done { session: None }, &[])
            }
            Ask::Release { probes } => {
                let mut at = 0;
                let mut inputs = HashMap::new();
                for (model, heads) in &probes {
                    if let Ok(tensors) = wire::decode_tensors(heads, payload, &mut at) {
                        inputs.insert(model.clone(), tensors);
                    }
                }
                if let Some(residency) = held.backend.residency() {
                    residency.release_memory(&|model: &str| inputs.get(model).cloned());
                }
                reply(stream, &Answer::Done { session: None }, &[])
            }
            other => reply(
                stream,
                &Answer::Refused(format!("not on a session connection: {other:?}")),
                &[],
            ),
        }
    }

    /// One run, its interrupts honoured: one sent for it before it started cancels it there.
    fn run(
        &self,
        stream: &mut UnixStream,
        backend: &mut dyn Backend,
        (runs, seq): (&Mutex<Runs>, u64),
        (model, outputs, inputs, stats, op): (&str, &[String], &[wire::TensorHead], bool, RunOp),
        (payload, out): (&[u8], Output<'_>),
    ) -> std::io::Result<()> {
        // Read where they lie (the socket's buffer, or the pool's shared memory).
        let views = match wire::decode_views(inputs, payload, &mut 0) {
            Ok(views) => views,
            Err(why) => return reply(stream, &Answer::Failed(WireError::InvalidInput(why)), &[]),
        };
        let stopped = {
            let mut runs = runs.lock().unwrap_or_else(|e| e.into_inner());
            runs.running = seq;
            runs.interrupted.remove(&seq)
        };
        let result = if stopped {
            Err(BackendError::Cancelled)
        } else if self.poisoned.load(Ordering::SeqCst) {
            Err(poisoned())
        } else {
            let meta = RunMeta::default();
            match op {
                RunOp::Run => backend.run_views(model, &views, outputs, &meta),
                RunOp::Prefill(sequence) => {
                    owned(&views).and_then(|inputs| backend.caches()?.prefill(model, sequence, inputs, &meta))
                }
                RunOp::PrefillMany(seqs) => {
                    owned(&views).and_then(|inputs| backend.caches()?.prefill_many(model, &seqs, inputs, &meta))
                }
                RunOp::Decode(step) => backend.caches().and_then(|caches| caches.decode(model, &step, &meta)),
            }
        };
        {
            let mut runs = runs.lock().unwrap_or_else(|e| e.into_inner());
            runs.running = 0;
            if let Some(interrupts) = backend.interrupts() {
                interrupts.clear_interrupt();
            }
        }
        // A driver-class failure poisons the process, as a sticky CUDA error does.
        if matches!(
            &result,
            Err(BackendError::Allocation {
                kind: crate::core::backend::AllocFailureKind::Driver,
                ..
            })
        ) {
            self.poisoned.store(true, Ordering::SeqCst);
        }
        match result {
            Ok(tensors) => {
                let (stats, held) = match stats {
                    true => fresh_stats(backend, None),
                    false => (None, None),
                };
                let (stats, held) = (stats.map(Into::into), held.map(Into::into));
                // Into the shared region when they fit, else inline.
                let shared = out
                    .region
                    .and_then(|region| wire::encode_tensors_at(&tensors, region.bytes_mut()));
                let (heads, shared) = match shared {
                    Some(heads) => (heads, true),
                    None => (wire::encode_tensors_into(&tensors, out.inline), false),
                };
                let blob: &[u8] = if shared { &[] } else { out.inline };
                reply(
                    stream,
                    &Answer::Ran {
                        outputs: heads,
                        stats,
                        held,
                        shared,
                    },
                    &[blob],
                )
            }
            Err(e) => reply(stream, &Answer::Failed(WireError::from(&e)), &[]),
        }
    }

    /// A session's interrupt connection: each frame stops the run it names, or the next run
    /// before it starts.
    fn interrupts(&self, mut stream: UnixStream, session: u64) {
        while let Ok((ask, _)) = wire::read_frame::<Ask>(&mut stream) {
            let Ask::Interrupt { session: id, seq } = ask else {
                continue;
            };
            let runs = self
                .sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&id.max(session))
                .cloned();
            if let Some(runs) = runs {
                let mut runs = runs.lock().unwrap_or_else(|e| e.into_inner());
                runs.interrupt(seq);
                if runs.running == seq
                    && let Some(handle) = &runs.handle
                {
                    handle();
                }
            }
        }
    }

    /// The control connection: the heartbeat and the simulated device.
    fn control(&self, mut stream: UnixStream) {
        while let Ok((ask, _)) = wire::read_frame::<Ask>(&mut stream) {
            self.wait_if_hung();
            let answer = match ask {
                Ask::Ping => Answer::Sim(self.sim_state()),
                Ask::Sim(change) => match self.change(change) {
                    Ok(()) => Answer::Sim(self.sim_state()),
                    Err(why) => Answer::Refused(why),
                },
                other => Answer::Refused(format!("not on the control connection: {other:?}")),
            };
            if reply(&mut stream, &answer, &[]).is_err() {
                break;
            }
        }
    }

    fn change(&self, change: SimChange) -> Result<(), String> {
        if change.hang {
            tracing::warn!("hang_worker: this worker stops answering (fault injection)");
            self.hung.store(true, Ordering::SeqCst);
            self.wait_if_hung();
        }
        let Some(device) = &self.device else {
            return Err("this worker has no simulated device".into());
        };
        if let Some(bytes) = change.pressure {
            device.set_pressure(bytes)?;
        }
        if let Some(n) = change.pass_first {
            device.pass_first(n);
        }
        if let Some(n) = change.fail_next {
            device.fail_next(n);
        }
        if change.driver_reset {
            self.poisoned.store(true, Ordering::SeqCst);
            device.set_driver_reset(true);
        }
        Ok(())
    }

    fn sim_state(&self) -> Option<SimState> {
        let device = self.device.as_ref()?;
        Some(SimState {
            pressure: device.pressure(),
            fail_next: device.failures_pending(),
            pass_first: device.passes_pending(),
            driver_reset: self.poisoned.load(Ordering::SeqCst),
            arena: device.arena_stats().ok().map(Into::into),
        })
    }

    /// A hung worker never answers again (it is killed by its parent's heartbeat).
    fn wait_if_hung(&self) {
        while self.hung.load(Ordering::SeqCst) {
            std::thread::park_timeout(std::time::Duration::from_secs(3600));
        }
    }
}

/// Tensors of their own made from `views` (a prompt's inputs are small).
fn owned(views: &[TensorView<'_>]) -> Result<Vec<crate::core::tensor::Tensor>, BackendError> {
    views
        .iter()
        .map(TensorView::to_tensor)
        .collect::<Result<Vec<_>, _>>()
        .map_err(BackendError::InvalidInput)
}

/// Read `backend`'s allocator statistics again, of `model`'s arena or of all, and return them:
/// the last run's arena and everything it holds (none without an arena).
fn fresh_stats(backend: &mut dyn Backend, model: Option<&str>) -> (Option<ArenaStats>, Option<ArenaStats>) {
    let Some(arenas) = backend.arenas() else {
        return (None, None);
    };
    match model {
        Some(model) => arenas.refresh_arena_stats_for(model),
        None => arenas.refresh_arena_stats(),
    }
    (arenas.arena_stats(), arenas.held_arena_stats())
}

fn poisoned() -> BackendError {
    BackendError::Allocation {
        kind: crate::core::backend::AllocFailureKind::Driver,
        message: "a driver fault poisoned this worker process (as a sticky CUDA error does): every run fails until the worker is replaced (restore)".into(),
    }
}

fn reply(stream: &mut UnixStream, answer: &Answer, blobs: &[&[u8]]) -> std::io::Result<()> {
    wire::write_frame(stream, answer, blobs)
}

/// The line a worker is started with: its spec as JSON, what [`serve`] reads first.
pub fn spec_line(spec: &WorkerSpec) -> String {
    let mut line = serde_json::to_string(spec).expect("a spec serialises");
    line.push('\n');
    line
}
