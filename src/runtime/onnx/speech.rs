//! The window job of a Whisper model, on the pool's device: a batch of 30 s windows encoded in
//! one run, then decoded together, one run per token for all rows, the decoder's
//! self-attention and cross-attention caches kept as ONNX Runtime values where its session put
//! them (on a CUDA pool, device memory) from one step to the next. A step sends each row's
//! token in and brings one row of logits per row out; the rules and the pick
//! ([`crate::runtime::speech::rules`]) run on the host.
//!
//! The decoder is `decoder_model_merged.onnx` when the folder has it: one graph, so one copy of
//! the decoder's weights in the device's memory, its first pass and its steps chosen by
//! `use_cache_branch`. Without it, `decoder_model.onnx` (the first pass) and
//! `decoder_with_past_model.onnx` (the steps): two sessions, each with its own copy of the
//! weights.
//!
//! What the serve layer sends ([`Backend::run`] on the encoder's model name):
//! `input_features` FP32 `[N, mels, frames]`, `decoder_input_ids` INT64 `[N, P]` (each row's
//! prompt; a language slot of [`DETECT`] is detected for that row), `max_new_tokens` INT64
//! `[N]` (the end token counts), `temperature` FP32 `[N]`, `seed` INT64 `[N]`. What comes back:
//! `tokens` INT64 `[N, T]` (after the prompt, the end token left out, right-padded with −1),
//! `language` INT64 `[N]` (the language token used; −1 for an English-only model),
//! `sum_logprob` FP32 `[N]` (the picked tokens' log-probabilities under the rules, the end
//! token's included, as `transformers`' `avg_logprob` sums them), `no_speech_prob` FP32 `[N]`.
//! A run with `input_features` alone runs the encoder alone.
//!
//! [`Backend::run`]: crate::core::backend::Backend::run

use std::path::Path;

use ort::memory::{AllocationDevice, AllocatorType, MemoryInfo, MemoryType};
use ort::session::{IoBinding, RunOptions, Session};
use ort::value::DynValue;

use super::kernels::Kernels;
use super::{SessionOptions, build_session, classify, to_value};
use crate::core::backend::BackendError;
use crate::core::model::ModelData;
use crate::core::rng::Rng;
use crate::core::signature::ModelSignature;
use crate::core::tensor::{DataType, Tensor, TensorData};
use crate::runtime::speech::{DETECT, Rules, Whisper, pick};

/// The encoder's input.
pub const INPUT_FEATURES: &str = "input_features";
/// The prompts' input.
pub const DECODER_INPUT_IDS: &str = "decoder_input_ids";
/// Each row's most new tokens.
pub const MAX_NEW_TOKENS: &str = "max_new_tokens";
/// Each row's temperature.
pub const TEMPERATURE: &str = "temperature";
/// Each row's seed.
pub const SEED: &str = "seed";
/// The encoder's output.
const LAST_HIDDEN_STATE: &str = "last_hidden_state";

/// The decoder's graphs.
enum Decoder {
    /// `decoder_model_merged.onnx`.
    Merged(Session),
    /// `decoder_model.onnx` and `decoder_with_past_model.onnx`.
    Pair { first: Session, step: Session },
}

/// A Whisper model's decoder and what its folder says; its encoder is the backend's session of
/// the model.
pub struct Speech {
    whisper: Whisper,
    decoder: Decoder,
    /// Where the first pass's logits are bound: the host (every position of them is read).
    host: MemoryInfo<'static>,
    /// The arenas of the decoder's sessions (none where a provider has none): what the decoder
    /// holds beside the encoder's session.
    arenas: Vec<ort::memory::Allocator>,
}

fn runtime(e: impl std::fmt::Display) -> BackendError {
    classify(&e.to_string())
}

fn invalid(message: String) -> BackendError {
    BackendError::InvalidInput(message)
}

