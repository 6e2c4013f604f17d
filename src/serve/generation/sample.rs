//! Picking a generation's next token from its logits: greedy at temperature 0, else sampled
//! under `temperature`, `top_k` and `top_p` from a seeded source, so the same seed and request
//! give the same tokens on any pool.
//!
//! Before the pick, a [`Sampler`] bends the logits by the request's [`Penalties`] in the order
//! vLLM and `transformers` apply them: `logit_bias` added, then the repetition penalty over the
//! prompt's and the generated tokens, then the frequency and presence penalties over the
//! generated tokens. Each touches only the tokens it names, kept as they come (the tokens seen
//! and how often each was generated), so a step costs the same whatever the answer's length
//! and allocates nothing the size of the vocabulary. The log-probabilities a request asks for
//! are those of the bent logits, before temperature, `top_k` and `top_p`: one pass over the
//! row for its maximum, its log-sum-exp and its most likely tokens, no sort.

use std::collections::{HashMap, HashSet};

use super::Params;

/// What bends a generation's logits before each pick (see the module's documentation for the
/// order): OpenAI's `presence_penalty`, `frequency_penalty` and `logit_bias`, and
/// `transformers`' `repetition_penalty`.
#[derive(Debug, Clone, PartialEq)]
pub struct Penalties {
    /// Subtracted once from the logit of every token generated so far.
    pub presence: f32,
    /// Subtracted from a token's logit once for each time it was generated so far.
    pub frequency: f32,
    /// Divides the logit of every token of the prompt or generated so far when it is positive,
    /// multiplies it when negative (1: none).
    pub repetition: f32,
    /// Token ids and what is added to their logits.
    pub bias: Vec<(u32, f32)>,
}

impl Penalties {
    /// Nothing bent.
    pub const NONE: Penalties = Penalties {
        presence: 0.0,
        frequency: 0.0,
        repetition: 1.0,
        bias: Vec::new(),
    };

    /// Whether the presence or frequency penalty is set: the generated tokens are counted.
    fn counts(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0
    }

    /// Whether the repetition penalty is set: the tokens seen are kept.
    fn repeats(&self) -> bool {
        self.repetition != 1.0
    }
}

/// The log-probabilities of a step: the picked token's and the most likely tokens' (most
/// likely first; equal ones by id).
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    /// The picked token's, whether or not it is among `top`.
    pub logprob: f32,
    /// The most likely tokens and theirs, as many as the request asked for.
    pub top: Vec<(u32, f32)>,
}

/// What a step picked.
#[derive(Debug)]
pub(super) struct Picked {
    /// The token.
    pub(super) token: u32,
    /// Its log-probabilities, when the request asks for them.
    pub(super) logprobs: Option<Logprobs>,
}

/// A generation's picks: its random source and what its penalties remember of the tokens so
/// far.
pub(super) struct Sampler<'a> {
    params: &'a Params,
    rng: Rng,
    /// Times each token was generated (kept only under a presence or frequency penalty).
    generated: HashMap<u32, u32>,
    /// The tokens of the prompt and generated, each once (kept only under a repetition
    /// penalty).
    seen: HashSet<u32>,
}

