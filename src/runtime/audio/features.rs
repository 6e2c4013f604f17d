//! A file's long-form log-mel features, a window at a time, its samples never held whole
//! ([`Features`]): the file is decoded once through for what only the whole audio says (its
//! length and its loudest value, [`Scan`]), then decoded again as its windows are asked for,
//! in order, holding the samples of one window. Its bytes (at most the request's file) are
//! what stays; two hours of audio at 16 kHz would be 460 MB of samples.
//!
//! Each window is the one [`LogMel::window_long`] cuts from the whole audio, to the bit: the
//! decoding and resampling give the same samples however they are read, and each frame is
//! computed from the same samples.
//!
//! [`Scan`]: super::mel::Scan

use super::mel::{Held, LogMel, Loudest};
use super::{AudioError, Stream};

/// A file's features for long-form decoding, its first pass done, read a window at a time.
pub struct Features {
    /// The second reading, where `held` ends.
    stream: Stream,
    /// The audio's samples from `offset` on: what the next window may read.
    held: Vec<f32>,
    offset: usize,
    /// The audio's samples in all, at the model's rate.
    samples: usize,
    loudest: Loudest,
}

impl std::fmt::Debug for Features {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Features")
            .field("samples", &self.samples)
            .field("loudest", &self.loudest)
            .finish_non_exhaustive()
    }
}

impl Features {
    /// The audio file `bytes`, at most `limit_seconds` of it, read through once at `mel`'s rate
    /// for its length and loudest value. It stops with [`AudioError::Stopped`] at the first
    /// packet after `stopped` says so (its client has gone).
    pub fn scan(
        bytes: Vec<u8>,
        mel: &LogMel,
        limit_seconds: u64,
        stopped: &dyn Fn() -> bool,
    ) -> Result<Features, AudioError> {
        let mut stream = Stream::open(bytes, mel.config().rate, limit_seconds)?;
        let mut scan = mel.scan();
        let mut samples = Vec::new();
        loop {
            if stopped() {
                return Err(AudioError::Stopped);
            }
            let more = stream.next(&mut samples)?;
            scan.push(&samples);
            samples.clear();
            if !more {
                break;
            }
        }
        let (loudest, samples) = scan.finish();
        Ok(Features {
            stream: stream.rewind()?,
            held: Vec::new(),
            offset: 0,
            samples,
            loudest,
        })
    }

    /// The audio's samples in all, at the model's rate.
    pub fn samples(&self) -> usize {
        self.samples
    }

    /// The window at frame `seek` of the long-form features ([`LogMel::window_of`]): the file
    /// decoded on as far as the window reads, what windows before it read and it does not
    /// let go. Windows are read in order: one at a seek before the last one's is refused
    /// (its samples are gone). Stops as [`scan`](Self::scan) does.
    pub fn window(&mut self, mel: &LogMel, seek: usize, stopped: &dyn Fn() -> bool) -> Result<Vec<f32>, AudioError> {
        let reads = mel.window_reads(seek);
        if reads.start < self.offset {
            return Err(AudioError::Corrupt(format!(
                "its windows were read out of order (frame {seek} after sample {})",
                self.offset
            )));
        }
        self.let_go(reads.start);
        let end = reads.end.min(self.samples);
        while self.offset + self.held.len() < end {
            if stopped() {
                return Err(AudioError::Stopped);
            }
            let more = self.stream.next(&mut self.held)?;
            self.let_go(reads.start);
            if !more {
                break;
            }
        }
        // The first reading's length is the audio's: the second gives the same samples.
        self.held.truncate(self.samples.saturating_sub(self.offset));
        let held = Held {
            samples: &self.held,
            offset: self.offset,
        };
        Ok(mel.window_of(held, self.samples, self.loudest, seek))
    }

    /// Let go of the samples before `first`.
    fn let_go(&mut self, first: usize) {
        let gone = first.saturating_sub(self.offset).min(self.held.len());
        self.held.drain(..gone);
        self.offset += gone;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::audio::mel::MelConfig;
    use crate::runtime::audio::{decode, wav};

    /// `seconds` of a tone whose loudness changes every second, at `rate`, as a WAV file.
    fn file(seconds: usize, rate: u32) -> Vec<u8> {
        let samples: Vec<i16> = (0..seconds * rate as usize)
            .map(|i| {
                let loudness = ((i / rate as usize) * 7 % 11) as f32 / 20.0;
                let t = i as f32 / rate as f32;
                ((2.0 * std::f32::consts::PI * 440.0 * t).sin() * loudness * 32767.0) as i16
            })
            .collect();
        wav(&samples, rate, 1)
    }

    #[test]
    fn every_window_is_the_one_cut_from_the_whole_audio_to_the_bit() {
        let mel = LogMel::new(MelConfig::WHISPER).unwrap();
        // 95 s at 44.1 kHz (resampled) and at 16 kHz; and 10 s, under one window.
        for (seconds, rate) in [(95, 44_100), (95, 16_000), (10, 22_050)] {
            let whole = decode(file(seconds, rate), 16_000, 600).unwrap();
            let loudest = mel.loudest(&whole);
            let mut features = Features::scan(file(seconds, rate), &mel, 600, &|| false).unwrap();
            assert_eq!((features.samples(), features.loudest), (whole.len(), loudest));
            // Seeks as the long-form loop moves them: a whole window, part of one, one frame.
            let total = mel.frames_long(whole.len());
            let mut seek = 0;
            for step in [3000, 1234, 1, 2999, 3000, 3000].into_iter().cycle() {
                if seek >= total {
                    break;
                }
                let window = features.window(&mel, seek, &|| false).unwrap();
                assert!(
                    window == mel.window_long(&whole, loudest, seek),
                    "{seconds} s at {rate} Hz, frame {seek}"
                );
                let window_samples = mel.config().window_samples();
                assert!(
                    features.held.len() <= window_samples + 16_000,
                    "{} held",
                    features.held.len()
                );
                seek += step;
            }
        }
    }

    #[test]
    fn windows_are_read_in_order_and_a_client_gone_stops_either_pass() {
        let mel = LogMel::new(MelConfig::WHISPER).unwrap();
        let mut features = Features::scan(file(65, 16_000), &mel, 600, &|| false).unwrap();
        features.window(&mel, 3000, &|| false).unwrap();
        let err = features.window(&mel, 100, &|| false).unwrap_err();
        assert!(err.to_string().contains("out of order"), "{err}");
        let err = features.window(&mel, 6000, &|| true).unwrap_err();
        assert_eq!(err, AudioError::Stopped);
        let err = Features::scan(file(65, 16_000), &mel, 600, &|| true).unwrap_err();
        assert_eq!(err, AudioError::Stopped);
        // What the first pass refuses is refused before any window.
        let err = Features::scan(file(65, 16_000), &mel, 60, &|| false).unwrap_err();
        assert_eq!(err, AudioError::TooLong { limit_seconds: 60 });
    }
}
