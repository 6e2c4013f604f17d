//! Shared by the benches: a figure with its median and spread, written as JSON under
//! `target/bench/` for `benches/report.rs` to gather into one table; and (in `server`) real
//! server processes driven by a load generator in another process. Here rather than in a
//! `benches/common` module that every bench compiles again, each using a part of it.

pub mod server;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// What a figure must be to meet its target.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    /// At most this (latencies).
    AtMost(f64),
    /// At least this (throughputs, ratios).
    AtLeast(f64),
}

impl Target {
    /// Whether `value` meets it.
    pub fn met(self, value: f64) -> bool {
        match self {
            Target::AtMost(t) => value <= t,
            Target::AtLeast(t) => value >= t,
        }
    }
}

/// One line of the table: a median and the spread around it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Figure {
    /// What was measured, as the table shows it.
    pub name: String,
    /// Its unit, as the table shows it (`µs`, `req/s`, `%`).
    pub unit: String,
    /// The median of the samples or runs.
    pub median: f64,
    /// The spread's low end.
    pub low: f64,
    /// The spread's high end.
    pub high: f64,
    /// What the spread is: `p5–p95 of 1000 samples`, `min–max of 5 runs`, ….
    pub spread: String,
    /// What it must be (`None`: a figure for context, judged by no target).
    pub target: Option<Target>,
    /// Anything a reader needs to read the figure right.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
}

impl Figure {
    /// The median and p5–p95 of individually timed samples.
    pub fn of_samples(name: impl Into<String>, unit: &str, samples: &[f64]) -> Figure {
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        Figure {
            name: name.into(),
            unit: unit.into(),
            median: quantile(&sorted, 0.5),
            low: quantile(&sorted, 0.05),
            high: quantile(&sorted, 0.95),
            spread: format!("p5–p95 of {} samples", sorted.len()),
            target: None,
            note: String::new(),
        }
    }

    /// The median and min–max of one value per repeated run.
    pub fn of_runs(name: impl Into<String>, unit: &str, runs: &[f64]) -> Figure {
        let mut sorted = runs.to_vec();
        sorted.sort_by(f64::total_cmp);
        Figure {
            name: name.into(),
            unit: unit.into(),
            median: quantile(&sorted, 0.5),
            low: sorted[0],
            high: sorted[sorted.len() - 1],
            spread: format!("min–max of {} runs", sorted.len()),
            target: None,
            note: String::new(),
        }
    }

    /// The figure with a target to meet.
    pub fn target(self, target: Target) -> Figure {
        Figure {
            target: Some(target),
            ..self
        }
    }

    /// The figure with a note for its reader.
    pub fn note(self, note: impl Into<String>) -> Figure {
        Figure {
            note: note.into(),
            ..self
        }
    }

    /// `MET`, `MISSED`, or empty without a target.
    pub fn verdict(&self) -> &'static str {
        match self.target {
            Some(t) if t.met(self.median) => "MET",
            Some(_) => "MISSED",
            None => "",
        }
    }
}

/// The `q` quantile of sorted values, the nearest rank (the median of an even count is the
/// mean of the two middle values).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    let at = (sorted.len() - 1) as f64 * q;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    if q == 0.5 {
        (sorted[lo] + sorted[hi]) / 2.0
    } else {
        sorted[at.round() as usize]
    }
}

/// Two measurements taken in alternating pairs, and the differences within each pair.
#[derive(Debug, Clone, Default)]
pub struct Paired {
    /// Each pair's first measure's value, in pair order.
    pub a: Vec<f64>,
    /// Each pair's second measure's value.
    pub b: Vec<f64>,
}