impl<'a> Sampler<'a> {
    /// The sampler of a generation under `params` whose prompt as it ran (after a shrink, cut)
    /// `prompt` gives, asked only when a repetition penalty counts it.
    pub(super) fn new(
        params: &'a Params,
        prompt: impl FnOnce() -> Result<Vec<u32>, String>,
    ) -> Result<Sampler<'a>, String> {
        let seen = match params.penalties.repeats() {
            true => prompt()?.into_iter().collect(),
            false => HashSet::new(),
        };
        Ok(Sampler {
            params,
            rng: Rng::new(params.seed),
            generated: HashMap::new(),
            seen,
        })
    }

    /// Bend `logits` by the penalties, pick the next token from them, and remember it.
    pub(super) fn pick(&mut self, logits: &mut [f32]) -> Picked {
        self.bend(logits);
        let token = pick(logits, self.params, &mut self.rng);
        let logprobs = self.params.logprobs.map(|top| logprobs(logits, token, top as usize));
        let penalties = &self.params.penalties;
        if penalties.counts() {
            *self.generated.entry(token).or_default() += 1;
        }
        if penalties.repeats() {
            self.seen.insert(token);
        }
        Picked { token, logprobs }
    }

    /// The penalties and bias applied to `logits`, in their order. An id past the row (a
    /// tokenizer larger than the model's vocabulary) has no logit to bend.
    fn bend(&self, logits: &mut [f32]) {
        let penalties = &self.params.penalties;
        for &(id, bias) in &penalties.bias {
            if let Some(logit) = logits.get_mut(id as usize) {
                *logit += bias;
            }
        }
        if penalties.repeats() {
            for &id in &self.seen {
                if let Some(logit) = logits.get_mut(id as usize) {
                    *logit = match *logit < 0.0 {
                        true => *logit * penalties.repetition,
                        false => *logit / penalties.repetition,
                    };
                }
            }
        }
        if penalties.counts() {
            for (&id, &times) in &self.generated {
                if let Some(logit) = logits.get_mut(id as usize) {
                    *logit -= times as f32 * penalties.frequency + penalties.presence;
                }
            }
        }
    }
}

/// The log-softmax of `logits` at `picked` and at its `top` most likely tokens, in one pass:
/// a running maximum and sum of exponentials (rescaled when the maximum grows), and the `top`
/// best kept in order as they come. Tokens whose logit is not a number or -inf (masked) have
/// probability 0 and are never among the best.
fn logprobs(logits: &[f32], picked: u32, top: usize) -> Logprobs {
    // The exponentials in f32 (a third faster than f64's over a 152k row), summed in f64: the
    // log-sum-exp is within 1e-8 of an all-f64 one.
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0.0f64);
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    for (id, &logit) in logits.iter().enumerate() {
        if logit.is_nan() || logit == f32::NEG_INFINITY {
            continue;
        }
        if logit > max {
            sum = sum * f64::from((max - logit).exp()) + 1.0;
            max = logit;
        } else {
            sum += f64::from((logit - max).exp());
        }
        // Strictly greater: of equal logits the lower id, met first, stays ahead.
        if top > 0 && (best.len() < top || logit > best[top - 1].1) {
            let at = best.partition_point(|&(_, l)| l >= logit);
            best.insert(at, (id as u32, logit));
            best.truncate(top);
        }
    }
    let lse = f64::from(max) + sum.ln();
    let logprob = |logit: f32| (f64::from(logit) - lse) as f32;
    Logprobs {
        logprob: logits.get(picked as usize).map_or(f32::NEG_INFINITY, |&l| logprob(l)),
        top: best.into_iter().map(|(id, l)| (id, logprob(l))).collect(),
    }
}

pub use crate::core::rng::Rng;

/// Pick the next token from `logits` under `params`' temperature, `top_k` and `top_p`: from the
/// candidates by descending logit (ties by id, so the order is the same everywhere), of which
/// only as many are put in order as the nucleus and the draw reach. A sort of the whole row
/// would cost O(V log V) every token on a real vocabulary (151,936 for Qwen2.5); a selection of
/// the most likely is linear, grown (doubled) only when the walk reaches past it.
fn pick(logits: &[f32], params: &Params, rng: &mut Rng) -> u32 {
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
    let mut order = Ordered::new(logits, params.top_k);
    if order.candidates.is_empty() {
        return greedy();
    }
    let (max, temperature) = (order.max as f64, params.temperature as f64);
    let weight = |token: u32| ((logits[token as usize] as f64 - max) / temperature).exp();
    let total: f64 = order.candidates.iter().map(|&t| weight(t)).sum();
    // Nucleus: keep the most likely tokens until their share reaches top_p (at 1, all).
    let (mut kept, mut kept_total) = (order.candidates.len(), total);
    if params.top_p < 1.0 {
        let (mut share, mut sum) = (0.0, 0.0);
        for i in 0.. {
            let w = weight(order.at(i));
            share += w / total;
            sum += w;
            if share >= params.top_p as f64 || i + 1 == order.candidates.len() {
                (kept, kept_total) = (i + 1, sum);
                break;
            }
        }
    }
    let mut target = rng.next_f64() * kept_total;
    for i in 0..kept {
        let token = order.at(i);
        let w = weight(token);
        if target < w {
            return token;
        }
        target -= w;
    }
    order.at(kept - 1)
}

