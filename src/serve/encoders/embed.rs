//! An embeddings request for a sentence encoder ([`Kind::Embedder`]: a sentence-transformers
//! folder): its inputs (texts, tokenized with the model's special tokens, or token ids as
//! sent) run as one batch, padded to the longest; each vector as the graph pooled it (or pooled
//! here from `last_hidden_state`, for a graph kept as exported), cut to `dimensions` (then
//! normalized again when the model normalizes). A dual encoder's tower answers with
//! [`Vectors`] too, cut the same way.
//!
//! [`Kind::Embedder`]: crate::serve::service::Kind::Embedder

use std::sync::Arc;

use serde_json::Value;
use tokenizers::Tokenizer;

use super::job::{Failure, Invalid, Job, Run, only_output};
use super::tokens::{Limit, limit, text_tokens, within};
use crate::core::signature::ModelSignature;
use crate::core::tensor::Tensor;
use crate::runtime::embedder::{Embedder, normalize};
use crate::serve::service::ModelEntry;

/// One input, as the request sent it.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// A text, to tokenize.
    Text(String),
    /// Token ids, as the body holds them (each checked to be one of the model's).
    Ids(Vec<Value>),
}

/// An embeddings request as its API asked it.
#[derive(Debug, Clone, PartialEq)]
pub struct Asked {
    /// Its inputs, in its order (none empty).
    pub inputs: Vec<Input>,
    /// Keep each vector's first this many dimensions.
    pub dimensions: Option<usize>,
    /// Cut an input longer than the model takes rather than refuse it; when the request does
    /// not say, the model's `auto_truncate`.
    pub truncate: Option<bool>,
}

/// An embeddings request checked against its sentence encoder.
pub struct Embed {
    model: String,
    /// How its token vectors are pooled.
    embedder: Embedder,
    tokenizer: Arc<Tokenizer>,
    signature: ModelSignature,
    limit: Limit,
    truncate: bool,
    dimensions: Option<usize>,
    /// Texts, or token ids of the model.
    inputs: Vec<Result<String, Vec<u32>>>,
}

impl Embed {
    /// `asked` of `entry`, a sentence encoder with `embedder`'s pooling and `tokenizer`
    /// (what [`Kind::embedder`](crate::serve::service::Kind::embedder) gives): refused when
    /// it asks for more dimensions than the model's or sends an id the model does not have.
    pub fn new(
        entry: &ModelEntry,
        (embedder, tokenizer): (Embedder, &Arc<Tokenizer>),
        asked: Asked,
    ) -> Result<Embed, Invalid> {
        let dimensions = dimensions(asked.dimensions, Embedder::size(&entry.signature))?;
        let vocabulary = tokenizer.get_vocab_size(true) as u64;
        let inputs = (asked.inputs.into_iter())
            .map(|input| match input {
                Input::Text(text) => Ok(Ok(text)),
                Input::Ids(ids) => ids.iter().map(|v| id(v, vocabulary)).collect::<Result<_, _>>().map(Err),
            })
            .collect::<Result<_, _>>()?;
        Ok(Embed {
            model: entry.config.name.clone(),
            embedder,
            tokenizer: Arc::clone(tokenizer),
            signature: entry.signature.clone(),
            limit: limit(entry, embedder.max_seq_length),
            truncate: asked.truncate.unwrap_or(entry.config.auto_truncate),
            dimensions,
            inputs,
        })
    }
}

/// `v`, when it is a token id below `vocabulary`.
fn id(v: &Value, vocabulary: u64) -> Result<u32, Invalid> {
    v.as_u64().filter(|&t| t < vocabulary).map(|t| t as u32).ok_or_else(|| {
        Invalid::new(
            format!(
                "`input` holds {v}, not a token id of the model (0 to {})",
                vocabulary - 1
            ),
            Some("input"),
        )
    })
}

/// What an [`Embed`] keeps for its answer.
pub struct Ready {
    embedder: Embedder,
    dimensions: Option<usize>,
    /// Each input's tokens.
    lengths: Vec<usize>,
}

impl Job for Embed {
    type Ready = Ready;
    type Answer = Vectors;

    fn model(&self) -> &str {
        &self.model
    }

    fn prepare(self, gone: &dyn Fn() -> bool) -> Result<(Ready, Vec<Run>), Invalid> {
        let (tokenizer, limit, truncate) = (&self.tokenizer, self.limit, self.truncate);
        let inputs: Vec<Vec<u32>> = (self.inputs.into_iter().enumerate())
            .map(|(i, input)| match input {
                _ if gone() => Err(Invalid::new("the client went away", None)),
                Ok(text) => text_tokens(tokenizer, i, &text, limit, truncate),
                Err(mut ids) => {
                    if let Some((limit, _)) = limit.filter(|_| truncate) {
                        ids.truncate(limit);
                    }
                    within(i, ids, limit)
                }
            })
            .collect::<Result<_, _>>()?;
        // The padding's id is never seen: the attention mask leaves it out of every token's
        // attention and the pooling reads only the tokens it keeps.
        let run = Run {
            model: self.model,
            inputs: Embedder::batch(&self.signature, &inputs, 0),
            output: Embedder::output(&self.signature),
            pads: true,
        };
        let ready = Ready {
            embedder: self.embedder,
            dimensions: self.dimensions,
            lengths: inputs.iter().map(Vec::len).collect(),
        };
        Ok((ready, vec![run]))
    }

    fn answer(ready: Ready, outputs: Vec<Tensor>) -> Result<Vectors, Failure> {
        let output = only_output(&outputs)?;
        let vectors = (ready
            .embedder
            .vectors(output, &ready.lengths)
            .map_err(Failure::Internal)?
            .into_iter())
        .map(|vector| cut(vector, ready.dimensions, ready.embedder.normalize))
        .collect::<Result<_, _>>()?;
        Ok(Vectors {
            vectors,
            tokens: ready.lengths.iter().sum(),
        })
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vector_cut_to_its_dimensions_is_normalized_again_when_the_model_normalizes() {
        assert_eq!(cut(vec![3.0, 4.0, 12.0], Some(2), true), Ok(vec![0.6, 0.8]));
        assert_eq!(cut(vec![3.0, 4.0, 12.0], Some(2), false), Ok(vec![3.0, 4.0]));
        assert_eq!(cut(vec![3.0, 4.0], None, true), Ok(vec![3.0, 4.0]));
        let above = Invalid::new("`dimensions` is 3, above the model's 2", Some("dimensions"));
        assert_eq!(cut(vec![3.0, 4.0], Some(3), true), Err(above.clone()));
        assert_eq!(dimensions(Some(3), Some(2)), Err(above));
        assert_eq!(dimensions(Some(3), None), Ok(Some(3)));
    }
}
