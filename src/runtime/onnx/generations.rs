//! The KV caches of the generations one backend runs, kept as ONNX Runtime values where its
//! sessions put them (on a CUDA pool, device memory) from one step to the next: a step sends
//! each sequence's new token in and brings one row of logits out, whatever its position.
//!
//! A prompt's run ([`Generations::prefill`]) leaves its sequence's cache on its own; a fork
//! ([`DecodeStep::forks`]) copies it as other sequences' rows beside it, on the device. A step
//! ([`Generations::decode`]) runs every sequence of the model as one batch, its rows padded to
//! the batch's length on the side the model's attention takes ([`Padding`](crate::runtime::decoder::Padding)): on the left,
//! padding masked out in the attention mask (which stays on the device too and grows by one
//! column a step); on the right, each row's mask its length in ones (`GroupQueryAttention`
//! reads only that, and writes a row's new position at its own length). When rows join or
//! leave, the batch is arranged again by small graphs on the same execution provider
//! ([`Kernels`]), so the cache never crosses to the host. A sequence of the batch that sends no
//! token in a step (its client is slow) takes a masked slot instead, and the batch is not
//! arranged again for it.

use std::collections::HashMap;

use ort::session::{RunOptions, Session};
use ort::value::DynValue;

use super::kernels::Kernels;
use super::{classify, to_value};
use crate::core::backend::{BackendError, DecodeStep};
use crate::core::tensor::{Tensor, TensorData};
use crate::runtime::decoder::DecoderLayout;

/// The generations of one backend, by model.
pub struct Generations {
    kernels: Kernels,
    models: HashMap<String, Caches>,
    /// [`PREFILL_CHUNK`] (a test sets another to compare a prompt run whole).
    chunk: usize,
}

/// One model's caches: prompts prefilled and not yet batched (each run's rows, with the steps
/// run since), and the batch.
#[derive(Default)]
struct Caches {
    prefilled: Vec<(Cache, u32)>,
    batch: Option<Cache>,
}

/// Steps after which a prefilled sequence that never joined is dropped: its generation joins
/// at its next step, so one that has not is gone (its client left while the prompt ran).
const UNCLAIMED_STEPS: u32 = 64;

/// Rows of caches that run together: `past_key_values` for each layer (key, value), the
/// attention mask `[rows, len]` of a left-padded batch (a right-padded one's is made from its
/// rows' lengths at each step), and each row's sequence.
struct Cache {
    rows: Vec<Row>,
    kv: Vec<DynValue>,
    mask: Option<DynValue>,
    /// Slots along the sequence axis (every row has them, padding included).
    len: i64,
}

#[derive(Debug, Clone, Copy)]
struct Row {
    seq: u64,
    /// Its real positions (prompt and tokens so far): its next token's position.
    past: u64,
    /// Masked slots before its first real one (left padding; 0 when padded on the right).
    lead: i64,
    /// Ended or prefilled again: dropped at the next arrangement.
    gone: bool,
}

/// The most tokens of a prompt one run takes ([`Generations::prefill_chunked`]): a longer one
/// runs in pieces of this many. 512, as serving engines chunk a prefill: a piece's attention
/// scores stay small (`heads × 512 × n` values per layer), while each run still carries enough
/// tokens that the pieces cost about what one run would.
pub const PREFILL_CHUNK: usize = 512;

/// The tokens that pad an idle row's step (masked out; any valid id).
const PAD_TOKEN: i64 = 0;
/// The position an idle row's padding slot gets (masked out; as `transformers` pads).
const PAD_POSITION: i64 = 1;

/// `data` as an INT64 value of `shape` made on the host (ids, masks, positions), bound as an
/// input and copied to the device by the run.
fn int64_value(name: &str, shape: Vec<i64>, data: Vec<i64>) -> Result<DynValue, BackendError> {
    to_value(Tensor {
        name: name.into(),
        shape,
        data: TensorData::Int64(data),
    })
    .map_err(runtime)
}

fn runtime(e: impl std::fmt::Display) -> BackendError {
    classify(&e.to_string())
}

impl Generations {
    /// Caches arranged with `kernels` (built for the backend's provider).
    pub fn new(kernels: Kernels) -> Generations {
        Generations {
            kernels,
            models: HashMap::new(),
            chunk: PREFILL_CHUNK,
        }
    }

    /// Run prompts in pieces of `chunk` tokens instead of [`PREFILL_CHUNK`] (`usize::MAX`: whole).
    #[cfg(test)]
    pub fn chunk_prompts_by(&mut self, chunk: usize) {
        self.chunk = chunk.max(1);
    }

