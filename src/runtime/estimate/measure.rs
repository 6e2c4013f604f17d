//! Measuring a model's profile at start-up: runs on zero inputs at several sizes along every
//! dynamic axis, each run's peak read from the session's own arena, then fitted.
//!
//! The arena reports only its all-time peak (`MaxInUse`), so a run's own peak is known when it
//! raises that peak; a run that does not is measured again on a fresh session. A size the model
//! refuses (an image smaller than its stride, audio shorter than its window) is skipped for the
//! next larger one, so a model with limits is still measured.

use std::time::{Duration, Instant};

use ort::memory::Allocator;
use ort::session::Session;

use super::fit::fit;
use super::{AxisRole, Dims, MAX_AXES, MemoryProfile, ProfileSource, axes_of};
use crate::config::ContextAxis;
use crate::core::tensor::{Tensor, TensorData};
use crate::runtime::onnx::{self, ModelSignature, arena};

/// Measuring adds no point after this long (the base run always happens).
const BUDGET: Duration = Duration::from_millis(1500);
/// No measuring run gets an input larger than this many elements.
const MAX_ELEMENTS: usize = 1 << 24;
/// The sizes tried for the smallest run, for every axis that is not a batch.
const BASE_SIZES: [u64; 4] = [16, 64, 256, 512];
/// An axis grows until its run's peak is at least this (and four times the base's), so the
/// arena's rounding of small blocks does not pass for the shape of the growth.
const SIGNAL_BYTES: u64 = 256 << 10;
/// The large run measuring ends with grows until its peak reaches this.
const LARGE_BYTES: u64 = 32 << 20;
/// Smallest runs tried before giving up.
const MAX_REFUSED: usize = 24;

/// A session to measure on, rebuilt when a run's peak cannot be told from an earlier one.
pub type Open<'a> = dyn FnMut() -> Result<(Session, Allocator), String> + 'a;

struct Probe<'a, 'b> {
    open: &'a mut Open<'b>,
    session: Option<(Session, Allocator)>,
    /// Arena bytes in use once the session was built (its weights, where they are in it).
    baseline: u64,
    /// The arena's all-time peak so far.
    peak: u64,
    signature: &'a ModelSignature,
    axes: &'a [super::Axis],
    /// How long the last run took, rebuilding included: the next, larger one takes longer.
    last_cost: Duration,
}

impl Probe<'_, '_> {
    fn ensure(&mut self) -> Result<(), String> {
        if self.session.is_none() {
            let (session, allocator) = (self.open)()?;
            let stats = arena::allocator_stats(&allocator)?;
            self.baseline = stats.active_bytes;
            self.peak = stats.peak_active_bytes;
            self.session = Some((session, allocator));
        }
        Ok(())
    }

    /// One run at `dims`, returning its peak working bytes.
    fn run(&mut self, dims: &Dims) -> Result<u64, String> {
        let started = Instant::now();
        let result = self.run_timed(dims);
        self.last_cost = started.elapsed();
        tracing::debug!(size = %describe(self.axes, dims), ms = self.last_cost.as_millis() as u64, ok = result.is_ok(), "measuring run");
        result
    }

    fn run_timed(&mut self, dims: &Dims) -> Result<u64, String> {
        let inputs = inputs_at(self.signature, self.axes, dims)?;
        self.ensure()?;
        let ran = self.run_once(inputs)?;
        if ran > self.peak {
            self.peak = ran;
            return Ok(ran.saturating_sub(self.baseline));
        }
        // Not above an earlier run's peak: this run's own is unknown, so measure it alone.
        self.session = None;
        self.ensure()?;
        let before = self.peak;
        // Built again rather than kept: a copy of every run's inputs for the rare rerun would
        // double what the largest measuring run holds.
        let ran = self.run_once(inputs_at(self.signature, self.axes, dims)?)?;
        self.peak = self.peak.max(ran);
        // At most the session's own start-up peak when even a fresh one did not move it.
        Ok(ran.max(before).saturating_sub(self.baseline))
    }

