//! An embeddings request for a dual encoder's tower ([`Kind::Tower`]: CLIP, SigLIP), whose
//! towers embed texts and images into one space. A model that is a text tower takes texts, and
//! images too when its config names its vision tower (`images`); a vision tower named directly
//! takes images. Each image is decoded and preprocessed as the vision tower's
//! `preprocessor_config.json` says; the texts run as one batch on the text tower, then the
//! images as one on the vision tower, and the vectors come back in the request's order,
//! normalized.
//!
//! [`Kind::Tower`]: crate::serve::service::Kind::Tower

use std::sync::Arc;

use tokenizers::Tokenizer;

use super::embed::{Vectors, cut, dimensions};
use super::job::{Failure, Invalid, Job, Run};
use super::tokens::{Limit, text_tokens};
use crate::core::signature::ModelSignature;
use crate::core::tensor::Tensor;
use crate::runtime::image::{self, MAX_IMAGE_BYTES, Preprocessor};
use crate::runtime::tower::Tower;
use crate::serve::service::{ModelEntry, Service};

/// One input, in the request's order.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// A text.
    Text(String),
    /// An image file's bytes.
    Image(Vec<u8>),
}

/// An embeddings request for a tower, as its API asked it.
#[derive(Debug, Clone, PartialEq)]
pub struct Asked {
    /// Its inputs, in its order.
    pub inputs: Vec<Input>,
    /// The field they came in (`input` or `messages`), for messages about an input.
    pub field: &'static str,
    /// Keep each vector's first this many dimensions.
    pub dimensions: Option<usize>,
    /// Cut a text longer than the model takes rather than refuse it; when the request does
    /// not say, the model's `auto_truncate`.
    pub truncate: Option<bool>,
}

/// Why an image sent as `characters` of base64 is refused before it is decoded: the bytes
/// they hold are more than an image file may have.
pub fn oversized(characters: usize) -> Option<String> {
    let bytes = characters / 4 * 3;
    // A file of the limit's size, in whole groups of four characters, reads as up to 2 more.
    (bytes > MAX_IMAGE_BYTES + 2).then(|| image::ImageError::TooManyBytes(bytes).to_string())
}

/// The text tower texts run on.
struct Texts {
    name: String,
    tower: Tower,
    signature: ModelSignature,
    tokenizer: Option<Arc<Tokenizer>>,
    limit: Limit,
}

/// The vision tower images run on.
struct Images {
    name: String,
    tower: Tower,
    preprocessor: Preprocessor,
}

/// An embeddings request checked against a tower.
pub struct Towers {
    model: String,
    /// The text tower, when the model is one.
    text: Option<Texts>,
    /// The vision tower, when the model is one or names one.
    vision: Option<Images>,
    inputs: Vec<Input>,
    field: &'static str,
    dimensions: Option<usize>,
    truncate: bool,
}

impl Towers {
    /// `asked` of `entry`, the dual encoder's `tower` (what
    /// [`Kind::tower`](crate::serve::service::Kind::tower) gives) of `service`: refused when it
    /// asks for more dimensions than the model's.
    pub fn new(service: &Service, entry: &ModelEntry, tower: &Tower, asked: Asked) -> Result<Towers, Invalid> {
        let dimensions = dimensions(asked.dimensions, tower.dimensions(&entry.signature))?;
        let vision = |vision: &ModelEntry| match vision.kind.tower() {
            // Checked when the models were read: a model's `images` names a vision tower.
            Some(tower @ Tower::Image(preprocessor, _)) => Some(Images {
                name: vision.config.name.clone(),
                tower: tower.clone(),
                preprocessor: preprocessor.clone(),
            }),
            _ => None,
        };
        let (text, vision) = match tower {
            Tower::Text { max_positions, .. } => (
                Some(Texts {
                    name: entry.config.name.clone(),
                    tower: tower.clone(),
                    signature: entry.signature.clone(),
                    tokenizer: entry.kind.tokenizer().cloned(),
                    limit: max_positions.map(|n| (n as usize, "max_position_embeddings")),
                }),
                (entry.config.images.as_deref())
                    .and_then(|v| service.model(v))
                    .and_then(vision),
            ),
            Tower::Image(..) => (None, vision(entry)),
        };
        Ok(Towers {
            model: entry.config.name.clone(),
            text,
            vision,
            inputs: asked.inputs,
            field: asked.field,
            dimensions,
            truncate: asked.truncate.unwrap_or(entry.config.auto_truncate),
        })
    }
}

