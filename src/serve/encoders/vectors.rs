//! What an embeddings request answers, whichever kind embeds (a sentence encoder, a dual
//! encoder's tower): each input's vector, cut to the dimensions asked for.

use super::job::Invalid;
use crate::runtime::embedder::normalize;

/// The vectors of a request's inputs, in its order, and the tokens its texts were.
#[derive(Debug, Clone, PartialEq)]
pub struct Vectors {
    /// One vector per input.
    pub vectors: Vec<Vec<f32>>,
    /// The tokens of its texts, for `usage`.
    pub tokens: usize,
}

/// `dimensions` (how many of each vector's to keep) when the model's vectors, of `size` when
/// known, have that many.
pub(super) fn dimensions(dimensions: Option<usize>, size: Option<usize>) -> Result<Option<usize>, Invalid> {
    match (dimensions, size) {
        (Some(n), Some(size)) if n > size => Err(dimensions_above(n, size)),
        _ => Ok(dimensions),
    }
}

/// `vector` cut to its first `dimensions` (Matryoshka), normalized again when the model
/// normalizes, as sentence-transformers' `truncate_dim` then `normalize` would.
pub(super) fn cut(mut vector: Vec<f32>, dimensions: Option<usize>, normalizes: bool) -> Result<Vec<f32>, Invalid> {
    let Some(dimensions) = dimensions else {
        return Ok(vector);
    };
    if dimensions > vector.len() {
        return Err(dimensions_above(dimensions, vector.len()));
    }
    vector.truncate(dimensions);
    if normalizes {
        normalize(&mut vector);
    }
    Ok(vector)
}

/// The refusal of `dimensions` above the model's.
fn dimensions_above(dimensions: usize, size: usize) -> Invalid {
    Invalid::new(
        format!("`dimensions` is {dimensions}, above the model's {size}"),
        Some("dimensions"),
    )
}
