//! One session connection to a worker process, shared by the two lanes (pool workers' slots)
//! that run on its sessions. Each lane sends its frame when its job starts, so the next run's
//! frame already waits in the socket while the one before it runs: the worker goes from one
//! run to the next without sleeping, as a pool thread in this process would. Answers come
//! back in the order the frames went; each lane reads its own in turn.

use std::collections::HashMap;
use std::io::BufReader;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::expect::{self, Expected};
use super::wire::{self, Answer, Ask, LANES, ModelHead};
use super::worker::Worker;
use crate::core::backend::BackendError;
use crate::core::model::ModelData;

/// The writing side: frames go out whole, each numbered by the answer it will get.
struct Writer {
    stream: UnixStream,
    next: u64,
}

/// The reading side: whose answer comes next.
struct Reader {
    stream: BufReader<UnixStream>,
    next: u64,
}

/// A session connection and what its lanes share.
pub struct Conn {
    pub(super) worker: Arc<Worker>,
    pub(super) pool: String,
    /// The worker's id of the connection (for interrupts).
    pub(super) session: u64,
    writer: Mutex<Writer>,
    /// Held by the lane reading its answer, for as long as that takes: never taken while
    /// writing, so the other lane's frame goes out meanwhile.
    reader: Mutex<Reader>,
    turn: Condvar,
    /// Why the worker is gone, once it is.
    lost: Mutex<Option<String>>,
    pub(super) interrupts: Mutex<UnixStream>,
    /// Run numbers, handed to the lanes' runs.
    seq: AtomicU64,
    /// The lanes holding each model's session (unloaded when none does).
    holders: Mutex<HashMap<String, [bool; LANES]>>,
    /// Which lanes are taken.
    pub(super) lanes: Mutex<[bool; LANES]>,
    /// When the answers of each kind of run come, so that a lane is awake for its own.
    expected: Expected,
}

