//! The log-mel spectrogram Whisper takes, computed as `transformers`' `WhisperFeatureExtractor`
//! computes it (its numpy path): the samples padded with zeros (or cut) to the window's length,
//! a short-time Fourier transform with a periodic Hann window, centred frames with reflected
//! edges, the power spectrum through a Slaney-normalized mel filter bank on the Slaney mel scale,
//! `log10` floored at 1e-10, the last frame dropped, everything below the window's maximum less
//! 8 raised to it, and the result scaled by `(x + 4) / 4`. In f64 throughout, as numpy does.
//!
//! Audio longer than a window is decoded a window at a time from its long-form features (the
//! whole audio's, clamped at its maximum): that maximum is found in one pass over the audio as
//! it is decoded ([`Scan`], holding a frame's samples), then each window's features are
//! computed from its own samples ([`LogMel::window_of`], given the samples it reads:
//! [`Held`]), the same values as cut from the whole, so no transcription holds the whole
//! audio's features (230 MB for two hours) or its samples (460 MB).

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
        let log = self.log_window(Held::whole(samples), self.config.window_samples(), 0);
        let top = log.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        log.iter().map(|&v| clamp(v, top)).collect()
    }

    /// A pass over an audio for its loudest log-mel value, fed its samples as they are decoded.
    pub fn scan(&self) -> Scan<'_> {
        Scan {
            stft: Stft::new(self),
            held: Vec::new(),
            offset: 0,
            next: 0,
            top: f64::NEG_INFINITY,
        }
    }

    /// The loudest log-mel value of the long-form features of `samples`, as a [`Scan`] fed them
    /// finds it.
    pub fn loudest(&self, samples: &[f32]) -> Loudest {
        let mut scan = self.scan();
        scan.push(samples);
        scan.finish().0
    }

    /// The window at frame `seek` of the long-form features of `samples`: [`window_of`](Self::window_of)
    /// the whole audio held.
    pub fn window_long(&self, samples: &[f32], loudest: Loudest, seek: usize) -> Vec<f32> {
        self.window_of(Held::whole(samples), samples.len(), loudest, seek)
    }

    /// The window at frame `seek` of the long-form features of an audio of `samples` samples,
    /// from `held`, which holds every sample the window's frames read
    /// ([`window_reads`](Self::window_reads)): `[bins, frames()]` row-major, everything below
    /// `loudest` (of the whole audio: [`Scan`]) less 8 raised to it, the frames past the
    /// audio's end zeros (as `transformers`' `_get_input_segment` pads a window). The same
    /// values as cutting the features of the whole audio.
    pub fn window_of(&self, held: Held<'_>, samples: usize, loudest: Loudest, seek: usize) -> Vec<f32> {
        let length = self.length_long(samples);
        let frames = self.config.frames();
        let log = self.log_window(held, length, seek);
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

    /// The samples the window at frame `seek` of the long-form features reads: from the first
    /// (its first frame's, reflected edge included) to one past the last.
    pub fn window_reads(&self, seek: usize) -> std::ops::Range<usize> {
        let MelConfig { n_fft, hop, .. } = self.config;
        (seek * hop).saturating_sub(n_fft / 2)..(seek + self.config.frames()) * hop + n_fft
    }

    /// The frames the long-form features of `samples` samples have (at least a window's).
    pub fn frames_long(&self, samples: usize) -> usize {
        self.length_long(samples) / self.config.hop
    }

    /// The length the long-form features pad `samples` samples to: a window at least.
    fn length_long(&self, samples: usize) -> usize {
        samples.max(self.config.window_samples())
    }

    /// The `log10` mel energies of the window of frames from `seek` of the samples `held`
    /// padded with zeros (or cut) to `length`: `[bins, frames()]` row-major, of which the
    /// frames up to the features' last (`length / hop`, the centred transform's last frame
    /// dropped, as the extractor drops it) are computed.
    fn log_window(&self, held: Held<'_>, length: usize, seek: usize) -> Vec<f64> {
        let frames = self.config.frames();
        let mut log = vec![0.0; self.config.bins * frames];
        let mut stft = Stft::new(self);
        for (at, frame) in (seek..(length / self.config.hop).min(seek + frames)).enumerate() {
            for (band, &value) in stft.frame(held, length, frame).iter().enumerate() {
                log[band * frames + at] = value;
            }
        }
        log
    }
}

