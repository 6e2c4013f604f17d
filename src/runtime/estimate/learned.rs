//! What runs really took, fed back into the estimate.
//!
//! Each observation is a run's size (its [`Dims`]) and its working memory, exact: the run raised
//! its arena's peak, the only time ONNX Runtime's statistics tell a run's own peak. (A run that
//! did not raise it is kept only so that its size is not measured again; one that failed to
//! allocate is an underrun for the metrics, but not kept: the memory that was free then says as
//! much about other work as about the run.) Two uses:
//!
//! - an **upper envelope**: a request never gets an estimate below what a run no larger in any
//!   dimension took (memory does not shrink as an input grows);
//! - a **refit**: once enough exact observations accumulate, the profile is fitted again over
//!   the start-up points and them, so sizes nobody ran yet are estimated from what was seen.
//!
//! At most [`MAX_SEEN`] observations are kept per model.

use std::sync::{PoisonError, RwLock};

use super::fit::fit;
use super::{Dims, MemoryProfile, ProfileSource, Term, monomial};
use crate::core::snapshot::EstimateSource;

/// Observations kept per model.
pub const MAX_SEEN: usize = 64;
/// Exact observations between two refits.
const REFIT_EVERY: usize = 8;

/// What a run was measured to need, in working bytes (beyond the weights).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observation {
    /// The run raised its arena's peak: this is what it took.
    Exactly(u64),
    /// The run failed to allocate: it needed more than this, what the arena had free.
    MoreThan(u64),
    /// The run did not raise its arena's peak: it took at most this (the peak less what was in
    /// use before it). Not a number to estimate by, but the size need not be measured again.
    AtMost(u64),
}

#[derive(Debug, Clone, Copy)]
struct Seen {
    dims: Dims,
    bytes: u64,
    exact: bool,
}

#[derive(Debug, Default)]
struct State {
    seen: Vec<Seen>,
    /// The latest refit (workspace, terms), once there is one.
    refit: Option<(f64, Vec<Term>)>,
    exact_since_refit: usize,
    refits: u64,
}

/// The observations of one model, shared by every request to it.
#[derive(Debug)]
pub struct Learned {
    /// Which axes are a batch (the fit never squares them).
    batch: Vec<bool>,
    /// The start-up points, refitted together with what runs took.
    measured: Vec<(Dims, u64)>,
    /// Config and KV-cache profiles are not refitted: the operator's numbers and the graph's
    /// layout stand, and only the envelope raises them.
    refittable: bool,
    /// A decoder's steps are not measured: its cache is sized from the graph, and each step
    /// is a new size (measuring every token would cost two arena reads a token).
    measures: bool,
    state: RwLock<State>,
}

/// What the store holds, for `/v2/models/{model}`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct LearnedView {
    /// Observations kept.
    pub observations: usize,
    /// Of them, exact.
    pub exact: usize,
    /// Refits so far.
    pub refits: u64,
    /// The refitted workspace and terms, when there is a refit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workspace_bytes: Option<f64>,
    /// The refitted terms.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub terms: Vec<Term>,
}

impl Learned {
    /// An empty store for `profile`.
    pub fn new(profile: &MemoryProfile) -> Learned {
        let (measured, refittable) = match &profile.source {
            ProfileSource::Measured { points, .. } => (points.iter().map(|(d, p)| (Dims::new(d), *p)).collect(), true),
            ProfileSource::Unmeasured { .. } => (Vec::new(), true),
            ProfileSource::Config | ProfileSource::KvCache { .. } => (Vec::new(), false),
        };
        Learned {
            measures: !matches!(profile.source, ProfileSource::KvCache { .. }),
            batch: profile
                .axes
                .iter()
                .take(super::MAX_AXES)
                .map(|a| a.role == super::AxisRole::Batch)
                .collect(),
            measured,
            refittable,
            state: RwLock::new(State::default()),
        }
    }

