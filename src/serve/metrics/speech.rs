//! The speech family: seconds of audio each speech model transcribed or translated, and how
//! long each took per second of audio (its real-time factor), by model and the pool that ran
//! it: whether voice keeps up with speech on a shared accelerator.

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
}

impl Default for SpeechMetrics {
    fn default() -> Self {
        SpeechMetrics {
            seconds: Family::default(),
            // 0.005 .. ~10 seconds of processing per second of audio, doubling: a GPU
            // transcribes a window in a fraction of its length; above 1 the model falls behind
            // a live speaker.
            real_time: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.005, 2.0, 12))),
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
        if audio_seconds > 0.0 {
            self.real_time
                .get_or_create(&labels)
                .observe(elapsed_seconds / audio_seconds);
        }
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
