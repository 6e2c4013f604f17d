use super::fit::{candidates, fit};
use super::learned::{Learned, MAX_SEEN, Observation};
use super::*;

fn axis(name: &str, role: AxisRole, input: &str, at: usize) -> Axis {
    Axis::single(name, role, input, at)
}

/// The encoder's axes and a profile fitted from `points`.
fn fitted(axes: Vec<Axis>, points: &[(Dims, u64)]) -> MemoryProfile {
    let batch: Vec<bool> = axes.iter().map(|a| a.role == AxisRole::Batch).collect();
    let f = fit(&batch, points);
    MemoryProfile {
        weights_bytes: 0,
        workspace_bytes: f.workspace,
        axes,
        terms: f.terms,
        source: ProfileSource::Measured {
            points: points.iter().map(|(d, p)| (d.as_slice().to_vec(), *p)).collect(),
            measure_ms: 0,
        },
    }
}

fn encoder_axes() -> Vec<Axis> {
    vec![
        axis("batch", AxisRole::Batch, "input", 0),
        axis("seq", AxisRole::Context, "input", 1),
    ]
}

/// The plan `measure` runs for two axes: a base, three sizes along each, two joint sizes.
fn plan2(base: [u64; 2]) -> Vec<Dims> {
    let mut out = vec![Dims::new(&base)];
    for f in [2, 4, 8] {
        out.push(Dims::new(&[base[0] * f, base[1]]));
    }
    for f in [2, 4, 8] {
        out.push(Dims::new(&[base[0], base[1] * f]));
    }
    for f in [4, 8] {
        out.push(Dims::new(&[base[0] * f, base[1] * f]));
    }
    out
}

fn within(estimate: u64, truth: u64, factor: f64) -> bool {
    let (e, t) = (estimate as f64, truth as f64);
    e <= t * factor && e * factor >= t
}

/// What `GET /v2/models/{model}` shows of a profile reads back as the same profile (the drill
/// sizes its requests from it).
#[test]
fn a_profile_reads_back_from_what_the_server_shows() {
    let profile = MemoryProfile {
        weights_bytes: 4_745_517,
        workspace_bytes: 170.5,
        axes: encoder_axes(),
        terms: vec![Term {
            bytes: 16.0,
            powers: vec![1, 2],
        }],
        source: ProfileSource::Measured {
            points: vec![(vec![1, 16], 68_096), (vec![4, 16], 271_872)],
            measure_ms: 12,
        },
    };
    let shown = serde_json::to_value(&profile).unwrap();
    assert_eq!(shown["source"], "measured");
    assert_eq!(serde_json::from_value::<MemoryProfile>(shown).unwrap(), profile);
}

/// The bundled encoder's attention: `batch·(16·seq² + 512·seq) + 4096`, recovered exactly from
/// the points measuring takes, and so exact far outside them.
#[test]
fn attention_is_recovered_exactly_over_batch_and_sequence() {
    let truth = |d: &Dims| 4096 + d.get(0) * (512 * d.get(1) + 16 * d.get(1) * d.get(1));
    let points: Vec<(Dims, u64)> = plan2([1, 16]).into_iter().map(|d| (d, truth(&d))).collect();
    let profile = fitted(encoder_axes(), &points);
    let seq2 = profile
        .terms
        .iter()
        .find(|t| t.powers == vec![1, 2])
        .expect("a batch·seq² term");
    assert!((seq2.bytes - 16.0).abs() < 1e-6, "{}", profile.formula());
    for dims in [Dims::new(&[1, 4096]), Dims::new(&[8, 1000]), Dims::new(&[3, 7])] {
        let e = profile.estimate(&dims);
        let exact = truth(&dims);
        assert!(
            e.context_bytes + e.workspace_bytes >= exact - 2 && e.context_bytes + e.workspace_bytes <= exact + 2,
            "{dims:?}: {e:?} vs {exact}"
        );
    }
}

