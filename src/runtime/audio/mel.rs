//! The log-mel spectrogram Whisper takes, computed as `transformers`' `WhisperFeatureExtractor`
//! computes it (its numpy path): the samples padded with zeros (or cut) to the window's length,
//! a short-time Fourier transform with a periodic Hann window, centred frames with reflected
//! edges, the power spectrum through a Slaney-normalized mel filter bank on the Slaney mel scale,
//! `log10` floored at 1e-10, the last frame dropped, everything below the window's maximum less
//! 8 raised to it, and the result scaled by `(x + 4) / 4`. In f64 throughout, as numpy does.
//!
//! Audio longer than a window is decoded a window at a time from its long-form features (the
//! whole audio's, clamped at its maximum): that maximum is found in one pass over the audio
//! ([`LogMel::loudest`]), then each window's features are computed from its own samples
//! ([`LogMel::window_long`]), the same values as cut from the whole, so two hours of audio
//! never have their features (230 MB) or an f64 copy of their samples held at once.

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
    /// row-major, the samples padded with zeros (or cut) to the window's length first, and
    /// clamped at the window's own maximum.
    pub fn features(&self, samples: &[f32]) -> Vec<f32> {
        let log = self.log_window(samples, self.config.window_samples(), 0);
        let top = log.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        log.iter().map(|&v| clamp(v, top)).collect()
    }

    /// The loudest log-mel value of the long-form features of `samples` (as the extractor
    /// gives them for long-form decoding, `padding="longest", truncation=False`: audio of no
    /// more than one window padded to one): what every window of
    /// [`window_long`](Self::window_long) is clamped by. A pass over the whole audio, a frame
    /// at a time, holding nothing but the frame. It stops early, with the loudest of the frames
    /// it read, once `stopped` says so (asked every [`FRAMES_BETWEEN_STOPS`]): for a caller that
    /// has gone, so that two hours of audio are not read for nobody.
    pub fn loudest(&self, samples: &[f32], stopped: &dyn Fn() -> bool) -> Loudest {
        let length = self.length_long(samples.len());
        let mut stft = Stft::new(self, samples, length);
        let top = (0..length / self.config.hop)
            .take_while(|frame| frame % FRAMES_BETWEEN_STOPS != 0 || !stopped())
            .map(|frame| stft.frame(frame).iter().copied().fold(f64::NEG_INFINITY, f64::max))
            .fold(f64::NEG_INFINITY, f64::max);
        Loudest(top)
    }

    /// The window at frame `seek` of the long-form features of `samples`: `[bins, frames()]`
    /// row-major, everything below `loudest` (of [`loudest`](Self::loudest)) less 8 raised to
    /// it, the frames past the audio's end zeros (as `transformers`' `_get_input_segment`
    /// pads a window). The same values as cutting the features of the whole audio, computed
    /// from the window's samples alone, so no transcription holds more than a window of them.
    pub fn window_long(&self, samples: &[f32], loudest: Loudest, seek: usize) -> Vec<f32> {
        let length = self.length_long(samples.len());
        let frames = self.config.frames();
        let log = self.log_window(samples, length, seek);
        // A row's frames past the audio's are zeros.
        let taken = (length / self.config.hop).saturating_sub(seek).min(frames);
        log.chunks(frames)
            .flat_map(|row| {
                let (audio, past) = row.split_at(taken);
                audio
                    .iter()
                    .map(|&v| clamp(v, loudest.0))
                    .chain(past.iter().map(|_| 0.0))
            })
            .collect()
    }

    /// The frames the long-form features of `samples` samples have (at least a window's).
    pub fn frames_long(&self, samples: usize) -> usize {
        self.length_long(samples) / self.config.hop
    }

    /// The length the long-form features pad `samples` samples to: a window at least.
    fn length_long(&self, samples: usize) -> usize {
        samples.max(self.config.window_samples())
    }

    /// The `log10` mel energies of the window of frames from `seek` of `samples` padded with
    /// zeros (or cut) to `length`: `[bins, frames()]` row-major, of which the frames up to the
    /// features' last (`length / hop`, the centred transform's last frame dropped, as the
    /// extractor drops it) are computed.
    fn log_window(&self, samples: &[f32], length: usize, seek: usize) -> Vec<f64> {
        let frames = self.config.frames();
        let mut log = vec![0.0; self.config.bins * frames];
        let mut stft = Stft::new(self, samples, length);
        for (at, frame) in (seek..(length / self.config.hop).min(seek + frames)).enumerate() {
            for (band, &value) in stft.frame(frame).iter().enumerate() {
                log[band * frames + at] = value;
            }
        }
        log
    }
}

