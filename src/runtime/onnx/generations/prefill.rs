//! A prompt's run: one sequence's ([`Generations::prefill`]), in pieces of [`PREFILL_CHUNK`](super::PREFILL_CHUNK)
//! when it is long ([`Generations::prefill_chunked`]), or several sequences' as one left-padded
//! batch ([`Generations::prefill_many`]). Each leaves its rows' cache among the model's
//! prefilled ones, to join the batch at their next step.

use ort::session::{RunOptions, Session};

use super::{Cache, Generations, PAD_POSITION, PAD_TOKEN, Row, int64_value, logits_tensor, past_name, runtime};
use crate::core::backend::BackendError;
use crate::core::tensor::{Tensor, TensorData};
use crate::runtime::decoder::{DecoderLayout, Padding, open_windows, step_inputs};
use crate::runtime::onnx::to_value;

impl Generations {
    /// Run a decoder's first pass (`inputs`: ids, mask, positions, empty pasts) and keep its
    /// cache as `seq`'s; the last position's logits come back as `logits` `[1, vocab]`.
    pub fn prefill(
        &mut self,
        session: &mut Session,
        layout: &DecoderLayout,
        model: &str,
        seq: u64,
        mut inputs: Vec<Tensor>,
        options: &RunOptions,
    ) -> Result<Vec<Tensor>, BackendError> {
        // A sequence prefilled again replaces the cache it had.
        self.models.entry(model.to_string()).or_default().end(seq);
        if let Some(ids) = chunkable(layout, &inputs, self.chunk) {
            return self.prefill_chunked(session, layout, (model, seq), (ids, inputs), options);
        }
        open_windows(layout, &mut inputs);
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
        caches.prefilled.push((
            Cache {
                rows: vec![Row {
                    seq,
                    past: past as u64,
                    lead: 0,
                    gone: false,
                }],
                kv,
                mask: (layout.padding == Padding::Left).then_some(mask),
                len: past,
            },
            0,
        ));
        Ok(vec![logits_tensor(logits, 1)])
    }

    /// [`prefill`](Self::prefill) of a prompt longer than [`PREFILL_CHUNK`](super::PREFILL_CHUNK) tokens: its pieces
    /// run one after another, each attending to the cache the pieces before it left (kept on
    /// the device), as its tokens would one at a time. A whole prompt's attention scores take
    /// `heads × n²` values per layer (a 15,000-token prompt on the 4-head fixture: 3.6 GB); a
    /// piece's take `heads × chunk × n`, so the prompt's working memory grows with its length,
    /// as its estimate says, not with its square. Only the last piece's last logits are kept.
    fn prefill_chunked(
        &mut self,
        session: &mut Session,
        layout: &DecoderLayout,
        (model, seq): (&str, u64),
        (ids, inputs): (Vec<i64>, Vec<Tensor>),
        options: &RunOptions,
    ) -> Result<Vec<Tensor>, BackendError> {
        let host = |name: &str, data: Vec<i64>| int64_value(name, vec![1, data.len() as i64], data);
        // The first piece's pasts are the prompt's own empty ones.
        let mut kv = inputs
            .into_iter()
            .filter(|t| t.name.starts_with("past_key_values."))
            .map(|t| to_value(t).map_err(runtime))
            .collect::<Result<Vec<_>, _>>()?;
        let n = ids.len();
        let (mut start, mut last) = (0, None);
        while start < n {
            let end = (start + self.chunk).min(n);
            let mut binding = session.create_binding().map_err(runtime)?;
            binding
                .bind_input("input_ids", &host("input_ids", ids[start..end].to_vec())?)
                .map_err(runtime)?;
            let mask = host("attention_mask", vec![1; end])?;
            binding.bind_input("attention_mask", &mask).map_err(runtime)?;
            if layout.position_ids {
                let positions = (start as i64..end as i64).collect();
                binding
                    .bind_input("position_ids", &host("position_ids", positions)?)
                    .map_err(runtime)?;
            }
            for (i, value) in kv.iter().enumerate() {
                binding.bind_input(past_name(i), value).map_err(runtime)?;
            }
            let (present, logits) = self.run_bound(session, &mut binding, layout, options)?;
            kv = present;
            last = Some((logits, mask));
            start = end;
        }
        let (logits, mask) = last.expect("a prompt of more than one piece");
        let logits = self.kernels.last_position(&logits).map_err(BackendError::Runtime)?;
        let cache = Cache {
            rows: vec![Row {
                seq,
                past: n as u64,
                lead: 0,
                gone: false,
            }],
            kv,
            mask: Some(mask),
            len: n as i64,
        };
        let caches = self.models.get_mut(model).expect("made by prefill");
        caches.prefilled.push((cache, 0));
        Ok(vec![logits_tensor(logits, 1)])
    }