    /// The statistics of the arenas of the graphs that move caches: what the values they made
    /// (caches moved on the device) hold there. Nothing on the host, where no graph runs.
    pub fn kernel_arena_stats(&self) -> Vec<super::arena::ArenaStats> {
        let kernels = &self.kernels;
        kernels
            .sessions
            .values()
            .filter_map(|session| super::arena_allocator(session, &kernels.options))
            .filter_map(|allocator| super::arena::allocator_stats(&allocator).ok())
            .collect()
    }

    /// The graphs that move values on the backend's device (a speech model's window job reads
    /// its steps' logits with them too).
    pub fn kernels(&mut self) -> &mut Kernels {
        &mut self.kernels
    }

    /// Drop every cache of `model` (its session is gone).
    pub fn forget(&mut self, model: &str) {
        self.models.remove(model);
    }

    /// Sequences of `model` whose caches are held.
    #[cfg(test)]
    pub fn sequences(&self, model: &str) -> usize {
        let live = |c: &Cache| c.rows.iter().filter(|r| !r.gone).count();
        self.models.get(model).map_or(0, |c| {
            c.prefilled.iter().map(|(p, _)| live(p)).sum::<usize>() + c.batch.as_ref().map_or(0, live)
        })
    }

    /// One batched step of `model`'s generations (see [`Generations::decode`]): ended caches
    /// dropped, joiners and leavers arranged into the batch, then one run for every row.
    ///
    /// [`Generations::decode`]: crate::core::backend::Generations::decode
    pub fn decode(
        &mut self,
        session: &mut Session,
        layout: &DecoderLayout,
        model: &str,
        step: &DecodeStep,
        options: &RunOptions,
    ) -> Result<Vec<Tensor>, BackendError> {
        let caches = self.models.entry(model.to_string()).or_default();
        for fork in &step.forks {
            if let Err(error) = caches.fork(&mut self.kernels, layout, fork) {
                self.models.remove(model);
                return Err(error);
            }
        }
        let caches = self.models.get_mut(model).expect("made above");
        let missing = caches.missing(step);
        if !missing.is_empty() {
            return Err(BackendError::CacheMissing(missing));
        }
        for seq in &step.ended {
            caches.end(*seq);
        }
        caches.prefilled.retain_mut(|(cache, waited)| {
            *waited += 1;
            let claimed = cache.rows.iter().any(|r| step.rows.iter().any(|w| w.seq == r.seq));
            cache.rows.iter().any(|r| !r.gone) && (*waited <= UNCLAIMED_STEPS || claimed)
        });
        let mut outputs = if step.rows.is_empty() {
            if caches.batch.as_ref().is_some_and(|b| b.rows.iter().all(|r| r.gone)) {
                caches.batch = None;
            }
            vec![logits_tensor(Vec::new(), 0), padding(caches.batch.as_ref(), layout)]
        } else {
            // A failure part-way leaves nothing half-arranged: the model's caches go, and their
            // sequences are prefilled again (or move) as after any failed step.
            match self.step(session, layout, model, step, options) {
                Ok(outputs) => outputs,
                Err(error) => {
                    self.models.remove(model);
                    return Err(error);
                }
            }
        };
        outputs.push(self.models.get(model).expect("made by decode").shape());
        Ok(outputs)
    }

    fn step(
        &mut self,
        session: &mut Session,
        layout: &DecoderLayout,
        model: &str,
        step: &DecodeStep,
        options: &RunOptions,
    ) -> Result<Vec<Tensor>, BackendError> {
        let caches = self.models.get_mut(model).expect("made by decode");
        // Prompts with a row in this step join the batch (their other rows as late ones).
        let (joiners, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut caches.prefilled)
            .into_iter()
            .partition(|(cache, _)| cache.rows.iter().any(|r| step.rows.iter().any(|w| w.seq == r.seq)));
        caches.prefilled = waiting;
        let mut batch = caches.batch.take().filter(|b| b.rows.iter().any(|r| !r.gone));
        if batch.as_ref().is_some_and(|b| b.rows.iter().any(|r| r.gone)) {
            batch = batch.map(|b| self.kernels.without_gone(b, layout)).transpose()?;
        }
        for (joiner, _) in joiners {
            let joiner = match joiner.rows.iter().any(|r| r.gone) {
                true => self.kernels.without_gone(joiner, layout)?,
                false => joiner,
            };
            batch = Some(match batch {
                None => joiner,
                Some(b) => self.kernels.join(b, joiner, layout)?,
            });
        }
        let mut batch = batch.ok_or_else(|| BackendError::CacheMissing(step.rows.iter().map(|r| r.seq).collect()))?;
        let result = self.run_step(session, layout, &mut batch, step, options);
        self.models.get_mut(model).expect("made by decode").batch = Some(batch);
        result
    }

