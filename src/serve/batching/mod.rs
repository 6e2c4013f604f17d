//! Dynamic batching across requests, sized by memory (`models[].batching`): single runs of one
//! model that arrive close together share one run. A batch collects the members that arrive
//! while it waits, up to `max_batch` rows, and only while the whole batch's estimate
//! is one admission lets run on the model's first-choice pool now
//! ([`lifecycle::fits_now`]): the member that would not fit closes the batch and starts the
//! next, so a long input never drags the others into an allocator failure. A batch does not
//! wait when a run of it could start now (the delay costs a lone request nothing); while the
//! model's runs fill the pool's workers it gathers, until a run ends, it is full, or (past
//! `max_delay`) other work waits in the pool's queue.
//!
//! A closed batch is one request to the lifecycle ([`lifecycle::place_batch`]): its inputs the
//! members' stacked along the batch axis (right-padded with zeros where every member allows
//! it, [`Request::pads`]; otherwise only members of equal shapes batch), its id the first
//! member's, its deadline the latest member's, its priority the highest. Each member keeps its
//! own identity and count (the protocol's [`lifecycle::Counted`]), waits for its own deadline
//! (it gets its 504 and the batch goes on), and may go away (its rows are left out if the batch
//! has not gone yet; when every member is gone, the run is cancelled). Each answer is the member's rows cut back out of the
//! outputs, its padding trimmed ([`rows`]).
//!
//! Runs that follow one another (a transcription's windows, each starting where the last one's
//! timestamps say) are placed as a [`Series`]: while one is between two runs, a batch that could
//! go waits for it up to `max_delay`, so that transcriptions moving in step share their runs.

mod rows;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures_util::future::join_all;
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use crate::config::Batching;
use crate::core::backend::RunMeta;
use crate::core::metrics::ModelPoolLabels;
use crate::pool::Pool;
use crate::pool::activity::Progress;
use crate::runtime::estimate::{AxisRole, Dims};
use crate::serve::lifecycle::{self, BatchRan, DeadlineMiss, Placement, Refused, Request, RequestError, Served};
use crate::serve::service::{ModelEntry, Service};

/// The batchers of a service's models with `batching`, and the service their batches run on:
/// what a protocol places its requests through ([`Batchers::infer`],
/// [`Batchers::place_or_fallback`]); a request of any other model is placed as the lifecycle
/// places it.
#[derive(Debug)]
pub struct Batchers {
    service: Arc<Service>,
    batchers: HashMap<String, Arc<Batcher>>,
}

impl Batchers {
    /// A batcher for each of `service`'s models with `batching`.
    pub fn new(service: Arc<Service>) -> Batchers {
        let batchers = (service.models.iter())
            .filter_map(|m| Some((m.config.name.clone(), Arc::new(Batcher::new(m.config.batching?)))))
            .collect();
        Batchers { service, batchers }
    }

    /// `model`'s batcher, when it has `batching`.
    pub fn batcher(&self, model: &str) -> Option<&Batcher> {
        self.batchers.get(model).map(Arc::as_ref)
    }

    /// [`lifecycle::place`], in a batch when the request is a single run of a model with
    /// `batching`.
    pub async fn place(&self, request: Request) -> Result<Served, Refused> {
        match self.batchers.get(&request.model) {
            Some(batcher) if request.max_new_tokens == 0 && request.sequence.is_none() => {
                batcher.join(&self.service, request, None).await
            }
            _ => lifecycle::place(&self.service, request).await,
        }
    }

    /// A series of `model`'s runs, due from now ([`Series`]).
    pub fn series(&self, model: &str) -> Series {
        let series = Series {
            batcher: self.batchers.get(model).cloned(),
            due: Arc::new(AtomicBool::new(false)),
        };
        series.arm();
        series
    }

