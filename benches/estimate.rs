//! What estimating a request costs on its path: reading its size along every axis of the
//! model's profile, the profile's terms, and the envelope of observed runs — for the bundled
//! encoder's two axes with nothing observed yet, and for a three-axis image model with a full
//! store of observations (the most an estimate ever scans).
//!
//! `cargo bench --bench estimate` prints criterion's estimates, then the median of 100 000
//! individually timed estimates per scenario (timer included); the figures go to
//! `target/bench/estimate.json`. Target (issue 19): ≤ 1 µs per request.

use std::hint::black_box;
use std::time::Instant;

use criterion::Criterion;
use vramguard::core::tensor::{DataType, Tensor, TensorData};
use vramguard::runtime::estimate::learned::{Learned, MAX_SEEN, Observation};
use vramguard::runtime::estimate::{Axis, AxisRole, Dims, MemoryProfile, ProfileSource, Term};
use vramguard::testing::bench::{Figure, Machine, Target, out_dir, record};

fn axis(name: &str, role: AxisRole, input: &str, at: usize) -> Axis {
    Axis::single(name, role, input, at)
}

fn measured(axes: Vec<Axis>, terms: Vec<Term>) -> MemoryProfile {
    MemoryProfile {
        weights_bytes: 4_745_517,
        workspace_bytes: 4096.0,
        axes,
        terms,
        source: ProfileSource::Measured {
            points: Vec::new(),
            measure_ms: 0,
        },
    }
}

fn tensor(name: &str, shape: Vec<i64>) -> Tensor {
    let len = Tensor::element_count(&shape).unwrap();
    Tensor {
        name: name.into(),
        shape,
        data: TensorData::zeros(DataType::Fp32, len),
    }
}

/// One scenario: a profile, what was learned, and a request's inputs.
struct Scenario {
    name: &'static str,
    profile: MemoryProfile,
    learned: Learned,
    inputs: Vec<Tensor>,
}

impl Scenario {
    /// What the server does for each request: dims, then the envelope-raised estimate.
    fn estimate(&self) -> u64 {
        let dims = self.profile.dims_of(&self.inputs);
        let (working, source) = self.learned.working(&self.profile, &dims);
        self.profile.estimate_with(working, source).total_bytes
    }
}

fn scenarios() -> Vec<Scenario> {
    let encoder = measured(
        vec![
            axis("batch", AxisRole::Batch, "input", 0),
            axis("seq", AxisRole::Context, "input", 1),
        ],
        vec![
            Term {
                bytes: 1024.0,
                powers: vec![1, 1],
            },
            Term {
                bytes: 16.0,
                powers: vec![1, 2],
            },
        ],
    );
    let detector = measured(
        vec![
            axis("batch", AxisRole::Batch, "x", 0),
            axis("height", AxisRole::Size, "x", 2),
            axis("width", AxisRole::Size, "x", 3),
        ],
        vec![Term {
            bytes: 132.5,
            powers: vec![1, 1, 1],
        }],
    );
    let full = Learned::new(&detector);
    for i in 0..MAX_SEEN as u64 {
        full.observe(Dims::new(&[1, 32 * (i + 1), 640]), Observation::Exactly(1 << 20));
    }
    vec![
        Scenario {
            name: "encoder, nothing observed",
            learned: Learned::new(&encoder),
            profile: encoder,
            inputs: vec![tensor("input", vec![1, 128, 64])],
        },
        Scenario {
            name: "image, 64 observed",
            profile: detector,
            learned: full,
            inputs: vec![tensor("x", vec![1, 3, 960, 960])],
        },
    ]
}

fn main() {
    let (started, machine) = (Instant::now(), Machine::now());
    let scenarios = scenarios();
    let mut criterion = Criterion::default().configure_from_args();
    for s in &scenarios {
        criterion.bench_function(&format!("estimate/{}", s.name), |b| b.iter(|| black_box(s.estimate())));
    }
    criterion.final_summary();
    let mut figures = Vec::new();
    for s in &scenarios {
        let mut micros = Vec::with_capacity(100_000);
        for _ in 0..100_000 {
            let t = Instant::now();
            black_box(s.estimate());
            micros.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let figure =
            Figure::of_samples(format!("estimate median, {}", s.name), "µs", &micros).target(Target::AtMost(1.0));
        figures.push(figure);
    }
    record(
        "estimate",
        &out_dir(env!("CARGO_TARGET_TMPDIR")),
        machine,
        started,
        figures,
    );
}
