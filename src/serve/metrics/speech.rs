//! The speech family: seconds of audio each speech model transcribed or translated, and how
//! long each took per second of audio (its real-time factor), by model and the pool that ran
//! it: whether voice keeps up with speech on a shared accelerator.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::core::metrics::ModelPoolLabels;

/// The speech family.
#[derive(Debug)]
pub struct SpeechMetrics {
    /// `vramguard_audio_seconds_total`
    pub seconds: Family<ModelPoolLabels, Counter<f64>>,
    /// `vramguard_audio_real_time_factor`
    pub real_time: Family<ModelPoolLabels, Histogram>,
    /// The same counts by model and pool, as `/status` reads them (the client library reads a
    /// histogram's sum and count back only in its own tests).
    totals: Mutex<BTreeMap<(String, String), SpeechTotals>>,
}

impl Default for SpeechMetrics {
    fn default() -> Self {
        SpeechMetrics {
            seconds: Family::default(),
            // 0.005 .. ~10 seconds of processing per second of audio, doubling: a GPU
            // transcribes a window in a fraction of its length; above 1 the model falls behind
            // a live speaker.
            real_time: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.005, 2.0, 12))),
            totals: Mutex::default(),
        }
    }
}

impl SpeechMetrics {
    /// Register under `registry` (prefixed `vramguard`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "audio_seconds",
            "Seconds of audio transcribed or translated, by model and the pool that ran its last window",
            self.seconds.clone(),
        );
        registry.register(
            "audio_real_time_factor",
            "Seconds from a transcription's arrival to its answer per second of its audio (below 1: faster than it was spoken), by model and the pool that ran its last window",
            self.real_time.clone(),
        );
    }

    /// Count a transcription of `audio_seconds` that took `elapsed_seconds`, answered by `pool`.
    pub fn transcribed(&self, model: &str, pool: &str, audio_seconds: f64, elapsed_seconds: f64) {
        let labels = ModelPoolLabels {
            model: model.to_string(),
            pool: pool.to_string(),
        };
        self.seconds.get_or_create(&labels).inc_by(audio_seconds);
        let mut totals = self.totals.lock().unwrap_or_else(PoisonError::into_inner);
        let totals = totals.entry((labels.model.clone(), labels.pool.clone())).or_default();
        totals.audio_seconds += audio_seconds;
        if audio_seconds > 0.0 {
            let factor = elapsed_seconds / audio_seconds;
            self.real_time.get_or_create(&labels).observe(factor);
            totals.transcriptions += 1;
            totals.real_time_factor_sum += factor;
        }
    }

    /// What has been counted of `model` on `pool` (zeros before its first transcription).
    pub fn totals(&self, model: &str, pool: &str) -> SpeechTotals {
        let totals = self.totals.lock().unwrap_or_else(PoisonError::into_inner);
        totals
            .get(&(model.to_string(), pool.to_string()))
            .copied()
            .unwrap_or_default()
    }

    /// The series of speech model `model` on `pool`, at 0 from the first scrape.
    pub fn serving(&self, model: &str, pool: &str) {
        let labels = ModelPoolLabels {
            model: model.to_string(),
            pool: pool.to_string(),
        };
        let _ = self.seconds.get_or_create(&labels);
        let _ = self.real_time.get_or_create(&labels);
    }
}

/// What the speech family has counted of one model on one pool.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SpeechTotals {
    /// `vramguard_audio_seconds_total`.
    pub audio_seconds: f64,
    /// Transcriptions with audio: `vramguard_audio_real_time_factor`'s count.
    pub transcriptions: u64,
    /// The sum of their real-time factors: the histogram's sum.
    pub real_time_factor_sum: f64,
}

impl SpeechTotals {
    /// The mean real-time factor of the transcriptions counted; `None` before the first.
    pub fn mean_real_time_factor(&self) -> Option<f64> {
        (self.transcriptions > 0).then(|| self.real_time_factor_sum / self.transcriptions as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_read_back_what_was_counted_and_the_mean_real_time_factor() {
        let metrics = SpeechMetrics::default();
        metrics.serving("whisper", "gpu");
        assert_eq!(metrics.totals("whisper", "gpu"), SpeechTotals::default());
        assert_eq!(metrics.totals("whisper", "gpu").mean_real_time_factor(), None);
        metrics.transcribed("whisper", "gpu", 75.0, 1.5);
        metrics.transcribed("whisper", "gpu", 30.0, 1.5);
        metrics.transcribed("whisper", "cpu", 10.0, 5.0);
        let gpu = metrics.totals("whisper", "gpu");
        assert_eq!((gpu.audio_seconds, gpu.transcriptions), (105.0, 2));
        assert!((gpu.mean_real_time_factor().unwrap() - (0.02 + 0.05) / 2.0).abs() < 1e-12);
        assert_eq!(metrics.totals("whisper", "cpu").mean_real_time_factor(), Some(0.5));
        assert_eq!(metrics.totals("other", "gpu"), SpeechTotals::default());
    }
}