    /// [`Batchers::place`] for the next run of `series`: in a batch, it is no longer due once
    /// it has joined one, and due again when its run is over.
    pub async fn place_next(&self, request: Request, series: &Series) -> Result<Served, Refused> {
        match self.batchers.get(&request.model) {
            Some(batcher) if request.max_new_tokens == 0 && request.sequence.is_none() => {
                let served = batcher.join(&self.service, request, Some(&series.due)).await;
                series.arm();
                served
            }
            _ => lifecycle::place(&self.service, request).await,
        }
    }

    /// [`lifecycle::place_or_fallback`] through [`Batchers::place`]. The fallback model, when
    /// it answers instead, runs the request alone.
    pub async fn place_or_fallback(&self, request: Request) -> Result<Placement, Refused> {
        lifecycle::place_or_fallback_with(&self.service, request, |request| self.place(request)).await
    }

    /// [`lifecycle::infer`] through [`Batchers::place_or_fallback`].
    pub async fn infer(&self, request: Request) -> Result<Served, Refused> {
        lifecycle::infer_with(&self.service, request, |request| self.place_or_fallback(request)).await
    }
}

/// Runs of one model that follow one another (a transcription's windows), placed with
/// [`Batchers::place_next`]. Between two of its runs (the next being prepared) the series is
/// *due*: a batch of the model that could go now waits for it, up to `max_delay` from when it
/// could go, and goes as soon as no series is due. Without it, series that move in
/// step alternate: the one whose window ends first finds the worker free and runs alone, and the
/// others gather behind it. Due from [`Batchers::series`] until it joins a batch, and again
/// from the end of that batch's run (before the worker counts as free); dropped, it is done.
#[derive(Debug)]
pub struct Series {
    /// The model's batcher (none: the model does not batch, and a series changes nothing).
    batcher: Option<Arc<Batcher>>,
    due: Arc<AtomicBool>,
}

impl Series {
    /// Due again: its next run is being prepared.
    fn arm(&self) {
        if let Some(batcher) = &self.batcher {
            batcher.set_due(&self.due, true);
        }
    }
}

impl Drop for Series {
    fn drop(&mut self) {
        if let Some(batcher) = &self.batcher {
            batcher.set_due(&self.due, false);
        }
    }
}

/// The batcher of one model with `batching`.
#[derive(Debug)]
pub struct Batcher {
    config: Batching,
    /// The batches still taking members, one per kind of member ([`Key`]).
    open: Mutex<Vec<Open>>,
    /// Runs of this model's batches in flight (from their admission to their answer).
    running: AtomicUsize,
    /// A run of this model's batches ended: a batch waiting for one may go.
    ended: Notify,
    /// Series of this model between two runs ([`Series`]).
    due: AtomicUsize,
    /// A series stopped being due (it joined a batch, or ended): a batch waiting for it may go.
    arrived: Notify,
    next_id: AtomicU64,
}

/// What members must share to run as one: their outputs asked for, their inputs' names, and
/// unless they all allow padding, their inputs' shapes along every axis but the batch axis.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Key {
    outputs: Vec<String>,
    inputs: Vec<(String, Option<Vec<i64>>)>,
}

/// A batch taking members.
#[derive(Debug)]
struct Open {
    id: u64,
    key: Key,
    members: Vec<Member>,
    /// Its rows, and its size along each axis of the model's estimate (the batch axis the
    /// members' sum, every other the longest).
    rows: u64,
    dims: Dims,
    first: Instant,
    /// The pool it was sized for (the model's first choice).
    pool: Arc<Pool>,
    /// Set when it takes no more members (full, or the next would not fit): it goes now.
    closed: bool,
    close: Arc<Notify>,
}

#[derive(Debug)]
struct Member {
    request: Request,
    rows: u64,
    dims: Dims,
    answer: oneshot::Sender<Result<Served, Refused>>,
    /// Its series' due flag, when it is the next run of one.
    series: Option<Arc<AtomicBool>>,
}

