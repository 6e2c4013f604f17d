//! A generation's grammar as its tokens come (structured outputs, [`crate::runtime::grammar`]):
//! the tokens that leave its text outside the grammar are masked before each pick, each token
//! picked moves its matcher on, and the next pick's mask is computed while the step that gives
//! the next logits runs, not after it. Each generation has its own matcher, so the rows of a
//! batch keep their own grammars.

use std::future::Future;

use crate::runtime::grammar::{Constrained, Mask};

use super::Params;
use super::sample::{Picked, Sampler};

/// A generation's matcher and the mask of its next pick.
pub(super) struct Constraint {
    matcher: Constrained,
    mask: Mask,
}

impl Constraint {
    /// At the start of `params`' grammar, if it has one.
    pub(super) fn new(params: &Params) -> Option<Constraint> {
        let (matcher, mask) = params.grammar.as_ref()?.start();
        Some(Constraint { matcher, mask })
    }

    /// Leave only the tokens the grammar allows next in `logits`.
    fn mask(&self, logits: &mut [f32]) {
        self.mask.apply(logits);
    }

    /// Move on by `token`: true once the grammar is finished and nothing may follow.
    fn accept(&mut self, token: u32) -> Result<bool, String> {
        self.matcher.accept(token)
    }
}

/// Pick the next token from `logits` with `sampler`, among those `constraint` allows, and
/// move the constraint on by it (not by an end-of-text token, in `eos`, which ends the
/// generation): with whether the grammar is finished.
pub(super) fn pick(
    constraint: &mut Option<Constraint>,
    sampler: &mut Sampler,
    logits: &mut [f32],
    eos: &[u32],
) -> Result<(Picked, bool), String> {
    let Some(constraint) = constraint else {
        return Ok((sampler.pick(logits), false));
    };
    constraint.mask(logits);
    let picked = sampler.pick(logits);
    let finished = match eos.contains(&picked.token) {
        true => false,
        false => constraint.accept(picked.token)?,
    };
    Ok((picked, finished))
}

/// Run `step`, with `constraint`'s next mask computed meanwhile: `step` is polled first, which
/// sends the step on its way, and the mask is computed while the pool runs it.
pub(super) async fn alongside<T>(
    constraint: Option<&mut Constraint>,
    step: impl Future<Output = T>,
) -> (T, Result<(), String>) {
    match constraint {
        None => (step.await, Ok(())),
        Some(constraint) => {
            let masked = async { constraint.matcher.mask().map(|mask| constraint.mask = mask) };
            futures_util::future::join(step, masked).await
        }
    }
}
