//! The log-mel spectrogram Whisper takes, computed as `transformers`' `WhisperFeatureExtractor`
//! computes it (its numpy path): the samples padded with zeros (or cut) to the window's length,
//! a short-time Fourier transform with a periodic Hann window, centred frames with reflected
//! edges, the power spectrum through a Slaney-normalized mel filter bank on the Slaney mel scale,
//! `log10` floored at 1e-10, the last frame dropped, everything below the window's maximum less
//! 8 raised to it, and the result scaled by `(x + 4) / 4`. In f64 throughout, as numpy does.

use std::sync::Arc;

use realfft::num_complex::Complex;
use realfft::{RealFftPlanner, RealToComplex};

/// A mel filter bank's largest frequency, Hz: Whisper's (`max_frequency=8000.0`).
const MAX_FREQUENCY: f64 = 8000.0;
/// The floor under a mel band's power before its logarithm.
const MEL_FLOOR: f64 = 1e-10;

/// What a speech model's `preprocessor_config.json` says of its features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MelConfig {
    /// Mel bands (`feature_size`: 80, or 128 for large-v3).
    pub bins: usize,
    /// The Fourier transform's length (`n_fft`).
    pub n_fft: usize,
    /// Samples between frames (`hop_length`).
    pub hop: usize,
    /// Samples per second (`sampling_rate`).
    pub rate: u32,
    /// Seconds in one window (`chunk_length`).
    pub chunk_seconds: u32,
}

impl MelConfig {
    /// Whisper's: 80 bands, 400-sample transforms every 160 samples of 16 kHz audio, 30 s windows.
    pub const WHISPER: MelConfig = MelConfig {
        bins: 80,
        n_fft: 400,
        hop: 160,
        rate: 16_000,
        chunk_seconds: 30,
    };

    /// Samples in one window.
    pub fn window_samples(&self) -> usize {
        self.rate as usize * self.chunk_seconds as usize
    }

    /// Frames in one window's features (3,000 for Whisper).
    pub fn frames(&self) -> usize {
        self.window_samples() / self.hop
    }
}

/// One mel band: the first frequency bin it weighs and its weights from there.
#[derive(Debug, Clone)]
struct Band {
    first: usize,
    weights: Vec<f64>,
}

/// The log-mel front end of one configuration: its window, transform and filter bank, made once.
pub struct LogMel {
    config: MelConfig,
    window: Vec<f64>,
    fft: Arc<dyn RealToComplex<f64>>,
    bands: Vec<Band>,
}

impl std::fmt::Debug for LogMel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogMel")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl LogMel {
    /// The front end of `config`, or why it cannot be made (a transform shorter than a hop, a
    /// rate whose Nyquist frequency is under the filter bank's top).
    pub fn new(config: MelConfig) -> Result<LogMel, String> {
        if config.n_fft < 2 || config.hop == 0 || config.bins == 0 || config.chunk_seconds == 0 {
            return Err(format!("features of {config:?} cannot be computed"));
        }
        if f64::from(config.rate) / 2.0 < MAX_FREQUENCY {
            return Err(format!(
                "a sampling rate of {} Hz cannot hold the mel filters' {MAX_FREQUENCY} Hz",
                config.rate
            ));
        }
        let n = config.n_fft;
        // numpy's periodic Hann window (`window_function(n_fft, "hann")`).
        let window = (0..n)
            .map(|i| 0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / n as f64).cos())
            .collect();
        Ok(LogMel {
            config,
            window,
            fft: RealFftPlanner::<f64>::new().plan_fft_forward(n),
            bands: bands(config),
        })
    }

    /// Its configuration.
    pub fn config(&self) -> MelConfig {
        self.config
    }

    /// The features of one window of mono `samples` at the configured rate: `[bins, frames]`
    /// row-major, the samples padded with zeros (or cut) to the window's length first.
    pub fn features(&self, samples: &[f32]) -> Vec<f32> {
        self.features_of(samples, self.config.window_samples())
    }

    /// The features of the whole of `samples`, as the extractor gives them for long-form
    /// decoding (`padding="longest", truncation=False`): `[bins, samples / hop]` row-major,
    /// nothing padded or cut, everything below the maximum of the whole audio less 8 raised
    /// to it. Audio of no more than one window gets [`features`](Self::features)' window, as
    /// its decoding takes one padded window.
    pub fn features_long(&self, samples: &[f32]) -> Vec<f32> {
        if samples.len() <= self.config.window_samples() {
            return self.features(samples);
        }
        self.features_of(samples, samples.len())
    }

    /// The frames [`features_long`](Self::features_long) gives for `samples` samples.
    pub fn frames_long(&self, samples: usize) -> usize {
        samples.max(self.config.window_samples()) / self.config.hop
    }

    /// The features of `samples` padded with zeros (or cut) to `length`: `length / hop`
    /// frames (the centred transform's last frame dropped, as the extractor drops it).
    fn features_of(&self, samples: &[f32], length: usize) -> Vec<f32> {
        let MelConfig { bins, n_fft, hop, .. } = self.config;
        let frames = length / hop;
        let padded = reflect_padded(samples, length, n_fft / 2);
        let mut input = self.fft.make_input_vec();
        let mut spectrum: Vec<Complex<f64>> = self.fft.make_output_vec();
        let mut scratch = self.fft.make_scratch_vec();
        let mut power = vec![0.0f64; spectrum.len()];
        let mut log = vec![0.0f64; bins * frames];
        for frame in 0..frames {
            let start = frame * hop;
            for (slot, (x, w)) in input
                .iter_mut()
                .zip(padded[start..start + n_fft].iter().zip(&self.window))
            {
                *slot = x * w;
            }
            self.fft
                .process_with_scratch(&mut input, &mut spectrum, &mut scratch)
                .expect("buffers made by the plan");
            for (p, c) in power.iter_mut().zip(&spectrum) {
                *p = c.norm_sqr();
            }
            for (band, filter) in self.bands.iter().enumerate() {
                let energy: f64 = filter
                    .weights
                    .iter()
                    .zip(&power[filter.first..])
                    .map(|(w, p)| w * p)
                    .sum();
                log[band * frames + frame] = energy.max(MEL_FLOOR).log10();
            }
        }
        let top = log.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        log.iter().map(|&v| ((v.max(top - 8.0) + 4.0) / 4.0) as f32).collect()
    }
}

