//! [`ProcessBackend`]: one lane of a session connection to the pool's worker process (two
//! lanes share each connection's sessions, see [`super::conn`]). A worker process that dies
//! (or is replaced) turns every run into [`BackendError::WorkerLost`] at once, and
//! [`Liveness::lost`] tells the pool to replace the backend with one on the new process.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::conn::Conn;
use super::host::WorkerHost;
use super::shm::{Region, SHARED_FROM};
use super::wire::{self, Answer, Ask, ModelHead};
use crate::core::backend::{
    ArenaStats, Arenas, Backend, BackendError, DecodeStep, Generations, Interrupt, Interrupts, Liveness, Residency,
    RunMeta,
};
use crate::core::model::ModelData;
use crate::core::tensor::Tensor;
use crate::pool::RunOp;

/// One pool worker slot's sessions in the worker process: a lane of a session connection.
pub struct ProcessBackend {
    host: Arc<WorkerHost>,
    conn: Arc<Conn>,
    lane: usize,
    /// The number of its next run (the one an interrupt handle given out now stops).
    seq: u64,
    stats: Option<ArenaStats>,
    /// All its arenas summed, as the worker last said ([`Arenas::held_arena_stats`]).
    held: Option<ArenaStats>,
    /// The last run's input bytes and answer: their allocations are reused.
    sent: Vec<u8>,
    received: Vec<u8>,
    /// Shared memory for large inputs and outputs (made when first needed).
    regions: Regions,
}

/// A lane's shared memory, made the first time a run's tensors would use it.
#[derive(Debug, Default)]
struct Regions {
    to_worker: Option<Region>,
    from_worker: Option<Region>,
    /// Why shared memory is not used on this lane (the worker could not map it).
    refused: Option<String>,
}