impl Batcher {
    /// A batcher for a model batched as `config` says.
    pub fn new(config: Batching) -> Batcher {
        Batcher {
            config,
            open: Mutex::default(),
            running: AtomicUsize::new(0),
            ended: Notify::new(),
            due: AtomicUsize::new(0),
            arrived: Notify::new(),
            next_id: AtomicU64::new(0),
        }
    }

    /// Rows waiting in batches that have not gone yet.
    pub fn waiting_rows(&self) -> u64 {
        self.lock().iter().map(|open| open.rows).sum()
    }

    /// Mark a series due or not (`flag` its own), counted in `due` once whichever way.
    fn set_due(&self, flag: &AtomicBool, due: bool) {
        if flag.swap(due, Ordering::AcqRel) == due {
            return;
        }
        if due {
            self.due.fetch_add(1, Ordering::AcqRel);
        } else {
            self.due.fetch_sub(1, Ordering::AcqRel);
            self.arrived.notify_waiters();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Open>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Run `request` in a batch with the requests beside it, and answer it with its own rows.
    /// One larger than `max_batch` alone, or one no pool could start (admission then says
    /// why), runs alone, as it would without batching. `series`: the due flag of the series
    /// whose next run it is.
    async fn join(
        self: &Arc<Self>,
        service: &Arc<Service>,
        request: Request,
        series: Option<&Arc<AtomicBool>>,
    ) -> Result<Served, Refused> {
        let Some(entry) = service.model(&request.model) else {
            return self.alone(service, request, series).await;
        };
        let Some(batch_axis) = entry.profile.axis_with(AxisRole::Batch) else {
            return self.alone(service, request, series).await;
        };
        let dims = entry.dims_of(&request.inputs);
        let rows = dims.get(batch_axis);
        let first_choice = service
            .pools
            .iter()
            .find(|p| p.serves(&request.model) && p.is_ready() && p.health().breaker_allows());
        let (Some(pool), true) = (first_choice, rows as usize <= self.config.max_batch) else {
            return self.alone(service, request, series).await;
        };
        let deadline = request.meta.deadline.map(Instant::from_std);
        let (answer, answered) = oneshot::channel();
        let member = Member {
            request,
            rows,
            dims,
            answer,
            series: series.cloned(),
        };
        if let Some(id) = self.add(service, entry, pool, batch_axis, member) {
            let (service, batcher) = (Arc::clone(service), Arc::clone(self));
            tokio::spawn(async move { batcher.go(&service, id).await });
        }
        let answer = match deadline {
            // Its rows run on: only this member stops waiting.
            Some(deadline) => match tokio::time::timeout_at(deadline, answered).await {
                Ok(answer) => answer,
                Err(_) => {
                    return Err(Refused {
                        pool: None,
                        error: RequestError::Deadline(DeadlineMiss::InPool),
                    });
                }
            },
            None => answered.await,
        };
        match answer {
            Ok(reply) => reply,
            // Its batch's task ended without answering: the runtime is shutting down.
            Err(_) => Err(Refused::at(
                pool,
                RequestError::ShuttingDown {
                    pool: pool.name().to_string(),
                },
            )),
        }
    }

    /// `request` placed as it would be without batching; its series (if any) is not due while
    /// it runs.
    async fn alone(
        &self,
        service: &Service,
        request: Request,
        series: Option<&Arc<AtomicBool>>,
    ) -> Result<Served, Refused> {
        series.inspect(|flag| self.set_due(flag, false));
        let served = lifecycle::place(service, request).await;
        series.inspect(|flag| self.set_due(flag, true));
        served
    }

    /// Add `member` to the open batch of its kind while the batch stays within `max_batch`
    /// and what admission lets run on `pool` now; otherwise that batch goes and the member
    /// opens the next. The new batch's id, when it opened one (its caller starts it).
    fn add(
        &self,
        service: &Service,
        entry: &ModelEntry,
        pool: &Arc<Pool>,
        batch_axis: usize,
        member: Member,
    ) -> Option<u64> {
        let key = key_of(entry, &member.request);
        let mut open = self.lock();
        let others = open.len().saturating_sub(1);
        if let Some(batch) = open.iter_mut().find(|b| b.key == key && !b.closed) {
            let rows = batch.rows + member.rows;
            let dims = merged(batch.dims, member.dims, batch_axis);
            // Rows expected now: this batch's, the member's, and a row for each other series
            // between two runs (the member's own is still counted due).
            let due = (self.due.load(Ordering::Acquire) as u64).saturating_sub(u64::from(member.series.is_some()));
            let expected = rows + due;
            let limit = self.limit(&batch.pool, expected, others);
            if rows <= limit && lifecycle::fits_now(service, entry, pool, &entry.estimate(&dims)) {
                batch.rows = rows;
                batch.dims = dims;
                if let Some(flag) = &member.series {
                    self.set_due(flag, false);
                }
                batch.members.push(member);
                if rows == limit {
                    batch.closed = true;
                    batch.close.notify_one();
                }
                return None;
            }
            // The next member would not fit with it: it goes as it is.
            batch.closed = true;
            batch.close.notify_one();
        }
        if let Some(flag) = &member.series {
            self.set_due(flag, false);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        open.push(Open {
            id,
            key,
            rows: member.rows,
            dims: member.dims,
            members: vec![member],
            first: Instant::now(),
            pool: Arc::clone(pool),
            closed: false,
            close: Arc::new(Notify::new()),
        });
        Some(id)
    }

    /// The most rows a batch on `pool` takes, with `expected` rows to run now and `others`
    /// batches waiting to go besides it. An accelerator's workers share one device, where a
    /// run of more rows costs little more than a run of fewer: up to `max_batch`. Each worker
    /// of a CPU pool has cores of its own, and there a run of four rows costs nearly what four
    /// runs of one do (`docs/performance.md`), so the rows expected are shared among the
    /// workers free for them: four transcriptions in step on two workers run two and two, not
    /// four on one worker while the other idles.
    fn limit(&self, pool: &Pool, expected: u64, others: usize) -> u64 {
        let most = self.config.max_batch as u64;
        if !matches!(pool.provider(), crate::config::Provider::Cpu) {
            return most;
        }
        let busy = self.running.load(Ordering::Relaxed) + others;
        match pool.config.workers.saturating_sub(busy) as u64 {
            // Every worker is taken: the batch gathers for whichever frees first.
            0 | 1 => most,
            free => expected.div_ceil(free).clamp(1, most),
        }
    }

    /// Batch `id`: wait for it to go, run it, answer its members.
    async fn go(&self, service: &Service, id: u64) {
        // Requests that arrived in the same turn of the runtime join before it decides to go.
        tokio::task::yield_now().await;
        let members = self.members_of(id).await;
        let Some(entry) = members.first().and_then(|m| service.model(&m.request.model)) else {
            return;
        };
        self.running.fetch_add(1, Ordering::Relaxed);
        run(service, entry, members, Running(self)).await;
    }

    /// Wait until batch `id` goes, and take its members. It goes when it is closed, or when a
    /// run of it could start now (this model's runs leave one of its pool's workers free) and
    /// no [`Series`] is due (one due is waited for up to `max_delay` from when the batch could
    /// start): a lone request waits for nothing. While the model's runs fill the workers it gathers
    /// the requests that arrive, as it would only wait in the pool's queue; once `max_delay`
    /// has passed it goes to that queue all the same when other work waits there, to keep
    /// its place among it.
    async fn members_of(&self, id: u64) -> Vec<Member> {
        // Since when a run of it could start (a worker free), while it waits for series.
        let mut free_since = None;
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            let (close, until) = {
                let mut open = self.lock();
                let at = open
                    .iter()
                    .position(|b| b.id == id)
                    .expect("a batch is taken once, by its own task");
                let batch = &open[at];
                let now = Instant::now();
                let delayed = now >= batch.first + self.config.max_delay;
                let free = self.running.load(Ordering::Relaxed) < batch.pool.config.slots();
                let series_until = match free {
                    true => *free_since.get_or_insert(now) + self.config.max_delay,
                    false => {
                        free_since = None;
                        now
                    }
                };
                let waits_for_series = now < series_until && self.due.load(Ordering::Acquire) > 0;
                if batch.closed || (free && !waits_for_series) || (delayed && batch.pool.load().queue_depth > 0) {
                    return open.swap_remove(at).members;
                }
                // Past its delay, it looks again at the queue every `max_delay`.
                let until = match delayed {
                    true => now + self.config.max_delay,
                    false => batch.first + self.config.max_delay,
                };
                let until = match waits_for_series {
                    true => until.min(series_until),
                    false => until,
                };
                (Arc::clone(&batch.close), until)
            };
            tokio::select! {
                _ = close.notified() => {}
                _ = &mut ended => {}
                _ = &mut arrived => {}
                _ = tokio::time::sleep_until(until) => {}
            }
        }
    }
}

/// A batch's run in flight, counted in its batcher's `running` until dropped: when the run is
/// over, before its members are answered, so that a client's next request finds the worker free.
struct Running<'a>(&'a Batcher);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::Relaxed);
        self.0.ended.notify_waiters();
    }
}

