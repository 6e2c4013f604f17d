//! Audio for speech models: a file as clients send it (WAV, FLAC, MP3, Ogg Vorbis or Opus,
//! WebM or Matroska with Opus or Vorbis, as browsers record, MP4 or M4A with AAC, as phones and
//! Safari record, its boxes checked before they are read, `mp4.rs`; at any sample rate in
//! [`RATES`] and any channel count) decoded a packet at a time (`source.rs`), its channels mixed
//! to one, and resampled as it is decoded to the rate the model's features are computed at
//! (`resample.rs`), as a [`Stream`]; the log-mel spectrogram Whisper's feature extractor makes
//! of those samples (`mel.rs`); and a long file's features a window at a time, its samples
//! never held whole (`features.rs`).
//!
//! Everything a client can send is bounded before it costs memory: the rate is checked before
//! any sample is decoded, the decoded length as the packets come, so a file claiming hours
//! stops at the limit, not at the end of memory; a decoder that panics on a forged file is a
//! refusal, not a lost connection; and a decoding whose client has gone stops at its next
//! packet.

mod features;
pub mod mel;
mod mp4;
mod resample;
mod source;

use std::ops::RangeInclusive;
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::core::human::panic_message;
pub use features::Features;
use resample::Resample;
use source::Source;

/// The sample rates a file may have, Hz: from telephony's 8 kHz (the lowest rate that carries
/// speech's band) to 384 kHz (the highest that recorders and interfaces write; Opus is always
/// 48 kHz, AAC at most 96 kHz, FLAC as written by its encoders at most 384 kHz). A rate outside
/// is only a forged or broken header; the resampler's cost grows with the rate's prime
/// factors (`resample.rs`), so it never sees one.
pub const RATES: RangeInclusive<u32> = 8_000..=384_000;

/// Why a file gives no audio: each names what is wrong, for the client's 400.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AudioError {
    /// Not a container served here.
    #[error("the file is not WAV, FLAC, MP3, Ogg, WebM or MP4 audio ({0})")]
    Format(String),
    /// A container with no track a decoder here reads.
    #[error("the file has no audio track in a codec served here (PCM, FLAC, MP3, Vorbis, Opus, AAC): {0}")]
    Codec(String),
    /// A sample rate outside [`RATES`].
    #[error("the file's sample rate is {0} Hz: rates from 8000 to 384000 Hz are served")]
    Rate(u32),
    /// The stream breaks off or is damaged where nothing could be decoded.
    #[error("the audio could not be decoded: {0}")]
    Corrupt(String),
    /// No samples at all.
    #[error("the file holds no audio samples")]
    Empty,
    /// Longer than the server takes.
    #[error("the audio is longer than the limit of {limit_seconds} s")]
    TooLong {
        /// The limit.
        limit_seconds: u64,
    },
    /// Stopped before its end: whoever asked for it no longer waits.
    #[error("the decoding was stopped: its request went away")]
    Stopped,
}

/// The mono samples of the audio file `bytes` at `rate` samples per second, at most
/// `limit_seconds` of them, all at once: for a clip, and for tests and references; a
/// transcription reads its file through [`Stream`] (`features.rs`).
pub fn decode(bytes: Vec<u8>, rate: u32, limit_seconds: u64) -> Result<Vec<f32>, AudioError> {
    let mut stream = Stream::open(bytes, rate, limit_seconds)?;
    let mut samples = Vec::new();
    while stream.next(&mut samples)? {}
    Ok(samples)
}

/// An audio file's mono samples at a rate, decoded a packet at a time and resampled as they
/// come ([`next`](Self::next)), and read again from the start when asked
/// ([`rewind`](Self::rewind)). A panic in a decoder (a forged file can find one) is caught
/// at each step and refused as a file that could not be decoded.
pub struct Stream {
    source: Source,
    resample: Option<Resample>,
    /// The rate it gives.
    rate: u32,
    limit_seconds: u64,
    /// The most frames it may have at the file's own rate.
    limit: u64,
    /// Frames decoded so far, at the file's own rate.
    taken: u64,
    /// A packet's samples on their way to the resampler.
    packet: Vec<f32>,
    ended: bool,
}

