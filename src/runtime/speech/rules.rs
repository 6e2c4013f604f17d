//! How each step of a window's decoding picks its token, as `transformers`' Whisper generation
//! does: the logits processors it applies, in its order (`SuppressTokensAtBegin`,
//! `SuppressTokens`, then `WhisperTimeStampLogitsProcessor` when timestamps are asked), then
//! the pick: the first highest logit at temperature 0, else a draw from the softmax of the
//! logits over the temperature (as OpenAI's Whisper samples: no top-k or top-p; the draw is
//! seeded, from [`Rng`], so it does not repeat `torch`'s). Language detection and the
//! no-speech probability read the raw logits, as `transformers` does.

use super::whisper::Whisper;
use crate::core::rng::Rng;

/// The rules of one window's decoding.
#[derive(Debug, Clone)]
pub struct Rules {
    suppress: Vec<u32>,
    begin_suppress: Vec<u32>,
    eos: u32,
    no_timestamps: Option<u32>,
    timestamp_begin: u32,
    max_initial_timestamp: Option<u32>,
    /// Whether the timestamp rules apply (the prompt does not end with `<|notimestamps|>`).
    timestamps: bool,
}

impl Whisper {
    /// The rules a window of `prompt` is decoded under: with the timestamp rules unless the
    /// prompt ends with `<|notimestamps|>` or the model names none (`transformers` decodes no
    /// timestamps then).
    pub fn rules(&self, prompt: &[i64]) -> Rules {
        Rules {
            suppress: self.suppress.clone(),
            begin_suppress: self.begin_suppress.clone(),
            eos: self.tokens.eos,
            no_timestamps: self.tokens.no_timestamps,
            timestamp_begin: self.tokens.timestamp_begin,
            max_initial_timestamp: self.max_initial_timestamp,
            timestamps: self
                .tokens
                .no_timestamps
                .is_some_and(|t| prompt.last() != Some(&i64::from(t))),
        }
    }
}

