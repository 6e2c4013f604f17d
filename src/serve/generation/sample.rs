//! Picking a generation's next token from its logits: greedy at temperature 0, else sampled
//! under `temperature`, `top_k` and `top_p` from a seeded source, so the same seed and request
//! give the same tokens on any pool.

use super::Params;

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
pub(super) fn pick(logits: &[f32], params: &Params, rng: &mut Rng) -> u32 {
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
            tools: false,
            grammar: None,
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