impl Stream {
    /// The audio file `bytes` opened to give mono samples at `rate` samples per second, at
    /// most `limit_seconds` of them: its container recognised and its header checked, nothing
    /// decoded yet.
    pub fn open(bytes: Vec<u8>, rate: u32, limit_seconds: u64) -> Result<Stream, AudioError> {
        caught(|| Stream::of(Source::open(bytes, limit_seconds)?, rate, limit_seconds))
    }

    /// The same file from its start (its bytes kept, not checked again): it gives the same
    /// samples to the bit.
    pub fn rewind(self) -> Result<Stream, AudioError> {
        let (rate, limit_seconds) = (self.rate, self.limit_seconds);
        caught(move || Stream::of(self.source.rewind()?, rate, limit_seconds))
    }

    fn of(source: Source, rate: u32, limit_seconds: u64) -> Result<Stream, AudioError> {
        let resample = (source.rate != rate)
            .then(|| Resample::new(source.rate, rate))
            .transpose()?;
        Ok(Stream {
            limit: limit_seconds.saturating_mul(u64::from(source.rate)),
            source,
            resample,
            rate,
            limit_seconds,
            taken: 0,
            packet: Vec::new(),
            ended: false,
        })
    }

    /// Decode the next packet onto `out` (resampled, some of it may stay in the resampler
    /// until more comes): `false` once the file has ended, its last samples given.
    pub fn next(&mut self, out: &mut Vec<f32>) -> Result<bool, AudioError> {
        caught(|| self.step(out))
    }

    fn step(&mut self, out: &mut Vec<f32>) -> Result<bool, AudioError> {
        if self.ended {
            return Ok(false);
        }
        let target = if self.resample.is_some() {
            &mut self.packet
        } else {
            &mut *out
        };
        let before = target.len();
        if !self.source.next(target)? {
            self.ended = true;
            self.source.end(self.taken)?;
            if self.taken == 0 {
                return Err(AudioError::Empty);
            }
            if let Some(resample) = &mut self.resample {
                resample.finish(out)?;
            }
            return Ok(false);
        }
        self.taken += (target.len() - before) as u64;
        if self.taken > self.limit {
            return Err(AudioError::TooLong {
                limit_seconds: self.limit_seconds,
            });
        }
        if let Some(resample) = &mut self.resample {
            resample.push(&self.packet, out)?;
            self.packet.clear();
        }
        Ok(true)
    }
}

/// `work`, a panic in it (a decoder's, on a forged file) refused as a file that could not be
/// decoded.
fn caught<T>(work: impl FnOnce() -> Result<T, AudioError>) -> Result<T, AudioError> {
    catch_unwind(AssertUnwindSafe(work)).unwrap_or_else(|panic| {
        let why = panic_message(panic.as_ref());
        tracing::warn!(%why, "an audio decoder panicked on a client's file");
        Err(AudioError::Corrupt(format!("the decoder failed on it ({why})")))
    })
}