/// Whether `signature` is a Whisper encoder's: `input_features` FP32 of rank 3 in,
/// `last_hidden_state` out.
fn is_encoder(signature: &ModelSignature) -> bool {
    let takes = signature
        .inputs
        .iter()
        .any(|i| i.name == INPUT_FEATURES && i.datatype == DataType::Fp32 && i.shape.len() == 3);
    takes && signature.outputs.iter().any(|o| o.name == LAST_HIDDEN_STATE)
}

impl Speech {
    /// The decoder of the Whisper model whose encoder `encoder` is, from `folder`: `None` when
    /// the graph is not a Whisper encoder or the folder has no Whisper `config.json`.
    pub fn open(
        rt: &'static super::OnnxRuntime,
        encoder: &Session,
        folder: Option<&Path>,
        options: &SessionOptions,
    ) -> Result<Option<Speech>, String> {
        let Some(folder) = folder else {
            return Ok(None);
        };
        if !super::signature(encoder).is_ok_and(|s| is_encoder(&s)) {
            return Ok(None);
        }
        let Some(whisper) = Whisper::read(folder)? else {
            return Ok(None);
        };
        let open = |name: &str| -> Result<Session, String> {
            let path = folder.join(name);
            let graph = std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            let model = ModelData {
                graph: &graph,
                folder: Some(folder),
                external_bytes: 0,
                owner: None,
                file: None,
            };
            build_session(rt, model, options).map_err(|e| format!("{}: {e}", path.display()))
        };
        let merged = folder.join("decoder_model_merged.onnx");
        let decoder = if merged.exists() {
            Decoder::Merged(open("decoder_model_merged.onnx")?)
        } else {
            Decoder::Pair {
                first: open("decoder_model.onnx")?,
                step: open("decoder_with_past_model.onnx")?,
            }
        };
        let host = MemoryInfo::new(AllocationDevice::CPU, 0, AllocatorType::Device, MemoryType::Default)
            .map_err(|e| e.to_string())?;
        let arenas = match &decoder {
            Decoder::Merged(session) => vec![session],
            Decoder::Pair { first, step } => vec![first, step],
        };
        let arenas = arenas
            .into_iter()
            .filter_map(|session| super::arena_allocator(session, options))
            .collect();
        Ok(Some(Speech {
            whisper,
            decoder,
            host,
            arenas,
        }))
    }

    /// The statistics of its decoder's arenas (the encoder's is its backend session's).
    pub fn arena_stats(&self) -> Vec<super::arena::ArenaStats> {
        self.arenas
            .iter()
            .filter_map(|allocator| super::arena::allocator_stats(allocator).ok())
            .collect()
    }

    /// Whether `inputs` ask for a transcription (a prompt is given), not the encoder alone.
    pub fn wants_decoding(inputs: &[Tensor]) -> bool {
        inputs.iter().any(|t| t.name == DECODER_INPUT_IDS)
    }
}

/// The rows of one window job, read from its inputs.
struct Job {
    features: Tensor,
    /// `[N][P]`.
    prompts: Vec<Vec<i64>>,
    limits: Vec<usize>,
    temperatures: Vec<f32>,
    seeds: Vec<u64>,
}

/// `inputs`' tensor `name`, or an error naming it.
fn take(inputs: &mut Vec<Tensor>, name: &str) -> Result<Tensor, BackendError> {
    let at = inputs
        .iter()
        .position(|t| t.name == name)
        .ok_or_else(|| invalid(format!("a transcription needs `{name}`")))?;
    Ok(inputs.swap_remove(at))
}