    /// Run once; the arena's peak after it (or the run's own error, if it failed).
    fn run_once(&mut self, inputs: Vec<Tensor>) -> Result<u64, String> {
        let (session, allocator) = self.session.as_mut().expect("ensured");
        let result = onnx::run(session, inputs, &[], None);
        let peak = arena::allocator_stats(allocator)?.peak_active_bytes;
        match result {
            Ok(_) => Ok(peak),
            Err(e) => {
                // A failed run may have moved the peak; later runs are judged against it.
                self.peak = self.peak.max(peak);
                Err(e.to_string())
            }
        }
    }
}

/// The shape and element count of each input of `signature` with its dynamic axes at `dims`,
/// or why a measuring run would not take it (an input over [`MAX_ELEMENTS`]). Allocates no
/// tensor, so sizes can be judged before any is built.
fn shapes_at(signature: &ModelSignature, axes: &[super::Axis], dims: &Dims) -> Result<Vec<(Vec<i64>, usize)>, String> {
    let shape_of = |spec: &crate::runtime::onnx::TensorSpec| -> Vec<i64> {
        let axis_of = |axis: usize| {
            axes.iter()
                .position(|a| a.at.iter().any(|at| at.input == spec.name && at.axis == axis))
                .filter(|&i| i < MAX_AXES)
        };
        (spec.shape.iter().enumerate())
            .map(|(axis, &dim)| {
                if dim != -1 {
                    dim
                } else {
                    axis_of(axis).map_or(1, |i| dims.get(i) as i64)
                }
            })
            .collect()
    };
    (signature.inputs.iter())
        .map(|spec| {
            let shape = shape_of(spec);
            let len = Tensor::element_count(&shape)
                .filter(|&n| n <= MAX_ELEMENTS)
                .ok_or_else(|| {
                    format!(
                        "input `{}` of shape {shape:?} is larger than a measuring run takes",
                        spec.name
                    )
                })?;
            Ok((shape, len))
        })
        .collect()
}

/// Zero inputs for `signature` with its dynamic axes at `dims`.
pub fn inputs_at(signature: &ModelSignature, axes: &[super::Axis], dims: &Dims) -> Result<Vec<Tensor>, String> {
    let shapes = shapes_at(signature, axes, dims)?;
    Ok((signature.inputs.iter().zip(shapes))
        .map(|(spec, (shape, len))| Tensor {
            name: spec.name.clone(),
            shape,
            data: TensorData::zeros(spec.datatype, len),
        })
        .collect())
}

/// `base` scaled by `factor` along axis `i`: a batch grows 1, 2, 4…, a size doubles from its base.
fn scaled(base: u64, factor: u64, role: AxisRole) -> u64 {
    match role {
        AxisRole::Batch => base.max(1) * factor,
        _ => base * factor,
    }
}

/// The smallest runs to try, in order: batch 1 and every other axis at 16, 64, 256 and 512;
/// then the same with one axis at 1 (a second input's batch that must match the first's).
fn bases(roles: &[AxisRole]) -> Vec<Dims> {
    let at = |size: u64, one: Option<usize>| {
        let values: Vec<u64> = (0..roles.len())
            .map(|i| match roles[i] {
                AxisRole::Batch => 1,
                _ if one == Some(i) => 1,
                _ => size,
            })
            .collect();
        Dims::new(&values)
    };
    let sizes: Vec<usize> = (0..roles.len()).filter(|&i| roles[i] != AxisRole::Batch).collect();
    let mut out: Vec<Dims> = BASE_SIZES.iter().map(|&v| at(v, None)).collect();
    for &v in &BASE_SIZES {
        out.extend(sizes.iter().map(|&i| at(v, Some(i))));
    }
    out.dedup();
    out
}

