//! Audio for speech models: a file as clients send it (WAV, FLAC, MP3 or Ogg Vorbis, at any
//! sample rate and channel count) decoded by Symphonia, its channels mixed to one, and
//! resampled by Rubato to the rate the model's features are computed at ([`decode`]); and the
//! log-mel spectrogram Whisper's feature extractor makes of those samples ([`mel`]).
//!
//! Everything a client can send is bounded before it costs memory: the decoded length is checked
//! as the packets come, so a file claiming hours stops at the limit, not at the end of memory.

pub mod mel;

use std::io::Cursor;

use rubato::{FftFixedIn, Resampler};
use symphonia::core::audio::SampleBuffer;
use symphonia::core::codecs::{CODEC_TYPE_NULL, DecoderOptions};
use symphonia::core::errors::Error as Symphonia;
use symphonia::core::formats::FormatOptions;
use symphonia::core::io::MediaSourceStream;
use symphonia::core::meta::MetadataOptions;
use symphonia::core::probe::Hint;

/// Frames the resampler takes at a time.
const RESAMPLE_CHUNK: usize = 1024;

/// Why a file gives no audio: each names what is wrong, for the client's 400.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AudioError {
    /// Not a container served here.
    #[error("the file is not WAV, FLAC, MP3 or Ogg audio ({0})")]
    Format(String),
    /// A container with no track a decoder here reads.
    #[error("the file has no audio track in a codec served here (PCM, FLAC, MP3, Vorbis): {0}")]
    Codec(String),
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
}

/// The mono samples of the audio file `bytes` at `rate` samples per second, at most
/// `limit_seconds` of them.
pub fn decode(bytes: Vec<u8>, rate: u32, limit_seconds: u64) -> Result<Vec<f32>, AudioError> {
    let (samples, source_rate) = decode_mono(bytes, limit_seconds)?;
    if samples.is_empty() {
        return Err(AudioError::Empty);
    }
    if source_rate == rate {
        return Ok(samples);
    }
    resample(&samples, source_rate, rate)
}

