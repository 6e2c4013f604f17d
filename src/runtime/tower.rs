//! Dual encoders for image search (CLIP, SigLIP): one graph per tower, each giving the vector of
//! the shared space with its projection applied, as Optimum exports them
//! (`clip-text-with-projection`: `input_ids` to `text_embeds`; a vision tower with its
//! projection: `pixel_values` to `image_embeds`; SigLIP's towers, whose pooling head is their
//! projection: `pooler_output`). A text's vector and an image's are compared by
//! cosine, so both are given normalized: the two towers' vectors are then in one space and
//! their dot products are CLIP's similarities.

use std::path::Path;

use serde_json::Value;

use super::embedder::Embedder;
use super::folder::json;
use super::image::{PREPROCESSOR_CONFIG, Preprocessor};
use crate::core::signature::ModelSignature;
use crate::core::tensor::{DataType, Tensor, TensorData};

/// A text tower's output: `[batch, dimensions]`.
pub const TEXT_EMBEDS: &str = "text_embeds";
/// A vision tower's output: `[batch, dimensions]`.
pub const IMAGE_EMBEDS: &str = "image_embeds";
/// A vision tower's input: `[batch, 3, height, width]`.
pub const PIXEL_VALUES: &str = "pixel_values";
/// A SigLIP tower's output: its features (`get_text_features`, `get_image_features`).
pub const POOLER_OUTPUT: &str = "pooler_output";

/// One tower of a dual encoder.
#[derive(Debug, Clone, PartialEq)]
pub enum Tower {
    /// Token ids in, `text_embeds` out.
    Text {
        /// The most tokens a text may have: `config.json`'s `text_config.max_position_embeddings`
        /// (a CLIP folder's), else its `max_position_embeddings` (a text tower's own).
        max_positions: Option<u64>,
        /// SigLIP's: every text is padded to `max_positions` with this id, as its processor is
        /// told to (`padding="max_length"`): its attention is not causal and takes no mask, and
        /// its vector is read at the last position, so the padding is part of every vector.
        pad: Option<u32>,
        /// The output that holds its vectors.
        output: &'static str,
    },
    /// `pixel_values` in, vectors out (the output named), made as the folder's
    /// `preprocessor_config.json` says.
    Image(Preprocessor, &'static str),
}

impl Tower {
    /// The tower a graph of `signature` in `folder` is, or `None` when it gives neither
    /// `text_embeds` nor `image_embeds`; an error names the file and key, or the graph's
    /// input or output, that is wrong.
    pub fn read(folder: Option<&Path>, signature: &ModelSignature) -> Result<Option<Tower>, String> {
        let gives = |name: &str| signature.outputs.iter().find(|o| o.name == name);
        let config = match folder {
            Some(folder) => json(folder, "config.json")?,
            None => None,
        };
        let siglip = config.as_ref().is_some_and(|c| c["model_type"] == "siglip");
        let takes_text = signature.inputs.iter().any(|i| i.name == "input_ids");
        let (output, tower) = match (gives(TEXT_EMBEDS), gives(IMAGE_EMBEDS), gives(POOLER_OUTPUT)) {
            (Some(_), Some(_), _) => {
                return Err(format!(
                    "it gives both `{TEXT_EMBEDS}` and `{IMAGE_EMBEDS}` (both towers in one graph, which would run both for every input): export each tower alone (docs/embeddings.md, image search)"
                ));
            }
            (Some(output), None, _) => (output, Tower::text(config.as_ref(), signature, None)?),
            (None, Some(output), _) => (output, Tower::image(folder, signature, IMAGE_EMBEDS)?),
            (None, None, Some(output)) if siglip && takes_text => {
                let pad = config.as_ref().and_then(|c| c["text_config"]["pad_token_id"].as_u64());
                let pad = pad.unwrap_or(0) as u32;
                (output, Tower::text(config.as_ref(), signature, Some(pad))?)
            }
            (None, None, Some(output)) if siglip => (output, Tower::image(folder, signature, POOLER_OUTPUT)?),
            _ => return Ok(None),
        };
        if output.datatype != DataType::Fp32 || output.shape.len() != 2 {
            return Err(format!(
                "output `{}` is {} of rank {}, not FP32 [batch, dimensions]",
                output.name,
                output.datatype.name(),
                output.shape.len()
            ));
        }
        Ok(Some(tower))
    }

