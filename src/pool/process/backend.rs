//! [`ProcessBackend`]: one pool worker's sessions, held in the pool's worker process and run
//! over a Unix socket. A worker process that dies (or is replaced) turns every run into
//! [`BackendError::WorkerLost`] at once, and [`Backend::lost`] tells the pool to replace the
//! backend with one on the new process.

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::host::{Worker, WorkerHost};
use super::wire::{self, Answer, Ask};
use crate::core::backend::{ArenaStats, Backend, BackendError, Interrupt, RunMeta};
use crate::core::tensor::Tensor;

/// One pool worker's sessions in the worker process.
pub struct ProcessBackend {
    host: Arc<WorkerHost>,
    worker: Arc<Worker>,
    /// Read through a buffer: a small answer is one read, not one per part of its frame.
    stream: std::io::BufReader<UnixStream>,
    session: u64,
    interrupts: Arc<Mutex<UnixStream>>,
    /// The number of the next run (the one an interrupt handle given out now stops).
    seq: Arc<AtomicU64>,
    stats: Option<ArenaStats>,
    /// Set once the worker process is gone: every later run fails at once.
    gone: Option<String>,
    /// The models it holds sessions of.
    models: std::collections::BTreeSet<String>,
    /// The last run's input bytes and answer: their allocations are reused.
    sent: Vec<u8>,
    received: Vec<u8>,
}

impl ProcessBackend {
    /// Open sessions of `models` in `host`'s current worker.
    pub fn open(host: &Arc<WorkerHost>, models: &[(String, &[u8])]) -> Result<ProcessBackend, String> {
        let worker = host
            .current()
            .ok_or_else(|| format!("pool `{}` has no worker process running", host.pool))?;
        let heads = Ask::Open {
            models: models.iter().map(|(n, b)| (n.clone(), b.len() as u64)).collect(),
        };
        let blobs: Vec<&[u8]> = models.iter().map(|(_, b)| *b).collect();
        let mut stream = worker.connect(&heads, &blobs)?;
        let session = match wire::read_frame::<Answer>(&mut stream) {
            Ok((Answer::Done { session: Some(id) }, _)) => id,
            Ok((Answer::Refused(why), _)) => return Err(why),
            Ok((other, _)) => return Err(format!("worker process {} answered {other:?} to an open", worker.pid)),
            Err(e) => return Err(format!("worker process {} did not open the sessions: {e}", worker.pid)),
        };
        let interrupts = worker.connect(&Ask::Interrupt { session, seq: 0 }, &[])?;
        let mut backend = ProcessBackend {
            host: Arc::clone(host),
            worker,
            stream: std::io::BufReader::with_capacity(64 << 10, stream),
            session,
            interrupts: Arc::new(Mutex::new(interrupts)),
            seq: Arc::new(AtomicU64::new(1)),
            stats: None,
            gone: None,
            models: models.iter().map(|(n, _)| n.clone()).collect(),
            sent: Vec::new(),
            received: Vec::new(),
        };
        backend.refresh_arena_stats();
        Ok(backend)
    }

    /// Send `ask` with `blobs` and read the answer; an I/O failure means the process is gone.
    fn exchange(&mut self, ask: &Ask, blobs: &[&[u8]]) -> Result<(Answer, Vec<u8>), BackendError> {
        let mut payload = Vec::new();
        let answer = self.exchange_into(ask, blobs, &mut payload)?;
        Ok((answer, payload))
    }

    /// [`exchange`](Self::exchange), the answer's payload read into `payload`.
    fn exchange_into(&mut self, ask: &Ask, blobs: &[&[u8]], payload: &mut Vec<u8>) -> Result<Answer, BackendError> {
        if let Some(why) = &self.gone {
            return Err(BackendError::WorkerLost(why.clone()));
        }
        let result = wire::write_frame(self.stream.get_mut(), ask, blobs)
            .and_then(|()| wire::read_frame_into(&mut self.stream, payload));
        result.map_err(|e| {
            let why = format!(
                "worker process {} of pool `{}` is gone: {e}",
                self.worker.pid, self.host.pool
            );
            self.gone = Some(why.clone());
            // What it read of a gone process's arena is nobody's now.
            self.stats = None;
            BackendError::WorkerLost(why)
        })
    }
}