/// How many frames [`LogMel::loudest`] reads between asking whether to stop: 10 s of audio at
/// Whisper's 10 ms hop, milliseconds of CPU.
pub const FRAMES_BETWEEN_STOPS: usize = 1000;

/// The largest log-mel value of an audio's long-form features, which all of its windows are
/// clamped by ([`LogMel::loudest`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Loudest(f64);

impl Loudest {
    /// The largest feature the audio's windows hold (its log-mel value scaled as every feature
    /// is), as the extractor's features of the whole audio have it.
    pub fn feature(self) -> f32 {
        clamp(self.0, self.0)
    }
}

/// A `log10` energy as a feature: raised to `top` less 8 when below it, scaled by
/// `(x + 4) / 4`.
fn clamp(log: f64, top: f64) -> f32 {
    ((log.max(top - 8.0) + 4.0) / 4.0) as f32
}

/// The short-time Fourier transform of one audio, a frame at a time: its buffers made once,
/// each frame's samples read where they lie (the reflected edges by index), so no copy of the
/// audio is made.
struct Stft<'a> {
    mel: &'a LogMel,
    samples: &'a [f32],
    length: usize,
    input: Vec<f64>,
    spectrum: Vec<Complex<f64>>,
    scratch: Vec<Complex<f64>>,
    power: Vec<f64>,
    log: Vec<f64>,
}

impl<'a> Stft<'a> {
    /// The transform of `samples` padded with zeros (or cut) to `length`.
    fn new(mel: &'a LogMel, samples: &'a [f32], length: usize) -> Stft<'a> {
        let spectrum = mel.fft.make_output_vec();
        Stft {
            mel,
            samples,
            length,
            input: mel.fft.make_input_vec(),
            power: vec![0.0; spectrum.len()],
            spectrum,
            scratch: mel.fft.make_scratch_vec(),
            log: vec![0.0; mel.config.bins],
        }
    }

    /// The `log10` energy (floored) of each mel band in `frame`, centred at `frame * hop`.
    fn frame(&mut self, frame: usize) -> &[f64] {
        let MelConfig { n_fft, hop, .. } = self.mel.config;
        let start = frame * hop;
        for (i, (slot, w)) in self.input.iter_mut().zip(&self.mel.window).enumerate() {
            *slot = reflected(self.samples, self.length, n_fft / 2, start + i) * w;
        }
        self.mel
            .fft
            .process_with_scratch(&mut self.input, &mut self.spectrum, &mut self.scratch)
            .expect("buffers made by the plan");
        for (p, c) in self.power.iter_mut().zip(&self.spectrum) {
            *p = c.norm_sqr();
        }
        for (slot, filter) in self.log.iter_mut().zip(&self.mel.bands) {
            let energy: f64 = filter
                .weights
                .iter()
                .zip(&self.power[filter.first..])
                .map(|(w, p)| w * p)
                .sum();
            *slot = energy.max(MEL_FLOOR).log10();
        }
        &self.log
    }
}