    /// A text tower: `input_ids` (and `attention_mask` when it takes one), INT64; SigLIP's
    /// (`pad`) gives `pooler_output`.
    fn text(config: Option<&Value>, signature: &ModelSignature, pad: Option<u32>) -> Result<Tower, String> {
        for input in &signature.inputs {
            match input.name.as_str() {
                "input_ids" | "attention_mask" if input.datatype == DataType::Int64 => {}
                name => {
                    return Err(format!(
                        "input `{name}` ({}) is not one a text tower is given (INT64 `input_ids`, `attention_mask`)",
                        input.datatype.name()
                    ));
                }
            }
        }
        if !signature.inputs.iter().any(|i| i.name == "input_ids") {
            return Err("it gives `text_embeds` but has no input `input_ids`".into());
        }
        let max_positions = config.and_then(|c| {
            [
                &c["text_config"]["max_position_embeddings"],
                &c["max_position_embeddings"],
            ]
            .into_iter()
            .find_map(Value::as_u64)
        });
        if pad.is_some() && max_positions.is_none() {
            return Err(
                "a SigLIP text tower's config.json has no `text_config.max_position_embeddings` to pad its texts to"
                    .into(),
            );
        }
        let output = if pad.is_some() { POOLER_OUTPUT } else { TEXT_EMBEDS };
        Ok(Tower::Text {
            max_positions,
            pad,
            output,
        })
    }

    /// A vision tower: FP32 `pixel_values` alone, of three channels and (where its size is
    /// fixed) the size its preprocessing gives.
    fn image(folder: Option<&Path>, signature: &ModelSignature, output: &'static str) -> Result<Tower, String> {
        let preprocessor = match folder {
            Some(folder) => Preprocessor::read(folder)?.ok_or_else(|| {
                format!(
                    "it gives `{IMAGE_EMBEDS}` but {} is missing (save the model's image processor beside it)",
                    folder.join(PREPROCESSOR_CONFIG).display()
                )
            })?,
            None => {
                return Err(format!(
                    "it gives `{IMAGE_EMBEDS}` but has no folder for its `{PREPROCESSOR_CONFIG}`"
                ));
            }
        };
        let (height, width) = preprocessor.size()?;
        match signature.inputs.as_slice() {
            [input] if input.name == PIXEL_VALUES && input.datatype == DataType::Fp32 && input.shape.len() == 4 => {
                let fits = |dim: i64, size: usize| dim == -1 || dim == size as i64;
                if !(fits(input.shape[1], 3) && fits(input.shape[2], height) && fits(input.shape[3], width)) {
                    return Err(format!(
                        "input `{PIXEL_VALUES}` is of shape {:?}; its preprocessing gives [batch, 3, {height}, {width}]",
                        input.shape
                    ));
                }
                Ok(Tower::Image(preprocessor, output))
            }
            _ => Err(format!(
                "it gives `{IMAGE_EMBEDS}` but its inputs are {}, not FP32 `{PIXEL_VALUES}` [batch, 3, height, width] alone",
                signature.input_names()
            )),
        }
    }

    /// `signature` with what the tower fixes made fixed: a vision tower's `pixel_values` take
    /// 3 channels and its preprocessing's height and width, whatever the export left dynamic.
    /// The memory profile is measured, health checks probe and estimates are made along the
    /// axes left (the batch): at another size the graph would not run (CLIP's position
    /// embeddings are for one number of patches).
    pub fn pinned(&self, mut signature: ModelSignature) -> ModelSignature {
        if let Tower::Image(preprocessor, _) = self {
            let (height, width) = preprocessor.size().expect("checked by read");
            for input in signature.inputs.iter_mut().filter(|i| i.name == PIXEL_VALUES) {
                input.shape[1..].copy_from_slice(&[3, height as i64, width as i64]);
            }
        }
        signature
    }

    /// The output that holds its vectors.
    pub fn output(&self) -> &'static str {
        match self {
            Tower::Text { output, .. } | Tower::Image(_, output) => output,
        }
    }