impl Job {
    fn read(whisper: &Whisper, mut inputs: Vec<Tensor>) -> Result<Job, BackendError> {
        let features = take(&mut inputs, INPUT_FEATURES)?;
        let n = *features.shape.first().unwrap_or(&0) as usize;
        let bins = whisper.mel.bins as i64;
        if features.shape.len() != 3 || features.shape[1] != bins || !matches!(features.data, TensorData::Fp32(_)) {
            return Err(invalid(format!(
                "`{INPUT_FEATURES}` must be FP32 [windows, {bins}, frames], not {:?}",
                features.shape
            )));
        }
        let ints = |t: Tensor, rank: usize| match t.data {
            TensorData::Int64(v) if t.shape.len() == rank && t.shape[0] as usize == n => Ok((t.shape, v)),
            _ => Err(invalid(format!(
                "`{}` must be INT64 with {n} rows and rank {rank}, not {:?}",
                t.name, t.shape
            ))),
        };
        let (shape, ids) = ints(take(&mut inputs, DECODER_INPUT_IDS)?, 2)?;
        let p = shape[1] as usize;
        if p == 0 {
            return Err(invalid(format!("`{DECODER_INPUT_IDS}` has no tokens")));
        }
        let prompts: Vec<Vec<i64>> = ids.chunks(p).map(<[i64]>::to_vec).collect();
        let (_, limits) = ints(take(&mut inputs, MAX_NEW_TOKENS)?, 1)?;
        let (_, seeds) = ints(take(&mut inputs, SEED)?, 1)?;
        let temperatures = match take(&mut inputs, TEMPERATURE)? {
            Tensor {
                data: TensorData::Fp32(v),
                ..
            } if v.len() == n => v,
            t => {
                return Err(invalid(format!(
                    "`{TEMPERATURE}` must be FP32 [{n}], not {:?}",
                    t.shape
                )));
            }
        };
        let most = whisper.dims.max_target_positions as usize;
        let vocab = i64::from(whisper.dims.vocab);
        for (row, (prompt, &limit)) in prompts.iter().zip(&limits).enumerate() {
            if limit < 0 || p + limit as usize > most {
                return Err(invalid(format!(
                    "row {row}: a prompt of {p} tokens and {limit} new tokens pass the model's {most} positions"
                )));
            }
            if let Some(bad) = prompt.iter().find(|&&t| t != DETECT && !(0..vocab).contains(&t)) {
                return Err(invalid(format!(
                    "row {row}: token {bad} is outside the vocabulary of {vocab}"
                )));
            }
            if !prompt.contains(&i64::from(whisper.tokens.start)) {
                return Err(invalid(format!("row {row}: the prompt has no <|startoftranscript|>")));
            }
        }
        Ok(Job {
            features,
            prompts,
            limits: limits.into_iter().map(|l| l as usize).collect(),
            temperatures,
            seeds: seeds.into_iter().map(|s| s as u64).collect(),
        })
    }
}

/// One row's decoding so far.
struct Row {
    rules: Rules,
    rng: Rng,
    temperature: f32,
    limit: usize,
    generated: Vec<u32>,
    sum_logprob: f64,
    done: bool,
}

impl Row {
    /// Pick from `logits` (its row of the step) and note it: ended by the end token or the limit.
    fn step(&mut self, logits: &mut [f32], eos: u32) {
        self.rules.apply(&self.generated, logits);
        let (token, logprob) = pick(logits, self.temperature, &mut self.rng);
        self.sum_logprob += f64::from(logprob);
        if token == eos {
            self.done = true;
        } else {
            self.generated.push(token);
        }
        self.done |= self.generated.len() >= self.limit;
    }
}

/// A cache tensor's name: `{prefix}.{layer}.{decoder|encoder}.{key|value}` for `i` in
/// layer-major order, key first.
fn cache_name(prefix: &str, side: &str, i: usize) -> String {
    let kind = if i.is_multiple_of(2) { "key" } else { "value" };
    format!("{prefix}.{}.{side}.{kind}", i / 2)
}

/// The caches between steps: the self-attention's (grows a position a step) and the
/// cross-attention's (fixed for the window), `layers × 2` each.
struct Caches {
    decoder: Vec<DynValue>,
    encoder: Vec<DynValue>,
}