/// Run the members still waiting as one request and answer each with its rows.
async fn run(service: &Service, entry: &ModelEntry, members: Vec<Member>, running: Running<'_>) {
    let (mut requests, mut answers, mut rows, mut series) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for member in members.into_iter().filter(|m| !m.answer.is_closed()) {
        requests.push(member.request);
        answers.push(member.answer);
        rows.push(member.rows as usize);
        series.extend(member.series);
    }
    if requests.is_empty() {
        return;
    }
    let batch = match batch_request(entry, &requests) {
        Ok(batch) => batch,
        Err(why) => {
            // Members that cannot be stacked (a client sent other types under one name) are
            // each the request they would have been without batching.
            tracing::debug!(model = %entry.config.name, %why, "the batch's members run alone");
            let alone = requests.into_iter().map(|r| lifecycle::place(service, r));
            for (answer, reply) in answers.into_iter().zip(join_all(alone).await) {
                let _ = answer.send(reply);
            }
            return;
        }
    };
    let total: usize = rows.iter().sum();
    let placed = lifecycle::place_batch(service, batch, &requests);
    let gone = join_all(answers.iter_mut().map(|a| a.closed()));
    // Dropping the run when every member is gone cancels its job, queued or running.
    let ran = tokio::select! {
        ran = placed => ran,
        _ = gone => {
            tracing::debug!(model = %entry.config.name, "every member of the batch went away");
            return;
        }
    };
    // Its series are due again before the worker counts as free: a batch that could go then
    // waits for their next runs.
    for flag in &series {
        running.0.set_due(flag, true);
    }
    drop(running);
    match ran {
        Ok(BatchRan::Together(served)) => {
            service
                .metrics
                .batching
                .rows
                .get_or_create(&ModelPoolLabels {
                    model: entry.config.name.clone(),
                    pool: served.pool.name().to_string(),
                })
                .observe(total as f64);
            let symbols = |name: &str| {
                let spec = entry.signature.outputs.iter().find(|o| o.name == name);
                spec.map(|o| o.symbols.clone()).unwrap_or_default()
            };
            let mut start = 0;
            for ((request, answer), n) in requests.iter().zip(answers).zip(rows) {
                let mine = rows::cut(&served.outputs, (start, n, total), &lengths(entry, request), &symbols);
                start += n;
                let reply = mine
                    .map(|outputs| Served {
                        pool: Arc::clone(&served.pool),
                        action: served.action,
                        context: None,
                        context_cut: None,
                        retry_started: None,
                        retried: None,
                        outputs,
                    })
                    .map_err(|why| {
                        tracing::error!(model = %entry.config.name, %why, "a member's answer cannot be cut out of its batch's");
                        let pool = served.pool.name().to_string();
                        Refused::at(&served.pool, RequestError::Failed { pool })
                    });
                let _ = answer.send(reply);
            }
        }
        Ok(BatchRan::Apart(each)) => {
            for (answer, reply) in answers.into_iter().zip(each) {
                let _ = answer.send(reply);
            }
        }
        Err(refused) => {
            for answer in answers {
                let _ = answer.send(Err(refused.clone()));
            }
        }
    }
}

