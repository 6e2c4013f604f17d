//! Progress on a terminal while the drill runs: the phase, the requests done and a bar.

use std::sync::Mutex;

use super::phase::Phase;

/// The progress line; draws nothing when stderr is not a terminal.
pub(super) struct Progress {
    on: bool,
    state: Mutex<Line>,
}

/// What the line shows.
#[derive(Clone, Copy)]
struct Line {
    phase: Phase,
    done: usize,
    total: usize,
}

impl Progress {
    /// A progress line, drawn only when `on`.
    pub(super) fn new(on: bool) -> Progress {
        Progress {
            on,
            state: Mutex::new(Line {
                phase: Phase::Baseline,
                done: 0,
                total: 0,
            }),
        }
    }

    /// `phase` starts, with `requests` to send.
    pub(super) fn phase(&self, phase: Phase, requests: usize) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = Line {
            phase,
            done: 0,
            total: requests,
        };
        self.draw();
    }

    /// One more request done.
    pub(super) fn step(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).done += 1;
        self.draw();
    }

    fn draw(&self) {
        if !self.on {
            return;
        }
        let Line { phase, done, total } = *self.state.lock().unwrap_or_else(|e| e.into_inner());
        let width = 24;
        let filled = (done.min(total) * width).checked_div(total).unwrap_or(0);
        eprint!(
            "\r\x1b[2K[{}/{}] {:<16} [{}{}] {done}/{total}",
            phase.number(),
            Phase::ALL.len(),
            phase.label(),
            "#".repeat(filled),
            "-".repeat(width - filled)
        );
    }

    /// Clear the line.
    pub(super) fn done(&self) {
        if self.on {
            eprint!("\r\x1b[2K");
        }
    }
}