impl Speech {
    /// Transcribe a batch of windows (see the module's doc for `inputs` and the outputs);
    /// `outputs` names those wanted (all when empty). `encoder` is the model's session,
    /// `kernels` the backend's, every run under `options` (its terminate flag stops the
    /// decoding between steps).
    pub fn transcribe(
        &mut self,
        encoder: &mut Session,
        kernels: &mut Kernels,
        inputs: Vec<Tensor>,
        outputs: &[String],
        options: &RunOptions,
    ) -> Result<Vec<Tensor>, BackendError> {
        let mut job = Job::read(&self.whisper, inputs)?;
        let n = job.prompts.len();
        let device = kernels.device().clone();
        let mut binding = encoder.create_binding().map_err(runtime)?;
        let features = to_value(std::mem::replace(&mut job.features, empty_f32(&[0]))).map_err(runtime)?;
        binding.bind_input(INPUT_FEATURES, &features).map_err(runtime)?;
        binding
            .bind_output_to_device(LAST_HIDDEN_STATE, &device)
            .map_err(runtime)?;
        let states = run_binding(encoder, &mut binding, options, &[LAST_HIDDEN_STATE.to_string()])?
            .pop()
            .expect("one output asked");
        drop(binding);
        let start = i64::from(self.whisper.tokens.start);
        if job.prompts.iter().any(|p| p.contains(&DETECT)) {
            // As `detect_language`: one pass on <|startoftranscript|> alone, for every row.
            let (logits, _) = self.first_pass(&states, &vec![vec![start]; n], n, None, options)?;
            let vocab = logits.len() / n;
            for (row, prompt) in job.prompts.iter_mut().enumerate() {
                let language = self.whisper.detect_language(&logits[row * vocab..(row + 1) * vocab]);
                prompt
                    .iter_mut()
                    .filter(|t| **t == DETECT)
                    .for_each(|t| *t = i64::from(language));
            }
        }
        let (logits, caches) = self.first_pass(&states, &job.prompts, n, Some(&device), options)?;
        let p = job.prompts[0].len();
        let vocab = logits.len() / (n * p);
        let mut rows = Vec::with_capacity(n);
        let mut no_speech = Vec::with_capacity(n);
        let mut step_logits = Vec::with_capacity(n * vocab);
        for (i, prompt) in job.prompts.iter().enumerate() {
            let at = |position: usize| &logits[(i * p + position) * vocab..(i * p + position + 1) * vocab];
            let sot = prompt.iter().position(|&t| t == start).expect("checked by Job::read");
            no_speech.push(self.whisper.no_speech_prob(at(sot)));
            step_logits.extend_from_slice(at(p - 1));
            rows.push(Row {
                rules: self.whisper.rules(prompt),
                rng: Rng::new(job.seeds[i]),
                temperature: job.temperatures[i],
                limit: job.limits[i],
                generated: Vec::new(),
                sum_logprob: 0.0,
                done: job.limits[i] == 0,
            });
        }
        let caches = caches.expect("bound to the device");
        self.decode(&states, caches, &mut rows, step_logits, kernels, options)?;
        let language = job.prompts.iter().map(|prompt| {
            let sot = prompt.iter().position(|&t| t == start).expect("checked by Job::read");
            match self.whisper.multilingual {
                true => prompt[sot + 1],
                false => -1,
            }
        });
        answer(&rows, language.collect(), no_speech, outputs)
    }

