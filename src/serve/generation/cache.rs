//! Where a generation's KV cache is between its steps, and a step on it. On a pool whose backends
//! keep caches, the cache stays in the pool's runtime (on its device) and the generation is a
//! row of the pool's batch for its model ([`crate::pool::batch`]): a step sends one token in
//! and one row of logits comes out. On a pool that keeps none (a remote one), each step carries
//! the cache as tensors, as a stateless server needs.
//!
//! A step that fails where the cache was kept does not carry it anywhere: the prompt and the
//! tokens so far are prefilled again ([`lifecycle::recompute`]), on the same pool when only
//! the cache was missing there, or on its fallback as any failed step moves.

use std::sync::Arc;

use crate::core::tensor::{Tensor, TensorData};
use crate::pool::Pool;
use crate::pool::batch::{Member, next_sequence};
use crate::runtime::decoder::{DecoderLayout, step_inputs};
use crate::serve::lifecycle::{self, DeadlineMiss, Request, RequestError};
use crate::serve::metrics::FailoverReason;
use crate::serve::service::Service;

/// Where a generation's cache is between steps.
pub enum Cache {
    /// In the pool's runtime: the generation is this member of the pool's batch.
    Kept(Member),
    /// With the generation: the previous run's `present.*` outputs.
    Carried(Vec<Tensor>),
}