    /// Prompts of several sequences (`inputs`: each one's first pass, one after another, as
    /// [`prefill`](Self::prefill) takes it) run as one padded batch: left-padded to the
    /// longest, padding masked out and given position 1, as batched prompts run in
    /// `transformers`. Their rows stay together and join the batch at their next step. One row
    /// of logits each comes back, as `logits` `[1, vocab]` in `seqs`' order. A model padded on
    /// the right runs each prompt alone: its padded rows' last position would be padding (and
    /// a windowed cache takes a prompt of one row only).
    pub fn prefill_many(
        &mut self,
        session: &mut Session,
        layout: &DecoderLayout,
        model: &str,
        seqs: &[u64],
        inputs: Vec<Tensor>,
        options: &RunOptions,
    ) -> Result<Vec<Tensor>, BackendError> {
        let prompts = prompt_ids(seqs.len(), inputs)?;
        if layout.padding == Padding::Right || layout.window.is_some() {
            let mut logits = Vec::with_capacity(seqs.len());
            for (&seq, prompt) in seqs.iter().zip(prompts) {
                let tokens: Vec<u32> = prompt.iter().map(|&t| t as u32).collect();
                let inputs = step_inputs(layout, &tokens, 0, Vec::new());
                logits.extend(self.prefill(session, layout, model, seq, inputs, options)?);
            }
            return Ok(logits);
        }
        let caches = self.models.entry(model.to_string()).or_default();
        for seq in seqs {
            caches.end(*seq);
        }
        let (k, len) = (seqs.len(), prompts.iter().map(Vec::len).max().unwrap_or(0));
        let (mut ids, mut mask, mut positions) = (Vec::new(), Vec::new(), Vec::new());
        for prompt in &prompts {
            let pad = len - prompt.len();
            ids.extend(std::iter::repeat_n(PAD_TOKEN, pad).chain(prompt.iter().copied()));
            mask.extend(std::iter::repeat_n(0, pad).chain(std::iter::repeat_n(1, prompt.len())));
            positions.extend(std::iter::repeat_n(PAD_POSITION, pad).chain(0..prompt.len() as i64));
        }
        let host = |name: &str, data: Vec<i64>| int64_value(name, vec![k as i64, len as i64], data);
        let mut binding = session.create_binding().map_err(runtime)?;
        let mask = host("attention_mask", mask)?;
        binding
            .bind_input("input_ids", &host("input_ids", ids)?)
            .map_err(runtime)?;
        binding.bind_input("attention_mask", &mask).map_err(runtime)?;
        if layout.position_ids {
            binding
                .bind_input("position_ids", &host("position_ids", positions)?)
                .map_err(runtime)?;
        }
        let empty = match layout.kv_datatype {
            crate::core::tensor::DataType::Fp16 => TensorData::Fp16(Vec::new()),
            _ => TensorData::Fp32(Vec::new()),
        };
        for i in 0..layout.layers * 2 {
            let shape = vec![k as i64, layout.kv_heads as i64, 0, layout.head_size as i64];
            let past = to_value(Tensor {
                name: past_name(i),
                shape,
                data: empty.clone(),
            })
            .map_err(runtime)?;
            binding.bind_input(past_name(i), &past).map_err(runtime)?;
        }
        let (kv, logits) = self.run_bound(session, &mut binding, layout, options)?;
        let logits = self.kernels.last_position(&logits).map_err(BackendError::Runtime)?;
        let rows = seqs
            .iter()
            .zip(&prompts)
            .map(|(&seq, prompt)| Row {
                seq,
                past: prompt.len() as u64,
                lead: (len - prompt.len()) as i64,
                gone: false,
            })
            .collect();
        let cache = Cache {
            rows,
            kv,
            mask: Some(mask),
            len: len as i64,
        };
        self.models
            .get_mut(model)
            .expect("made above")
            .prefilled
            .push((cache, 0));
        let vocab = logits.len() / k.max(1);
        Ok(logits
            .chunks(vocab.max(1))
            .map(|row| logits_tensor(row.to_vec(), 1))
            .collect())
    }
}

/// The tokens of a prompt's run that [`Generations::prefill_chunked`] runs in pieces of
/// `chunk`: one row of more than `chunk` tokens, all attended (no padding) from position 0 with
/// empty pasts, on a model padded on the left whose layers attend to every position. A model
/// padded on the right reads its rows' lengths in `GroupQueryAttention`, and a windowed cache
/// holds only its window: each runs its prompt whole.
pub(super) fn chunkable(layout: &DecoderLayout, inputs: &[Tensor], chunk: usize) -> Option<Vec<i64>> {
    if layout.padding != Padding::Left || layout.window.is_some() {
        return None;
    }
    let find = |name: &str| inputs.iter().find(|t| t.name == name);
    let ids = find("input_ids")?;
    let (TensorData::Int64(tokens), [1, n]) = (&ids.data, ids.shape.as_slice()) else {
        return None;
    };
    let mask = find("attention_mask")?;
    let whole = matches!(&mask.data, TensorData::Int64(m) if m.len() as i64 == *n && m.iter().all(|&v| v == 1));
    let fresh = inputs
        .iter()
        .filter(|t| t.name.starts_with("past_key_values."))
        .all(|t| t.shape.get(2) == Some(&0));
    let known = inputs.iter().all(|t| {
        matches!(t.name.as_str(), "input_ids" | "attention_mask" | "position_ids")
            || t.name.starts_with("past_key_values.")
    });
    (tokens.len() > chunk && whole && fresh && known).then(|| tokens.clone())
}

/// The token ids of `count` first passes given one after another: each one's `input_ids`.
fn prompt_ids(count: usize, inputs: Vec<Tensor>) -> Result<Vec<Vec<i64>>, BackendError> {
    let prompts: Vec<Vec<i64>> = inputs
        .into_iter()
        .filter(|t| t.name == "input_ids")
        .map(|t| match t.data {
            TensorData::Int64(ids) if t.shape.first() == Some(&1) && !ids.is_empty() => Ok(ids),
            _ => Err(BackendError::InvalidInput(format!(
                "a prompt's `input_ids` must be INT64 [1, tokens], not {:?}",
                t.shape
            ))),
        })
        .collect::<Result<_, _>>()?;
    if prompts.len() != count {
        return Err(BackendError::InvalidInput(format!(
            "{} prompts' inputs for {count} sequences",
            prompts.len()
        )));
    }
    Ok(prompts)
}