/// A convolution's activations grow with batch × height × width: fitted from small images, an
/// image of 2048×2048 is estimated within 1.5× (the text detector was estimated at 68 KB
/// against 570 MB measured when only one axis was seen).
#[test]
fn an_image_model_is_estimated_from_height_times_width() {
    let axes = vec![
        axis("batch", AxisRole::Batch, "x", 0),
        axis("height", AxisRole::Size, "x", 2),
        axis("width", AxisRole::Size, "x", 3),
    ];
    // 136 bytes per pixel (34 float channels) and a little per row, as feature maps have.
    let truth = |d: &Dims| 200_000 + d.get(0) * (136 * d.get(1) * d.get(2) + 64 * d.get(1));
    let mut plan = vec![Dims::new(&[1, 32, 32])];
    for i in 0..3 {
        for f in [2, 4, 8] {
            let base = plan[0];
            plan.push(base.with(i, base.get(i) * f));
        }
    }
    plan.push(Dims::new(&[4, 128, 128]));
    let points: Vec<(Dims, u64)> = plan.into_iter().map(|d| (d, truth(&d))).collect();
    let profile = fitted(axes, &points);
    for dims in [
        Dims::new(&[1, 2048, 2048]),
        Dims::new(&[1, 320, 320]),
        Dims::new(&[2, 960, 544]),
    ] {
        let e = profile.estimate(&dims);
        assert!(
            within(e.context_bytes + e.workspace_bytes, truth(&dims), 1.5),
            "{dims:?}: {} vs {}",
            e.total_bytes,
            truth(&dims)
        );
    }
}

/// Two inputs that grow apart (`a·n + b·m`) are not a product: each axis has its own term.
#[test]
fn inputs_that_grow_separately_get_a_term_each() {
    let axes = vec![axis("n", AxisRole::Size, "a", 0), axis("m", AxisRole::Size, "b", 0)];
    let truth = |d: &Dims| 1000 + 1000 * d.get(0) + 4000 * d.get(1);
    let points: Vec<(Dims, u64)> = plan2([16, 16]).into_iter().map(|d| (d, truth(&d))).collect();
    let profile = fitted(axes, &points);
    for dims in [
        Dims::new(&[100_000, 16]),
        Dims::new(&[16, 100_000]),
        Dims::new(&[5000, 5000]),
    ] {
        let e = profile.estimate(&dims);
        assert!(
            within(e.context_bytes + e.workspace_bytes, truth(&dims), 1.5),
            "{dims:?}: {}",
            profile.formula()
        );
    }
}

#[test]
fn noise_never_makes_larger_inputs_cheaper() {
    // A slightly concave measurement along one axis; every coefficient stays non-negative.
    let axes = vec![axis("seq", AxisRole::Context, "x", 0)];
    let points: Vec<(Dims, u64)> = [(16, 10_000), (32, 19_000), (64, 36_000), (128, 68_000), (256, 130_000)]
        .iter()
        .map(|&(n, y)| (Dims::new(&[n]), y))
        .collect();
    let profile = fitted(axes, &points);
    assert!(profile.terms.iter().all(|t| t.bytes >= 0.0) && profile.workspace_bytes >= 0.0);
    assert!(profile.estimate(&Dims::new(&[512])).total_bytes > profile.estimate(&Dims::new(&[256])).total_bytes);
}

#[test]
fn a_single_point_is_a_constant() {
    let f = fit(&[false], &[(Dims::new(&[16]), 5000)]);
    assert_eq!((f.workspace, f.terms.len()), (5000.0, 0));
}

#[test]
fn candidates_are_distinct_and_never_square_a_batch() {
    assert_eq!(candidates(&[false]), vec![vec![0], vec![1], vec![2]]);
    assert_eq!(candidates(&[false, false]).len(), 1 + 2 + 1 + 2 + 1);
    // A batch is never squared: batch·seq² and nothing with batch².
    assert_eq!(
        candidates(&[true, false]),
        vec![vec![0, 0], vec![1, 0], vec![0, 1], vec![1, 1], vec![1, 2]]
    );
}

