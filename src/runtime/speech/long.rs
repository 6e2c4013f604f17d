//! Audio longer than one window, decoded as `transformers`' long-form generation does: the
//! features of the whole audio, a window of up to 30 s cut at each seek (in feature frames) and
//! padded with zeros to a whole window ([`LogMel::window_long`]); each window's
//! tokens split into segments at its timestamps, and the seek moved on by what they consumed
//! ([`window_segments`], as `_retrieve_segment`): the whole window when its tokens end with a
//! single timestamp or have no pair of them, else up to the last pair's timestamp, so the
//! unfinished segment after it is decoded again from its start in the next window.
//!
//! [`LogMel::window_long`]: crate::runtime::audio::mel::LogMel::window_long

use super::whisper::{INPUT_STRIDE, TIME_PRECISION};

/// One segment of a window: where it starts and ends in the audio, and its tokens (text and
/// timestamps).
#[derive(Debug, Clone, PartialEq)]
pub struct WindowSegment {
    /// Seconds from the start of the audio.
    pub start: f64,
    /// Seconds from the start of the audio.
    pub end: f64,
    /// Its tokens, its timestamps included.
    pub tokens: Vec<u32>,
}

/// A decoded window's segments and the feature frames it consumed: the next window starts at
/// its seek plus `consumed`.
#[derive(Debug, Clone, PartialEq)]
pub struct WindowResult {
    /// Its segments, in order.
    pub segments: Vec<WindowSegment>,
    /// Frames the seek moves on by.
    pub consumed: u64,
}

/// Seconds from the start of the audio at `seek` (in feature frames), in `f64` as
/// `transformers` computes a window's offset.
pub fn seconds_at(seek: u64) -> f64 {
    seek as f64 * TIME_PRECISION / INPUT_STRIDE as f64
}

/// Frames of a window at `seek` in features of `total` frames: the rest of the audio, at most
/// `window_frames` (3,000).
pub fn frames_at(total: u64, seek: u64, window_frames: u64) -> u64 {
    total.saturating_sub(seek).min(window_frames)
}

/// The segments of a window decoded at `seek` over `frames` frames of audio ([`frames_at`]),
/// from `tokens` (its generated tokens, the end token left out), with timestamps from
/// `timestamp_begin` (`<|0.00|>`): as `_retrieve_segment` cuts them, in `f64` as it computes
/// them.
pub fn window_segments(tokens: &[u32], seek: u64, frames: u64, timestamp_begin: u32) -> WindowResult {
    let offset = seconds_at(seek);
    let is_time: Vec<bool> = tokens.iter().map(|&t| t >= timestamp_begin).collect();
    // Signed: a segment of a window decoded without timestamps may start with text, which
    // `transformers` subtracts all the same (its start then lies before the window's).
    let position = |t: u32| (i64::from(t) - i64::from(timestamp_begin)) as f64;
    let n = tokens.len();
    let single_ending = n >= 2 && !is_time[n - 2] && is_time[n - 1];
    // Where a pair of timestamps meets: a segment ends before the second.
    let mut slices: Vec<usize> = (1..n).filter(|&i| is_time[i - 1] && is_time[i]).collect();
    if slices.is_empty() {
        // No pair: the whole window is one segment, ending at its last timestamp when it has
        // one past <|0.00|>, else at the window's end.
        let last = tokens.iter().rev().find(|&&t| t >= timestamp_begin).copied();
        let end = match last {
            Some(t) if t != timestamp_begin => position(t),
            // `int(frames * 0.01 / 0.02)`, in float32 as torch computes it on the long tensor.
            _ => f64::from(((frames as f32 * 0.01f32) / TIME_PRECISION as f32) as i64 as i32),
        };
        return WindowResult {
            segments: vec![WindowSegment {
                start: offset,
                end: offset + end * TIME_PRECISION,
                tokens: tokens.to_vec(),
            }],
            consumed: frames,
        };
    }
    if single_ending {
        slices.push(n);
    } else {
        // The last segment keeps its closing timestamp, to show it was closed.
        *slices.last_mut().expect("not empty") += 1;
    }
    let mut segments = Vec::with_capacity(slices.len());
    let mut last = 0;
    for (i, &slice) in slices.iter().enumerate() {
        let sliced = &tokens[last..slice];
        let end_at = match i == slices.len() - 1 && !single_ending {
            true => sliced.len() - 2,
            false => sliced.len() - 1,
        };
        segments.push(WindowSegment {
            start: offset + position(sliced[0]) * TIME_PRECISION,
            end: offset + position(sliced[end_at]) * TIME_PRECISION,
            tokens: sliced.to_vec(),
        });
        last = slice;
    }
    let consumed = match single_ending {
        // Nothing spoken after the last timestamp: the whole window is done.
        true => frames,
        false => u64::from(tokens[last - 2] - timestamp_begin) * INPUT_STRIDE,
    };
    WindowResult { segments, consumed }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: u32 = 100;

    #[test]
    fn pairs_cut_segments_and_an_unfinished_one_is_decoded_again() {
        // <|0.00|> a b <|1.00|><|1.00|> c <|2.40|><|2.40|> d (cut off by the window's end)
        let tokens = [T, 1, 2, T + 50, T + 50, 3, T + 120, T + 120, 4];
        let r = window_segments(&tokens, 3000, 3000, T);
        assert_eq!(r.segments.len(), 2);
        assert_eq!(r.segments[0].tokens, [T, 1, 2, T + 50]);
        assert!((r.segments[0].start - 30.0).abs() < 1e-9 && (r.segments[0].end - 31.0).abs() < 1e-9);
        assert_eq!(r.segments[1].tokens, [T + 50, 3, T + 120, T + 120]);
        assert!((r.segments[1].end - 32.4).abs() < 1e-9);
        assert_eq!(r.consumed, 240, "seek to <|2.40|>: 120 steps of 2 frames");
    }

    #[test]
    fn a_single_timestamp_at_the_end_consumes_the_window() {
        let tokens = [T, 1, T + 50, T + 50, 3, T + 90];
        let r = window_segments(&tokens, 0, 2500, T);
        assert_eq!(r.segments.len(), 2);
        assert_eq!(r.segments[1].tokens, [T + 50, 3, T + 90]);
        assert!((r.segments[1].end - 1.8).abs() < 1e-9);
        assert_eq!(r.consumed, 2500);
    }

    #[test]
    fn without_a_pair_the_window_is_one_segment() {
        let r = window_segments(&[T, 1, 2], 600, 3000, T);
        assert_eq!(r.segments.len(), 1);
        assert!((r.segments[0].start - 6.0).abs() < 1e-9);
        assert!((r.segments[0].end - 36.0).abs() < 1e-9, "to the window's end");
        assert_eq!(r.consumed, 3000);
        let r = window_segments(&[T, 1, 2, T + 40], 0, 3000, T);
        assert!((r.segments[0].end - 0.8).abs() < 1e-9, "to its last timestamp");
        let r = window_segments(&[1, 2], 0, 1234, T);
        assert!((r.segments[0].end - 12.34).abs() < 1e-9);
    }

    #[test]
    fn a_window_holds_the_rest_of_the_audio_at_most() {
        assert_eq!(frames_at(7000, 6000, 3000), 1000);
        assert_eq!(frames_at(7000, 0, 3000), 3000);
    }
}