    /// Run the batch's next slot: each row of `step` its token, every other row a masked pad.
    fn run_step(
        &mut self,
        session: &mut Session,
        layout: &DecoderLayout,
        batch: &mut Cache,
        step: &DecodeStep,
        options: &RunOptions,
    ) -> Result<Vec<Tensor>, BackendError> {
        let rows = batch.rows.len();
        let mut ids = vec![PAD_TOKEN; rows];
        let mut positions = vec![PAD_POSITION; rows];
        let mut column = vec![0i64; rows];
        let mut order = Vec::with_capacity(step.rows.len());
        for want in &step.rows {
            let at = batch
                .rows
                .iter()
                .position(|r| r.seq == want.seq)
                .expect("checked by missing()");
            ids[at] = i64::from(want.token);
            positions[at] = want.past as i64;
            column[at] = 1;
            order.push(at);
        }
        let host = |name: &str, data: Vec<i64>| int64_value(name, vec![rows as i64, 1], data);
        let (mask, mask_bytes) = match &batch.mask {
            Some(before) => {
                let column = host("column", column)?;
                let mask = self.kernels.concat(before, &column, 1).map_err(BackendError::Runtime)?;
                (mask, 0)
            }
            None => {
                // Right-padded: each row's mask is its length (with this step's slot) in ones;
                // a masked slot keeps its length, so its pad lands where its next token will.
                let width = batch.rows.iter().map(|r| r.past + 1).max().unwrap_or(1);
                let mut ones = Vec::with_capacity(rows * width as usize);
                for row in &batch.rows {
                    let len = row.past + 1;
                    ones.extend((0..width).map(|at| i64::from(at < len)));
                }
                let mask = to_value(Tensor {
                    name: "attention_mask".into(),
                    shape: vec![rows as i64, width as i64],
                    data: TensorData::Int64(ones),
                })
                .map_err(runtime)?;
                // The whole mask crosses, not one column of it.
                (mask, rows as u64 * (width - 1) * 8)
            }
        };
        let mut binding = session.create_binding().map_err(runtime)?;
        binding
            .bind_input("input_ids", &host("input_ids", ids)?)
            .map_err(runtime)?;
        if layout.position_ids {
            binding
                .bind_input("position_ids", &host("position_ids", positions)?)
                .map_err(runtime)?;
        }
        binding.bind_input("attention_mask", &mask).map_err(runtime)?;
        for (i, value) in batch.kv.iter().enumerate() {
            binding.bind_input(past_name(i), value).map_err(runtime)?;
        }
        let (mut kv, logits) = self.run_bound(session, &mut binding, layout, options)?;
        let logits = self.kernels.last_position(&logits).map_err(BackendError::Runtime)?;
        let mut mask = mask;
        if order.len() < rows {
            self.kernels
                .settle_masked(layout, batch, (&mut kv, &mut mask), &order)?;
        }
        // Left-padded caches grow by the step's slot; right-padded ones to the longest row's
        // length with it (a windowed layer's stays its window: another layer's says it).
        let grown = (0..kv.len()).find(|i| !layout.windowed(i / 2)).map(|i| kv[i].dtype());
        batch.len = match grown {
            Some(ort::value::ValueType::Tensor { shape, .. }) if shape.len() == 4 => shape[2],
            _ if batch.mask.is_none() => batch.rows.iter().map(|r| r.past as i64 + 1).max().unwrap_or(0),
            _ => batch.len + 1,
        };
        batch.kv = kv;
        batch.mask = batch.mask.is_some().then_some(mask);
        for &at in &order {
            batch.rows[at].past += 1;
        }
        let vocab = logits.len() / rows.max(1);
        let mut picked = Vec::with_capacity(order.len() * vocab);
        for at in order {
            picked.extend_from_slice(&logits[at * vocab..(at + 1) * vocab]);
        }
        // Every row of the batch crossed, masked ones too: their inputs went in, and the
        // last position's logits of all of them came out before the step's own were picked.
        let crossed = [
            rows as u64 * DecodeStep::ROW_BYTES + mask_bytes,
            (logits.len() * std::mem::size_of::<f32>()) as u64,
        ];
        Ok(vec![
            logits_tensor(picked, step.rows.len()),
            padding(Some(batch), layout),
            crossed_tensor(crossed),
        ])
    }