    /// What it embeds, for messages.
    pub fn label(&self) -> &'static str {
        match self {
            Tower::Text { .. } => "text",
            Tower::Image(..) => "images",
        }
    }

    /// The size of its vectors, when the graph fixes it.
    pub fn dimensions(&self, signature: &ModelSignature) -> Option<usize> {
        let output = signature.outputs.iter().find(|o| o.name == self.output())?;
        usize::try_from(output.shape[1]).ok()
    }

    /// The inputs that run `texts` (token ids each) through a text tower: padded to the
    /// longest, as an embedder's batch, with only the inputs the graph takes. The padding never
    /// reaches a CLIP text's vector: its text attention is causal and its vector is read at the
    /// text's end token, before the padding. A SigLIP text is padded to its positions.
    pub fn text_batch(&self, signature: &ModelSignature, texts: &[Vec<u32>]) -> Vec<Tensor> {
        let (pad, texts) = match self {
            Tower::Text {
                pad: Some(pad),
                max_positions: Some(n),
                ..
            } => {
                let length = |t: &Vec<u32>| (*n as usize).max(t.len());
                let padded = texts
                    .iter()
                    .map(|t| {
                        t.iter()
                            .copied()
                            .chain(std::iter::repeat(*pad))
                            .take(length(t))
                            .collect()
                    })
                    .collect();
                (*pad, std::borrow::Cow::Owned(padded))
            }
            _ => (0, std::borrow::Cow::Borrowed(texts)),
        };
        Embedder::batch(signature, &texts, pad)
            .into_iter()
            .filter(|t| signature.inputs.iter().any(|i| i.name == t.name))
            .collect()
    }

    /// The `pixel_values` of images each preprocessed to `[3, height, width]`.
    pub fn image_batch(images: Vec<Vec<f32>>, (height, width): (usize, usize)) -> Tensor {
        let shape = vec![images.len() as i64, 3, height as i64, width as i64];
        Tensor {
            name: PIXEL_VALUES.into(),
            shape,
            data: TensorData::Fp32(images.concat()),
        }
    }

    /// Each row of a run's output, normalized.
    pub fn vectors(&self, output: &Tensor) -> Result<Vec<Vec<f32>>, String> {
        let TensorData::Fp32(values) = &output.data else {
            return Err(format!(
                "`{}` came back as {}",
                output.name,
                output.data.datatype().name()
            ));
        };
        let [_, size] = output.shape[..] else {
            return Err(format!("`{}` came back of shape {:?}", output.name, output.shape));
        };
        Ok(values
            .chunks(size.max(1) as usize)
            .map(|row| {
                let mut row = row.to_vec();
                super::embedder::normalize(&mut row);
                row
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::signature::TensorSpec;

    fn spec(name: &str, datatype: DataType, shape: Vec<i64>) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            datatype,
            shape,
            symbols: Vec::new(),
        }
    }

    #[test]
    fn a_graph_is_a_tower_by_its_output_and_a_wrong_one_is_named() {
        let folder = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/models/embed/clip"));
        let text = ModelSignature {
            inputs: vec![spec("input_ids", DataType::Int64, vec![-1, -1])],
            outputs: vec![spec(TEXT_EMBEDS, DataType::Fp32, vec![-1, 16])],
        };
        let tower = Tower::read(Some(folder), &text).unwrap().unwrap();
        assert_eq!(
            tower,
            Tower::Text {
                max_positions: Some(32),
                pad: None,
                output: TEXT_EMBEDS
            }
        );
        assert_eq!(tower.dimensions(&text), Some(16));
        let vision = ModelSignature {
            inputs: vec![spec(PIXEL_VALUES, DataType::Fp32, vec![-1, 3, -1, -1])],
            outputs: vec![spec(IMAGE_EMBEDS, DataType::Fp32, vec![-1, 16])],
        };
        let image = Tower::read(Some(folder), &vision).unwrap().unwrap();
        assert!(matches!(image, Tower::Image(_, IMAGE_EMBEDS)));
        assert_eq!(image.pinned(vision.clone()).inputs[0].shape, vec![-1, 3, 32, 32]);
        let nowhere = std::env::temp_dir();
        assert!(
            Tower::read(Some(&nowhere), &vision)
                .unwrap_err()
                .ends_with("preprocessor_config.json is missing (save the model's image processor beside it)")
        );
        let fixed = ModelSignature {
            inputs: vec![spec(PIXEL_VALUES, DataType::Fp32, vec![-1, 3, 224, 224])],
            ..vision.clone()
        };
        assert!(
            Tower::read(Some(folder), &fixed)
                .unwrap_err()
                .contains("gives [batch, 3, 32, 32]")
        );
        let both = ModelSignature {
            inputs: vision.inputs.clone(),
            outputs: vec![text.outputs[0].clone(), vision.outputs[0].clone()],
        };
        assert!(
            Tower::read(Some(folder), &both)
                .unwrap_err()
                .contains("export each tower alone")
        );
        let plain = ModelSignature {
            inputs: text.inputs.clone(),
            outputs: vec![spec("logits", DataType::Fp32, vec![-1, 2])],
        };
        assert_eq!(Tower::read(Some(folder), &plain), Ok(None));
    }

    #[test]
    fn a_text_batch_has_only_the_inputs_the_graph_takes_and_vectors_come_back_normalized() {
        let text = ModelSignature {
            inputs: vec![spec("input_ids", DataType::Int64, vec![-1, -1])],
            outputs: Vec::new(),
        };
        let tower = Tower::Text {
            max_positions: None,
            pad: None,
            output: TEXT_EMBEDS,
        };
        let batch = tower.text_batch(&text, &[vec![5, 3], vec![5, 6, 3]]);
        assert_eq!(batch.len(), 1);
        assert_eq!(batch[0].data, TensorData::Int64(vec![5, 3, 0, 5, 6, 3]));
        let out = Tensor {
            name: TEXT_EMBEDS.into(),
            shape: vec![2, 2],
            data: TensorData::Fp32(vec![3., 4., 0., 2.]),
        };
        let siglip = Tower::Text {
            max_positions: Some(4),
            pad: Some(1),
            output: POOLER_OUTPUT,
        };
        let padded = siglip.text_batch(&text, &[vec![5, 3], vec![5, 6, 3]]);
        assert_eq!(padded[0].data, TensorData::Int64(vec![5, 3, 1, 1, 5, 6, 3, 1]));
        assert_eq!(tower.vectors(&out).unwrap(), vec![vec![0.6, 0.8], vec![0., 1.]]);
    }
}