#[test]
fn configured_profiles_scale_with_batch_and_split_into_parts() {
    let profile = MemoryProfile {
        weights_bytes: 1000,
        workspace_bytes: 100.0,
        axes: encoder_axes(),
        terms: vec![
            Term {
                bytes: 10.0,
                powers: vec![1, 1],
            },
            Term {
                bytes: 1.0,
                powers: vec![1, 2],
            },
        ],
        source: ProfileSource::Config,
    };
    let e = profile.estimate_tokens(10, 2);
    assert_eq!(e.context_bytes, 2 * (100 + 100));
    assert_eq!(e.workspace_bytes, 100);
    assert_eq!(e.total_bytes, 1000 + 400 + 100);
    assert_eq!(e.source, EstimateSource::Config);
}

#[test]
fn absurd_inputs_saturate_at_the_ceiling_so_sums_cannot_overflow() {
    let profile = MemoryProfile {
        weights_bytes: u64::MAX,
        workspace_bytes: f64::INFINITY,
        axes: encoder_axes(),
        terms: vec![Term {
            bytes: 1e12,
            powers: vec![2, 2],
        }],
        source: ProfileSource::Config,
    };
    let e = profile.estimate(&Dims::new(&[u64::MAX, u64::MAX]));
    assert_eq!(e.weights_bytes, ESTIMATE_CEILING);
    assert_eq!(e.context_bytes, ESTIMATE_CEILING);
    assert_eq!(e.workspace_bytes, ESTIMATE_CEILING);
    assert_eq!(e.total_bytes, 3 * ESTIMATE_CEILING);
}

#[test]
fn a_request_is_read_along_every_axis_and_shared_names_are_one_axis() {
    use crate::core::tensor::{DataType, TensorData};
    let spec = |name: &str, shape: Vec<i64>, symbols: Vec<&str>| crate::runtime::onnx::TensorSpec {
        name: name.into(),
        datatype: DataType::Fp32,
        shape,
        symbols: symbols.into_iter().map(String::from).collect(),
    };
    let signature = ModelSignature {
        inputs: vec![
            spec("image", vec![-1, 3, -1, -1], vec!["N", "", "h", "?"]),
            spec("mask", vec![-1, -1, -1], vec!["N", "h", "?"]),
            spec("extra", vec![-1, 5], vec!["", ""]),
        ],
        outputs: vec![],
    };
    let axes = axes_of(&signature, None);
    let names: Vec<(&str, AxisRole)> = axes.iter().map(|a| (a.name.as_str(), a.role)).collect();
    assert_eq!(
        names,
        [
            ("N", AxisRole::Batch),
            ("h", AxisRole::Size),
            ("image[3]", AxisRole::Size),
            ("mask[2]", AxisRole::Size),
            ("extra[0]", AxisRole::Batch)
        ]
    );
    assert_eq!(axes[1].at.len(), 2);
    let profile = MemoryProfile::weights_only(0, axes, String::new());
    let tensor = |name: &str, shape: Vec<i64>| Tensor {
        name: name.into(),
        data: TensorData::zeros(DataType::Fp32, Tensor::element_count(&shape).unwrap()),
        shape,
    };
    let dims = profile.dims_of(&[tensor("image", vec![2, 3, 64, 48])]);
    // `?` is a placeholder, not a shared axis; `mask` and `extra` are absent and read as 1.
    assert_eq!(dims.as_slice(), &[2, 64, 48, 1, 1]);
}

fn learned_encoder() -> (MemoryProfile, Learned) {
    let truth = |d: &Dims| 4096 + d.get(0) * 16 * d.get(1) * d.get(1);
    let points: Vec<(Dims, u64)> = plan2([1, 16]).into_iter().map(|d| (d, truth(&d))).collect();
    let profile = fitted(encoder_axes(), &points);
    let learned = Learned::new(&profile);
    (profile, learned)
}