/// What a [`Towers`] keeps for its answer: each run's tower and the indexes of its inputs.
pub struct Ready {
    runs: Vec<(Tower, Vec<usize>)>,
    dimensions: Option<usize>,
    /// The texts' tokens.
    tokens: usize,
}

impl Job for Towers {
    type Ready = Ready;
    type Answer = Vectors;

    fn model(&self) -> &str {
        &self.model
    }

    fn prepare(self, gone: &dyn Fn() -> bool) -> Result<(Ready, Vec<Run>), Invalid> {
        let (model, field) = (&self.model, self.field);
        let (mut texts, mut images) = (Vec::new(), Vec::new());
        for (i, input) in self.inputs.into_iter().enumerate() {
            if gone() {
                return Err(Invalid::new("the client went away", None));
            }
            match input {
                Input::Text(text) => {
                    let Some(tower) = &self.text else {
                        return Err(Invalid::new(
                            format!(
                                "model `{model}` embeds images only (a vision tower); send texts to its text tower"
                            ),
                            Some(field),
                        ));
                    };
                    let tokenizer = tower.tokenizer.as_ref().expect("a text tower has its tokenizer");
                    texts.push((i, text_tokens(tokenizer, i, &text, tower.limit, self.truncate)?));
                }
                Input::Image(bytes) => {
                    if self.vision.is_none() {
                        return Err(Invalid::new(
                            format!(
                                "model `{model}` embeds text only: its config names no vision tower (`models[].images`)"
                            ),
                            Some(field),
                        ));
                    }
                    images.push((i, bytes));
                }
            }
        }
        let tokens = texts.iter().map(|(_, ids)| ids.len()).sum();
        // The texts run first, then the images; the answer's headers are of the last run.
        let (mut runs, mut kept) = (Vec::new(), Vec::new());
        if let Some(tower) = self.text.filter(|_| !texts.is_empty()) {
            let (indexes, ids): (Vec<usize>, Vec<Vec<u32>>) = texts.into_iter().unzip();
            runs.push(Run {
                model: tower.name,
                inputs: tower.tower.text_batch(&tower.signature, &ids),
                output: tower.tower.output(),
                pads: false,
            });
            kept.push((tower.tower, indexes));
        }
        if let Some(tower) = self.vision.filter(|_| !images.is_empty()) {
            let mut pixels = Vec::with_capacity(images.len());
            for (i, bytes) in &images {
                if gone() {
                    return Err(Invalid::new("the client went away", None));
                }
                let at = match field {
                    "input" => format!("input[{i}]"),
                    _ => field.to_string(),
                };
                let rgb = image::decode(bytes).map_err(|e| Invalid::new(format!("`{at}`: {e}"), Some(field)))?;
                pixels.push(tower.preprocessor.pixels(&rgb));
            }
            let size = tower.preprocessor.size().expect("checked when the model was read");
            runs.push(Run {
                model: tower.name,
                inputs: vec![Tower::image_batch(pixels, size)],
                output: tower.tower.output(),
                pads: false,
            });
            kept.push((tower.tower, images.into_iter().map(|(i, _)| i).collect()));
        }
        let ready = Ready {
            runs: kept,
            dimensions: self.dimensions,
            tokens,
        };
        Ok((ready, runs))
    }

    fn answer(ready: Ready, outputs: Vec<Tensor>) -> Result<Vectors, Failure> {
        if outputs.len() != ready.runs.len() {
            return Err(Failure::Internal(format!(
                "{} outputs for {} runs",
                outputs.len(),
                ready.runs.len()
            )));
        }
        let mut vectors: Vec<(usize, Vec<f32>)> = Vec::new();
        for ((tower, indexes), output) in ready.runs.into_iter().zip(&outputs) {
            let out = tower.vectors(output).map_err(Failure::Internal)?;
            vectors.extend(indexes.into_iter().zip(out));
        }
        vectors.sort_by_key(|(i, _)| *i);
        let vectors = (vectors.into_iter())
            .map(|(_, vector)| cut(vector, ready.dimensions, true))
            .collect::<Result<_, _>>()?;
        Ok(Vectors {
            vectors,
            tokens: ready.tokens,
        })
    }
}