/// The last position's logits, and the cache to carry to the next run (none when the pool
/// kept it).
pub fn read_outputs(outputs: Vec<Tensor>) -> Result<(Vec<f32>, Vec<Tensor>), String> {
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

/// Copy the cache that `request`'s prompt's run on `pool` left (its `outputs`) for each of
/// `copies`, generations of the same prompt under sequences of their own. Where the pool keeps
/// caches the copy is made there, by its backend, before any of them takes a step (on a GPU the
/// cache never crosses to the host); a cache the outputs carry is copied with them, as each
/// copy's outputs are.
pub fn fork(pool: &Arc<Pool>, request: &Request, outputs: &[Tensor], copies: &[&Request]) {
    let carried = outputs.iter().any(|t| t.name.starts_with("present."));
    let Some(from) = kept_as(pool, request, carried) else {
        return;
    };
    let to = copies.iter().filter_map(|copy| copy.sequence).collect();
    pool.batch(&request.model).fork(from, to);
}

/// A generation's cache site: the pool its steps run on, where its cache is there, and
/// whether a run of it moved.
pub struct CacheSite {
    /// The pool its steps run on.
    pub pool: Arc<Pool>,
    /// Its cache.
    pub cache: Cache,
    /// Set once a run moved to the fallback pool.
    pub retried: Option<FailoverReason>,
}

/// A step's failure: what the client is told, or the model's outputs not being a decoder's.
pub enum Failed {
    /// The request's error.
    Request(RequestError),
    /// The outputs were not what a decoder gives.
    Broken(String),
}

impl CacheSite {
    /// After the prompt's run on `pool` gave `cache` (empty when the pool kept it, as
    /// `request`'s sequence).
    pub fn new(pool: Arc<Pool>, request: &Request, cache: Vec<Tensor>, retried: Option<FailoverReason>) -> CacheSite {
        let cache = keep_or_carry(&pool, request, cache);
        CacheSite { pool, cache, retried }
    }

    /// Run `token` at position `past`: the logits of the next position. `history` gives the
    /// prompt and every token so far (`token` included), for a prefill after a failure, which
    /// gives `request` a new sequence.
    pub async fn step(
        &mut self,
        service: &Service,
        request: &mut Request,
        layout: &DecoderLayout,
        (token, past): (u32, usize),
        history: impl FnOnce() -> Result<Vec<u32>, String>,
        estimate_bytes: u64,
    ) -> Result<Vec<f32>, Failed> {
        let failed = match &mut self.cache {
            Cache::Carried(cache) => {
                let inputs = step_inputs(layout, &[token], past, std::mem::take(cache));
                let stepped = lifecycle::step(service, &self.pool, request, inputs, estimate_bytes)
                    .await
                    .map_err(Failed::Request)?;
                return self.settle(request, stepped);
            }
            Cache::Kept(member) => {
                let stepped = member.step(token, past as u64);
                let result = match request.meta.deadline {
                    Some(deadline) => tokio::time::timeout_at(deadline.into(), stepped)
                        .await
                        .map_err(|_| Failed::Request(RequestError::Deadline(DeadlineMiss::InPool)))?,
                    None => stepped.await,
                };
                match result {
                    Ok(logits) => return Ok(logits),
                    Err(error) => error,
                }
            }
        };
        // The cache is gone with the step: leave the batch, and build it again.
        self.cache = Cache::Carried(Vec::new());
        tracing::info!(request_id = %request.meta.request_id, pool = self.pool.name(), error = %failed, "a generation's step failed: prefilling it again");
        let tokens = history().map_err(Failed::Broken)?;
        let inputs = step_inputs(layout, &tokens, 0, Vec::new());
        // The member dropped above leaves the batch with its sequence's cache, and that can
        // reach the backend after the prefill: under the same number, it would drop the new
        // cache, and the next step would find it missing again.
        request.sequence = request.sequence.map(|_| next_sequence());
        let ran = lifecycle::recompute(service, &self.pool, request, failed, inputs, estimate_bytes)
            .await
            .map_err(Failed::Request)?;
        self.settle(request, ran)
    }

    /// Take a run's outcome: its pool, and where the cache is now.
    fn settle(&mut self, request: &Request, ran: lifecycle::Ran) -> Result<Vec<f32>, Failed> {
        self.pool = ran.pool;
        self.retried = ran.retried.or(self.retried);
        let (logits, cache) = read_outputs(ran.outputs).map_err(Failed::Broken)?;
        self.cache = keep_or_carry(&self.pool, request, cache);
        Ok(logits)
    }
}

/// The sequence under which `pool` keeps the cache of `request`'s run, when it does: when the
/// run gave none to carry (`carried`).
fn kept_as(pool: &Pool, request: &Request, carried: bool) -> Option<u64> {
    request.sequence.filter(|_| !carried && pool.keeps_caches())
}

/// Where the cache is after a run on `pool` that gave `cache`: kept by the pool (as the
/// request's sequence) when it gave none, else carried.
fn keep_or_carry(pool: &Arc<Pool>, request: &Request, cache: Vec<Tensor>) -> Cache {
    match kept_as(pool, request, !cache.is_empty()) {
        Some(seq) => {
            let mut member = pool.batch(&request.model).member(seq);
            member.join();
            Cache::Kept(member)
        }
        _ => Cache::Carried(cache),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use crate::core::model::ModelData;

    use super::*;
    use crate::config::{ModelConfig, PoolConfig};
    use crate::core::backend::{
        Arenas, Backend, BackendError, DecodeStep, Generations, Interrupts, Liveness, Residency, RunMeta,
    };
    use crate::runtime::estimate::MemoryProfile;
    use crate::runtime::onnx::ModelSignature;
    use crate::serve::generation::{self, Generated, Params, Penalties, Placed};
    use crate::serve::lifecycle::Refused;
    use crate::serve::service::{BackendFactory, OrtFactory};

    /// Prompts past this many mean a generation is prefilled again and again: the backend
    /// refuses them, so such a test fails instead of running on.
    const MOST_PROMPTS: usize = 8;

    /// An ONNX Runtime backend whose sessions are built again (and with them every cache
    /// dropped) before its `forget_at`-th step, as when a pool's backend is replaced in the
    /// middle of a generation. It counts the prompts it runs.
    struct Forgetting {
        inner: Box<dyn Backend>,
        /// The models' graphs (builtin ones, all inline), to load them again.
        models: Vec<(String, Vec<u8>)>,
        steps: usize,
        forget_at: Option<usize>,
        prompts: Arc<AtomicUsize>,
    }

    impl Backend for Forgetting {
        fn run(
            &mut self,
            model: &str,
            inputs: Vec<Tensor>,
            outputs: &[String],
            meta: &RunMeta,
        ) -> Result<Vec<Tensor>, BackendError> {
            self.inner.run(model, inputs, outputs, meta)
        }

        fn residency(&mut self) -> Option<&mut dyn Residency> {
            self.inner.residency()
        }

        /// Its own, which forget and count.
        fn generations(&mut self) -> Option<&mut dyn Generations> {
            self.inner.generations()?;
            Some(self)
        }

        fn arenas(&mut self) -> Option<&mut dyn Arenas> {
            self.inner.arenas()
        }

        fn liveness(&self) -> Option<&dyn Liveness> {
            self.inner.liveness()
        }

        fn interrupts(&mut self) -> Option<&mut dyn Interrupts> {
            self.inner.interrupts()
        }
    }

    impl Generations for Forgetting {
        fn prefill(
            &mut self,
            model: &str,
            seq: u64,
            inputs: Vec<Tensor>,
            meta: &RunMeta,
        ) -> Result<Vec<Tensor>, BackendError> {
            if self.prompts.fetch_add(1, Ordering::SeqCst) >= MOST_PROMPTS {
                return Err(BackendError::Runtime("prefilled again and again".into()));
            }
            self.inner.caches()?.prefill(model, seq, inputs, meta)
        }

        fn decode(&mut self, model: &str, step: &DecodeStep, meta: &RunMeta) -> Result<Vec<Tensor>, BackendError> {
            if !step.rows.is_empty() {
                self.steps += 1;
                if Some(self.steps) == self.forget_at {
                    for (name, bytes) in &self.models {
                        let sessions = self.inner.loader(name).expect("ONNX Runtime backends hold sessions");
                        let model = crate::core::model::ModelData::inline(bytes);
                        sessions.load_model(name, model).expect("the model loads again");
                    }
                }
            }
            self.inner.caches()?.decode(model, step, meta)
        }
    }

    /// [`OrtFactory`], its backends [`Forgetting`].
    struct Factory {
        ort: OrtFactory,
        forget_at: Option<usize>,
        prompts: Arc<AtomicUsize>,
    }

    impl BackendFactory for Factory {
        fn runtime_version(&self) -> String {
            self.ort.runtime_version()
        }

        fn signature(&self, model: &ModelConfig, data: ModelData<'_>) -> Result<ModelSignature, String> {
            self.ort.signature(model, data)
        }

        fn measure_profile(
            &self,
            model: &ModelConfig,
            data: ModelData<'_>,
            signature: &ModelSignature,
        ) -> MemoryProfile {
            self.ort.measure_profile(model, data, signature)
        }

        fn backend(&self, pool: &PoolConfig, models: &[(String, ModelData<'_>)]) -> Result<Box<dyn Backend>, String> {
            Ok(Box::new(Forgetting {
                inner: self.ort.backend(pool, models)?,
                models: models.iter().map(|(n, m)| (n.clone(), m.graph.to_vec())).collect(),
                steps: 0,
                forget_at: self.forget_at,
                prompts: Arc::clone(&self.prompts),
            }))
        }
    }

    /// A greedy generation of 32 tokens on a CPU pool whose backend forgets its caches before
    /// its `forget_at`-th step; with the prompts the backend ran.
    async fn generation(forget_at: Option<usize>) -> (Generated, usize) {
        let (mut generated, prompts) = generations(forget_at, 1, greedy(7)).await;
        (generated.remove(0), prompts)
    }

    /// `n` generations of one prompt's run under `params` on a CPU pool whose backend forgets
    /// its caches before its `forget_at`-th step; with the prompts the backend ran.
    async fn generations(forget_at: Option<usize>, n: usize, params: Params) -> (Vec<Generated>, usize) {
        let models = "models: [{name: tiny, path: 'builtin:decoder', tokenizer: 'builtin:decoder'}]\n\
                      pools: [{name: cpu, provider: cpu, models: [tiny]}]\n";
        generations_of(models, crate::testing::ADMIT_ALL, ("tiny", n, params), forget_at, false).await
    }

    /// 32 tokens, greedy, from `seed`.
    fn greedy(seed: u64) -> Params {
        Params {
            max_tokens: Some(32),
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed,
            stop: Vec::new(),
            tools: false,
            grammar: None,
            penalties: Penalties::NONE,
            logprobs: None,
        }
    }

    /// A greedy generation of 32 tokens for `model` under `policy`, on a CPU pool serving
    /// `models` whose backend forgets its caches before its `forget_at`-th step; with the
    /// prompts the backend ran. With `substitute`, the client allows the model's fallback to
    /// answer, its prompt made again with the same tokens.
    async fn generation_of(
        models: &str,
        policy: &str,
        model: &str,
        forget_at: Option<usize>,
        substitute: bool,
    ) -> (Generated, usize) {
        let (mut generated, prompts) =
            generations_of(models, policy, (model, 1, greedy(7)), forget_at, substitute).await;
        (generated.remove(0), prompts)
    }

    /// `n` generations of `model` under `params` from one run of its prompt, as
    /// [`generation_of`] makes one.
    async fn generations_of(
        models: &str,
        policy: &str,
        (model, n, params): (&str, usize, Params),
        forget_at: Option<usize>,
        substitute: bool,
    ) -> (Vec<Generated>, usize) {
        let scratch = crate::testing::Scratch::new();
        let yaml = format!("{models}{}", scratch.policy(policy));
        let config = crate::testing::config::validated(&yaml);
        let rt = crate::runtime::onnx::runtime(None).expect("ONNX Runtime loads");
        let prompts = Arc::new(AtomicUsize::new(0));
        let factory = Factory {
            ort: OrtFactory::new(rt, &config, Vec::new()),
            forget_at,
            prompts: Arc::clone(&prompts),
        };
        let service = crate::testing::fakes::service(config, Arc::new(factory));
        let prompt: Vec<u32> = (40..100).collect();
        let mut request = crate::testing::request(model, Vec::new());
        request.allow_substitute = substitute;
        let entry = service.model(model).expect("configured");
        let fails = |refused: Refused| -> String {
            let prompts = prompts.load(Ordering::SeqCst);
            format!("the generation fails after {prompts} prompts: {:?}", refused.error)
        };
        request.generations = n as u64;
        let placed = generation::place(&service, entry, prompt.clone().into(), &params, request).await;
        let prefilled = match placed.unwrap_or_else(|r| panic!("{}", fails(r))) {
            Placed::Prefilled(prefilled) => prefilled,
            // The fallback's prompt made again: the same tokens.
            Placed::Fallback(fallback) => {
                assert!(substitute, "a fallback is asked only when the client allows it");
                let rebuilt = Ok((prompt.into(), params.clone()));
                fallback.place(rebuilt).await.unwrap_or_else(|r| panic!("{}", fails(r)))
            }
        };
        let runs = prefilled.fork(n).into_iter().map(|p| p.run(None));
        let generated = futures_util::future::join_all(runs).await;
        let generated = generated
            .into_iter()
            .map(|g| g.unwrap_or_else(|r| panic!("{}", fails(r))));
        (generated.collect(), prompts.load(Ordering::SeqCst))
    }

    /// `n` generations of one prompt run it once and go on from copies of its cache: at
    /// temperature 0 each is the one generation's text; sampled, generation `i` is the one
    /// generation seeded `i` after the request's seed. Each is a request of its own.
    #[tokio::test]
    async fn n_generations_share_one_run_of_their_prompt_and_each_has_its_seed() {
        let (one, prompts) = generation(None).await;
        assert_eq!(prompts, 1);
        let (three, prompts) = generations(None, 3, greedy(7)).await;
        assert_eq!(prompts, 1, "one run of the prompt for the three");
        for generated in &three {
            assert_eq!((&generated.tokens, &generated.text), (&one.tokens, &one.text));
        }
        let sampled = |seed| Params {
            temperature: 1.0,
            ..greedy(seed)
        };
        let (forked, prompts) = generations(None, 3, sampled(40)).await;
        assert_eq!(prompts, 1);
        for (i, generated) in forked.iter().enumerate() {
            let (alone, _) = generations(None, 1, sampled(40 + i as u64)).await;
            assert_eq!(generated.tokens, alone[0].tokens, "generation {i} is seed {}'s", 40 + i);
        }
        assert!(forked[0].tokens != forked[1].tokens || forked[1].tokens != forked[2].tokens);
    }

    /// Generations of one run whose caches the backend lost are each prefilled again alone,
    /// and go on with the tokens they would have had.
    #[tokio::test]
    async fn n_generations_whose_caches_went_missing_are_each_prefilled_again() {
        let (undisturbed, _) = generations(None, 3, greedy(7)).await;
        let (disturbed, prompts) = generations(Some(8), 3, greedy(7)).await;
        assert_eq!(prompts, 1 + 3, "the prompt, then each generation's own");
        for (a, b) in disturbed.iter().zip(&undisturbed) {
            assert_eq!((&a.tokens, &a.text), (&b.tokens, &b.text));
        }
    }

    /// A generation whose cache its pool's backend lost is prefilled again on the same pool,
    /// once, and goes on with the tokens it would have had: its old cache dropped after it
    /// left the batch never takes the new one.
    #[tokio::test]
    async fn a_generation_whose_cache_went_missing_is_prefilled_again_once_with_the_same_text() {
        let (undisturbed, prompts) = generation(None).await;
        assert_eq!(prompts, 1);
        assert!(undisturbed.tokens.len() > 10, "{} tokens", undisturbed.tokens.len());
        let (disturbed, prompts) = generation(Some(8)).await;
        assert_eq!(prompts, 2, "the prompt, then once more with the tokens so far");
        assert_eq!(disturbed.pool.name(), "cpu");
        assert_eq!(disturbed.tokens, undisturbed.tokens);
        assert_eq!(disturbed.text, undisturbed.text);
    }

    /// A generation its model's fallback answers (the policy keeps the model off) steps on the
    /// cache its prompt's run left, under the substitute's sequence: the prompt is prefilled
    /// once, and the text is the fallback's own.
    #[tokio::test]
    async fn a_substituted_generation_steps_on_the_cache_its_prompt_left() {
        let models = "models:\n\
                      - {name: tiny, path: 'builtin:decoder', tokenizer: 'builtin:decoder', fallback_model: small}\n\
                      - {name: small, path: 'builtin:decoder', tokenizer: 'builtin:decoder'}\n\
                      pools: [{name: cpu, provider: cpu, models: [tiny, small]}]\n";
        let keep_tiny_off = r#"fn decide(req, state) {
            if req.model == "small" { admit() } else { reject("the policy keeps this model off") }
        }"#;
        let (own, prompts) = generation_of(models, keep_tiny_off, "small", None, false).await;
        assert_eq!(prompts, 1);
        assert!(own.tokens.len() > 10, "{} tokens", own.tokens.len());
        let (substituted, prompts) = generation_of(models, keep_tiny_off, "tiny", None, true).await;
        assert_eq!(substituted.source.model, "small");
        assert!(substituted.source.substitution.is_some());
        assert_eq!(
            prompts, 1,
            "the substitute's prompt, and no prefill again for a missing cache"
        );
        assert_eq!(substituted.tokens, own.tokens);
        assert_eq!(substituted.text, own.text);
    }
}
