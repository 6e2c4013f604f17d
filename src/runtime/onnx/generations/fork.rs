//! Copies of a prompt's cache for the generations that share its run (OpenAI's `n`), made on
//! the device by the graph that arranges a batch ([`DecodeStep::forks`]).
//!
//! [`DecodeStep::forks`]: crate::core::backend::DecodeStep::forks

use super::{Cache, Caches, Row};
use crate::core::backend::{BackendError, Fork};
use crate::runtime::decoder::{DecoderLayout, Padding};
use crate::runtime::onnx::kernels::{Along, Kernels};

impl Caches {
    /// Copy `fork.from`'s rows as `fork.to`'s, on the device, in the cache that holds it: its
    /// key, value and mask rows gathered again with the copies after them, by the same graph
    /// that arranges a batch. Sequences held already are not copied again; a `from` not held
    /// copies nothing (the new sequences are then missing).
    pub(super) fn fork(
        &mut self,
        kernels: &mut Kernels,
        layout: &DecoderLayout,
        fork: &Fork,
    ) -> Result<(), BackendError> {
        let holds = |c: &Cache, seq: u64| c.rows.iter().position(|r| r.seq == seq && !r.gone);
        let held = |c: &Caches, seq: u64| {
            c.prefilled.iter().any(|(p, _)| holds(p, seq).is_some())
                || c.batch.as_ref().is_some_and(|b| holds(b, seq).is_some())
        };
        let to: Vec<u64> = fork.to.iter().copied().filter(|&seq| !held(self, seq)).collect();
        let cache = self
            .prefilled
            .iter_mut()
            .map(|(c, _)| c)
            .chain(self.batch.as_mut())
            .find(|c| holds(c, fork.from).is_some());
        let (Some(cache), false) = (cache, to.is_empty()) else {
            return Ok(());
        };
        let at = holds(cache, fork.from).expect("found above");
        let indices: Vec<i64> = (0..cache.rows.len() as i64)
            .chain(std::iter::repeat_n(at as i64, to.len()))
            .collect();
        let along = |axis| match layout.padding {
            Padding::Left => Along::left(axis, 0),
            Padding::Right => Along::right(axis, cache.len),
        };
        let (kv, mask) = kernels.gather(cache, layout, &indices, along)?;
        let row = cache.rows[at];
        cache.rows.extend(to.into_iter().map(|seq| Row { seq, ..row }));
        cache.kv = kv;
        cache.mask = mask;
        Ok(())
    }
}