    /// A first pass of `prompts` (`n` rows of equal length): every position's logits, on the
    /// host (`[n, P, vocab]` row-major), and the caches it made when `device` is given (bound
    /// there).
    fn first_pass(
        &mut self,
        states: &DynValue,
        prompts: &[Vec<i64>],
        n: usize,
        device: Option<&MemoryInfo<'static>>,
        options: &RunOptions,
    ) -> Result<(Vec<f32>, Option<Caches>), BackendError> {
        let layers = self.whisper.dims.decoder_layers as usize;
        let heads = i64::from(self.whisper.dims.decoder_heads);
        let head_size = i64::from(self.whisper.dims.d_model) / heads.max(1);
        let ids = Tensor {
            name: "input_ids".into(),
            shape: vec![n as i64, prompts[0].len() as i64],
            data: TensorData::Int64(prompts.concat()),
        };
        let ids = to_value(ids).map_err(runtime)?;
        let (session, merged) = match &mut self.decoder {
            Decoder::Merged(session) => (session, true),
            Decoder::Pair { first, .. } => (first, false),
        };
        let mut binding = session.create_binding().map_err(runtime)?;
        binding.bind_input("input_ids", &ids).map_err(runtime)?;
        binding.bind_input("encoder_hidden_states", states).map_err(runtime)?;
        // The merged graph's first branch reads no past; its inputs still need values.
        let empty = to_value(empty_f32(&[n as i64, heads, 0, head_size])).map_err(runtime)?;
        let branch = to_value(Tensor {
            name: "use_cache_branch".into(),
            shape: vec![1],
            data: TensorData::Bool(vec![false]),
        })
        .map_err(runtime)?;
        if merged {
            for i in 0..layers * 2 {
                for side in ["decoder", "encoder"] {
                    binding
                        .bind_input(cache_name("past_key_values", side, i), &empty)
                        .map_err(runtime)?;
                }
            }
            binding.bind_input("use_cache_branch", &branch).map_err(runtime)?;
        }
        binding.bind_output_to_device("logits", &self.host).map_err(runtime)?;
        let mut names = vec!["logits".to_string()];
        if let Some(device) = device {
            for side in ["decoder", "encoder"] {
                for i in 0..layers * 2 {
                    let name = cache_name("present", side, i);
                    binding.bind_output_to_device(&name, device).map_err(runtime)?;
                    names.push(name);
                }
            }
        }
        let mut out = run_binding(session, &mut binding, options, &names)?.into_iter();
        let logits = out.next().expect("asked first");
        let (_, logits) = logits.try_extract_tensor::<f32>().map_err(runtime)?;
        let logits = logits.to_vec();
        let caches = device.map(|_| Caches {
            decoder: out.by_ref().take(layers * 2).collect(),
            encoder: out.collect(),
        });
        Ok((logits, caches))
    }

    /// Step every row until each has ended: a finished row keeps stepping with the end token
    /// (its logits ignored), so the batch keeps its shape and its caches need no arranging.
    fn decode(
        &mut self,
        states: &DynValue,
        mut caches: Caches,
        rows: &mut [Row],
        mut logits: Vec<f32>,
        kernels: &mut Kernels,
        options: &RunOptions,
    ) -> Result<(), BackendError> {
        let n = rows.len();
        let eos = self.whisper.tokens.eos;
        let layers = caches.decoder.len();
        let vocab = logits.len() / n.max(1);
        let branch = to_value(Tensor {
            name: "use_cache_branch".into(),
            shape: vec![1],
            data: TensorData::Bool(vec![true]),
        })
        .map_err(runtime)?;
        let device = kernels.device().clone();
        loop {
            for (row, chunk) in rows.iter_mut().zip(logits.chunks_mut(vocab)) {
                if !row.done {
                    row.step(chunk, eos);
                }
            }
            if rows.iter().all(|r| r.done) {
                return Ok(());
            }
            let ids: Vec<i64> = rows
                .iter()
                .map(|r| match (r.done, r.generated.last()) {
                    (false, Some(&t)) => i64::from(t),
                    _ => i64::from(eos),
                })
                .collect();
            let ids = to_value(Tensor {
                name: "input_ids".into(),
                shape: vec![n as i64, 1],
                data: TensorData::Int64(ids),
            })
            .map_err(runtime)?;
            let (session, merged) = match &mut self.decoder {
                Decoder::Merged(session) => (session, true),
                Decoder::Pair { step, .. } => (step, false),
            };
            let mut binding = session.create_binding().map_err(runtime)?;
            binding.bind_input("input_ids", &ids).map_err(runtime)?;
            if merged {
                binding.bind_input("encoder_hidden_states", states).map_err(runtime)?;
                binding.bind_input("use_cache_branch", &branch).map_err(runtime)?;
            }
            let mut names = vec!["logits".to_string()];
            for i in 0..layers {
                binding
                    .bind_input(cache_name("past_key_values", "decoder", i), &caches.decoder[i])
                    .map_err(runtime)?;
                binding
                    .bind_input(cache_name("past_key_values", "encoder", i), &caches.encoder[i])
                    .map_err(runtime)?;
                let name = cache_name("present", "decoder", i);
                binding.bind_output_to_device(&name, &device).map_err(runtime)?;
                names.push(name);
            }
            binding.bind_output_to_device("logits", &device).map_err(runtime)?;
            let mut out = run_binding(session, &mut binding, options, &names)?.into_iter();
            let step = out.next().expect("asked first");
            logits = kernels.last_position(&step).map_err(BackendError::Runtime)?;
            caches.decoder = out.collect();
        }
    }
}

