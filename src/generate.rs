//! Text generation on a decoder with past key values (see [`crate::decoder`]), below any
//! protocol. The prompt's run goes through the request lifecycle like any request (policy,
//! breaker, one retry on the fallback pool, deadline, cancellation), with the estimate covering
//! the KV cache of the prompt and every token it may add. Each following token is one more run
//! on the same pool ([`lifecycle::step`]): the KV cache stays with the request between runs
//! (freed when it finishes or its client goes away), so runs of different requests interleave
//! on a pool's workers instead of one long generation holding a worker.

use std::sync::Arc;

use crate::decoder::DecoderLayout;
use crate::lifecycle::{self, Refused, Request, RequestError, Served};
use crate::metrics::FailoverReason;
use crate::pool::Pool;
use crate::service::{ModelEntry, Service};
use crate::snapshot::Action;
use crate::tensor::{DataType, Tensor, TensorData};

/// Where a streamed generation sends each token as it is picked.
pub type Sink = tokio::sync::mpsc::Sender<u32>;

/// How to pick tokens and when to stop.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// Most tokens to add.
    pub max_tokens: u32,
    /// Softmax temperature; 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches this.
    pub top_p: f32,
    /// Only the `top_k` most likely tokens (0: all).
    pub top_k: u32,
    /// Seed of the sampler: the same seed and request give the same tokens, on any pool.
    pub seed: u64,
    /// Strings that end the text (not included).
    pub stop: Vec<String>,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The end-of-text token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl Finish {
    /// OpenAI's `finish_reason`.
    pub fn label(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// A finished generation.
#[derive(Debug)]
pub struct Generated {
    /// The pool that ran the last token (after a failover, the fallback).
    pub pool: Arc<Pool>,
    /// The decision that placed the prompt's run.
    pub action: Action,
    /// Set when a run moved to the fallback pool after an allocator failure.
    pub retried: Option<FailoverReason>,
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub tokens: Vec<u32>,
    /// Their text, cut before a stop string.
    pub text: String,
    /// Why it ended.
    pub finish: Finish,
}

/// A deterministic random source (SplitMix64): the same seed gives the same tokens anywhere.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next value in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Pick the next token from `logits` under `params`.
pub fn pick(logits: &[f32], params: &Params, rng: &mut Rng) -> u32 {
    let greedy = || {
        logits
            .iter()
            .enumerate()
            .fold(
                (0usize, f32::NEG_INFINITY),
                |best, (i, &l)| if l > best.1 { (i, l) } else { best },
            )
            .0 as u32
    };
    if params.temperature <= 0.0 {
        return greedy();
    }
    // Candidates by descending logit (ties by id, so the order is the same everywhere).
    let mut order: Vec<usize> = (0..logits.len()).filter(|&i| logits[i].is_finite()).collect();
    if order.is_empty() {
        return greedy();
    }
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if params.top_k > 0 {
        order.truncate(params.top_k as usize);
    }
    let max = logits[order[0]] as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / params.temperature as f64).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    // Nucleus: keep the most likely tokens until their share reaches top_p.
    let mut kept = 0;
    let mut share = 0.0;
    while kept < weights.len() {
        share += weights[kept] / total;
        kept += 1;
        if share >= params.top_p as f64 {
            break;
        }
    }
    let kept_total: f64 = weights[..kept].iter().sum();
    let mut target = rng.next_f64() * kept_total;
    for (i, w) in weights[..kept].iter().enumerate() {
        if target < *w {
            return order[i] as u32;
        }
        target -= w;
    }
    order[kept - 1] as u32
}

/// The inputs of one run: `new` tokens after `past` positions whose cache is `cache` (the
/// previous run's `present.*` outputs; empty for the prompt's run).
fn step_inputs(layout: &DecoderLayout, new: &[u32], past: usize, cache: Vec<Tensor>) -> Vec<Tensor> {
    let n = new.len();
    let mut inputs = vec![
        Tensor {
            name: "input_ids".into(),
            shape: vec![1, n as i64],
            data: TensorData::Int64(new.iter().map(|&t| i64::from(t)).collect()),
        },
        Tensor {
            name: "attention_mask".into(),
            shape: vec![1, (past + n) as i64],
            data: TensorData::Int64(vec![1; past + n]),
        },
    ];
    if layout.position_ids {
        inputs.push(Tensor {
            name: "position_ids".into(),
            shape: vec![1, n as i64],
            data: TensorData::Int64((past..past + n).map(|p| p as i64).collect()),
        });
    }
    if cache.is_empty() {
        let empty = match layout.kv_datatype {
            DataType::Fp16 => TensorData::Fp16(Vec::new()),
            _ => TensorData::Fp32(Vec::new()),
        };
        for layer in 0..layout.layers {
            for kind in ["key", "value"] {
                inputs.push(Tensor {
                    name: format!("past_key_values.{layer}.{kind}"),
                    shape: vec![1, layout.kv_heads as i64, 0, layout.head_size as i64],
                    data: empty.clone(),
                });
            }
        }
    } else {
        for mut tensor in cache {
            tensor.name = tensor.name.replacen("present.", "past_key_values.", 1);
            inputs.push(tensor);
        }
    }
    inputs
}

/// The last position's logits, and the cache to carry to the next run.
fn read_outputs(outputs: Vec<Tensor>) -> Result<(Vec<f32>, Vec<Tensor>), String> {
    let mut logits = None;
    let mut cache = Vec::new();
    for tensor in outputs {
        if tensor.name == "logits" {
            logits = Some(tensor);
        } else if tensor.name.starts_with("present.") {
            cache.push(tensor);
        }
    }
    let logits = logits.ok_or("the model gave no `logits`")?;
    let vocab = *logits.shape.last().ok_or("`logits` has no axes")? as usize;
    let last = match logits.data {
        TensorData::Fp32(v) if vocab > 0 && v.len() >= vocab => v[v.len() - vocab..].to_vec(),
        TensorData::Fp16(v) if vocab > 0 && v.len() >= vocab => {
            v[v.len() - vocab..].iter().map(|x| x.to_f32()).collect()
        }
        _ => return Err(format!("`logits` of shape {:?} has no last position", logits.shape)),
    };
    Ok((last, cache))
}

/// Generate from `prompt` (token ids) under `params`. `request` carries the id, deadline,
/// priority and replayability; its inputs are built here.
pub async fn generate(
    service: &Service,
    entry: &ModelEntry,
    prompt: Vec<u32>,
    params: &Params,
    mut request: Request,
    sink: Option<Sink>,
) -> Result<Generated, Refused> {
    let (Some(layout), Some(tokenizer)) = (&entry.decoder, &entry.tokenizer) else {
        return Err(lifecycle::reject(
            service,
            &entry.config.name,
            RequestError::BadInput(format!(
                "model `{}` does not generate text (it needs a decoder with past key values and `models[].tokenizer`)",
                entry.config.name
            )),
            request.received,
        ));
    };
    let prompt_tokens = prompt.len();
    let eos = ["<|endoftext|>", "</s>", "<eos>"]
        .iter()
        .find_map(|t| tokenizer.token_to_id(t));
    request.inputs = step_inputs(layout, &prompt, 0, Vec::new());
    request.outputs = Vec::new();
    request.max_new_tokens = u64::from(params.max_tokens);
    request.progress = service.activity.accept();
    let model = request.model.clone();
    let received = request.received;
    lifecycle::counted(service, &model, received, async move {
        let generated = run(
            service,
            entry,
            layout,
            tokenizer,
            prompt_tokens,
            eos,
            params,
            request,
            sink,
        )
        .await?;
        let pool = Arc::clone(&generated.pool);
        Ok((generated, pool))
    })
    .await
}

/// [`generate`]'s runs, uncounted.
#[allow(clippy::too_many_arguments)]
async fn run(
    service: &Service,
    entry: &ModelEntry,
    layout: &DecoderLayout,
    tokenizer: &tokenizers::Tokenizer,
    prompt_tokens: usize,
    eos: Option<u32>,
    params: &Params,
    request: Request,
    sink: Option<Sink>,
) -> Result<Generated, Refused> {
    let template = Request {
        inputs: Vec::new(),
        ..request.clone()
    };
    let Served {
        pool,
        action,
        retried,
        outputs,
        ..
    } = lifecycle::place(service, request).await?;
    let mut pool = pool;
    let mut retried = retried;
    let failed = |pool: &Arc<Pool>, error: RequestError| Refused {
        pool: Some(Arc::clone(pool)),
        error,
    };
    let internal = |pool: &Arc<Pool>, e: String| {
        tracing::warn!(model = %entry.config.name, error = %e, "generation failed");
        failed(
            pool,
            RequestError::Failed {
                pool: pool.name().to_string(),
            },
        )
    };
    let (mut logits, mut cache) = read_outputs(outputs).map_err(|e| internal(&pool, e))?;
    let labels = |pool: &Pool| crate::metrics::ModelPoolLabels {
        model: entry.config.name.clone(),
        pool: pool.name().to_string(),
    };
    let metrics = &service.metrics;
    metrics
        .time_to_first_token
        .get_or_create(&labels(&pool))
        .observe(template.received.elapsed().as_secs_f64());
    let mut last_token = tokio::time::Instant::now();
    let mut rng = Rng::new(params.seed);
    let mut tokens: Vec<u32> = Vec::new();
    let estimate = entry
        .profile
        .estimate((prompt_tokens as u64).saturating_add(u64::from(params.max_tokens)), 1);
    let estimate_bytes = estimate.context_bytes.saturating_add(estimate.workspace_bytes);
    let finish = loop {
        let next = pick(&logits, params, &mut rng);
        if Some(next) == eos {
            break Finish::Stop;
        }
        tokens.push(next);
        if let Some(sink) = &sink
            && sink.send(next).await.is_err()
        {
            // The stream's reader is gone: stop here; the KV cache goes with this future.
            return Err(failed(&pool, RequestError::ClientGone));
        }
        if !params.stop.is_empty() {
            let text = tokenizer.decode(&tokens, true).unwrap_or_default();
            if params.stop.iter().any(|s| text.contains(s.as_str())) {
                break Finish::Stop;
            }
        }
        if tokens.len() >= params.max_tokens as usize {
            break Finish::Length;
        }
        let past = prompt_tokens + tokens.len() - 1;
        let inputs = step_inputs(layout, &[next], past, std::mem::take(&mut cache));
        let stepped = lifecycle::step(service, &pool, &template, inputs, estimate_bytes)
            .await
            .map_err(|e| failed(&pool, e))?;
        pool = stepped.pool;
        retried = stepped.moved.or(retried);
        (logits, cache) = read_outputs(stepped.outputs).map_err(|e| internal(&pool, e))?;
        metrics
            .inter_token
            .get_or_create(&labels(&pool))
            .observe(last_token.elapsed().as_secs_f64());
        last_token = tokio::time::Instant::now();
    };
    metrics
        .generated_tokens
        .get_or_create(&labels(&pool))
        .inc_by(tokens.len() as u64);
    let mut text = tokenizer
        .decode(&tokens, true)
        .map_err(|e| internal(&pool, format!("cannot decode the tokens: {e}")))?;
    if let Some(cut) = params.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
        text.truncate(cut);
    }
    Ok(Generated {
        pool,
        action: if retried.is_some() { Action::Redirect } else { action },
        retried,
        prompt_tokens,
        tokens,
        text,
        finish,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, top_k: u32) -> Params {
        Params {
            max_tokens: 8,
            temperature,
            top_p,
            top_k,
            seed: 7,
            stop: vec![],
        }
    }

    #[test]
    fn greedy_takes_the_most_likely_token() {
        let mut rng = Rng::new(1);
        assert_eq!(pick(&[0.1, 3.0, -1.0, 2.9], &params(0.0, 1.0, 0), &mut rng), 1);
    }

    #[test]
    fn sampling_is_seeded_and_respects_top_k_and_top_p() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let run = |p: &Params| {
            let mut rng = Rng::new(p.seed);
            (0..200).map(|_| pick(&logits, p, &mut rng)).collect::<Vec<u32>>()
        };
        let p = params(1.0, 1.0, 0);
        assert_eq!(run(&p), run(&p), "same seed, same tokens");
        assert_ne!(run(&p), run(&Params { seed: 8, ..p.clone() }));
        // top_k = 3: only the three largest logits are ever picked.
        let mut best: Vec<usize> = (0..50).collect();
        best.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let top3: Vec<u32> = best[..3].iter().map(|&i| i as u32).collect();
        assert!(run(&params(1.0, 1.0, 3)).iter().all(|t| top3.contains(t)));
        // A tiny top_p keeps only the most likely token.
        assert!(run(&params(1.0, 1e-6, 0)).iter().all(|&t| t == top3[0]));
    }

    #[test]
    fn the_rng_is_uniform_enough() {
        let mut rng = Rng::new(42);
        let mean = (0..10_000).map(|_| rng.next_f64()).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }
}