impl Backend for ProcessBackend {
    fn run(
        &mut self,
        model: &str,
        inputs: Vec<Tensor>,
        outputs: &[String],
        _: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        let mut sent = std::mem::take(&mut self.sent);
        let heads = wire::encode_tensors_into(&inputs, &mut sent);
        drop(inputs);
        let ask = Ask::Run {
            model: model.to_string(),
            outputs: outputs.to_vec(),
            inputs: heads,
            stats: false,
        };
        let mut received = std::mem::take(&mut self.received);
        let answer = self.exchange_into(&ask, &[&sent], &mut received);
        if sent.capacity() <= 64 << 20 {
            self.sent = sent;
        }
        let decoded = match answer? {
            Answer::Ran { outputs, stats } => {
                if let Some(stats) = stats {
                    self.stats = Some(stats.into());
                }
                wire::decode_tensors(&outputs, &received, &mut 0).map_err(BackendError::Runtime)
            }
            Answer::Failed(error) => Err(error.into()),
            other => Err(BackendError::Runtime(format!("the worker answered {other:?} to a run"))),
        };
        // Keep the buffers for the next run, unless an outsized one would stay for ever.
        if received.capacity() <= 64 << 20 {
            self.received = received;
        }
        decoded
    }

    fn arena_stats(&self) -> Option<ArenaStats> {
        self.stats
    }

    fn refresh_arena_stats(&mut self) {
        if let Ok((Answer::Stats(stats), _)) = self.exchange(&Ask::Stats { model: None }, &[]) {
            self.stats = stats.map(Into::into);
        }
    }

    fn refresh_arena_stats_for(&mut self, model: &str) {
        let ask = Ask::Stats {
            model: Some(model.to_string()),
        };
        if let Ok((Answer::Stats(stats), _)) = self.exchange(&ask, &[]) {
            self.stats = stats.map(Into::into);
        }
    }

    fn interrupt_handle(&self) -> Option<Interrupt> {
        let (interrupts, session) = (Arc::clone(&self.interrupts), self.session);
        let seq = self.seq.load(Ordering::SeqCst);
        Some(Arc::new(move || {
            let mut stream = interrupts.lock().unwrap_or_else(|e| e.into_inner());
            let _ = wire::write_frame(&mut *stream, &Ask::Interrupt { session, seq }, &[]);
        }))
    }

    fn clear_interrupt(&mut self) {
        // The next run has the next number: a stop sent for an earlier one does not reach it.
        self.seq.fetch_add(1, Ordering::SeqCst);
    }

    fn load_model(&mut self, name: &str, bytes: &[u8]) -> Result<(), String> {
        let ask = Ask::Load {
            name: name.to_string(),
            bytes: bytes.len() as u64,
        };
        match self.exchange(&ask, &[bytes]).map_err(|e| e.to_string())? {
            (Answer::Done { .. }, _) => {
                self.models.insert(name.to_string());
                Ok(())
            }
            (Answer::Refused(why), _) => Err(why),
            (other, _) => Err(format!("the worker answered {other:?} to a load")),
        }
    }

    fn unload_model(&mut self, name: &str) {
        self.models.remove(name);
        let _ = self.exchange(&Ask::Unload { name: name.to_string() }, &[]);
    }

    fn release_memory(&mut self, probe: &dyn Fn(&str) -> Option<Vec<Tensor>>) {
        // The worker shrinks the arena of the sessions that ran since the last release, with
        // the models' probe inputs, sent along.
        let mut probes = Vec::new();
        let mut blobs = Vec::new();
        for model in &self.models {
            if let Some(inputs) = probe(model) {
                let (heads, bytes) = wire::encode_tensors(&inputs);
                probes.push((model.clone(), heads));
                blobs.extend(bytes);
            }
        }
        let refs: Vec<&[u8]> = blobs.iter().map(Vec::as_slice).collect();
        let _ = self.exchange(&Ask::Release { probes }, &refs);
    }

    fn lost(&self) -> bool {
        self.gone.is_some()
            || self
                .host
                .current()
                .is_none_or(|current| current.generation != self.worker.generation)
    }
}