/// `samples` padded with zeros or cut to `length`, then with `edge` samples reflected at each
/// end (numpy's `pad(mode="reflect")`, the edge sample itself not repeated), in f64.
fn reflect_padded(samples: &[f32], length: usize, edge: usize) -> Vec<f64> {
    let mut body: Vec<f64> = samples.iter().take(length).map(|&s| f64::from(s)).collect();
    body.resize(length, 0.0);
    let mut out = Vec::with_capacity(length + 2 * edge);
    out.extend((1..=edge).rev().map(|i| body[i]));
    out.extend_from_slice(&body);
    out.extend((1..=edge).map(|i| body[length - 1 - i]));
    out
}

/// Hz to mels on the Slaney scale: linear below 1 kHz, logarithmic above.
fn hz_to_mel(hz: f64) -> f64 {
    let (f_sp, min_log_hz) = (200.0 / 3.0, 1000.0);
    let min_log_mel = min_log_hz / f_sp;
    let step = 6.4f64.ln() / 27.0;
    if hz >= min_log_hz {
        min_log_mel + (hz / min_log_hz).ln() / step
    } else {
        hz / f_sp
    }
}

/// Mels on the Slaney scale back to Hz.
fn mel_to_hz(mel: f64) -> f64 {
    let (f_sp, min_log_hz) = (200.0 / 3.0, 1000.0);
    let min_log_mel = min_log_hz / f_sp;
    let step = 6.4f64.ln() / 27.0;
    if mel >= min_log_mel {
        min_log_hz * ((mel - min_log_mel) * step).exp()
    } else {
        mel * f_sp
    }
}