/// The members as one request of the model: their inputs stacked, the first member's id, the
/// latest deadline (none when one has none), the highest priority, replayable when every
/// member is (a batch that fails is retried member by member, each as its own says).
fn batch_request(entry: &ModelEntry, members: &[Request]) -> Result<Request, String> {
    let batch_axis = |input: &str| entry.profile.batch_axis_of(&entry.signature, input).unwrap_or(0);
    let inputs: Vec<&[crate::core::tensor::Tensor]> = members.iter().map(|r| r.inputs.as_slice()).collect();
    let inputs = rows::merge(&inputs, &batch_axis)?;
    let first = &members[0];
    let deadline = match members.iter().all(|r| r.meta.deadline.is_some()) {
        true => members.iter().filter_map(|r| r.meta.deadline).max(),
        false => None,
    };
    Ok(Request {
        meta: RunMeta {
            request_id: first.meta.request_id.clone(),
            deadline,
            idempotency_key: None,
            priority: members.iter().map(|r| r.meta.priority).max().unwrap_or(0),
            replayable: members.iter().all(|r| r.meta.replayable),
            allow_shrink: false,
        },
        model: first.model.clone(),
        inputs,
        outputs: first.outputs.clone(),
        max_new_tokens: 0,
        received: members.iter().map(|r| r.received).min().unwrap_or(first.received),
        shrinker: None,
        progress: Progress::batch(members.iter().map(|r| r.progress.clone()).collect()),
        allow_substitute: false,
        sequence: None,
        generations: 0,
        pads: first.pads,
    })
}