/// Measure a profile: `open` builds a fresh CPU session with its own arena (read through the
/// allocator it returns), `model_size` is the serialized model's size.
pub fn measure(
    open: &mut Open<'_>,
    signature: &ModelSignature,
    context: Option<&ContextAxis>,
    model_size: u64,
) -> MemoryProfile {
    let started = Instant::now();
    let mut axes = axes_of(signature, context);
    axes.truncate(MAX_AXES);
    let mut probe = Probe {
        open,
        session: None,
        baseline: 0,
        peak: 0,
        signature,
        axes: &axes,
        last_cost: Duration::ZERO,
    };
    if let Err(reason) = probe.ensure() {
        return MemoryProfile::weights_only(model_size, axes.clone(), reason);
    }
    // What the arena holds once the session is built, but never less than the serialized model:
    // initializers a provider keeps outside the arena (not copied into it, or pre-packed
    // elsewhere) do not show in its statistics, and counting only the arena took a 4.6 MB text
    // detector for 11 KiB of weights.
    let weights_bytes = probe.baseline.max(model_size);
    let mut plan = Plan {
        probe,
        roles: axes.iter().map(|a| a.role).collect(),
        started,
        base: Dims::default(),
        points: Vec::new(),
    };
    if let Err(reason) = plan.find_base() {
        return MemoryProfile::weights_only(weights_bytes, axes.clone(), reason);
    }
    let stuck = plan.each_axis();
    let joint = plan.pairs_and_joint(&stuck);
    plan.one_large(&joint);
    let batch: Vec<bool> = plan.roles.iter().map(|r| *r == AxisRole::Batch).collect();
    let fitted = fit(&batch, &plan.points);
    MemoryProfile {
        weights_bytes,
        workspace_bytes: fitted.workspace,
        axes: axes.clone(),
        terms: fitted.terms,
        source: ProfileSource::Measured {
            points: plan.points.iter().map(|(d, p)| (d.as_slice().to_vec(), *p)).collect(),
            measure_ms: started.elapsed().as_millis() as u64,
        },
    }
}

/// The measuring runs of one model, phase by phase.
struct Plan<'a, 'b> {
    probe: Probe<'a, 'b>,
    roles: Vec<AxisRole>,
    started: Instant,
    /// The smallest size the model takes.
    base: Dims,
    points: Vec<(Dims, u64)>,
}

impl Plan<'_, '_> {
    /// Whether another run fits the budget, taking it to cost four times the last one (a run
    /// costs about what its input's size is, and sizes double along one or two axes).
    fn in_budget(&self) -> bool {
        self.fits_budget(4)
    }

    /// Whether a run `growth` times as costly as the last fits the budget.
    fn fits_budget(&self, growth: u32) -> bool {
        self.started.elapsed() + growth * self.probe.last_cost < BUDGET
    }

    /// Whether a run the fit cannot do without (an axis's first size above the base, the first
    /// joint size) may still start: while any budget is left, whatever the last run cost. A fit
    /// with no second size along an axis extrapolates it flat, and the first run's cost (one-off
    /// planning, a busy machine) is a poor guide to the next one's: seen here, a base run of
    /// 333 ms on a starved machine left an image model with one point, and images of any size
    /// estimated at 48 KiB.
    fn needed_in_budget(&self) -> bool {
        self.started.elapsed() < BUDGET
    }

    /// Run at `dims`; the point is kept when the model takes it.
    fn try_at(&mut self, dims: Dims) -> Option<u64> {
        let peak = self.probe.run(&dims).ok()?;
        self.points.push((dims, peak));
        Some(peak)
    }

    /// `base` with the axes in `which` scaled by `factor`.
    fn scaled_base(&self, which: &[usize], factor: u64) -> Dims {
        which.iter().fold(self.base, |d, &i| {
            d.with(i, scaled(self.base.get(i), factor, self.roles[i]))
        })
    }