/// A row's candidate tokens (finite logits; the `top_k` most likely when set), the most likely
/// first as far as they have been put in order.
struct Ordered<'a> {
    logits: &'a [f32],
    candidates: Vec<u32>,
    /// How many at the front are in order: the most likely of all, by descending logit.
    sorted: usize,
    /// The largest candidate logit.
    max: f32,
}

impl<'a> Ordered<'a> {
    /// How many the first selection puts in order: enough for most picks from a real model's
    /// peaked distribution.
    const FIRST: usize = 64;

    fn new(logits: &'a [f32], top_k: u32) -> Ordered<'a> {
        let candidates: Vec<u32> = (0..logits.len() as u32)
            .filter(|&t| logits[t as usize].is_finite())
            .collect();
        let max = candidates
            .iter()
            .map(|&t| logits[t as usize])
            .fold(f32::NEG_INFINITY, f32::max);
        let mut order = Ordered {
            logits,
            candidates,
            sorted: 0,
            max,
        };
        let k = top_k as usize;
        if k > 0 && k < order.candidates.len() {
            let before = order.before();
            order.candidates.select_nth_unstable_by(k - 1, before);
            order.candidates.truncate(k);
        }
        order
    }

    /// The order of candidates: descending logit, ties by id.
    fn before(&self) -> impl Fn(&u32, &u32) -> std::cmp::Ordering + 'a {
        let logits = self.logits;
        move |a, b| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b))
    }

    /// The `i`-th most likely candidate (`i` below their number), putting more in order when
    /// `i` is past those in order: the next most likely, selected from the rest, then sorted.
    fn at(&mut self, i: usize) -> u32 {
        if i >= self.sorted {
            let upto = (i + 1).max(2 * self.sorted).max(Self::FIRST).min(self.candidates.len());
            let before = self.before();
            let rest = &mut self.candidates[self.sorted..];
            let take = upto - self.sorted;
            if take < rest.len() {
                rest.select_nth_unstable_by(take - 1, &before);
            }
            rest[..take].sort_unstable_by(&before);
            self.sorted = upto;
        }
        self.candidates[i]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, top_k: u32) -> Params {
        Params {
            max_tokens: Some(8),
            temperature,
            top_p,
            top_k,
            seed: 7,
            stop: vec![],
            tools: false,
            grammar: None,
            penalties: Penalties::NONE,
            logprobs: None,
        }
    }

    /// The pick as a whole sort of the row would make it: every candidate in order, then the
    /// nucleus and the draw.
    fn sorted_pick(logits: &[f32], params: &Params, rng: &mut Rng) -> u32 {
        let mut order: Vec<usize> = (0..logits.len()).filter(|&i| logits[i].is_finite()).collect();
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
        let mut kept = weights.len();
        let mut share = 0.0;
        for (i, w) in weights.iter().enumerate() {
            share += w / total;
            if params.top_p < 1.0 && share >= params.top_p as f64 {
                kept = i + 1;
                break;
            }
        }
        let mut target = rng.next_f64() * weights[..kept].iter().sum::<f64>();
        for (i, w) in weights[..kept].iter().enumerate() {
            if target < *w {
                return order[i] as u32;
            }
            target -= w;
        }
        order[kept - 1] as u32
    }

    #[test]
    fn the_pick_puts_in_order_only_what_it_reaches_and_picks_as_a_whole_sort_would() {
        // Rows from peaked (a real model's) to flat (random weights'), with ties and masked
        // tokens, sampled under every kind of nucleus and top_k.
        let mut source = Rng::new(5);
        for (row, spread) in [0.5f64, 3.0, 12.0, 40.0].into_iter().enumerate() {
            let logits: Vec<f32> = (0..2000)
                .map(|i| match i % 97 {
                    0 => f32::NEG_INFINITY,
                    1 => 2.0,
                    _ => (source.next_f64() * spread) as f32,
                })
                .collect();
            for (temperature, top_p, top_k) in [
                (1.0, 1.0, 0),
                (0.7, 0.9, 0),
                (1.3, 0.5, 0),
                (1.0, 1.0, 40),
                (1.0, 0.95, 300),
                (2.0, 0.999, 0),
            ] {
                let p = params(temperature, top_p, top_k);
                let (mut a, mut b) = (Rng::new(row as u64), Rng::new(row as u64));
                for draw in 0..60 {
                    assert_eq!(
                        pick(&logits, &p, &mut a),
                        sorted_pick(&logits, &p, &mut b),
                        "row {row}, {temperature} {top_p} {top_k}, draw {draw}"
                    );
                }
            }
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

    /// Logits from `rng`: spread over -20..20, a few masked to -inf and a few tied.
    fn row(rng: &mut Rng, vocab: usize) -> Vec<f32> {
        let mut logits: Vec<f32> = (0..vocab).map(|_| (rng.next_f64() * 40.0 - 20.0) as f32).collect();
        logits[3] = f32::NEG_INFINITY;
        logits[vocab - 1] = logits[vocab - 2];
        logits
    }

    /// The penalties as their definitions read, over the whole vocabulary: `logit_bias` added;
    /// every token of `prompt` or `generated` divided by the repetition penalty when positive,
    /// multiplied when negative; then less `frequency × count + presence` for each token
    /// generated `count` > 0 times.
    fn bent_by_definition(logits: &[f32], penalties: &Penalties, prompt: &[u32], generated: &[u32]) -> Vec<f32> {
        let mut out = logits.to_vec();
        for &(id, bias) in &penalties.bias {
            out[id as usize] += bias;
        }
        for (id, logit) in out.iter_mut().enumerate() {
            let id = id as u32;
            if prompt.contains(&id) || generated.contains(&id) {
                *logit = if *logit > 0.0 {
                    *logit / penalties.repetition
                } else {
                    *logit * penalties.repetition
                };
            }
            let count = generated.iter().filter(|&&t| t == id).count();
            if count > 0 {
                *logit -= count as f32 * penalties.frequency + penalties.presence;
            }
        }
        out
    }

    /// Token by token, the sampler bends the logits as the definitions do and picks the
    /// greedy token of the bent logits; tokens of the prompt only get the repetition penalty.
    #[test]
    fn penalties_and_bias_bend_the_logits_as_defined() {
        let vocab = 40;
        let penalties = Penalties {
            presence: 0.7,
            frequency: 1.3,
            repetition: 1.8,
            bias: vec![(0, 5.0), (7, -100.0), (12, 2.5)],
        };
        let p = Params {
            penalties: penalties.clone(),
            ..params(0.0, 1.0, 0)
        };
        let prompt = [5, 9, 9, 21];
        let mut sampler = Sampler::new(&p, || Ok(prompt.to_vec())).unwrap();
        let mut rng = Rng::new(3);
        let mut generated = Vec::new();
        for step in 0..60 {
            let logits = row(&mut rng, vocab);
            let want = bent_by_definition(&logits, &penalties, &prompt, &generated);
            let mut got = logits.clone();
            let picked = sampler.pick(&mut got);
            for (id, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g == w || (g - w).abs() <= 1e-4 * w.abs(),
                    "step {step}, token {id}: {g} != {w}"
                );
            }
            assert_eq!(picked.token, pick(&want, &p, &mut Rng::new(0)), "step {step}");
            assert_ne!(picked.token, 7, "a bias of -100 keeps a token out");
            generated.push(picked.token);
        }
        let distinct: HashSet<u32> = generated.iter().copied().collect();
        assert!(distinct.len() > 10, "the penalties spread the picks: {generated:?}");
    }

    /// Without penalties nothing is remembered and the logits are left as they are.
    #[test]
    fn no_penalties_leave_the_logits_alone() {
        let p = params(0.0, 1.0, 0);
        let mut sampler = Sampler::new(&p, || Ok(vec![1, 2, 3])).unwrap();
        let mut rng = Rng::new(5);
        for _ in 0..5 {
            let logits = row(&mut rng, 30);
            let mut bent = logits.clone();
            sampler.pick(&mut bent);
            assert_eq!(
                bent.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
                logits.iter().map(|l| l.to_bits()).collect::<Vec<_>>()
            );
        }
        assert!(sampler.generated.is_empty() && sampler.seen.is_empty());
    }

    /// The log-softmax as defined, in f64 over the whole row, sorted: (id, logprob), most
    /// likely first, equal ones by id; masked tokens left out.
    fn log_softmax_sorted(logits: &[f32]) -> Vec<(u32, f64)> {
        let finite: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, f64::from(l)))
            .collect();
        let max = finite.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
        let lse = max + finite.iter().map(|p| (p.1 - max).exp()).sum::<f64>().ln();
        let mut all: Vec<(u32, f64)> = finite.into_iter().map(|(i, l)| (i, l - lse)).collect();
        all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        all
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_its_top_tokens() {
        let mut rng = Rng::new(11);
        for case in 0..50 {
            let vocab = 2 + case * 7;
            let mut logits = row(&mut rng, vocab.max(5));
            if case % 5 == 0 {
                // Ties at the top: the lower id first, as greedy picks it.
                let top = logits.iter().copied().fold(f32::MIN, f32::max);
                logits[1] = top;
                logits[4] = top;
            }
            let want = log_softmax_sorted(&logits);
            for top in [0, 1, 5, 20] {
                let picked = (case * 13 % logits.len()) as u32;
                let got = logprobs(&logits, picked, top);
                let want_top = &want[..top.min(want.len())];
                assert_eq!(got.top.len(), want_top.len());
                for ((id, lp), (want_id, want_lp)) in got.top.iter().zip(want_top) {
                    assert_eq!(id, want_id, "case {case}, top {top}: {:?}", got.top);
                    assert!((f64::from(*lp) - want_lp).abs() < 1e-5, "{lp} != {want_lp}");
                }
                // The picked token's, whether or not among the top (a masked one: -inf).
                let want_picked = want.iter().find(|p| p.0 == picked).map_or(f64::NEG_INFINITY, |p| p.1);
                let got_picked = f64::from(got.logprob);
                assert!(
                    got_picked == want_picked || (got_picked - want_picked).abs() < 1e-5,
                    "case {case}: {got_picked} != {want_picked}"
                );
            }
            // The probabilities sum to 1.
            let total: f64 = want.iter().map(|p| p.1.exp()).sum();
            assert!((total - 1.0).abs() < 1e-9);
        }
        // Greedy's token is the first of the top.
        let logits = row(&mut rng, 64);
        let greedy = pick(&logits, &params(0.0, 1.0, 0), &mut rng);
        assert_eq!(logprobs(&logits, greedy, 3).top[0].0, greedy);
    }

    /// The sampler gives log-probabilities only when asked, of the bent logits (after the
    /// bias, before temperature): the same at any temperature.
    #[test]
    fn logprobs_are_of_the_bent_logits_whatever_the_temperature() {
        let logits = row(&mut Rng::new(2), 50);
        let bias = Penalties {
            bias: vec![(10, 30.0)],
            ..Penalties::NONE
        };
        let at = |temperature: f32, logprobs: Option<u32>| {
            let p = Params {
                penalties: bias.clone(),
                logprobs,
                ..params(temperature, 1.0, 0)
            };
            Sampler::new(&p, || Ok(Vec::new())).unwrap().pick(&mut logits.clone())
        };
        assert_eq!(at(0.0, None).logprobs, None);
        let cold = at(0.0, Some(2)).logprobs.unwrap();
        let hot = at(1.5, Some(2)).logprobs.unwrap();
        assert_eq!(cold.top, hot.top);
        assert_eq!(cold.top[0].0, 10, "the bias made token 10 the most likely");
        let mut bent = logits.clone();
        bent[10] += 30.0;
        assert_eq!(logprobs(&bent, 10, 2), cold);
    }

    #[test]
    fn the_rng_is_uniform_enough() {
        let mut rng = Rng::new(42);
        let mean = (0..10_000).map(|_| rng.next_f64()).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }
}