/// A run that took more than the profile said raises later estimates for the same size and
/// every larger one, and not for smaller ones.
#[test]
fn an_observed_run_larger_than_the_profile_raises_later_estimates() {
    let (profile, learned) = learned_encoder();
    let dims = Dims::new(&[1, 512]);
    let (before, source) = learned.working(&profile, &dims);
    assert_eq!(source, EstimateSource::Profile);
    let took = 3 * (before as u64 + 4096);
    learned.observe(dims, Observation::Exactly(took));
    let (after, source) = learned.working(&profile, &dims);
    assert_eq!(source, EstimateSource::Observed);
    assert!((after + profile.workspace_bytes - took as f64).abs() < 1.0);
    assert!(learned.working(&profile, &Dims::new(&[2, 512])).0 >= after);
    assert_eq!(
        learned.working(&profile, &Dims::new(&[1, 256])).1,
        EstimateSource::Profile
    );
}

/// A run that failed to allocate is not kept: what was free then depends on other work.
#[test]
fn a_failed_allocation_does_not_raise_later_estimates() {
    let (profile, learned) = learned_encoder();
    let dims = Dims::new(&[1, 64]);
    let before = learned.working(&profile, &dims);
    assert!(!learned.observe(dims, Observation::MoreThan(1 << 30)));
    assert_eq!(learned.working(&profile, &dims), before);
    assert_eq!(learned.view().observations, 0);
}

/// Exact observations refit the profile: a model that grows faster than measured at start-up
/// is estimated from what runs took, at sizes no run had.
#[test]
fn exact_observations_refit_the_profile() {
    let (profile, learned) = learned_encoder();
    let mut due = false;
    for n in [300u64, 400, 500, 600, 700, 800, 900, 1000] {
        due = learned.observe(Dims::new(&[1, n]), Observation::Exactly(4096 + 32 * n * n));
    }
    assert!(due, "eight exact observations make a refit due");
    learned.refit();
    let far = Dims::new(&[1, 4000]);
    let (working, source) = learned.working(&profile, &far);
    assert_eq!(source, EstimateSource::Profile);
    let truth = 32.0 * 4000.0 * 4000.0;
    assert!(
        working >= 0.9 * (16.0 * 4000.0 * 4000.0) && working <= 1.5 * truth,
        "{working} vs {truth}"
    );
    assert_eq!(learned.view().refits, 1);
}

#[test]
fn the_store_is_bounded() {
    let (_, learned) = learned_encoder();
    for n in 0..(3 * MAX_SEEN as u64) {
        learned.observe(Dims::new(&[1, n + 1]), Observation::Exactly(n));
    }
    assert_eq!(learned.view().observations, MAX_SEEN);
}

/// A run that did not raise its arena's peak is an upper bound: its size is not measured again,
/// and no estimate is raised (or lowered) by it.
#[test]
fn a_bound_stops_measuring_a_size_without_changing_its_estimate() {
    let (profile, learned) = learned_encoder();
    let dims = Dims::new(&[1, 512]);
    let before = learned.working(&profile, &dims);
    assert!(learned.wants(&dims));
    assert!(!learned.observe(dims, Observation::AtMost(1 << 40)));
    assert!(!learned.wants(&dims) && !learned.wants(&Dims::new(&[1, 256])));
    assert!(learned.wants(&Dims::new(&[1, 1024])));
    assert_eq!(learned.working(&profile, &dims), before);
    // An exact number replaces the bound, and a later bound does not replace it.
    learned.observe(dims, Observation::Exactly(64 << 20));
    learned.observe(dims, Observation::AtMost(1 << 40));
    assert_eq!(learned.view().exact, 1);
    let (working, source) = learned.working(&profile, &dims);
    assert_eq!(source, EstimateSource::Observed);
    assert!((working + profile.workspace_bytes - (64 << 20) as f64).abs() < 1.0);
}

/// A full store gives up bounds before exact observations.
#[test]
fn bounds_go_before_exact_observations() {
    let (_, learned) = learned_encoder();
    learned.observe(Dims::new(&[1, 10_000]), Observation::Exactly(1 << 30));
    for n in 0..(2 * MAX_SEEN as u64) {
        learned.observe(Dims::new(&[2, n + 1]), Observation::AtMost(1 << 20));
    }
    let view = learned.view();
    assert_eq!((view.observations, view.exact), (MAX_SEEN, 1));
}