/// Run `binding` under `options`, its host inputs copied first and its outputs ready after:
/// the outputs `names`, in that order.
fn run_binding(
    session: &mut Session,
    binding: &mut IoBinding,
    options: &RunOptions,
    names: &[String],
) -> Result<Vec<DynValue>, BackendError> {
    binding.synchronize_inputs().map_err(runtime)?;
    let mut outputs = session.run_binding_with_options(binding, options).map_err(runtime)?;
    binding.synchronize_outputs().map_err(runtime)?;
    names
        .iter()
        .map(|name| {
            outputs
                .remove(name.as_str())
                .ok_or_else(|| BackendError::Runtime(format!("the model gave no `{name}`")))
        })
        .collect()
}

/// An FP32 tensor of `shape` with no elements (a dimension is 0).
fn empty_f32(shape: &[i64]) -> Tensor {
    Tensor {
        name: String::new(),
        shape: shape.to_vec(),
        data: TensorData::Fp32(Vec::new()),
    }
}

/// The outputs of a finished batch, those of `wanted` (all when empty) in its order.
fn answer(
    rows: &[Row],
    language: Vec<i64>,
    no_speech: Vec<f32>,
    wanted: &[String],
) -> Result<Vec<Tensor>, BackendError> {
    let n = rows.len() as i64;
    let width = rows.iter().map(|r| r.generated.len()).max().unwrap_or(0);
    let mut tokens = Vec::with_capacity(rows.len() * width);
    for row in rows {
        tokens.extend(row.generated.iter().map(|&t| i64::from(t)));
        tokens.extend(std::iter::repeat_n(-1, width - row.generated.len()));
    }
    let all = [
        Tensor {
            name: "tokens".into(),
            shape: vec![n, width as i64],
            data: TensorData::Int64(tokens),
        },
        Tensor {
            name: "language".into(),
            shape: vec![n],
            data: TensorData::Int64(language),
        },
        Tensor {
            name: "sum_logprob".into(),
            shape: vec![n],
            data: TensorData::Fp32(rows.iter().map(|r| r.sum_logprob as f32).collect()),
        },
        Tensor {
            name: "no_speech_prob".into(),
            shape: vec![n],
            data: TensorData::Fp32(no_speech),
        },
    ];
    if wanted.is_empty() {
        return Ok(all.to_vec());
    }
    wanted
        .iter()
        .map(|name| {
            all.iter().find(|t| &t.name == name).cloned().ok_or_else(|| {
                invalid(format!(
                    "a transcription gives `tokens`, `language`, `sum_logprob` and `no_speech_prob`, not `{name}`"
                ))
            })
        })
        .collect()
}

#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;