impl Paired {
    /// `pairs` pairs of `a()` and `b()`, back to back, the one that goes first alternating
    /// from pair to pair (`a` first in the first).
    ///
    /// A small difference between two medians each measured over seconds is lost on a shared
    /// machine whose speed drifts from one second to the next more than the difference: the
    /// same figure measured seconds apart read anything from −600 to +400 µs for a difference
    /// near 0 on this VM. Within one pair both see about the same machine, and alternating the
    /// order keeps the second of a pair from always being the one that sees it slower.
    pub fn measure(pairs: usize, mut a: impl FnMut() -> f64, mut b: impl FnMut() -> f64) -> Paired {
        let mut out = Paired::default();
        for i in 0..pairs {
            let (x, y) = if i % 2 == 0 {
                let x = a();
                (x, b())
            } else {
                let y = b();
                (a(), y)
            };
            out.a.push(x);
            out.b.push(y);
        }
        out
    }

    /// The median of `b − a` over the pairs.
    pub fn median_difference(&self) -> f64 {
        median(&self.b.iter().zip(&self.a).map(|(b, a)| b - a).collect::<Vec<_>>())
    }

    /// The median of `b / a` over the pairs.
    pub fn median_ratio(&self) -> f64 {
        median(&self.b.iter().zip(&self.a).map(|(b, a)| b / a).collect::<Vec<_>>())
    }

    /// How a figure taken within `pairs` pairs was made, for its note: `of` what (differences,
    /// ratios), and pairs of `what` (the measurements, in their pair order).
    pub fn note(pairs: usize, of: &str, what: &str) -> String {
        format!("each run's median of {pairs} {of} within pairs of {what}, order alternated")
    }

    /// The median of the first measure's values.
    pub fn median_a(&self) -> f64 {
        median(&self.a)
    }

    /// The median of the second measure's values.
    pub fn median_b(&self) -> f64 {
        median(&self.b)
    }
}

/// The value of the first series in the metrics `text` whose line starts with `prefix` (its
/// name and labels), or 0 when there is none.
pub fn series_value(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// The median of `values`, in any order (of an even count, the mean of the two middle ones).
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    quantile(&sorted, 0.5)
}

/// The `p` quantile of sorted durations, the nearest rank.
pub fn percentile(sorted: &[std::time::Duration], p: f64) -> std::time::Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// The value after `name` on the bench's command line, or `default` when it is missing or does
/// not parse: `cargo bench` passes `--bench` and others of its own, which are ignored.
pub fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// The bundled encoder's width: a token is 64 values.
pub const ENCODER_DIM: usize = 64;

/// The bundled encoder's input of `seq` tokens (batch 1): small values of both signs, the same
/// in every bench so that their figures compare.
pub fn encoder_input(seq: usize) -> Vec<f32> {
    (0..seq * ENCODER_DIM).map(|i| ((i % 13) as f32 - 6.0) * 0.05).collect()
}

/// [`encoder_input`] as the body of the binary data extension (the JSON header, then the
/// tensor's bytes), asking for `pooled` in binary too. Returns the header's length (the
/// `Inference-Header-Content-Length` value) and the body.
pub fn encoder_binary_body(seq: usize) -> (usize, Vec<u8>) {
    let header = serde_json::json!({
        "inputs": [{"name": "input", "shape": [1, seq, ENCODER_DIM], "datatype": "FP32",
                    "parameters": {"binary_data_size": seq * ENCODER_DIM * 4}}],
        "outputs": [{"name": "pooled", "parameters": {"binary_data": true}}]
    })
    .to_string();
    let mut body = header.clone().into_bytes();
    encoder_input(seq)
        .iter()
        .for_each(|v| body.extend_from_slice(&v.to_le_bytes()));
    (header.len(), body)
}

/// `target/bench/`, where each bench writes its figures and the report its table, from the
/// bench's `CARGO_TARGET_TMPDIR` (`target/tmp`; Cargo gives it to benches, not to this library):
/// `out_dir(env!("CARGO_TARGET_TMPDIR"))`.
pub fn out_dir(target_tmpdir: &str) -> PathBuf {
    let tmp = PathBuf::from(target_tmpdir);
    tmp.parent().map_or(tmp.clone(), |t| t.join("bench"))
}

/// The machine as the table's header states it, read when the bench starts.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    /// The CPU's model name.
    pub cpu: String,
    /// The cores this process may use.
    pub cores: usize,
    /// The 1-minute load average: above 0.5 or so, something else was running.
    pub load_average: f64,
}