impl ProcessBackend {
    /// A lane with sessions of `models` in `host`'s current worker: the free lane of the last
    /// connection opened with the same models, or the first lane of a new one.
    pub fn open(host: &Arc<WorkerHost>, models: &[(String, ModelData<'_>)]) -> Result<ProcessBackend, String> {
        let worker = host
            .current()
            .ok_or_else(|| format!("pool `{}` has no worker process running", host.pool))?;
        let names: BTreeSet<String> = models.iter().map(|(n, _)| n.clone()).collect();
        let mut spare = host.spare.lock().unwrap_or_else(|e| e.into_inner());
        // A connection on this worker with a lane free and the same sessions is joined.
        let joined = spare
            .take()
            .and_then(|conn| conn.upgrade())
            .filter(|conn| conn.worker.generation == worker.generation && conn.gone().is_none())
            .filter(|conn| conn.held() == names)
            .and_then(|conn| Some((conn.take_lane()?, conn)));
        let (lane, conn) = match joined {
            Some(joined) => joined,
            None => {
                let conn = Arc::new(Conn::open(worker, &host.pool, models)?);
                let lane = conn.take_lane().expect("a new connection has its lanes free");
                *spare = Some(Arc::downgrade(&conn));
                (lane, conn)
            }
        };
        drop(spare);
        conn.hold(lane, names);
        let mut backend = ProcessBackend {
            host: Arc::clone(host),
            seq: conn.next_seq(),
            conn,
            lane,
            stats: None,
            held: None,
            sent: Vec::new(),
            received: Vec::new(),
            regions: Regions::default(),
        };
        backend.refresh_arena_stats();
        Ok(backend)
    }

    /// The region for a run's inputs (`to_worker`) or outputs, at least `need` bytes long,
    /// made (and handed to the worker) when it is missing or short; `None` when `need` is small
    /// enough to cross inline, too large for shared memory, or the worker cannot map it.
    fn region(&mut self, to_worker: bool, need: usize) -> Option<&mut Region> {
        if need < SHARED_FROM || self.regions.refused.is_some() {
            return None;
        }
        let have = match to_worker {
            true => &self.regions.to_worker,
            false => &self.regions.from_worker,
        };
        if have.as_ref().is_none_or(|r| r.len() < need) {
            let fresh = match Region::create(need) {
                Ok(Some(region)) => region,
                Ok(None) => return None,
                Err(why) => {
                    self.refuse_regions(why);
                    return None;
                }
            };
            let ask = Ask::Region {
                lane: self.lane,
                to_worker,
                fd: fresh.fd(),
                len: fresh.len() as u64,
            };
            match self.conn.exchange(&ask, &[]) {
                Ok((Answer::Done { .. }, _)) => {}
                Ok((Answer::Refused(why), _)) => {
                    self.refuse_regions(why);
                    return None;
                }
                Ok((other, _)) => {
                    self.refuse_regions(format!("the worker answered {other:?} to a region"));
                    return None;
                }
                // The worker is gone: the run that follows says so.
                Err(_) => return None,
            }
            match to_worker {
                true => self.regions.to_worker = Some(fresh),
                false => self.regions.from_worker = Some(fresh),
            }
        }
        match to_worker {
            true => self.regions.to_worker.as_mut(),
            false => self.regions.from_worker.as_mut(),
        }
    }

    /// Shared memory does not work with this worker: every tensor crosses inline from now on.
    fn refuse_regions(&mut self, why: String) {
        tracing::warn!(pool = %self.host.pool, pid = self.conn.worker.pid, %why, "shared memory for tensors refused: they cross through the socket");
        self.regions = Regions {
            refused: Some(why),
            ..Regions::default()
        };
    }

    /// What it read of a gone process's arena is nobody's now.
    fn exchange(&mut self, ask: &Ask, blobs: &[&[u8]]) -> Result<(Answer, Vec<u8>), BackendError> {
        self.conn.exchange(ask, blobs).inspect_err(|_| self.forget_stats())
    }

    /// A lost worker holds nothing any more.
    fn forget_stats(&mut self) {
        self.stats = None;
        self.held = None;
    }
}

impl Drop for ProcessBackend {
    /// The lane is given up: sessions only it held go, and a connection with a lane still
    /// taken is the one the next lane joins (a replaced slot pairs up again).
    fn drop(&mut self) {
        // With both lanes gone the connection closes, and the worker drops its sessions.
        if self.conn.leave(self.lane) && self.conn.gone().is_none() {
            for model in self.conn.held_by(self.lane) {
                self.unload_model(&model);
            }
            *self.host.spare.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::downgrade(&self.conn));
        }
    }
}

impl ProcessBackend {
    /// Send one run of `model` (`op`: plain, a prompt's or a step's) and read its outputs.
    /// Inputs given by value are freed once copied out, before the worker runs them; borrowed
    /// ones stay with their owner (a request keeping them for a retry).
    fn call(
        &mut self,
        model: &str,
        inputs: impl AsRef<[Tensor]>,
        outputs: &[String],
        op: RunOp,
    ) -> Result<Vec<Tensor>, BackendError> {
        let mut sent = std::mem::take(&mut self.sent);
        sent.clear();
        // Large inputs go through shared memory, small ones in the frame.
        let tensors = inputs.as_ref();
        let shared = match self.region(true, wire::tensor_bytes(tensors)) {
            Some(region) => wire::encode_tensors_at(tensors, region.bytes_mut()),
            None => None,
        };
        let (heads, shared) = match shared {
            Some(heads) => (heads, true),
            None => (wire::encode_tensors_into(tensors, &mut sent), false),
        };
        drop(inputs);
        let ask = Ask::Run {
            model: model.to_string(),
            outputs: outputs.to_vec(),
            inputs: heads,
            stats: false,
            shared,
            lane: self.lane,
            seq: self.seq,
            op,
        };
        let mut received = std::mem::take(&mut self.received);
        let answer = self.conn.exchange_into(&ask, &[&sent], &mut received);
        if answer.is_err() {
            self.forget_stats();
        }
        if sent.capacity() <= 64 << 20 {
            self.sent = sent;
        }
        let decoded = match answer? {
            Answer::Ran {
                outputs,
                stats,
                held,
                shared,
            } => {
                if let Some(stats) = stats {
                    self.stats = Some(stats.into());
                    self.held = held.map(Into::into);
                }
                let from = match (shared, &self.regions.from_worker) {
                    (true, Some(region)) => region.bytes(),
                    (true, None) => {
                        return Err(BackendError::Runtime(
                            "the worker answered in shared memory it has not been given".into(),
                        ));
                    }
                    (false, _) => &received,
                };
                let decoded = wire::decode_tensors(&outputs, from, &mut 0).map_err(BackendError::Runtime);
                if !shared {
                    // Outputs this large come back through shared memory from the next run on.
                    let _ = self.region(false, received.len());
                }
                decoded
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
}

impl Backend for ProcessBackend {
    fn run(
        &mut self,
        model: &str,
        inputs: Vec<Tensor>,
        outputs: &[String],
        _: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        self.call(model, inputs, outputs, RunOp::Run)
    }

    /// The inputs are copied to the worker either way: read where they are.
    fn run_borrowed(
        &mut self,
        model: &str,
        inputs: &[Tensor],
        outputs: &[String],
        _: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        self.call(model, inputs, outputs, RunOp::Run)
    }

    fn residency(&mut self) -> Option<&mut dyn Residency> {
        Some(self)
    }

    /// The worker keeps the caches: they live and die with its process.
    fn generations(&mut self) -> Option<&mut dyn Generations> {
        Some(self)
    }

    fn arenas(&mut self) -> Option<&mut dyn Arenas> {
        Some(self)
    }

    fn liveness(&self) -> Option<&dyn Liveness> {
        Some(self)
    }

    fn interrupts(&mut self) -> Option<&mut dyn Interrupts> {
        Some(self)
    }
}

impl Generations for ProcessBackend {
    fn prefill(
        &mut self,
        model: &str,
        seq: u64,
        inputs: Vec<Tensor>,
        _: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        self.call(model, inputs, &[], RunOp::Prefill(seq))
    }

    fn prefill_many(
        &mut self,
        model: &str,
        seqs: &[u64],
        inputs: Vec<Tensor>,
        _: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        self.call(model, inputs, &[], RunOp::PrefillMany(seqs.to_vec()))
    }

    fn decode(&mut self, model: &str, step: &DecodeStep, _: &RunMeta) -> Result<Vec<Tensor>, BackendError> {
        self.call(model, &[], &[], RunOp::Decode(step.clone()))
    }
}

impl Arenas for ProcessBackend {
    fn arena_stats(&self) -> Option<ArenaStats> {
        self.stats
    }

    fn held_arena_stats(&self) -> Option<ArenaStats> {
        self.held
    }

    fn refresh_arena_stats(&mut self) {
        if let Ok((Answer::Stats { last, held }, _)) = self.exchange(&Ask::Stats { model: None }, &[]) {
            self.stats = last.map(Into::into);
            self.held = held.map(Into::into);
        }
    }

    fn refresh_arena_stats_for(&mut self, model: &str) {
        let ask = Ask::Stats {
            model: Some(model.to_string()),
        };
        if let Ok((Answer::Stats { last, .. }, _)) = self.exchange(&ask, &[]) {
            self.stats = last.map(Into::into);
        }
    }
}

impl Interrupts for ProcessBackend {
    fn interrupt_handle(&self) -> Interrupt {
        let (conn, seq) = (Arc::clone(&self.conn), self.seq);
        Arc::new(move || conn.interrupt(seq))
    }

    fn clear_interrupt(&mut self) {
        // The next run has a number of its own: a stop sent for an earlier one (this lane's
        // or the other's) does not reach it.
        self.seq = self.conn.next_seq();
    }
}

impl Residency for ProcessBackend {
    fn load_model(&mut self, name: &str, model: ModelData<'_>) -> Result<(), String> {
        let conn = Arc::clone(&self.conn);
        conn.load(self.lane, name, || {
            let ask = Ask::Load {
                model: ModelHead::of(name, model),
            };
            match conn
                .exchange(&ask, &[ModelHead::blob(&model)])
                .map_err(|e| e.to_string())?
            {
                (Answer::Done { .. }, _) => Ok(()),
                (Answer::Refused(why), _) => Err(why),
                (other, _) => Err(format!("the worker answered {other:?} to a load")),
            }
        })
    }

    fn unload_model(&mut self, name: &str) {
        let conn = Arc::clone(&self.conn);
        conn.unload(self.lane, name, || {
            let _ = conn.exchange(&Ask::Unload { name: name.to_string() }, &[]);
        });
    }

    /// A worker process builds every name's session of its own: the pool plans no sharing
    /// for a process-isolated pool (`serve::service::pools`), and this is never asked.
    fn share_model(&mut self, name: &str, with: &str) -> Result<(), String> {
        Err(format!(
            "`{name}` cannot share `{with}`'s session: a worker process builds each model's own"
        ))
    }

    fn release_memory(&mut self, probe: &dyn Fn(&str) -> Option<Vec<Tensor>>) {
        // The worker shrinks the arena of the sessions that ran since the last release, with
        // the models' probe inputs, sent along.
        let mut probes = Vec::new();
        let mut blobs = Vec::new();
        for model in self.conn.held_by(self.lane) {
            if let Some(inputs) = probe(&model) {
                let (heads, bytes) = wire::encode_tensors(&inputs);
                probes.push((model, heads));
                blobs.extend(bytes);
            }
        }
        let refs: Vec<&[u8]> = blobs.iter().map(Vec::as_slice).collect();
        let _ = self.exchange(&Ask::Release { probes }, &refs);
    }
}

impl Liveness for ProcessBackend {
    fn worker_gone(&self) -> Option<String> {
        let why = self.conn.gone()?;
        let current = self.host.current()?;
        (current.generation == self.conn.worker.generation).then_some(why)
    }

    fn lost(&self) -> bool {
        self.conn.gone().is_some()
            || self
                .host
                .current()
                .is_none_or(|current| current.generation != self.conn.worker.generation)
    }
}