/// A 16-bit PCM WAV file of `samples` (interleaved) at `rate` with `channels`: what the drill
/// sends, and tests write.
pub fn wav(samples: &[i16], rate: u32, channels: u16) -> Vec<u8> {
    let data = (samples.len() * 2) as u32;
    let mut out = Vec::with_capacity(44 + data as usize);
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + data).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    out.extend_from_slice(&16u32.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&channels.to_le_bytes());
    out.extend_from_slice(&rate.to_le_bytes());
    out.extend_from_slice(&(rate * u32::from(channels) * 2).to_le_bytes());
    out.extend_from_slice(&(channels * 2).to_le_bytes());
    out.extend_from_slice(&16u16.to_le_bytes());
    out.extend_from_slice(b"data");
    out.extend_from_slice(&data.to_le_bytes());
    out.extend(samples.iter().flat_map(|s| s.to_le_bytes()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_are_mixed_as_ffmpeg_mixes_them_and_the_rate_kept_when_it_is_the_models() {
        let stereo = wav(&[1000, 3000, -2000, 0], 16_000, 2);
        let mono = decode(stereo, 16_000, 30).unwrap();
        let gain = std::f32::consts::FRAC_1_SQRT_2;
        assert_eq!(mono, [4000.0 / 32768.0 * gain, -2000.0 / 32768.0 * gain]);
        let three = wav(&[300, 600, 900], 16_000, 3);
        assert_eq!(decode(three, 16_000, 30).unwrap(), [600.0 / 32768.0]);
    }

    #[test]
    fn a_tone_resampled_keeps_its_length_phase_and_frequency() {
        let from: Vec<i16> = tone(440.0, 44_100, 44_100)
            .iter()
            .map(|s| (s * 32767.0) as i16)
            .collect();
        let out = decode(wav(&from, 44_100, 1), 16_000, 30).unwrap();
        assert_eq!(out.len(), 16_000);
        let worst = worst_against_tone(&out, 440.0);
        assert!(worst < 2e-3, "{worst}");
    }

    /// A second of 16-bit mono silence whose header states `rate`.
    fn claiming(rate: u32) -> Vec<u8> {
        let mut file = wav(&vec![0; 16_000], 16_000, 1);
        file[24..28].copy_from_slice(&rate.to_le_bytes());
        file
    }

    #[test]
    fn a_rate_outside_the_served_range_is_refused_naming_it_before_anything_is_decoded() {
        // 0 made Symphonia panic; the others made the FFT resampler take gigabytes (its
        // transforms follow the rate's prime factors: 4294967291 is prime).
        for rate in [0, 1, 7_999, 384_001, 16_777_259, 2_147_483_649, 4_294_967_291, u32::MAX] {
            let err = decode(claiming(rate), 16_000, 30).unwrap_err();
            assert_eq!(err, AudioError::Rate(rate));
            assert_eq!(
                err.to_string(),
                format!("the file's sample rate is {rate} Hz: rates from 8000 to 384000 Hz are served")
            );
        }
        // The edges are served: the 16,000 samples are two seconds at 8 kHz, 1/24 s at 384 kHz.
        assert_eq!(decode(claiming(8_000), 16_000, 30).unwrap().len(), 32_000);
        assert_eq!(decode(claiming(384_000), 16_000, 30).unwrap().len(), 667);
    }

    /// A tone of `hz` at half scale, `n` samples at `rate`.
    fn tone(hz: f32, rate: u32, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (2.0 * std::f32::consts::PI * hz * i as f32 / rate as f32).sin() * 0.5)
            .collect()
    }

    /// The largest difference between `out` and a tone of `hz` at 16 kHz, away from the edges
    /// (where the filter sees the clip's ends).
    fn worst_against_tone(out: &[f32], hz: f32) -> f32 {
        let want = tone(hz, 16_000, out.len());
        out[500..out.len() - 500]
            .iter()
            .zip(&want[500..])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max)
    }

    #[test]
    fn a_rate_with_a_large_prime_factor_is_read_as_the_nearest_hundred_hertz() {
        // 383,987 Hz is prime: the FFT resampler's transforms would be 383,987 samples long.
        // Read as 384,000 Hz, a second is as long, and its tone 0.0034 % higher.
        let samples: Vec<i16> = tone(440.0, 383_987, 383_987)
            .iter()
            .map(|s| (s * 32767.0) as i16)
            .collect();
        let out = decode(wav(&samples, 383_987, 1), 16_000, 30).unwrap();
        assert_eq!(out.len(), 16_000);
        let worst = worst_against_tone(&out, 440.0 * 384_000.0 / 383_987.0);
        assert!(worst < 2e-3, "{worst}");
    }

    #[test]
    fn what_is_not_audio_is_refused_naming_why() {
        let err = decode(b"this is not audio at all".to_vec(), 16_000, 30).unwrap_err();
        assert!(matches!(err, AudioError::Format(_)), "{err}");
        assert!(
            err.to_string()
                .starts_with("the file is not WAV, FLAC, MP3, Ogg, WebM or MP4 audio")
        );
        assert_eq!(decode(wav(&[], 16_000, 1), 16_000, 30).unwrap_err(), AudioError::Empty);
        let long = wav(&vec![0; 16_000 * 3], 16_000, 1);
        assert_eq!(
            decode(long, 16_000, 2).unwrap_err(),
            AudioError::TooLong { limit_seconds: 2 }
        );
    }
}
