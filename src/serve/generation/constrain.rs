//! A generation's grammar as its tokens come (structured outputs, [`crate::runtime::grammar`]):
//! the tokens that leave its text outside the grammar are masked before each pick, each token
//! picked moves its matcher on, and the next pick's mask is computed while the step that gives
//! the next logits runs, not after it. Each generation has its own matcher, so the rows of a
//! batch keep their own grammars.

use std::future::Future;

use crate::runtime::grammar::{Constrained, Mask};

use super::Params;

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
}

/// Leave only the tokens `constraint`'s grammar allows next in `logits` (all, without one).
pub(super) fn mask(constraint: Option<&Constraint>, logits: &mut [f32]) {
    if let Some(constraint) = constraint {
        constraint.mask.apply(logits);
    }
}

/// Move `constraint` on by `token`: true once its grammar is finished and nothing may follow
/// (never, without one).
pub(super) fn accept(constraint: Option<&mut Constraint>, token: u32) -> Result<bool, String> {
    constraint.map_or(Ok(false), |constraint| constraint.matcher.accept(token))
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
