//! When a run's answer should come back from the worker process, so that the lane waiting for
//! it is awake by then instead of asleep in its read.
//!
//! A lane sends its frame and waits for the answer. For a run of a few ms it cannot look for the
//! answer the whole time without taking a core from the run it waits for, so it sleeps, and the
//! answer then wakes it: one wake-up more than a thread-isolated pool pays, whose own thread runs
//! the model. On the 2-core VM the benches run on, a seq-1024 encoder request at concurrency 1
//! (runs of 3.5–4.5 ms) cost about 135 µs more with process isolation than with thread
//! isolation; sleeping until just before the answer is due and looking from then on took 80 to
//! 130 µs of that away (16 pairs of 1 s, in both orders: docs/isolation.md).
//!
//! [`Expected`] keeps how long the last run of each kind took to be answered (the same model,
//! operation and input size) and gives the window to look in: that time, give or take an eighth
//! of it (at most [`MARGIN_MAX`]). Until the window opens the lane waits in `ppoll`, which an
//! early answer ends as a read would; past it the lane sleeps in its read as before, so a wrong
//! guess costs at most the window's CPU, never time. Runs answered in under [`LOOK_FROM`] get
//! no window: looking through most of a short run takes the core the worker process needs (a
//! 300 µs window around seq-128 runs of ~100 µs cost 14 % of saturated throughput) and the
//! wake-up is a small part of their time.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::pool::RunOp;

/// Runs answered sooner than this get no window.
pub const LOOK_FROM: Duration = Duration::from_micros(500);
/// The widest half-window.
pub const MARGIN_MAX: Duration = Duration::from_micros(300);

/// The window around an answer expected `expect` after its frame went out: from when to look,
/// and until when, both after the frame; `None` for runs too short to look for.
pub fn window(expect: Duration) -> Option<(Duration, Duration)> {
    if expect < LOOK_FROM {
        return None;
    }
    let margin = (expect / 8).min(MARGIN_MAX);
    Some((expect - margin, expect + margin))
}

/// Most kinds of run remembered; past it the oldest knowledge goes (a client with many input
/// sizes would otherwise grow it without end).
const KINDS_MAX: usize = 256;

/// A kind of run: its model, operation and input bytes, hashed (a collision only misplaces a
/// window).
pub fn kind(model: &str, op: &RunOp, input_bytes: u64) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    model.hash(&mut hasher);
    std::mem::discriminant(op).hash(&mut hasher);
    input_bytes.hash(&mut hasher);
    hasher.finish()
}

/// How long the last run of each kind took to be answered on one session connection.
#[derive(Debug, Default)]
pub struct Expected {
    last: Mutex<HashMap<u64, Duration>>,
}

impl Expected {
    /// When to look for the answer to a run of `kind` whose frame went out at `sent`.
    pub fn window(&self, kind: u64, sent: Instant) -> Option<(Instant, Instant)> {
        let expect = *self.last.lock().unwrap_or_else(|e| e.into_inner()).get(&kind)?;
        window(expect).map(|(from, until)| (sent + from, sent + until))
    }

    /// A run of `kind` was answered `took` after its frame went out.
    pub fn answered(&self, kind: u64, took: Duration) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.len() >= KINDS_MAX && !last.contains_key(&kind) {
            last.clear();
        }
        last.insert(kind, took);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn short_runs_get_no_window_and_long_ones_one_an_eighth_wide_at_most_300_us() {
        assert_eq!(window(Duration::from_micros(100)), None);
        assert_eq!(window(Duration::from_micros(499)), None);
        let us = Duration::from_micros;
        assert_eq!(window(us(800)), Some((us(700), us(900))));
        assert_eq!(window(4 * MS), Some((us(3700), us(4300))));
        assert_eq!(window(40 * MS), Some((us(39_700), us(40_300))));
    }

    #[test]
    fn the_window_follows_the_last_answer_of_the_same_model_operation_and_size() {
        let expected = Expected::default();
        let sent = Instant::now();
        let (long, short) = (
            kind("encoder", &RunOp::Run, 262_144),
            kind("encoder", &RunOp::Run, 32_768),
        );
        let prefill = kind("encoder", &RunOp::Prefill(1), 262_144);
        assert_eq!(expected.window(long, sent), None, "nothing known yet");
        expected.answered(long, 4 * MS);
        expected.answered(short, Duration::from_micros(150));
        let (from, until) = expected.window(long, sent).unwrap();
        assert_eq!((from - sent, until - sent), window(4 * MS).unwrap());
        assert_eq!(expected.window(short, sent), None, "too short to look for");
        assert_eq!(expected.window(prefill, sent), None, "another operation");
        expected.answered(long, 2 * MS);
        assert_eq!(expected.window(long, sent).unwrap().0 - sent, 2 * MS - 2 * MS / 8);
    }

    #[test]
    fn it_remembers_a_bounded_number_of_kinds() {
        let expected = Expected::default();
        for bytes in 0..(KINDS_MAX as u64 + 10) {
            expected.answered(kind("m", &RunOp::Run, bytes), 4 * MS);
        }
        let last = expected.last.lock().unwrap();
        assert!(last.len() <= KINDS_MAX, "{} kinds kept", last.len());
        assert!(last.contains_key(&kind("m", &RunOp::Run, KINDS_MAX as u64 + 9)));
    }
}