impl Conn {
    /// Open a session connection on `worker` with sessions of `models`.
    pub fn open(worker: Arc<Worker>, pool: &str, models: &[(String, ModelData<'_>)]) -> Result<Conn, String> {
        let heads = Ask::Open {
            models: models.iter().map(|(n, m)| ModelHead::of(n, *m)).collect(),
        };
        let blobs: Vec<&[u8]> = models.iter().map(|(_, m)| ModelHead::blob(m)).collect();
        let mut stream = worker.connect(&heads, &blobs)?;
        let session = match wire::read_frame::<Answer>(&mut stream) {
            Ok((Answer::Done { session: Some(id) }, _)) => id,
            Ok((Answer::Refused(why), _)) => return Err(why),
            Ok((other, _)) => return Err(format!("worker process {} answered {other:?} to an open", worker.pid)),
            Err(e) => return Err(format!("worker process {} did not open the sessions: {e}", worker.pid)),
        };
        let interrupts = worker.connect(&Ask::Interrupt { session, seq: 0 }, &[])?;
        let reading = stream
            .try_clone()
            .map_err(|e| format!("worker process {}: {e}", worker.pid))?;
        Ok(Conn {
            worker,
            pool: pool.to_string(),
            session,
            writer: Mutex::new(Writer { stream, next: 0 }),
            reader: Mutex::new(Reader {
                stream: BufReader::with_capacity(64 << 10, reading),
                next: 0,
            }),
            turn: Condvar::new(),
            lost: Mutex::new(None),
            interrupts: Mutex::new(interrupts),
            seq: AtomicU64::new(1),
            holders: Mutex::new(HashMap::new()),
            lanes: Mutex::new([false; LANES]),
            expected: Expected::default(),
        })
    }

    /// Take a free lane, if one is.
    pub fn take_lane(&self) -> Option<usize> {
        let mut lanes = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
        let free = lanes.iter().position(|taken| !taken)?;
        lanes[free] = true;
        Some(free)
    }

    /// Give lane `lane` up; true when another lane is still taken.
    pub fn leave(&self, lane: usize) -> bool {
        let mut lanes = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
        lanes[lane] = false;
        lanes.iter().any(|&taken| taken)
    }

    /// The models whose sessions it holds now.
    pub fn held(&self) -> std::collections::BTreeSet<String> {
        self.holding()
            .iter()
            .filter(|(_, lanes)| lanes.iter().any(|&h| h))
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// The models lane `lane` holds.
    pub fn held_by(&self, lane: usize) -> Vec<String> {
        self.holding()
            .iter()
            .filter(|(_, lanes)| lanes[lane])
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Lane `lane` holds `models` (sessions the connection has).
    pub fn hold(&self, lane: usize, models: impl IntoIterator<Item = String>) {
        let mut holders = self.holding();
        for name in models {
            holders.entry(name).or_default()[lane] = true;
        }
    }

    /// Lane `lane` holds `name`, loading it with `load` unless another lane already holds it
    /// (the session is the connection's).
    pub fn load(&self, lane: usize, name: &str, load: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
        let mut holders = self.holding();
        let held = holders
            .get(name)
            .is_some_and(|lanes| lanes.iter().enumerate().any(|(l, &h)| h && l != lane));
        if !held {
            load()?;
        }
        holders.entry(name.to_string()).or_default()[lane] = true;
        Ok(())
    }

    /// Lane `lane` no longer holds `name`; the session goes (`unload`) when no lane does.
    pub fn unload(&self, lane: usize, name: &str, unload: impl FnOnce()) {
        let mut holders = self.holding();
        let Some(held) = holders.get_mut(name) else {
            return;
        };
        held[lane] = false;
        if held.iter().all(|h| !h) {
            holders.remove(name);
            unload();
        }
    }

    fn holding(&self) -> std::sync::MutexGuard<'_, HashMap<String, [bool; LANES]>> {
        self.holders.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A fresh run number.
    pub fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::SeqCst)
    }

    /// Why the worker is gone, once it is.
    pub fn gone(&self) -> Option<String> {
        self.lost.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Send `ask` with `blobs` and read its answer into `payload`, after the answers to the
    /// frames sent before it; an I/O failure means the process is gone, for both lanes.
    pub fn exchange_into(&self, ask: &Ask, blobs: &[&[u8]], payload: &mut Vec<u8>) -> Result<Answer, BackendError> {
        let ticket = {
            let mut writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(why) = self.gone() {
                return Err(BackendError::WorkerLost(why));
            }
            if let Err(e) = wire::write_frame(&mut writer.stream, ask, blobs) {
                // The lane reading now (if any) fails too, and wakes the others.
                return Err(self.lose(&e));
            }
            writer.next += 1;
            writer.next - 1
        };
        let sent = std::time::Instant::now();
        let kind = match ask {
            Ask::Run { model, op, inputs, .. } => Some(expect::kind(model, op, inputs.iter().map(|t| t.bytes).sum())),
            _ => None,
        };
        let mut reader = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(why) = self.gone() {
                drop(reader);
                self.turn.notify_all();
                return Err(BackendError::WorkerLost(why));
            }
            if reader.next == ticket {
                break;
            }
            // Bounded: a loss found while writing is announced without this lock.
            reader = self
                .turn
                .wait_timeout(reader, std::time::Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        // Awake when the answer is due: sleep until just before (an earlier answer wakes it),
        // then look (see `expect`).
        if let Some((from, until)) = kind.and_then(|k| self.expected.window(k, sent))
            && reader.stream.buffer().is_empty()
        {
            let stream = reader.stream.get_ref();
            let now = std::time::Instant::now();
            if from > now {
                wire::wait_readable(stream, from - now);
            }
            let now = std::time::Instant::now();
            wire::spin_until_readable(stream, until.saturating_duration_since(now));
        }
        let read = wire::read_frame_into(&mut reader.stream, payload);
        if let (Some(kind), Ok(_)) = (kind, &read) {
            self.expected.answered(kind, sent.elapsed());
        }
        reader.next += 1;
        let answer = read.map_err(|e| self.lose(&e));
        drop(reader);
        self.turn.notify_all();
        answer
    }

    /// [`exchange_into`](Self::exchange_into) with a payload of its own.
    pub fn exchange(&self, ask: &Ask, blobs: &[&[u8]]) -> Result<(Answer, Vec<u8>), BackendError> {
        let mut payload = Vec::new();
        let answer = self.exchange_into(ask, blobs, &mut payload)?;
        Ok((answer, payload))
    }

    /// The worker went away (`e`): every frame waiting for an answer, and every later one, fails.
    fn lose(&self, e: &std::io::Error) -> BackendError {
        let why = self
            .lost
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(|| {
                format!(
                    "worker process {} of pool `{}` is gone: {e}",
                    self.worker.pid, self.pool
                )
            })
            .clone();
        self.turn.notify_all();
        BackendError::WorkerLost(why)
    }

    /// Send an interrupt for run `seq`.
    pub fn interrupt(&self, seq: u64) {
        let mut stream = self.interrupts.lock().unwrap_or_else(|e| e.into_inner());
        let _ = wire::write_frame(
            &mut *stream,
            &Ask::Interrupt {
                session: self.session,
                seq,
            },
            &[],
        );
    }
}