/// Set `ids` (those in range) of `logits` to −∞.
fn forbid(logits: &mut [f32], ids: impl IntoIterator<Item = u32>) {
    for id in ids {
        if let Some(l) = logits.get_mut(id as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// Set `logits[range]` (clamped to the row) to −∞.
fn forbid_range(logits: &mut [f32], from: usize, to: usize) {
    let to = to.min(logits.len());
    if from < to {
        logits[from..to].fill(f32::NEG_INFINITY);
    }
}

impl Rules {
    /// Apply the rules to `logits`, the row of the step after `generated` (the tokens picked so
    /// far in this window, after its prompt).
    pub fn apply(&self, generated: &[u32], logits: &mut [f32]) {
        if generated.is_empty() {
            forbid(logits, self.begin_suppress.iter().copied());
        }
        forbid(logits, self.suppress.iter().copied());
        if self.timestamps {
            self.timestamp_rules(generated, logits);
        }
    }

    /// `WhisperTimeStampLogitsProcessor`: `<|notimestamps|>` never; timestamps in pairs (after
    /// a pair, text; after one timestamp that follows text, another or the end); none earlier
    /// than the last (nor the last again, unless closing its pair); the first token a timestamp
    /// no later than the initial limit; and a timestamp whenever all timestamps together are
    /// likelier than the likeliest text token.
    fn timestamp_rules(&self, generated: &[u32], logits: &mut [f32]) {
        let begin = self.timestamp_begin;
        let is_time = |t: &u32| *t >= begin;
        forbid(logits, self.no_timestamps);
        let n = generated.len();
        let last_was_time = n >= 1 && is_time(&generated[n - 1]);
        let penultimate_was_time = n < 2 || is_time(&generated[n - 2]);
        if last_was_time {
            if penultimate_was_time {
                forbid_range(logits, begin as usize, logits.len());
            } else {
                forbid_range(logits, 0, self.eos as usize);
            }
        }
        if let Some(&last) = generated.iter().rev().find(|t| is_time(t)) {
            let last = match last_was_time && !penultimate_was_time {
                true => last,
                false => last + 1,
            };
            forbid_range(logits, begin as usize, last as usize);
        }
        if generated.is_empty() {
            forbid_range(logits, 0, begin as usize);
            if let Some(most) = self.max_initial_timestamp {
                forbid_range(logits, (begin + most + 1) as usize, logits.len());
            }
        }
        let (text, times) = logits.split_at(begin as usize);
        let max_text = text.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if f64::from(max_text) < log_sum_exp(times) {
            forbid_range(logits, 0, begin as usize);
        }
    }
}

/// `log Σ exp(x)` in f64 (−∞ for an empty or all −∞ row).
fn log_sum_exp(row: &[f32]) -> f64 {
    let top = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if top == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    let top = f64::from(top);
    top + row.iter().map(|&x| (f64::from(x) - top).exp()).sum::<f64>().ln()
}

/// The token picked from `logits` (the rules applied) and its log-probability under them: the
/// first highest at `temperature` 0, else drawn from `softmax(logits / temperature)` with `rng`.
pub fn pick(logits: &[f32], temperature: f32, rng: &mut Rng) -> (u32, f32) {
    let picked = if temperature > 0.0 {
        let scaled: Vec<f32> = logits.iter().map(|&l| l / temperature).collect();
        let norm = log_sum_exp(&scaled);
        let mut target = rng.next_f64();
        let mut chosen = None;
        for (id, &l) in scaled.iter().enumerate() {
            let p = (f64::from(l) - norm).exp();
            if p > 0.0 {
                chosen = Some(id);
                if target < p {
                    break;
                }
                target -= p;
            }
        }
        chosen.unwrap_or_else(|| argmax(logits))
    } else {
        argmax(logits)
    };
    let logprob = f64::from(logits[picked]) - log_sum_exp(logits);
    (picked as u32, logprob as f32)
}

/// The first index of the highest value (as `torch.argmax`).
fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

impl Whisper {
    /// The language token `logits` (the raw row after `<|startoftranscript|>` alone) detect:
    /// the first highest among the language tokens, as `detect_language` picks.
    pub fn detect_language(&self, logits: &[f32]) -> u32 {
        let mut best: Option<(u32, f32)> = None;
        for &(_, _, token) in &self.languages {
            let l = logits.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY);
            if best.is_none_or(|(id, b)| l > b || (l == b && token < id)) {
                best = Some((token, l));
            }
        }
        best.map_or(self.tokens.start, |(token, _)| token)
    }

    /// The probability of `<|nospeech|>` in `logits`, the raw row at a prompt's
    /// `<|startoftranscript|>` (as `WhisperNoSpeechDetection` reads it).
    pub fn no_speech_prob(&self, logits: &[f32]) -> f32 {
        let l = logits
            .get(self.tokens.no_speech as usize)
            .copied()
            .unwrap_or(f32::NEG_INFINITY);
        (f64::from(l) - log_sum_exp(logits)).exp() as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rules over a vocabulary of 20: text 0..9, `eos` 9, `<|notimestamps|>` 10, timestamps 11..20.
    fn rules(timestamps: bool) -> Rules {
        Rules {
            suppress: vec![3],
            begin_suppress: vec![1, 9],
            eos: 9,
            no_timestamps: Some(10),
            timestamp_begin: 11,
            max_initial_timestamp: Some(2),
            timestamps,
        }
    }

    fn allowed(logits: &[f32]) -> Vec<usize> {
        (0..logits.len()).filter(|&i| logits[i] > f32::NEG_INFINITY).collect()
    }

    #[test]
    fn suppressed_tokens_never_and_begin_suppressed_not_first() {
        let r = rules(false);
        let mut first = vec![0.0; 20];
        r.apply(&[], &mut first);
        assert!(!allowed(&first).contains(&1) && !allowed(&first).contains(&9) && !allowed(&first).contains(&3));
        let mut later = vec![0.0; 20];
        r.apply(&[5], &mut later);
        assert_eq!(allowed(&later), (0..20).filter(|&i| i != 3).collect::<Vec<_>>());
    }

    #[test]
    fn the_first_token_is_an_early_timestamp_and_timestamps_come_in_pairs() {
        let r = rules(true);
        let mut first = vec![0.0; 20];
        r.apply(&[], &mut first);
        assert_eq!(allowed(&first), [11, 12, 13], "at most <|0.04|> first");
        // After text then a timestamp: another timestamp (not earlier) or the end.
        let mut closing = vec![0.0; 20];
        closing[9] = 5.0;
        r.apply(&[11, 5, 14], &mut closing);
        assert_eq!(
            allowed(&closing),
            (9..20)
                .filter(|&i| i != 10 && i != 11 && i != 12 && i != 13)
                .collect::<Vec<_>>()
        );
        // After a pair: text only, no timestamps.
        let mut after_pair = vec![0.0; 20];
        r.apply(&[11, 5, 14, 14], &mut after_pair);
        assert_eq!(allowed(&after_pair), [0, 1, 2, 4, 5, 6, 7, 8, 9]);
        // After text: timestamps later than the last one only.
        let mut text = vec![0.0; 20];
        r.apply(&[11, 5, 14, 14, 6], &mut text);
        assert!(
            allowed(&text).iter().all(|i| !(11..=14).contains(i)),
            "{:?}",
            allowed(&text)
        );
    }

    #[test]
    fn timestamps_win_when_together_they_are_likelier_than_any_text() {
        let r = rules(true);
        let mut logits = vec![0.0f32; 20];
        logits[5] = 2.0;
        // Nine timestamps at 0 each sum to log 9 ≈ 2.2 > 2: text is forbidden.
        r.apply(&[11, 5], &mut logits);
        assert!(allowed(&logits).iter().all(|&i| i >= 11), "{:?}", allowed(&logits));
        let mut logits = vec![0.0f32; 20];
        logits[5] = 2.5;
        r.apply(&[11, 5], &mut logits);
        assert!(allowed(&logits).contains(&5));
    }

    #[test]
    fn greedy_takes_the_first_highest_and_sampling_is_seeded() {
        let mut rng = Rng::new(1);
        let logits = [0.5, 2.0, 2.0, f32::NEG_INFINITY];
        let (token, logprob) = pick(&logits, 0.0, &mut rng);
        assert_eq!(token, 1);
        let expected = 2.0 - (0.5f64.exp() + 2.0 * 2.0f64.exp()).ln();
        assert!((f64::from(logprob) - expected).abs() < 1e-6);
        let draws = |seed| {
            let mut rng = Rng::new(seed);
            (0..100).map(|_| pick(&logits, 1.0, &mut rng).0).collect::<Vec<u32>>()
        };
        assert_eq!(draws(7), draws(7));
        assert_ne!(draws(7), draws(8));
        assert!(draws(7).iter().all(|&t| t < 3), "never a forbidden token");
        assert!(draws(7).contains(&0) && draws(7).contains(&2));
    }
}
