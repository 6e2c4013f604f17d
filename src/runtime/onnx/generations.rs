//! The KV caches of the generations one backend runs, kept as ONNX Runtime values where its
//! sessions put them (on a CUDA pool, device memory) from one step to the next: a step sends
//! each sequence's new token in and brings one row of logits out, whatever its position.
//!
//! A prompt's run ([`Generations::prefill`]) leaves its sequence's cache on its own. A step
//! ([`Generations::decode`]) runs every sequence of the model as one batch: rows left-padded to
//! the batch's length, padding masked out in the attention mask (which stays on the device too
//! and grows by one column a step). When rows join or leave, the batch is arranged again by
//! small graphs on the same execution provider ([`Kernels`]), so the cache never crosses to
//! the host. A sequence of the batch that sends no token in a step (its client is slow) takes
//! a masked slot instead, and the batch is not arranged again for it.

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
}

/// One model's caches: sequences prefilled and not yet batched (with the steps run since),
/// and the batch.
#[derive(Default)]
struct Caches {
    solo: HashMap<u64, (Cache, u32)>,
    batch: Option<Cache>,
}

/// Steps after which a prefilled sequence that never joined is dropped: its generation joins
/// at its next step, so one that has not is gone (its client left while the prompt ran).
const UNCLAIMED_STEPS: u32 = 64;

/// Rows of caches that run together: `past_key_values` for each layer (key, value), the
/// attention mask `[rows, len]`, and each row's sequence.
struct Cache {
    rows: Vec<Row>,
    kv: Vec<DynValue>,
    mask: DynValue,
    /// Slots along the sequence axis (every row has them, padding included).
    len: i64,
}

#[derive(Debug, Clone, Copy)]
struct Row {
    seq: u64,
    /// Its real positions (prompt and tokens so far): its next token's position.
    past: u64,
    /// Masked slots before its first real one (left padding).
    lead: i64,
    /// Ended or prefilled again: dropped at the next arrangement.
    gone: bool,
}

/// The tokens that pad an idle row's step (masked out; any valid id).
const PAD_TOKEN: i64 = 0;
/// The position an idle row's padding slot gets (masked out; as `transformers` pads).
const PAD_POSITION: i64 = 1;

fn runtime(e: impl std::fmt::Display) -> BackendError {
    classify(&e.to_string())
}

impl Generations {
    /// Caches arranged with `kernels` (built for the backend's provider).
    pub fn new(kernels: Kernels) -> Generations {
        Generations {
            kernels,
            models: HashMap::new(),
        }
    }

    /// Drop every cache of `model` (its session is gone).
    pub fn forget(&mut self, model: &str) {
        self.models.remove(model);
    }

    /// Sequences of `model` whose caches are held.
    #[cfg(test)]
    pub fn sequences(&self, model: &str) -> usize {
        self.models.get(model).map_or(0, |c| {
            c.solo.len()
                + c.batch
                    .as_ref()
                    .map_or(0, |b| b.rows.iter().filter(|r| !r.gone).count())
        })
    }

    /// Run a decoder's first pass (`inputs`: ids, mask, positions, empty pasts) and keep its
    /// cache as `seq`'s; the last position's logits come back as `logits` `[1, vocab]`.
    pub fn prefill(
        &mut self,
        session: &mut Session,
        layout: &DecoderLayout,
        model: &str,
        seq: u64,
        inputs: Vec<Tensor>,
        options: &RunOptions,
    ) -> Result<Vec<Tensor>, BackendError> {
        // A sequence prefilled again replaces the cache it had.
        self.models.entry(model.to_string()).or_default().end(seq);
        let mut binding = session.create_binding().map_err(runtime)?;
        let mut mask = None;
        let mut past = 0;
        for tensor in inputs {
            let name = tensor.name.clone();
            if name == "attention_mask" {
                past = tensor.shape.last().copied().unwrap_or(0);
            }
            let value = to_value(tensor).map_err(runtime)?;
            binding.bind_input(&name, &value).map_err(runtime)?;
            if name == "attention_mask" {
                mask = Some(value);
            }
        }
        let mask = mask.ok_or_else(|| BackendError::InvalidInput("a prompt's run needs `attention_mask`".into()))?;
        let (kv, logits) = self.run_bound(session, &mut binding, layout, options)?;
        let logits = self.kernels.last_position(&logits).map_err(BackendError::Runtime)?;
        let caches = self.models.get_mut(model).expect("made above");
        caches.solo.insert(
            seq,
            (
                Cache {
                    rows: vec![Row {
                        seq,
                        past: past as u64,
                        lead: 0,
                        gone: false,
                    }],
                    kv,
                    mask,
                    len: past,
                },
                0,
            ),
        );
        Ok(vec![logits_tensor(logits, 1)])
    }