/// Sample `at` of `samples` padded with zeros or cut to `length`, then with `edge` samples
/// reflected at each end (numpy's `pad(mode="reflect")`, the edge sample itself not
/// repeated), in f64.
fn reflected(samples: &[f32], length: usize, edge: usize, at: usize) -> f64 {
    let i = if at < edge {
        edge - at
    } else if at < edge + length {
        at - edge
    } else {
        2 * length + edge - 2 - at
    };
    samples.get(i).map_or(0.0, |&s| f64::from(s))
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
        let read = |samples: &[f32], length: usize, edge: usize| -> Vec<f64> {
            (0..length + 2 * edge)
                .map(|at| reflected(samples, length, edge, at))
                .collect()
        };
        assert_eq!(
            read(&[1.0, 2.0, 3.0], 5, 2),
            [3.0, 2.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 3.0]
        );
        assert_eq!(read(&[1.0, 2.0, 3.0, 4.0], 3, 1), [2.0, 1.0, 2.0, 3.0, 2.0]);
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
    fn the_pass_for_the_loudest_stops_when_asked_at_the_next_ten_seconds() {
        let mel = LogMel::new(MelConfig::WHISPER).unwrap();
        // 30 s: faint for the first 15, loud after.
        let audio: Vec<f32> = (0..30 * 16_000)
            .map(|i| {
                let loudness = if i < 15 * 16_000 { 1e-4 } else { 0.5 };
                (2.0 * std::f32::consts::PI * 440.0 * i as f32 / 16_000.0).sin() * loudness
            })
            .collect();
        let whole = mel.loudest(&audio, &|| false).feature();
        let asked = std::cell::Cell::new(0);
        // Gone at the second question: the first 10 s were read, all of them faint.
        let stopped = || {
            asked.set(asked.get() + 1);
            asked.get() > 1
        };
        let first = mel.loudest(&audio, &stopped).feature();
        assert_eq!(asked.get(), 2, "asked at frames 0 and {FRAMES_BETWEEN_STOPS}");
        assert!(
            first < whole - 1.0,
            "the faint part's {first} is below the whole's {whole}"
        );
        assert_eq!(mel.loudest(&audio, &|| true).feature(), f32::NEG_INFINITY, "none read");
    }

    #[test]
    fn long_windows_are_cut_from_the_whole_audio_under_one_clamp() {
        let mel = LogMel::new(MelConfig::WHISPER).unwrap();
        let short: Vec<f32> = (0..16_000).map(|i| ((i % 50) as f32 / 50.0) - 0.5).collect();
        assert_eq!(
            mel.window_long(&short, mel.loudest(&short, &|| false), 0),
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
        assert_eq!(mel.frames_long(long.len()), 4500);
        let loudest = mel.loudest(&long, &|| false);
        let (first, second) = (
            mel.window_long(&long, loudest, 0),
            mel.window_long(&long, loudest, 1234),
        );
        assert_eq!((first.len(), second.len()), (80 * 3000, 80 * 3000));
        // The faint part's floor is the loud second's maximum less 8, not its own.
        let top = first.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(top, loudest.feature());
        let floor = second.iter().copied().fold(f32::INFINITY, f32::min);
        assert!(
            (top - floor - 2.0).abs() < 1e-5,
            "(max - 8 + 4) / 4 below (max + 4) / 4: {top} {floor}"
        );
        assert!(
            second.iter().all(|&v| v == floor),
            "the faint tone is under the global floor"
        );
        // Windows that overlap agree where they do, band by band: each frame is computed from
        // its own samples wherever its window starts.
        for band in [0, 17, 79] {
            assert_eq!(
                first[band * 3000 + 1234..band * 3000 + 3000],
                second[band * 3000..band * 3000 + 1766]
            );
        }
        // The first window alone is clamped at its own maximum, which is the same.
        assert_eq!(first[..100], mel.features(&long[..16_000 * 30])[..100]);
        // The last window holds the audio's last 500 frames, then zeros, as a cut window is padded.
        let last = mel.window_long(&long, loudest, 4000);
        for band in [0, 79] {
            let row = &last[band * 3000..(band + 1) * 3000];
            assert!(row[..500].iter().all(|&v| v == floor), "band {band}");
            assert!(row[500..].iter().all(|&v| v == 0.0), "band {band}");
        }
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