/// The file's first decodable audio track, its channels mixed to one: its samples and their rate.
fn decode_mono(bytes: Vec<u8>, limit_seconds: u64) -> Result<(Vec<f32>, u32), AudioError> {
    let stream = MediaSourceStream::new(Box::new(Cursor::new(bytes)), Default::default());
    let probed = symphonia::default::get_probe()
        .format(
            &Hint::new(),
            stream,
            &FormatOptions {
                // Encoder delay and padding (MP3's LAME header, Vorbis' pre-skip) are not audio: they
                // would shift every later frame, as ffmpeg, which trims them, does not.
                enable_gapless: true,
                ..FormatOptions::default()
            },
            &MetadataOptions::default(),
        )
        .map_err(|e| match e {
            // A container recognised and cut before its header ends is damaged, not foreign.
            Symphonia::IoError(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
                AudioError::Corrupt("it ends before its header does".into())
            }
            e => AudioError::Format(e.to_string()),
        })?;
    let mut format = probed.format;
    let track = format
        .tracks()
        .iter()
        .find(|t| t.codec_params.codec != CODEC_TYPE_NULL)
        .ok_or_else(|| AudioError::Codec("no track names a codec".into()))?;
    let (track_id, params) = (track.id, track.codec_params.clone());
    let rate = params
        .sample_rate
        .filter(|r| *r > 0)
        .ok_or_else(|| AudioError::Codec("the track does not say its sample rate".into()))?;
    let mut decoder = symphonia::default::get_codecs()
        .make(&params, &DecoderOptions::default())
        .map_err(|e| AudioError::Codec(e.to_string()))?;
    let limit = limit_seconds.saturating_mul(u64::from(rate)) as usize;
    let mut mono = Vec::new();
    let mut damaged = None;
    loop {
        let packet = match format.next_packet() {
            Ok(packet) => packet,
            // The end of the stream (a file cut short ends here too, with what it held).
            Err(Symphonia::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(Symphonia::ResetRequired) => break,
            Err(e) => return Err(AudioError::Corrupt(e.to_string())),
        };
        if packet.track_id() != track_id {
            continue;
        }
        let decoded = match decoder.decode(&packet) {
            Ok(decoded) => decoded,
            // A damaged packet is skipped, as players and ffmpeg skip it; a file of nothing but
            // damaged packets is refused below.
            Err(Symphonia::DecodeError(e)) => {
                damaged.get_or_insert_with(|| e.to_string());
                continue;
            }
            Err(e) => return Err(AudioError::Corrupt(e.to_string())),
        };
        let spec = *decoded.spec();
        let channels = spec.channels.count().max(1);
        let gain = downmix_gain(channels);
        let mut buffer = SampleBuffer::<f32>::new(decoded.capacity() as u64, spec);
        buffer.copy_interleaved_ref(decoded);
        mono.extend(
            buffer
                .samples()
                .chunks(channels)
                .map(|frame| frame.iter().sum::<f32>() * gain),
        );
        if mono.len() > limit {
            return Err(AudioError::TooLong { limit_seconds });
        }
    }
    match damaged {
        Some(why) if mono.is_empty() => Err(AudioError::Corrupt(why)),
        _ => Ok((mono, rate)),
    }
}

/// What each channel's samples are multiplied by in the mono sum. Stereo is mixed as ffmpeg's
/// `-ac 1` mixes it (each channel at -3 dB, 1/√2), which is how Whisper's own `load_audio` and
/// `transformers`' ASR pipeline read a file, so a stereo clip gives the features those give;
/// other layouts are averaged.
fn downmix_gain(channels: usize) -> f32 {
    match channels {
        2 => std::f32::consts::FRAC_1_SQRT_2,
        n => 1.0 / n as f32,
    }
}

/// `samples` at `from` samples per second, resampled to `to`: as many samples as the same
/// duration holds at the new rate, the resampler's delay taken off the front.
fn resample(samples: &[f32], from: u32, to: u32) -> Result<Vec<f32>, AudioError> {
    let mut resampler = FftFixedIn::<f32>::new(from as usize, to as usize, RESAMPLE_CHUNK, 2, 1)
        .map_err(|e| AudioError::Codec(format!("cannot resample {from} Hz to {to} Hz: {e}")))?;
    let expected = (samples.len() as u64 * u64::from(to)).div_ceil(u64::from(from)) as usize;
    let delay = resampler.output_delay();
    let mut out = Vec::with_capacity(expected + delay + RESAMPLE_CHUNK);
    let failed = |e: rubato::ResampleError| AudioError::Corrupt(format!("resampling failed: {e}"));
    let mut rest = samples;
    while rest.len() >= resampler.input_frames_next() {
        let (chunk, after) = rest.split_at(resampler.input_frames_next());
        out.extend_from_slice(&resampler.process(&[chunk], None).map_err(failed)?[0]);
        rest = after;
    }
    if !rest.is_empty() {
        out.extend_from_slice(&resampler.process_partial(Some(&[rest]), None).map_err(failed)?[0]);
    }
    // What the filter still holds: flushed until the delayed tail is out.
    while out.len() < expected + delay {
        out.extend_from_slice(&resampler.process_partial::<&[f32]>(None, None).map_err(failed)?[0]);
    }
    Ok(out[delay..delay + expected].to_vec())
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
        let tone = |rate: u32, n: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (2.0 * std::f32::consts::PI * 440.0 * i as f32 / rate as f32).sin() * 0.5)
                .collect()
        };
        let from: Vec<i16> = tone(44_100, 44_100).iter().map(|s| (s * 32767.0) as i16).collect();
        let out = decode(wav(&from, 44_100, 1), 16_000, 30).unwrap();
        assert_eq!(out.len(), 16_000);
        let want = tone(16_000, 16_000);
        // Away from the edges (where the filter sees the clip's ends) it is the same tone.
        let worst = out[500..15_500]
            .iter()
            .zip(&want[500..15_500])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 2e-3, "{worst}");
    }

    #[test]
    fn what_is_not_audio_is_refused_naming_why() {
        let err = decode(b"this is not audio at all".to_vec(), 16_000, 30).unwrap_err();
        assert!(matches!(err, AudioError::Format(_)), "{err}");
        assert!(
            err.to_string()
                .starts_with("the file is not WAV, FLAC, MP3 or Ogg audio")
        );
        assert_eq!(decode(wav(&[], 16_000, 1), 16_000, 30).unwrap_err(), AudioError::Empty);
        let long = wav(&vec![0; 16_000 * 3], 16_000, 1);
        assert_eq!(
            decode(long, 16_000, 2).unwrap_err(),
            AudioError::TooLong { limit_seconds: 2 }
        );
    }
}