/// Samples of an audio: those from sample `offset` on, as many as `samples` has. A sample
/// before them is never read (the callers hold what they read); one after them, past the
/// audio's end, is a zero of its padding.
#[derive(Debug, Clone, Copy)]
pub struct Held<'a> {
    /// The samples held.
    pub samples: &'a [f32],
    /// The audio's sample the first of them is.
    pub offset: usize,
}

impl<'a> Held<'a> {
    /// The whole audio.
    pub fn whole(samples: &'a [f32]) -> Held<'a> {
        Held { samples, offset: 0 }
    }

    /// The audio's sample `i`, in f64.
    fn get(self, i: usize) -> f64 {
        debug_assert!(i >= self.offset, "sample {i} read, {} held on", self.offset);
        i.checked_sub(self.offset)
            .and_then(|i| self.samples.get(i))
            .map_or(0.0, |&s| f64::from(s))
    }
}

/// The pass for an audio's loudest log-mel value ([`LogMel::scan`]), as its samples are
/// decoded: each frame is computed once the samples it reads have come ([`push`](Self::push)),
/// the last ones when the audio's length is known ([`finish`](Self::finish)), holding no more
/// than a frame's samples and a packet's. The same frames as the whole audio's features, so the
/// same maximum to the bit.
pub struct Scan<'m> {
    stft: Stft<'m>,
    /// The samples from `offset` on that frames not yet computed read.
    held: Vec<f32>,
    offset: usize,
    /// The first frame not yet computed.
    next: usize,
    top: f64,
}

impl Scan<'_> {
    /// The audio's next `samples`: every frame they complete is computed.
    pub fn push(&mut self, samples: &[f32]) {
        self.held.extend_from_slice(samples);
        let MelConfig { n_fft, hop, .. } = self.stft.mel.config;
        let known = self.offset + self.held.len();
        // A frame reads a transform's length of samples from `frame * hop` less the edge, the
        // first frames' reflected edges within it: one whose last sample has come lies
        // wholly within the audio, whatever its length turns out to be.
        while self.next * hop + n_fft <= known {
            let held = Held {
                samples: &self.held,
                offset: self.offset,
            };
            self.top = self
                .stft
                .frame(held, known, self.next)
                .iter()
                .copied()
                .fold(self.top, f64::max);
            self.next += 1;
        }
        let first = (self.next * hop).saturating_sub(n_fft / 2);
        let done = (first - self.offset).min(self.held.len());
        self.held.drain(..done);
        self.offset += done;
    }

    /// The loudest value, and how many samples the audio had: its last frames computed, now
    /// that its length is known.
    pub fn finish(mut self) -> (Loudest, usize) {
        let samples = self.offset + self.held.len();
        let mel = self.stft.mel;
        let length = mel.length_long(samples);
        let held = Held {
            samples: &self.held,
            offset: self.offset,
        };
        for frame in self.next..length / mel.config.hop {
            self.top = self
                .stft
                .frame(held, length, frame)
                .iter()
                .copied()
                .fold(self.top, f64::max);
        }
        (Loudest(self.top), samples)
    }
}

/// The largest log-mel value of an audio's long-form features, which all of its windows are
/// clamped by ([`Scan`]).
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

/// The short-time Fourier transform, a frame at a time: its buffers made once, each frame's
/// samples read where they are held (the reflected edges by index), so no copy of them is made.
struct Stft<'m> {
    mel: &'m LogMel,
    input: Vec<f64>,
    spectrum: Vec<Complex<f64>>,
    scratch: Vec<Complex<f64>>,
    power: Vec<f64>,
    log: Vec<f64>,
}