    /// One batched step of `model`'s generations (see [`Backend::decode`]): ended caches
    /// dropped, joiners and leavers arranged into the batch, then one run for every row.
    ///
    /// [`Backend::decode`]: crate::core::backend::Backend::decode
    pub fn decode(
        &mut self,
        session: &mut Session,
        layout: &DecoderLayout,
        model: &str,
        step: &DecodeStep,
        options: &RunOptions,
    ) -> Result<Vec<Tensor>, BackendError> {
        let caches = self.models.entry(model.to_string()).or_default();
        let missing = caches.missing(step);
        if !missing.is_empty() {
            return Err(BackendError::CacheMissing(missing));
        }
        for seq in &step.ended {
            caches.end(*seq);
        }
        caches.solo.retain(|seq, (_, waited)| {
            *waited += 1;
            *waited <= UNCLAIMED_STEPS || step.rows.iter().any(|r| r.seq == *seq)
        });
        if step.rows.is_empty() {
            if caches.batch.as_ref().is_some_and(|b| b.rows.iter().all(|r| r.gone)) {
                caches.batch = None;
            }
            return Ok(vec![
                logits_tensor(Vec::new(), 0),
                padding(caches.batch.as_ref(), layout),
            ]);
        }
        // A failure part-way leaves nothing half-arranged: the model's caches go, and their
        // sequences are prefilled again (or move) as after any failed step.
        let result = self.step(session, layout, model, step, options);
        if result.is_err() {
            self.models.remove(model);
        }
        result
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
        let joiners: Vec<Cache> = step
            .rows
            .iter()
            .filter_map(|r| caches.solo.remove(&r.seq).map(|(cache, _)| cache))
            .collect();
        let mut batch = caches.batch.take().filter(|b| b.rows.iter().any(|r| !r.gone));
        if batch.as_ref().is_some_and(|b| b.rows.iter().any(|r| r.gone)) {
            batch = batch.map(|b| self.kernels.without_gone(b)).transpose()?;
        }
        for joiner in joiners {
            batch = Some(match batch {
                None => joiner,
                Some(b) => self.kernels.join(b, joiner)?,
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
        let host = |name: &str, data: Vec<i64>| {
            to_value(Tensor {
                name: name.into(),
                shape: vec![rows as i64, 1],
                data: TensorData::Int64(data),
            })
            .map_err(runtime)
        };
        let column = host("column", column)?;
        let mask = self
            .kernels
            .concat(&batch.mask, &column, 1)
            .map_err(BackendError::Runtime)?;
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
        let (kv, logits) = self.run_bound(session, &mut binding, layout, options)?;
        let logits = self.kernels.last_position(&logits).map_err(BackendError::Runtime)?;
        batch.kv = kv;
        batch.mask = mask;
        batch.len += 1;
        for &at in &order {
            batch.rows[at].past += 1;
        }
        let vocab = logits.len() / rows.max(1);
        let mut picked = Vec::with_capacity(order.len() * vocab);
        for at in order {
            picked.extend_from_slice(&logits[at * vocab..(at + 1) * vocab]);
        }
        Ok(vec![
            logits_tensor(picked, step.rows.len()),
            padding(Some(batch), layout),
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
        let mut outputs = session.run_binding_with_options(binding, options).map_err(runtime)?;
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
    /// Rows of `step` whose cache is not held at their `past` (and not ended by it).
    fn missing(&self, step: &DecodeStep) -> Vec<u64> {
        step.rows
            .iter()
            .filter(|want| {
                let held = self.solo.get(&want.seq).map(|(c, _)| c.rows[0]).or_else(|| {
                    self.batch
                        .as_ref()
                        .and_then(|b| b.rows.iter().find(|r| r.seq == want.seq && !r.gone).copied())
                });
                step.ended.contains(&want.seq) || held.is_none_or(|r| r.past != want.past)
            })
            .map(|want| want.seq)
            .collect()
    }

    fn end(&mut self, seq: u64) {
        self.solo.remove(&seq);
        if let Some(batch) = &mut self.batch {
            batch
                .rows
                .iter_mut()
                .filter(|r| r.seq == seq)
                .for_each(|r| r.gone = true);
        }
    }
}

impl Kernels {
    /// `batch` without its gone rows, and without the leading slots every kept row pads.
    fn without_gone(&mut self, batch: Cache) -> Result<Cache, BackendError> {
        let kept: Vec<usize> = (0..batch.rows.len()).filter(|&i| !batch.rows[i].gone).collect();
        let start = kept.iter().map(|&i| batch.rows[i].lead).min().unwrap_or(0);
        let indices: Vec<i64> = kept.iter().map(|&i| i as i64).collect();
        let arrange = |k: &mut Kernels, value: &DynValue, axis| {
            k.arrange(value, 0, None, &indices, axis, start)
                .map_err(BackendError::Runtime)
        };
        let kv = batch
            .kv
            .iter()
            .map(|v| arrange(self, v, 2))
            .collect::<Result<Vec<_>, _>>()?;
        let mask = arrange(self, &batch.mask, 1)?;
        let rows = kept
            .iter()
            .map(|&i| Row {
                lead: batch.rows[i].lead - start,
                ..batch.rows[i]
            })
            .collect();
        Ok(Cache {
            rows,
            kv,
            mask,
            len: batch.len - start,
        })
    }

    /// `a`'s rows then `b`'s, the shorter left-padded to the longer's length.
    fn join(&mut self, a: Cache, b: Cache) -> Result<Cache, BackendError> {
        let len = a.len.max(b.len);
        let (pad_a, pad_b) = (len - a.len, len - b.len);
        let indices: Vec<i64> = (0..(a.rows.len() + b.rows.len()) as i64).collect();
        let mut arrange = |x: &DynValue, y: &DynValue, axis| {
            self.arrange(x, pad_a, Some((y, pad_b)), &indices, axis, 0)
                .map_err(BackendError::Runtime)
        };
        let kv =
            a.kv.iter()
                .zip(&b.kv)
                .map(|(x, y)| arrange(x, y, 2))
                .collect::<Result<Vec<_>, _>>()?;
        let mask = arrange(&a.mask, &b.mask, 1)?;
        let shift = |rows: Vec<Row>, pad| {
            rows.into_iter().map(move |r| Row {
                lead: r.lead + pad,
                ..r
            })
        };
        let rows = shift(a.rows, pad_a).chain(shift(b.rows, pad_b)).collect();
        Ok(Cache { rows, kv, mask, len })
    }
}

/// `past_key_values.{layer}.{key|value}` of cache tensor `i` (layer-major, key first).
fn past_name(i: usize) -> String {
    format!("past_key_values.{}.{}", i / 2, if i % 2 == 0 { "key" } else { "value" })
}

/// `present.{layer}.{key|value}` of cache tensor `i`.
fn present_name(i: usize) -> String {
    format!("present.{}.{}", i / 2, if i % 2 == 0 { "key" } else { "value" })
}

/// `padding_bytes` (INT64 `[1]`): the bytes of `batch`'s masked slots, held by no sequence.
fn padding(batch: Option<&Cache>, layout: &DecoderLayout) -> Tensor {
    let slots: i64 = batch.map_or(0, |b| b.rows.iter().map(|r| b.len - r.past as i64).sum());
    Tensor {
        name: "padding_bytes".into(),
        shape: vec![1],
        data: TensorData::Int64(vec![slots.max(0) * layout.kv_bytes_per_token() as i64]),
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

#[cfg(test)]
mod tests {
    use super::super::{OrtBackend, SessionOptions, runtime};
    use crate::core::backend::{Backend, DecodeRow, DecodeStep, RunMeta};
    use crate::core::model::BuiltinModel;
    use crate::core::tensor::TensorData;
    use crate::runtime::decoder::{DecoderLayout, step_inputs};

    /// The reference cases: prompt ids and greedy continuations (numpy, float64, no cache).
    fn cases() -> Vec<(Vec<u32>, Vec<u32>)> {
        let text =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/models/decoder/reference.json")).unwrap();
        let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
        let ids = |v: &serde_json::Value| {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        reference["cases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (ids(&c["prompt_ids"]), ids(&c["greedy_ids"])))
            .collect()
    }

    fn argmax(row: &[f32]) -> u32 {
        row.iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |b, (i, &l)| if l > b.1 { (i, l) } else { b })
            .0 as u32
    }

    fn rows(logits: &crate::core::tensor::Tensor) -> Vec<Vec<f32>> {
        let TensorData::Fp32(values) = &logits.data else {
            panic!("{logits:?}")
        };
        let vocab = logits.shape[1] as usize;
        values.chunks(vocab).map(<[f32]>::to_vec).collect()
    }

    /// Sequences join at different steps, one skips a step (a masked slot), one ends early:
    /// every row's greedy tokens are the references', so left padding, masks and the
    /// re-arranged caches are right.
    #[test]
    fn a_batch_whose_rows_join_skip_and_leave_gives_each_row_its_reference_tokens() {
        let rt = runtime(None).expect("ONNX Runtime loads");
        let model = [("lm".to_string(), BuiltinModel::Decoder.bytes())];
        let mut backend = OrtBackend::load(rt, &model, &SessionOptions::quiet_cpu()).unwrap();
        let layout = DecoderLayout::detect(&super::super::signature(&backend.sessions["lm"].0).unwrap())
            .unwrap()
            .unwrap();
        let cases = cases();
        let meta = RunMeta::default();
        // Sequence i: its tokens so far, and the last logits it got.
        let mut got: Vec<Vec<u32>> = vec![Vec::new(); cases.len()];
        let mut pending: Vec<Option<u32>> = vec![None; cases.len()];
        let prefill = |backend: &mut OrtBackend, i: usize| {
            let inputs = step_inputs(&layout, &cases[i].0, 0, Vec::new());
            let out = backend.prefill("lm", i as u64, inputs, &meta).unwrap();
            assert_eq!(out[0].shape, vec![1, 512], "one row of logits");
            argmax(&rows(&out[0])[0])
        };
        for step in 0..20 {
            // Sequence i joins at step 2 i; sequence 1 skips step 5; sequence 0 stops at 6 tokens.
            for (i, next) in pending.iter_mut().enumerate() {
                if step == 2 * i {
                    *next = Some(prefill(&mut backend, i));
                }
            }
            let mut step_rows = Vec::new();
            let mut ended = Vec::new();
            for (i, next) in pending.iter_mut().enumerate() {
                let Some(token) = *next else { continue };
                if got[i].len() == cases[i].1.len() || (i == 0 && got[i].len() == 6) {
                    ended.push(i as u64);
                    *next = None;
                    continue;
                }
                if i == 1 && step == 5 {
                    continue;
                }
                got[i].push(token);
                step_rows.push(DecodeRow {
                    seq: i as u64,
                    token,
                    past: (cases[i].0.len() + got[i].len() - 1) as u64,
                });
            }
            let decode = DecodeStep {
                rows: step_rows.clone(),
                ended,
            };
            let out = backend.decode("lm", &decode, &meta).unwrap();
            for (row, logits) in step_rows.iter().zip(rows(&out[0])) {
                pending[row.seq as usize] = Some(argmax(&logits));
            }
        }
        assert_eq!(got[0], cases[0].1[..6].to_vec());
        for i in 1..cases.len() {
            let n = got[i].len();
            assert!(n >= 10, "sequence {i} ran {n} steps");
            assert_eq!(got[i], cases[i].1[..n].to_vec(), "sequence {i}");
        }
        let live: Vec<usize> = (0..cases.len()).filter(|&i| pending[i].is_some()).collect();
        assert!(!live.is_empty() && !live.contains(&0));
        assert_eq!(
            backend.generations.sequences("lm"),
            live.len(),
            "ended ones were dropped"
        );
        // A row whose cache is not held at its position fails the step and changes nothing.
        let seq = live[0] as u64;
        let wrong = DecodeStep {
            rows: vec![DecodeRow { seq, token: 5, past: 3 }],
            ended: vec![],
        };
        let err = backend.decode("lm", &wrong, &meta).unwrap_err();
        assert_eq!(err, crate::core::backend::BackendError::CacheMissing(vec![seq]));
        assert_eq!(backend.generations.sequences("lm"), live.len());
    }

    /// The batch's masked slots (left padding, a late row's slot) are reported as bytes held by
    /// no sequence, and trimmed when the row that needed them leaves.
    #[test]
    fn the_bytes_of_masked_slots_are_reported_and_trimmed_when_rows_leave() {
        let rt = runtime(None).expect("ONNX Runtime loads");
        let model = [("lm".to_string(), BuiltinModel::Decoder.bytes())];
        let mut backend = OrtBackend::load(rt, &model, &SessionOptions::quiet_cpu()).unwrap();
        let layout = backend.decoders["lm"];
        let per_slot = layout.kv_bytes_per_token() as i64;
        let meta = RunMeta::default();
        for (seq, prompt) in [(1u64, vec![5u32, 6]), (2, (10..20).collect())] {
            backend
                .prefill("lm", seq, step_inputs(&layout, &prompt, 0, Vec::new()), &meta)
                .unwrap();
        }
        let mut step = |rows: Vec<DecodeRow>, ended: Vec<u64>| {
            let out = backend.decode("lm", &DecodeStep { rows, ended }, &meta).unwrap();
            assert_eq!(out[1].name, "padding_bytes");
            let TensorData::Int64(bytes) = &out[1].data else {
                panic!()
            };
            bytes[0] / per_slot
        };
        let row = |seq, past| DecodeRow { seq, token: 7, past };
        // Both: 11 slots, the short one padded by 8 on the left.
        assert_eq!(step(vec![row(1, 2), row(2, 10)], vec![]), 8);
        // The short one is late: a masked slot of its own.
        assert_eq!(step(vec![row(2, 11)], vec![]), 9);
        // The long one ends; with the next step the batch is trimmed to the short one's slots.
        assert_eq!(step(vec![], vec![2]), 9);
        assert_eq!(step(vec![row(1, 3)], vec![]), 1);
    }
}