impl Machine {
    /// The machine now: read when a bench starts, so a loaded machine shows in its table.
    pub fn now() -> Machine {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|t| {
                t.lines().find_map(|l| {
                    l.strip_prefix("model name")?
                        .split_once(':')
                        .map(|(_, v)| v.trim().to_string())
                })
            })
            .unwrap_or_else(|| "unknown".into());
        Machine {
            cpu,
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            load_average: load_average(),
        }
    }
}

/// The 1-minute load average (NaN without /proc).
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// What one bench wrote.
#[derive(Debug, Serialize, Deserialize)]
pub struct BenchFile {
    /// The bench's name.
    pub bench: String,
    /// The machine when it started.
    pub machine: Machine,
    /// The load average when it ended.
    pub load_average_after: f64,
    /// How long it ran.
    pub seconds: f64,
    /// What it measured.
    pub figures: Vec<Figure>,
}

/// Write `figures` to `target/bench/BENCH.json` and print them, so a bench run alone shows the
/// same lines as the report.
pub fn record(bench: &str, out: &Path, machine: Machine, started: std::time::Instant, figures: Vec<Figure>) {
    let file = BenchFile {
        bench: bench.into(),
        machine,
        load_average_after: load_average(),
        seconds: started.elapsed().as_secs_f64(),
        figures,
    };
    println!();
    print_table(&file.figures);
    std::fs::create_dir_all(out).unwrap();
    let path = out.join(format!("{bench}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&file).unwrap()).unwrap();
    println!("written to {}", path.display());
}

/// A number with the precision its size warrants.
pub fn number(v: f64) -> String {
    let a = v.abs();
    if a >= 1000.0 || v == v.trunc() && a >= 10.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// The table the report and each bench print: figure, median, spread, target, verdict.
pub fn print_table(figures: &[Figure]) {
    let width = figures.iter().map(|f| f.name.chars().count()).max().unwrap_or(6).max(6);
    println!(
        "{:<width$}  {:>10} {:<6} {:<44} {:<12} result",
        "figure", "median", "unit", "spread", "target"
    );
    for f in figures {
        let target = match f.target {
            Some(Target::AtMost(t)) => format!("≤ {}", number(t)),
            Some(Target::AtLeast(t)) => format!("≥ {}", number(t)),
            None => String::new(),
        };
        println!(
            "{:<width$}  {:>10} {:<6} {:<44} {:<12} {}",
            f.name,
            number(f.median),
            f.unit,
            format!("{}–{} ({})", number(f.low), number(f.high), f.spread),
            target,
            f.verdict()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::Paired;
    use std::cell::RefCell;

    #[test]
    fn pairs_alternate_which_goes_first_and_difference_within_each_pair() {
        // A machine that slows by 10 every measurement: b is 3 more than a in the same
        // conditions, so each pair's difference is 3 ± the drift between its two halves.
        let (clock, order) = (RefCell::new(0.0), RefCell::new(String::new()));
        let tick = |name: char, extra: f64| {
            *clock.borrow_mut() += 10.0;
            order.borrow_mut().push(name);
            *clock.borrow() + extra
        };
        let paired = Paired::measure(4, || tick('a', 0.0), || tick('b', 3.0));
        assert_eq!(*order.borrow(), "abbaabba");
        assert_eq!(paired.a, vec![10.0, 40.0, 50.0, 80.0]);
        assert_eq!(paired.b, vec![23.0, 33.0, 63.0, 73.0]);
        // Differences 13, −7, 13, −7: with the order alternated, the drift cancels.
        assert_eq!(paired.median_difference(), 3.0);
        // Ratios 2.3, 0.825, 1.26, 0.9125: their median is the mean of the middle two.
        assert!((paired.median_ratio() - (0.9125 + 1.26) / 2.0).abs() < 1e-12);
        assert_eq!((paired.median_a(), paired.median_b()), (45.0, 48.0));
    }
}