impl<'m> Stft<'m> {
    fn new(mel: &'m LogMel) -> Stft<'m> {
        let spectrum = mel.fft.make_output_vec();
        Stft {
            mel,
            input: mel.fft.make_input_vec(),
            power: vec![0.0; spectrum.len()],
            spectrum,
            scratch: mel.fft.make_scratch_vec(),
            log: vec![0.0; mel.config.bins],
        }
    }

    /// The `log10` energy (floored) of each mel band in `frame`, centred at `frame * hop`, of
    /// the audio whose samples `held` holds, padded with zeros (or cut) to `length`.
    fn frame(&mut self, held: Held<'_>, length: usize, frame: usize) -> &[f64] {
        let MelConfig { n_fft, hop, .. } = self.mel.config;
        let start = frame * hop;
        for (i, (slot, w)) in self.input.iter_mut().zip(&self.mel.window).enumerate() {
            *slot = reflected(held, length, n_fft / 2, start + i) * w;
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

/// Sample `at` of the audio `held` holds, padded with zeros or cut to `length`, then with
/// `edge` samples reflected at each end (numpy's `pad(mode="reflect")`, the edge sample itself
/// not repeated), in f64.
fn reflected(held: Held<'_>, length: usize, edge: usize, at: usize) -> f64 {
    let i = if at < edge {
        edge - at
    } else if at < edge + length {
        at - edge
    } else {
        2 * length + edge - 2 - at
    };
    held.get(i)
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
                .map(|at| reflected(Held::whole(samples), length, edge, at))
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
    fn the_scan_finds_the_loudest_frame_however_the_audio_comes() {
        let mel = LogMel::new(MelConfig::WHISPER).unwrap();
        // 40 s of a tone whose loudness changes every second: its loudest frame is anywhere.
        let audio: Vec<f32> = (0..40 * 16_000)
            .map(|i| {
                let loudness = ((i / 16_000) * 7 % 11) as f32 / 20.0;
                (2.0 * std::f32::consts::PI * 440.0 * i as f32 / 16_000.0).sin() * loudness
            })
            .collect();
        // The whole audio's features, computed as the extractor does: every frame at once, of
        // the audio padded to a window at least.
        let whole = |audio: &[f32]| {
            let length = mel.length_long(audio.len());
            let mut stft = Stft::new(&mel);
            let top = (0..length / 160)
                .map(|frame| {
                    let log = stft.frame(Held::whole(audio), length, frame);
                    log.iter().copied().fold(f64::NEG_INFINITY, f64::max)
                })
                .fold(f64::NEG_INFINITY, f64::max);
            (Loudest(top), audio.len())
        };
        // A frame's samples (400, from 200 before its start) and a piece's are held, never more.
        let pieces = |audio: &[f32], piece: usize| {
            let mut scan = mel.scan();
            for samples in audio.chunks(piece) {
                scan.push(samples);
                assert!(scan.held.len() < 600 + piece, "{piece}: {} held", scan.held.len());
            }
            scan.finish()
        };
        for piece in [1, 199, 1152, 16_000, audio.len()] {
            assert_eq!(pieces(&audio, piece), whole(&audio), "in pieces of {piece}");
        }
        // Shorter than the transform, and shorter than a window: the padding is read too.
        for short in [&audio[..100], &audio[16_000..16_000 * 5]] {
            assert_eq!(pieces(short, 64), whole(short));
        }
    }

    #[test]
    fn long_windows_are_cut_from_the_whole_audio_under_one_clamp() {
        let mel = LogMel::new(MelConfig::WHISPER).unwrap();
        let short: Vec<f32> = (0..16_000).map(|i| ((i % 50) as f32 / 50.0) - 0.5).collect();
        assert_eq!(
            mel.window_long(&short, mel.loudest(&short), 0),
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
        let loudest = mel.loudest(&long);
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
