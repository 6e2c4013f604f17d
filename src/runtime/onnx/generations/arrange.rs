//! Re-arranging a model's batch of caches when rows join or leave, on the device, by the
//! graph that arranges values ([`Kernels::arrange`]): padding on the layout's side, and a
//! windowed layer's cache kept at its window.

use ort::value::DynValue;

use super::{Cache, Row};
use crate::core::backend::BackendError;
use crate::runtime::decoder::{DecoderLayout, Padding};
use crate::runtime::onnx::kernels::{Along, Kernels};

impl Kernels {
    /// After a step in which the rows of `batch` not in `stepped` took a masked slot, their
    /// caches as the model's attention needs them (`kv` and `mask`: the step's). A windowed
    /// layer's row is given back as it was: the operator lays a row's window out by its length,
    /// and writing the pad may have evicted its oldest position, which its next token, at the
    /// same length, still reads. Where the mask applies a sliding window by cache slot, the
    /// row's slot goes first instead of last (its old cache padded by one on the left): its
    /// window then spans its positions, not the pad.
    pub(super) fn settle_masked(
        &mut self,
        layout: &DecoderLayout,
        batch: &mut Cache,
        (kv, mask): (&mut [DynValue], &mut DynValue),
        stepped: &[usize],
    ) -> Result<(), BackendError> {
        let rows = batch.rows.len() as i64;
        let indices: Vec<i64> = (0..rows)
            .map(|at| {
                if stepped.contains(&(at as usize)) {
                    at
                } else {
                    rows + at
                }
            })
            .collect();
        let e = BackendError::Runtime;
        if let Some(window) = layout.window {
            for (i, value) in kv.iter_mut().enumerate().filter(|(i, _)| layout.windowed(i / 2)) {
                let along = Along::right(2, window.size as i64);
                *value = self
                    .arrange(value, 0, Some((&batch.kv[i], 0)), &indices, along)
                    .map_err(e)?;
            }
        }
        if let (Some(_), Some(before)) = (layout.slot_window, &batch.mask) {
            for (value, old) in kv.iter_mut().zip(&batch.kv) {
                *value = self
                    .arrange(value, 0, Some((old, 1)), &indices, Along::left(2, 0))
                    .map_err(e)?;
            }
            *mask = self
                .arrange(mask, 0, Some((before, 1)), &indices, Along::left(1, 0))
                .map_err(e)?;
            for (at, row) in batch.rows.iter_mut().enumerate() {
                row.lead += i64::from(!stepped.contains(&at));
            }
        }
        Ok(())
    }

    /// `batch` without its gone rows, and without the slots every kept row pads (leading ones
    /// when padded on the left, trailing ones on the right; a windowed layer keeps its window).
    pub(super) fn without_gone(&mut self, batch: Cache, layout: &DecoderLayout) -> Result<Cache, BackendError> {
        let side = layout.padding;
        let kept: Vec<usize> = (0..batch.rows.len()).filter(|&i| !batch.rows[i].gone).collect();
        let start = kept.iter().map(|&i| batch.rows[i].lead).min().unwrap_or(0);
        let end = kept.iter().map(|&i| batch.rows[i].past as i64).max().unwrap_or(0);
        let along = |axis| match side {
            Padding::Left => Along::left(axis, start),
            Padding::Right => Along::right(axis, end),
        };
        let indices: Vec<i64> = kept.iter().map(|&i| i as i64).collect();
        let (kv, mask) = self.gather(&batch, layout, &indices, along)?;
        let rows = kept
            .iter()
            .map(|&i| Row {
                lead: batch.rows[i].lead - start,
                ..batch.rows[i]
            })
            .collect();
        Ok(Cache {
            rows,
            kv,
            mask,
            len: match side {
                Padding::Left => batch.len - start,
                Padding::Right => end,
            },
        })
    }

    /// The rows of `cache` at `indices` (a row may come more than once): its key, value and
    /// mask values gathered, each axis arranged as `along` says of it, a windowed layer's kept
    /// at its window.
    pub(super) fn gather(
        &mut self,
        cache: &Cache,
        layout: &DecoderLayout,
        indices: &[i64],
        along: impl Fn(usize) -> Along,
    ) -> Result<(Vec<DynValue>, Option<DynValue>), BackendError> {
        let mut pick = |value: &DynValue, along: Along| {
            self.arrange(value, 0, None, indices, along)
                .map_err(BackendError::Runtime)
        };
        let kv = cache
            .kv
            .iter()
            .enumerate()
            .map(|(i, v)| pick(v, window_or(layout, i, along(2))))
            .collect::<Result<Vec<_>, _>>()?;
        let mask = cache.mask.as_ref().map(|m| pick(m, along(1))).transpose()?;
        Ok((kv, mask))
    }

    /// `a`'s rows then `b`'s, the shorter padded to the longer's length on the layout's side
    /// (a windowed layer's are both their window).
    pub(super) fn join(&mut self, a: Cache, b: Cache, layout: &DecoderLayout) -> Result<Cache, BackendError> {
        let side = layout.padding;
        let len = a.len.max(b.len);
        let (pad_a, pad_b) = (len - a.len, len - b.len);
        let indices: Vec<i64> = (0..(a.rows.len() + b.rows.len()) as i64).collect();
        let along = |axis| match side {
            Padding::Left => Along::left(axis, 0),
            Padding::Right => Along::right(axis, len),
        };
        let mut arrange = |x: &DynValue, y: &DynValue, along: Along, padded: bool| {
            let (pad_a, pad_b) = if padded { (pad_a, pad_b) } else { (0, 0) };
            self.arrange(x, pad_a, Some((y, pad_b)), &indices, along)
                .map_err(BackendError::Runtime)
        };
        let kv =
            a.kv.iter()
                .zip(&b.kv)
                .enumerate()
                .map(|(i, (x, y))| arrange(x, y, window_or(layout, i, along(2)), !layout.windowed(i / 2)))
                .collect::<Result<Vec<_>, _>>()?;
        let mask = match (&a.mask, &b.mask) {
            (Some(x), Some(y)) => Some(arrange(x, y, along(1), true)?),
            _ => None,
        };
        let lead = |pad| if side == Padding::Left { pad } else { 0 };
        let shift = |rows: Vec<Row>, pad| {
            rows.into_iter().map(move |r| Row {
                lead: r.lead + lead(pad),
                ..r
            })
        };
        let rows = shift(a.rows, pad_a).chain(shift(b.rows, pad_b)).collect();
        Ok(Cache { rows, kv, mask, len })
    }
}

/// How cache value `i` (layer-major, key first) is arranged along its sequence axis: a windowed
/// layer's keeps its whole window, unpadded (every row has it, laid out by its own length);
/// another layer's as `along` says.
fn window_or(layout: &DecoderLayout, i: usize, along: Along) -> Along {
    match layout.window {
        Some(window) if layout.windowed(i / 2) => Along::right(2, window.size as i64),
        _ => along,
    }
}
