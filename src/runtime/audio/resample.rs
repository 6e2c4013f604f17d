//! Mono samples resampled as they are decoded ([`Resample`]), fed a packet at a time and giving
//! back what each whole chunk makes, so a file is held neither at its own rate nor at the
//! model's: the output is the same to the bit however the input is cut.
//!
//! Rubato's FFT resampler does it (the front end's references hold its output to ffmpeg's,
//! `tests/it/speech_front_end.rs`), but its cost follows the rates' ratio in lowest terms: its
//! transforms are multiples of `from / gcd(from, to)` samples long, so a rate with a large prime
//! factor (383,987 Hz is prime) takes transforms of hundreds of thousands of samples, each
//! computed the slow way. A rate whose ratio has more than [`FFT_MOST`] input samples in lowest
//! terms (never a recorder's: 44.1 kHz to 16 kHz is 441:160) is taken as the nearest multiple
//! of 100 Hz, whose ratio to 16 kHz is at most 3,840:1: off by at most 50 Hz (0.6 % at 8 kHz,
//! 0.013 % at 384 kHz), which stretches the audio's timing by as much and leaves its words as
//! they are, while the resampler's cost stays that of an ordinary rate whatever the header says.

use rubato::{FftFixedIn, Resampler};

use super::AudioError;

/// Frames the FFT resampler takes at a time.
const CHUNK: usize = 1024;

/// The longest ratio in lowest terms (input side) given to the FFT resampler: 44.1 kHz to
/// 16 kHz is 441:160; NTSC-pulled 44,056 Hz is 5,507:2,000.
const FFT_MOST: usize = 8192;

/// A resampler from `from` to `to` samples per second being fed.
pub(super) struct Resample {
    resampler: FftFixedIn<f32>,
    from: u32,
    to: u32,
    /// Input not yet a whole chunk.
    pending: Vec<f32>,
    /// Input frames taken in all.
    taken: u64,
    /// Output frames still to drop from the front: the filter's delay.
    delay: usize,
    /// Output frames given, the delay taken off.
    given: u64,
}

impl Resample {
    /// A resampler from `from` to `to` Hz.
    pub(super) fn new(from: u32, to: u32) -> Result<Resample, AudioError> {
        let from = read_as(from, to);
        let resampler = FftFixedIn::<f32>::new(from as usize, to as usize, CHUNK, 2, 1)
            .map_err(|e| AudioError::Codec(format!("cannot resample {from} Hz to {to} Hz: {e}")))?;
        Ok(Resample {
            delay: resampler.output_delay(),
            pending: Vec::with_capacity(CHUNK),
            resampler,
            from,
            to,
            taken: 0,
            given: 0,
        })
    }

    /// Take `samples`, resampling every whole chunk onto `out`.
    pub(super) fn push(&mut self, mut samples: &[f32], out: &mut Vec<f32>) -> Result<(), AudioError> {
        self.taken += samples.len() as u64;
        while !samples.is_empty() {
            let room = CHUNK - self.pending.len();
            let (now, later) = samples.split_at(room.min(samples.len()));
            self.pending.extend_from_slice(now);
            samples = later;
            if self.pending.len() == CHUNK {
                let chunk = self
                    .resampler
                    .process(std::slice::from_ref(&self.pending), None)
                    .map_err(failed)?;
                self.keep(&chunk[0], out);
                self.pending.clear();
            }
        }
        Ok(())
    }

    /// The rest of the samples onto `out`, the input having ended: in all, as many as the
    /// same duration holds at the new rate, the resampler's delay taken off the front.
    pub(super) fn finish(&mut self, out: &mut Vec<f32>) -> Result<(), AudioError> {
        let expected = (self.taken * u64::from(self.to)).div_ceil(u64::from(self.from));
        if !self.pending.is_empty() {
            let rest = std::mem::take(&mut self.pending);
            let chunk = self.resampler.process_partial(Some(&[rest]), None).map_err(failed)?;
            self.keep(&chunk[0], out);
        }
        // What the filter still holds: flushed until the delayed tail is out.
        while self.given < expected {
            let chunk = self.resampler.process_partial::<&[f32]>(None, None).map_err(failed)?;
            // Each flush gives a chunk's worth: one that gives nothing would never end.
            if chunk[0].is_empty() {
                return Err(AudioError::Corrupt("resampling gave no samples".into()));
            }
            self.keep(&chunk[0], out);
        }
        // The whole chunks before the end gave no more than the input's duration at the new
        // rate less the delay: what overshoots came from here, and is taken back from `out`.
        let over = (self.given - expected) as usize;
        out.truncate(out.len().saturating_sub(over));
        self.given = expected;
        Ok(())
    }

    /// Keep `chunk` on `out`, less what is left of the delay.
    fn keep(&mut self, chunk: &[f32], out: &mut Vec<f32>) {
        let skip = self.delay.min(chunk.len());
        self.delay -= skip;
        out.extend_from_slice(&chunk[skip..]);
        self.given += (chunk.len() - skip) as u64;
    }
}

/// The rate `from` is resampled as to reach `to`: itself, or where its ratio to `to` in lowest
/// terms is longer than [`FFT_MOST`], the nearest multiple of 100 Hz.
fn read_as(from: u32, to: u32) -> u32 {
    let (a, b) = (from as usize, to as usize);
    if a / gcd(a, b) <= FFT_MOST {
        return from;
    }
    from.saturating_add(50) / 100 * 100
}

/// The greatest common divisor of `a` and `b` (Euclid's).
fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn failed(e: rubato::ResampleError) -> AudioError {
    AudioError::Corrupt(format!("resampling failed: {e}"))
}