/// What a request shares with the others of its batch ([`Key`]).
fn key_of(entry: &ModelEntry, request: &Request) -> Key {
    let inputs = request
        .inputs
        .iter()
        .map(|t| {
            let axis = entry.profile.batch_axis_of(&entry.signature, &t.name).unwrap_or(0);
            let shape = (!request.pads).then(|| {
                let mut shape = t.shape.clone();
                if axis < shape.len() {
                    shape.remove(axis);
                }
                shape
            });
            (t.name.clone(), shape)
        })
        .collect();
    Key {
        outputs: request.outputs.clone(),
        inputs,
    }
}

/// A batch's size with a member added: its rows the sum, every other axis the longer.
fn merged(batch: Dims, member: Dims, batch_axis: usize) -> Dims {
    let values: Vec<u64> = (0..batch.as_slice().len())
        .map(|i| match i == batch_axis {
            true => batch.get(i) + member.get(i),
            false => batch.get(i).max(member.get(i)),
        })
        .collect();
    Dims::new(&values)
}

/// A request's own length along each named axis of its inputs (by the symbol the model gives
/// it), but the batch axis: where its answer's padding ends.
fn lengths(entry: &ModelEntry, request: &Request) -> HashMap<String, usize> {
    let batch = entry
        .profile
        .axis_with(AxisRole::Batch)
        .map(|i| entry.profile.axes[i].name.as_str());
    let mut lengths = HashMap::new();
    for tensor in &request.inputs {
        let Some(spec) = entry.signature.inputs.iter().find(|s| s.name == tensor.name) else {
            continue;
        };
        for (symbol, &len) in spec.symbols.iter().zip(&tensor.shape) {
            if !symbol.is_empty() && Some(symbol.as_str()) != batch {
                lengths.insert(symbol.clone(), len.max(0) as usize);
            }
        }
    }
    lengths
}