    /// The working memory (beyond weights) a run of `dims` is expected to need, and where the
    /// number comes from: the profile (or its refit), or the envelope of what runs took.
    pub fn working(&self, profile: &MemoryProfile, dims: &Dims) -> (f64, EstimateSource) {
        let state = self.state.read().unwrap_or_else(PoisonError::into_inner);
        let fitted = match &state.refit {
            Some((workspace, terms)) => {
                // The refit's own constant replaces the profile's workspace.
                workspace - profile.workspace_bytes
                    + terms.iter().map(|t| t.bytes * monomial(dims, &t.powers)).sum::<f64>()
            }
            None => profile.working_bytes(dims),
        };
        let floor = state
            .seen
            .iter()
            .filter(|s| s.exact && s.dims.within(dims))
            .map(|s| s.bytes)
            .max()
            .unwrap_or(0) as f64;
        // Observations are whole runs (workspace included); the estimate's parts keep the
        // workspace apart.
        let from_envelope = floor - profile.workspace_bytes;
        if from_envelope > fitted {
            (from_envelope, EstimateSource::Observed)
        } else {
            (fitted, profile.estimate_source())
        }
    }

    /// Whether a run of `dims` is worth measuring: no run at least as large in every
    /// dimension was measured yet (one that was tells what this one needs at most, and
    /// measuring costs two reads of the arena's statistics).
    pub fn wants(&self, dims: &Dims) -> bool {
        if !self.measures {
            return false;
        }
        let state = self.state.read().unwrap_or_else(PoisonError::into_inner);
        !state.seen.iter().any(|s| dims.within(&s.dims))
    }

    /// Record a run of `dims`. True when enough exact observations have come in that a
    /// [`refit`](Self::refit) is due (the caller runs it off the request's path).
    pub fn observe(&self, dims: Dims, observation: Observation) -> bool {
        // A failed allocation says what was free then, which other work may have taken: it
        // counts as an underrun, but raising every later estimate of the size to it would
        // send them all away for one moment of pressure (or one injected fault).
        let (bytes, exact) = match observation {
            Observation::Exactly(bytes) => (bytes, true),
            Observation::AtMost(bytes) => (bytes, false),
            Observation::MoreThan(_) => return false,
        };
        let mut state = self.state.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(same) = state.seen.iter_mut().find(|s| s.dims == dims) {
            // An exact number stands; a bound only fills in for one not yet known.
            if exact && (!same.exact || bytes > same.bytes) {
                (same.bytes, same.exact) = (bytes, true);
            }
        } else {
            if state.seen.len() >= MAX_SEEN {
                // A bound goes first; then an exact point that another no larger and no
                // cheaper covers (it adds nothing to the envelope); else the oldest.
                let bound = state.seen.iter().position(|s| !s.exact);
                let covered = || {
                    (0..state.seen.len()).find(|&i| {
                        let p = state.seen[i];
                        let covers =
                            |(j, q): (usize, &Seen)| j != i && q.exact && q.dims.within(&p.dims) && q.bytes >= p.bytes;
                        state.seen.iter().enumerate().any(covers)
                    })
                };
                let victim = bound.or_else(covered).unwrap_or(0);
                state.seen.remove(victim);
            }
            state.seen.push(Seen { dims, bytes, exact });
        }
        if exact {
            state.exact_since_refit += 1;
        }
        self.refittable && state.exact_since_refit >= REFIT_EVERY
    }

    /// Fit the profile again over the start-up points and the exact observations.
    pub fn refit(&self) {
        let points: Vec<(Dims, u64)> = {
            let state = self.state.read().unwrap_or_else(PoisonError::into_inner);
            let seen = state.seen.iter().filter(|s| s.exact).map(|s| (s.dims, s.bytes));
            self.measured.iter().copied().chain(seen).collect()
        };
        let fitted = fit(&self.batch, &points);
        let mut state = self.state.write().unwrap_or_else(PoisonError::into_inner);
        state.refit = Some((fitted.workspace, fitted.terms));
        state.exact_since_refit = 0;
        state.refits += 1;
    }

    /// What the store holds.
    pub fn view(&self) -> LearnedView {
        let state = self.state.read().unwrap_or_else(PoisonError::into_inner);
        LearnedView {
            observations: state.seen.len(),
            exact: state.seen.iter().filter(|s| s.exact).count(),
            refits: state.refits,
            workspace_bytes: state.refit.as_ref().map(|r| r.0),
            terms: state.refit.as_ref().map(|r| r.1.clone()).unwrap_or_default(),
        }
    }
}