    /// The smallest size the model takes, or why none was found.
    fn find_base(&mut self) -> Result<(), String> {
        let mut refused: Vec<String> = Vec::new();
        for candidate in bases(&self.roles) {
            if !refused.is_empty() && (!self.in_budget() || refused.len() >= MAX_REFUSED) {
                break;
            }
            match self.probe.run(&candidate) {
                Ok(peak) => {
                    self.base = candidate;
                    self.points.push((candidate, peak));
                    return Ok(());
                }
                Err(e) => refused.push(format!("{}: {e}", describe(self.probe.axes, &candidate))),
            }
        }
        let first = refused.first().cloned().unwrap_or_default();
        Err(format!(
            "all {} measuring sizes tried were refused (first: {first})",
            refused.len()
        ))
    }

    /// Each axis alone: at least three sizes above the base (a refused size gives way to the
    /// next), and on until the peak clearly rises above the arena's allocation granularity.
    /// Returns the axes that cannot move alone.
    fn each_axis(&mut self) -> Vec<usize> {
        let base_peak = self.points[0].1;
        let mut stuck = Vec::new();
        for i in 0..self.roles.len() {
            let (mut got, mut last, mut factor, mut refused) = (0, base_peak, 2, 0);
            // Two refusals in a row past a size it took: the model's limit on this axis.
            while (got < 3 || last < (4 * base_peak).max(SIGNAL_BYTES))
                && factor <= 256
                && !(got > 0 && refused >= 2)
                && (self.in_budget() || (got == 0 && self.needed_in_budget()))
            {
                match self.try_at(self.scaled_base(&[i], factor)) {
                    Some(peak) => (got, last, refused) = (got + 1, peak, 0),
                    None => refused += 1,
                }
                factor *= 2;
            }
            if got == 0 {
                stuck.push(i);
            }
        }
        stuck
    }

    /// Two axes that cannot move alone (a second input's batch that must match the first's)
    /// may move together; then every axis that moves at once, which tells `P²` from `P·dᵢ`.
    /// Returns the axes that move.
    fn pairs_and_joint(&mut self, stuck: &[usize]) -> Vec<usize> {
        let mut joint: Vec<usize> = (0..self.roles.len()).filter(|i| !stuck.contains(i)).collect();
        for (n, &i) in stuck.iter().enumerate() {
            for &j in &stuck[n + 1..] {
                if joint.contains(&i) || joint.contains(&j) || !self.in_budget() {
                    continue;
                }
                for factor in [2, 4] {
                    if self.try_at(self.scaled_base(&[i, j], factor)).is_some() {
                        joint.extend([i, j]);
                    }
                }
            }
        }
        joint.sort_unstable();
        joint.dedup();
        if joint.len() >= 2 {
            for (n, factor) in [4, 8].into_iter().enumerate() {
                if self.in_budget() || (n == 0 && self.needed_in_budget()) {
                    self.try_at(self.scaled_base(&joint, factor));
                }
            }
        }
        joint
    }

    /// Then one item as large as the budget allows, up to tens of MiB: the requests admission
    /// must judge right are the large ones, and a runtime plans large tensors differently from
    /// small ones (reuses buffers, works in place), so small runs alone mislead the fit.
    fn one_large(&mut self, joint: &[usize]) {
        let sizes: Vec<usize> = joint
            .iter()
            .copied()
            .filter(|&i| self.roles[i] != AxisRole::Batch)
            .collect();
        let mut largest = self.points.iter().map(|p| p.1).max().unwrap_or(0);
        let mut factor = 16;
        // Each step doubles every size: the run costs 2^sizes times the last.
        let growth = 1u32 << sizes.len().min(8);
        while !sizes.is_empty() && largest < LARGE_BYTES && factor <= 64 && self.fits_budget(growth) {
            let dims = sizes
                .iter()
                .fold(self.base, |d, &i| d.with(i, self.base.get(i) * factor));
            if shapes_at(self.probe.signature, self.probe.axes, &dims).is_err() {
                break;
            }
            if let Some(peak) = self.try_at(dims) {
                largest = largest.max(peak);
            }
            factor *= 2;
        }
    }
}

fn describe(axes: &[super::Axis], dims: &Dims) -> String {
    let parts: Vec<String> = axes
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{}={}", a.name, dims.get(i)))
        .collect();
    parts.join(" ")
}
