//! Cross-encoders (rerankers): a sequence-classification model with one logit, as
//! sentence-transformers' `CrossEncoder` saves it, that scores a query and a document read
//! together as one pair of texts. What its folder's `config.json` says of it (one label, and
//! the activation `CrossEncoder.predict` applies to the logit by default), and each pair's
//! score from the graph's `logits` `[batch, 1]`.

use std::path::Path;

use serde_json::Value;

use super::folder::json;
use crate::core::signature::ModelSignature;
use crate::core::tensor::{DataType, Tensor, TensorData};

/// The graph output an Optimum `text-classification` export gives: `[batch, labels]`.
pub const LOGITS: &str = "logits";

/// What becomes of the logit: `CrossEncoder.predict`'s activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `torch.nn.Sigmoid`: the default for one label, a score in (0, 1).
    Sigmoid,
    /// `torch.nn.Identity`: the logit as it is.
    Identity,
}

/// The activations served, by the name `CrossEncoder.save` writes.
const ACTIVATIONS: [(&str, Activation); 2] = [
    ("torch.nn.modules.activation.Sigmoid", Activation::Sigmoid),
    ("torch.nn.modules.linear.Identity", Activation::Identity),
];

/// What a cross-encoder's folder says of its scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reranker {
    /// What `CrossEncoder.predict` applies to the logit.
    pub activation: Activation,
}

impl Reranker {
    /// The reranker `folder` describes, or `None` when its `config.json` does not name a
    /// `…ForSequenceClassification` architecture with one label; an error names the file and
    /// the key. The activation is `sentence_transformers.activation_fn` (which
    /// `CrossEncoder.save` writes), else Sigmoid, as `CrossEncoder` chooses for one label.
    pub fn read(folder: &Path) -> Result<Option<Reranker>, String> {
        let Some(config) = json(folder, "config.json")? else {
            return Ok(None);
        };
        let classifies = config["architectures"].as_array().is_some_and(|a| {
            a.iter()
                .any(|n| n.as_str().is_some_and(|n| n.ends_with("ForSequenceClassification")))
        });
        let labels = match (&config["id2label"], &config["num_labels"]) {
            (Value::Object(labels), _) => labels.len() as u64,
            (_, n) => n.as_u64().unwrap_or(2),
        };
        if !classifies || labels != 1 {
            return Ok(None);
        }
        let named = folder.join("config.json").display().to_string();
        let activation = match &config["sentence_transformers"]["activation_fn"] {
            Value::Null => Activation::Sigmoid,
            Value::String(name) => ACTIVATIONS
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, a)| *a)
                .ok_or_else(|| {
                    format!(
                        "{named}: `sentence_transformers.activation_fn` is `{name}`; served: {}",
                        ACTIVATIONS.map(|(n, _)| n).join(", ")
                    )
                })?,
            other => {
                return Err(format!(
                    "{named}: `sentence_transformers.activation_fn` is {other}, not a name"
                ));
            }
        };
        Ok(Some(Reranker { activation }))
    }

    /// Whether `signature` is a graph a reranker can run: int64 `input_ids` and
    /// `attention_mask` (and `token_type_ids` when it takes them), nothing else, and an fp32
    /// `logits` `[batch, 1]`; else why not.
    pub fn check(signature: &ModelSignature) -> Result<(), String> {
        for input in &signature.inputs {
            match input.name.as_str() {
                "input_ids" | "attention_mask" | "token_type_ids" if input.datatype == DataType::Int64 => {}
                "input_ids" | "attention_mask" | "token_type_ids" => {
                    return Err(format!(
                        "input `{}` is {}, not INT64",
                        input.name,
                        input.datatype.name()
                    ));
                }
                other => return Err(format!("input `{other}` is not one a cross-encoder is given")),
            }
        }
        for needed in ["input_ids", "attention_mask"] {
            if !signature.inputs.iter().any(|i| i.name == needed) {
                return Err(format!("it has no input `{needed}`"));
            }
        }
        match signature.outputs.iter().find(|o| o.name == LOGITS) {
            Some(o) if o.datatype == DataType::Fp32 && o.shape.len() == 2 && o.shape[1] == 1 => Ok(()),
            Some(o) => Err(format!(
                "output `{LOGITS}` is {} of shape {:?}, not FP32 [batch, 1]",
                o.datatype.name(),
                o.shape
            )),
            None => Err(format!(
                "it has no output `{LOGITS}` (export it with Optimum's `text-classification` task)"
            )),
        }
    }

    /// Each pair's score from the batch's `logits` (`pairs` of them), as `CrossEncoder.predict`
    /// gives it.
    pub fn scores(&self, logits: &Tensor, pairs: usize) -> Result<Vec<f32>, String> {
        let TensorData::Fp32(values) = &logits.data else {
            return Err(format!("`{LOGITS}` came back as {}", logits.data.datatype().name()));
        };
        if logits.shape != [pairs as i64, 1] {
            return Err(format!(
                "`{LOGITS}` came back of shape {:?} for {pairs} pairs",
                logits.shape
            ));
        }
        Ok(values
            .iter()
            .map(|&logit| match self.activation {
                Activation::Sigmoid => 1.0 / (1.0 + (-logit).exp()),
                Activation::Identity => logit,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_one_label_classifier_reranks_with_its_activation_and_another_is_named() {
        let dir = std::env::temp_dir().join(format!("vramguard-reranker-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("config.json");
        let write = |text: &str| std::fs::write(&config, text).unwrap();
        assert_eq!(Reranker::read(&dir).unwrap(), None);
        let bert = r#"{"architectures": ["BertForSequenceClassification"], "id2label": {"0": "LABEL_0"}"#;
        write(&format!("{bert}}}"));
        let sigmoid = Reranker {
            activation: Activation::Sigmoid,
        };
        assert_eq!(Reranker::read(&dir).unwrap(), Some(sigmoid));
        write(&format!(
            r#"{bert}, "sentence_transformers": {{"activation_fn": "torch.nn.modules.linear.Identity"}}}}"#
        ));
        let identity = Reranker::read(&dir).unwrap().unwrap();
        assert_eq!(identity.activation, Activation::Identity);
        write(&format!(
            r#"{bert}, "sentence_transformers": {{"activation_fn": "torch.nn.modules.activation.Tanh"}}}}"#
        ));
        let err = Reranker::read(&dir).unwrap_err();
        assert!(
            err.contains("`sentence_transformers.activation_fn` is `torch.nn.modules.activation.Tanh`"),
            "{err}"
        );
        // Two labels classify; they do not score a pair.
        write(r#"{"architectures": ["BertForSequenceClassification"], "id2label": {"0": "a", "1": "b"}}"#);
        assert_eq!(Reranker::read(&dir).unwrap(), None);
        write(r#"{"architectures": ["BertModel"]}"#);
        assert_eq!(Reranker::read(&dir).unwrap(), None);
        std::fs::remove_dir_all(&dir).unwrap();

        let logits = Tensor {
            name: LOGITS.into(),
            shape: vec![2, 1],
            data: TensorData::Fp32(vec![0.0, 2.0]),
        };
        assert_eq!(sigmoid.scores(&logits, 2).unwrap(), [0.5, 1.0 / (1.0 + (-2f32).exp())]);
        assert_eq!(identity.scores(&logits, 2).unwrap(), [0.0, 2.0]);
        assert!(sigmoid.scores(&logits, 3).unwrap_err().contains("for 3 pairs"));
    }
}