/// The triangular filters, each scaled to unit area (Slaney's normalization), evenly spaced on
/// the mel scale from 0 Hz to [`MAX_FREQUENCY`], over the transform's frequency bins.
fn bands(config: MelConfig) -> Vec<Band> {
    let bins_in = config.n_fft / 2 + 1;
    let nyquist = f64::from(config.rate / 2);
    let fft_hz: Vec<f64> = (0..bins_in)
        .map(|i| nyquist * i as f64 / (bins_in - 1) as f64)
        .collect();
    let (low, high) = (hz_to_mel(0.0), hz_to_mel(MAX_FREQUENCY));
    let edges: Vec<f64> = (0..config.bins + 2)
        .map(|i| mel_to_hz(low + (high - low) * i as f64 / (config.bins + 1) as f64))
        .collect();
    (0..config.bins)
        .map(|m| {
            let (left, centre, right) = (edges[m], edges[m + 1], edges[m + 2]);
            let norm = 2.0 / (right - left);
            let weights: Vec<f64> = fft_hz
                .iter()
                .map(|&f| {
                    let down = (f - left) / (centre - left);
                    let up = (right - f) / (right - centre);
                    down.min(up).max(0.0) * norm
                })
                .collect();
            let first = weights.iter().position(|&w| w > 0.0).unwrap_or(0);
            let last = weights.iter().rposition(|&w| w > 0.0).map_or(first, |i| i + 1);
            Band {
                first,
                weights: weights[first..last].to_vec(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slaney_scale_is_linear_below_1_khz_and_round_trips() {
        assert!((hz_to_mel(500.0) - 7.5).abs() < 1e-12);
        assert!((hz_to_mel(1000.0) - 15.0).abs() < 1e-12);
        for hz in [0.0, 200.0, 999.0, 1000.0, 4000.0, 8000.0] {
            assert!((mel_to_hz(hz_to_mel(hz)) - hz).abs() < 1e-9, "{hz}");
        }
    }

    #[test]
    fn reflection_leaves_the_edge_sample_out_and_pads_with_zeros_first() {
        let padded = reflect_padded(&[1.0, 2.0, 3.0], 5, 2);
        assert_eq!(padded, [3.0, 2.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 3.0]);
        assert_eq!(reflect_padded(&[1.0, 2.0, 3.0, 4.0], 3, 1), [2.0, 1.0, 2.0, 3.0, 2.0]);
    }

    #[test]
    fn silence_is_one_value_and_a_tone_lights_its_band() {
        let mel = LogMel::new(MelConfig::WHISPER).unwrap();
        let silent = mel.features(&[]);
        assert_eq!(silent.len(), 80 * 3000);
        assert!(silent.iter().all(|&v| v == silent[0]));
        // A 440 Hz tone for one second: the band holding 440 Hz is the loudest in its frames.
        let tone: Vec<f32> = (0..16_000)
            .map(|i| (2.0 * std::f32::consts::PI * 440.0 * i as f32 / 16_000.0).sin() * 0.5)
            .collect();
        let features = mel.features(&tone);
        let features = &features;
        let column = |frame: usize| (0..80).map(move |band| features[band * 3000 + frame]);
        let loudest = column(50).enumerate().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0;
        let band = &mel.bands[loudest];
        let (low, high) = (
            band.first as f64 * 40.0,
            (band.first + band.weights.len()) as f64 * 40.0,
        );
        assert!((low..=high).contains(&440.0), "band {loudest} spans {low}..{high} Hz");
        assert!(column(2000).all(|v| v == features[2999]), "past the tone: padding only");
    }

    #[test]
    fn long_features_cover_the_whole_audio_under_one_clamp() {
        let mel = LogMel::new(MelConfig::WHISPER).unwrap();
        let short: Vec<f32> = (0..16_000).map(|i| ((i % 50) as f32 / 50.0) - 0.5).collect();
        assert_eq!(
            mel.features_long(&short),
            mel.features(&short),
            "one window or less: the window"
        );
        // 45 s: a loud tone for the first second, then a faint one.
        let long: Vec<f32> = (0..45 * 16_000)
            .map(|i| {
                let loudness = if i < 16_000 { 0.5 } else { 1e-6 };
                (2.0 * std::f32::consts::PI * 440.0 * i as f32 / 16_000.0).sin() * loudness
            })
            .collect();
        let features = mel.features_long(&long);
        let frames = mel.frames_long(long.len());
        assert_eq!(frames, 4500);
        assert_eq!(features.len(), 80 * frames);
        // The faint part's floor is the loud second's maximum less 8, not its own.
        let top = features.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let floor = features.iter().copied().fold(f32::INFINITY, f32::min);
        assert!(
            (top - floor - 2.0).abs() < 1e-5,
            "(max - 8 + 4) / 4 below (max + 4) / 4: {top} {floor}"
        );
        let second_window = &features[4000..4100];
        assert!(
            second_window.iter().all(|&v| v == floor),
            "the faint tone is under the global floor"
        );
        // The same samples' first window alone is clamped at its own maximum, which is the same.
        assert_eq!(features[..100], mel.features(&long[..16_000 * 30])[..100]);
    }

    #[test]
    fn a_rate_too_low_for_the_filters_is_refused() {
        let config = MelConfig {
            rate: 8000,
            ..MelConfig::WHISPER
        };
        assert!(LogMel::new(config).unwrap_err().contains("8000 Hz"));
    }
}