    /// Run `binding`'s inputs with every output bound to the device: the `present.*` values (in
    /// layer order, key then value) and the logits.
    fn run_bound(
        &self,
        session: &mut Session,
        binding: &mut ort::session::IoBinding,
        layout: &DecoderLayout,
        options: &RunOptions,
    ) -> Result<(Vec<DynValue>, DynValue), BackendError> {
        let device = self.kernels.device();
        binding.bind_output_to_device("logits", device).map_err(runtime)?;
        for i in 0..layout.layers * 2 {
            binding
                .bind_output_to_device(present_name(i), device)
                .map_err(runtime)?;
        }
        // As in the kernels' runs: host inputs bound are copied to the device asynchronously
        // (on CUDA, on another stream), and the outputs are read right after.
        binding.synchronize_inputs().map_err(runtime)?;
        let mut outputs = session.run_binding_with_options(binding, options).map_err(runtime)?;
        binding.synchronize_outputs().map_err(runtime)?;
        let mut take = |name: &str| {
            outputs
                .remove(name)
                .ok_or_else(|| BackendError::Runtime(format!("the decoder gave no `{name}`")))
        };
        let logits = take("logits")?;
        let kv = (0..layout.layers * 2)
            .map(|i| take(&present_name(i)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((kv, logits))
    }
}

impl Caches {
    /// [`DecodeStep::BATCH`]: the rows held (batched, or prefilled and not joined yet) and the
    /// positions they share once together.
    fn shape(&self) -> Tensor {
        let caches = self.batch.iter().chain(self.prefilled.iter().map(|(c, _)| c));
        let (mut rows, mut slots) = (0i64, 0i64);
        for cache in caches {
            let live = cache.rows.iter().filter(|r| !r.gone).count() as i64;
            if live > 0 {
                rows += live;
                slots = slots.max(cache.len);
            }
        }
        Tensor {
            name: DecodeStep::BATCH.into(),
            shape: vec![2],
            data: TensorData::Int64(vec![rows, slots]),
        }
    }

    /// Rows of `step` whose cache is not held at their `past` (and not ended by it).
    fn missing(&self, step: &DecodeStep) -> Vec<u64> {
        step.rows
            .iter()
            .filter(|want| {
                let row = |c: &Cache| c.rows.iter().find(|r| r.seq == want.seq && !r.gone).copied();
                let held = self
                    .prefilled
                    .iter()
                    .find_map(|(c, _)| row(c))
                    .or_else(|| self.batch.as_ref().and_then(row));
                step.ended.contains(&want.seq) || held.is_none_or(|r| r.past != want.past)
            })
            .map(|want| want.seq)
            .collect()
    }

    fn end(&mut self, seq: u64) {
        let caches = self.prefilled.iter_mut().map(|(c, _)| c).chain(self.batch.as_mut());
        for cache in caches {
            cache
                .rows
                .iter_mut()
                .filter(|r| r.seq == seq)
                .for_each(|r| r.gone = true);
        }
        self.prefilled.retain(|(c, _)| c.rows.iter().any(|r| !r.gone));
    }
}

/// `past_key_values.{layer}.{key|value}` of cache tensor `i` (layer-major, key first).
fn past_name(i: usize) -> String {
    format!(
        "past_key_values.{}.{}",
        i / 2,
        if i.is_multiple_of(2) { "key" } else { "value" }
    )
}

/// `present.{layer}.{key|value}` of cache tensor `i`.
fn present_name(i: usize) -> String {
    format!(
        "present.{}.{}",
        i / 2,
        if i.is_multiple_of(2) { "key" } else { "value" }
    )
}

/// `padding_bytes` (INT64 `[1]`): the bytes of `batch`'s masked slots, held by no sequence.
fn padding(batch: Option<&Cache>, layout: &DecoderLayout) -> Tensor {
    let slots: i64 = batch.map_or(0, |b| b.rows.iter().map(|r| b.len - r.past as i64).sum());
    Tensor {
        name: DecodeStep::PADDING.into(),
        shape: vec![1],
        data: TensorData::Int64(vec![slots.max(0) * layout.kv_bytes_per_token() as i64]),
    }
}

/// What a step moved between the host and the runtime, as [`DecodeStep::CROSSED`] reports it.
fn crossed_tensor([to_runtime, from_runtime]: [u64; 2]) -> Tensor {
    let int = |bytes: u64| i64::try_from(bytes).unwrap_or(i64::MAX);
    Tensor {
        name: DecodeStep::CROSSED.into(),
        shape: vec![2],
        data: TensorData::Int64(vec![int(to_runtime), int(from_runtime)]),
    }
}

/// Rows of last-position logits as the `logits` tensor `[rows, vocab]`.
fn logits_tensor(values: Vec<f32>, rows: usize) -> Tensor {
    let vocab = values.len().checked_div(rows).unwrap_or(0);
    Tensor {
        name: "logits".into(),
        shape: vec![rows as i64, vocab as i64],
        data: TensorData::Fp32(values),
    }
}

mod arrange;
mod fork;
mod prefill;
#[cfg(test)]
mod tests;
