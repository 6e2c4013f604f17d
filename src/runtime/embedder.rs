//! Sentence-transformers embedders: what a folder saved by `SentenceTransformer.save` says of
//! how its transformer's hidden states become one vector (`modules.json`, the Pooling module's
//! `config.json`, a Normalize module, `sentence_bert_config.json`'s `max_seq_length`), the
//! inputs a batch of token ids runs as (padded to the longest, with its attention mask), and
//! the pooling of the graph's `last_hidden_state` back into one vector per input.

use std::path::Path;

use serde_json::Value;

use super::folder::json;
use crate::core::signature::ModelSignature;
use crate::core::tensor::{DataType, Tensor, TensorData};

/// The graph output an Optimum `feature-extraction` export gives: `[batch, sequence, hidden]`.
pub const HIDDEN_STATE: &str = "last_hidden_state";

/// The output the rewritten graph gives instead: one vector per input, `[batch, hidden]`,
/// pooled and normalized as the folder says (sentence-transformers' name for it).
pub const EMBEDDING: &str = "sentence_embedding";

/// How the hidden states of an input's tokens become its vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over the tokens the attention mask keeps.
    Mean,
    /// The first token's (BERT's `[CLS]`).
    Cls,
    /// The last token the attention mask keeps (decoder-based embedders).
    LastToken,
}

impl Pooling {
    /// Its name in docs and logs.
    pub fn label(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::LastToken => "lasttoken",
        }
    }
}

/// The poolings sentence-transformers' Pooling module can name, and what each is here (`None`:
/// refused): the name its `config.json` gives in `pooling_mode` (as sentence-transformers 5.7
/// saves it; a list of several concatenates them), and the key older releases set to `true`.
const POOLING_MODES: [(&str, &str, Option<Pooling>); 6] = [
    ("cls", "pooling_mode_cls_token", Some(Pooling::Cls)),
    ("max", "pooling_mode_max_tokens", None),
    ("mean", "pooling_mode_mean_tokens", Some(Pooling::Mean)),
    ("mean_sqrt_len_tokens", "pooling_mode_mean_sqrt_len_tokens", None),
    ("weightedmean", "pooling_mode_weightedmean_tokens", None),
    ("lasttoken", "pooling_mode_lasttoken", Some(Pooling::LastToken)),
];

/// The poolings served, for messages.
const SERVED: &str = "served: mean, cls, lasttoken";

/// What a sentence-transformers folder says of its embeddings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Embedder {
    /// How token states become one vector.
    pub pooling: Pooling,
    /// Whether the vector is scaled to length 1 (a Normalize module).
    pub normalize: bool,
    /// The most tokens an input may have: `sentence_bert_config.json`'s `max_seq_length`.
    pub max_seq_length: Option<u64>,
}

impl Embedder {
    /// What the bundled embedder's folder (`builtin:embedder`, `models/embed/bert-mean-normalize/`)
    /// says: the binary carries its graph and tokenizer, not the folder (a test reads the folder
    /// and compares).
    pub const BUNDLED: Embedder = Embedder {
        pooling: Pooling::Mean,
        normalize: true,
        max_seq_length: Some(512),
    };

    /// The embedder `folder` describes, or `None` when it has no `modules.json` with a Pooling
    /// module (it is not a sentence-transformers folder); an error names the file and the key.
    pub fn read(folder: &Path) -> Result<Option<Embedder>, String> {
        let Some(modules) = json(folder, "modules.json")? else {
            return Ok(None);
        };
        let modules = modules
            .as_array()
            .ok_or_else(|| format!("{} is not a list of modules", folder.join("modules.json").display()))?;
        let module = |kind: &str| {
            modules
                .iter()
                .find(|m| m["type"].as_str().is_some_and(|t| t.ends_with(kind)))
        };
        let Some(pooling) = module(".Pooling") else {
            return Ok(None);
        };
        let dir = folder.join(pooling["path"].as_str().unwrap_or_default());
        let config = json(&dir, "config.json")?.ok_or_else(|| {
            format!(
                "{} is missing: the Pooling module's config",
                dir.join("config.json").display()
            )
        })?;
        let pooling = read_pooling(&config, &dir.join("config.json").display().to_string())?;
        let max_seq_length = match read_max_seq_length(folder)? {
            Some(n) => Some(n),
            None => model_max_length(folder)?,
        };
        Ok(Some(Embedder {
            pooling,
            normalize: module(".Normalize").is_some(),
            max_seq_length,
        }))
    }

    /// Whether `signature` is a graph this embedder can run: int64 `input_ids` and
    /// `attention_mask` (and `token_type_ids` or `position_ids` when it takes them), nothing
    /// else, and an fp32 `sentence_embedding` `[batch, hidden]` or `last_hidden_state`
    /// `[batch, sequence, hidden]`; else why not.
    pub fn check(signature: &ModelSignature) -> Result<(), String> {
        for input in &signature.inputs {
            match input.name.as_str() {
                "input_ids" | "attention_mask" | "token_type_ids" | "position_ids"
                    if input.datatype == DataType::Int64 => {}
                "input_ids" | "attention_mask" | "token_type_ids" | "position_ids" => {
                    return Err(format!(
                        "input `{}` is {}, not INT64",
                        input.name,
                        input.datatype.name()
                    ));
                }
                other => return Err(format!("input `{other}` is not one an embedder is given")),
            }
        }
        for needed in ["input_ids", "attention_mask"] {
            if !signature.inputs.iter().any(|i| i.name == needed) {
                return Err(format!("it has no input `{needed}`"));
            }
        }
        let output = Self::output(signature);
        let rank = if output == EMBEDDING { 2 } else { 3 };
        match signature.outputs.iter().find(|o| o.name == output) {
            Some(o) if o.datatype == DataType::Fp32 && o.shape.len() == rank => Ok(()),
            Some(o) => Err(format!(
                "output `{output}` is {} of rank {}, not FP32 of rank {rank}",
                o.datatype.name(),
                o.shape.len()
            )),
            None => Err(format!(
                "it has no output `{HIDDEN_STATE}` (export it with Optimum's `feature-extraction` task)"
            )),
        }
    }

    /// The output a run asks for: `sentence_embedding` when the graph pools, else
    /// `last_hidden_state`.
    pub fn output(signature: &ModelSignature) -> &'static str {
        match signature.outputs.iter().any(|o| o.name == EMBEDDING) {
            true => EMBEDDING,
            false => HIDDEN_STATE,
        }
    }

    /// The size of the vectors, when the graph declares it.
    pub fn size(signature: &ModelSignature) -> Option<usize> {
        let output = Self::output(signature);
        let spec = signature.outputs.iter().find(|o| o.name == output)?;
        usize::try_from(*spec.shape.last()?).ok()
    }

    /// The inputs that run `inputs` (token ids each) as one batch: [`text_batch`] with every
    /// token of type 0.
    pub fn batch(signature: &ModelSignature, inputs: &[Vec<u32>], pad: u32) -> Vec<Tensor> {
        text_batch(signature, inputs, None, pad)
    }

    /// One vector per input from what the run gave: the rows of `sentence_embedding` as the
    /// graph pooled them, or `last_hidden_state` pooled here ([`Embedder::pool`]).
    pub fn vectors(&self, output: &Tensor, lengths: &[usize]) -> Result<Vec<Vec<f32>>, String> {
        if output.name != EMBEDDING {
            return self.pool(output, lengths);
        }
        let TensorData::Fp32(values) = &output.data else {
            return Err(format!("`{EMBEDDING}` came back as {}", output.data.datatype().name()));
        };
        match output.shape[..] {
            [batch, size] if batch as usize == lengths.len() && size > 0 => {
                Ok(values.chunks(size as usize).map(<[f32]>::to_vec).collect())
            }
            _ => Err(format!(
                "`{EMBEDDING}` came back of shape {:?} for {} inputs",
                output.shape,
                lengths.len()
            )),
        }
    }

    /// One vector per input from the batch's `last_hidden_state` (`lengths`: each input's
    /// tokens, the rest being padding), normalized when the folder says so.
    pub fn pool(&self, hidden: &Tensor, lengths: &[usize]) -> Result<Vec<Vec<f32>>, String> {
        let TensorData::Fp32(values) = &hidden.data else {
            return Err(format!(
                "`{HIDDEN_STATE}` came back as {}",
                hidden.data.datatype().name()
            ));
        };
        let [batch, sequence, size] = hidden.shape[..] else {
            return Err(format!("`{HIDDEN_STATE}` came back of shape {:?}", hidden.shape));
        };
        let (sequence, size) = (sequence as usize, size as usize);
        if batch as usize != lengths.len() || lengths.iter().any(|&n| n > sequence || n == 0) {
            return Err(format!(
                "`{HIDDEN_STATE}` came back of shape {:?} for {} inputs",
                hidden.shape,
                lengths.len()
            ));
        }
        Ok(lengths
            .iter()
            .enumerate()
            .map(|(row, &length)| {
                let token = |t: usize| &values[(row * sequence + t) * size..][..size];
                let mut vector = match self.pooling {
                    Pooling::Cls => token(0).to_vec(),
                    Pooling::LastToken => token(length - 1).to_vec(),
                    Pooling::Mean => {
                        let mut sum = vec![0f32; size];
                        for t in 0..length {
                            sum.iter_mut().zip(token(t)).for_each(|(s, v)| *s += v);
                        }
                        sum.iter_mut().for_each(|s| *s /= length as f32);
                        sum
                    }
                };
                if self.normalize {
                    normalize(&mut vector);
                }
                vector
            })
            .collect())
    }
}

/// The pooling a Pooling module's `config.json` (`named`) chooses: its `pooling_mode` (a name,
/// or a list of them), else the one `pooling_mode_*` key that is `true`; one that is not served,
/// a name sentence-transformers does not know, or several (concatenated) refused by name.
fn read_pooling(config: &Value, named: &str) -> Result<Pooling, String> {
    let modes = match &config["pooling_mode"] {
        Value::Null => None,
        Value::String(mode) => Some(vec![mode.as_str()]),
        Value::Array(modes) if !modes.is_empty() && modes.iter().all(Value::is_string) => {
            Some(modes.iter().filter_map(Value::as_str).collect())
        }
        other => return Err(format!("{named}: `pooling_mode` is {other}, not a pooling's name")),
    };
    let chosen: Vec<(&str, Option<Pooling>)> = match modes {
        Some(modes) => {
            let mut chosen = Vec::with_capacity(modes.len());
            for mode in modes {
                let Some((name, _, pooling)) = POOLING_MODES.iter().find(|(name, _, _)| *name == mode) else {
                    let known: Vec<&str> = POOLING_MODES.iter().map(|(name, _, _)| *name).collect();
                    return Err(format!(
                        "{named}: `pooling_mode` \"{mode}\" is not a pooling sentence-transformers names ({})",
                        known.join(", ")
                    ));
                };
                chosen.push((*name, *pooling));
            }
            chosen
        }
        None => POOLING_MODES
            .iter()
            .filter(|(_, key, _)| config[*key].as_bool() == Some(true))
            .map(|(_, key, pooling)| (*key, *pooling))
            .collect(),
    };
    // How the folder says it: `pooling_mode` "max", or the key `pooling_mode_max_tokens`.
    let said = |name: &str| match name.starts_with("pooling_mode_") {
        true => format!("`{name}`"),
        false => format!("`pooling_mode` \"{name}\""),
    };
    match chosen.as_slice() {
        [(_, Some(pooling))] => Ok(*pooling),
        [(name, None)] => Err(format!("{named}: {} is not served ({SERVED})", said(name))),
        [] => Err(format!(
            "{named}: no `pooling_mode`, and no `pooling_mode_*` key is true"
        )),
        several => {
            let names: Vec<String> = several.iter().map(|(name, _)| said(name)).collect();
            Err(format!(
                "{named}: {} are all chosen; one pooling is served, not their concatenation",
                names.join(", ")
            ))
        }
    }
}

/// `sentence_bert_config.json`'s `max_seq_length`, as sentence-transformers before 5.7 saved it.
fn read_max_seq_length(folder: &Path) -> Result<Option<u64>, String> {
    let Some(config) = json(folder, "sentence_bert_config.json")? else {
        return Ok(None);
    };
    match &config["max_seq_length"] {
        Value::Null => Ok(None),
        v => v.as_u64().filter(|n| *n > 0).map(Some).ok_or_else(|| {
            format!(
                "{}: `max_seq_length` is {v}, not a number of tokens",
                folder.join("sentence_bert_config.json").display()
            )
        }),
    }
}

/// The tokenizer's `model_max_length` (`tokenizer_config.json`): where sentence-transformers 5.7
/// keeps a model's `max_seq_length`, and what older releases took when theirs was unset. Not a
/// limit when it is `transformers`' "none" (1e30, past any `u64`) or absent.
fn model_max_length(folder: &Path) -> Result<Option<u64>, String> {
    let Some(config) = json(folder, "tokenizer_config.json")? else {
        return Ok(None);
    };
    match &config["model_max_length"] {
        Value::Null => Ok(None),
        Value::Number(n) if n.as_u64().is_none() && n.as_f64().is_some_and(|x| x >= u64::MAX as f64) => Ok(None),
        v => v.as_u64().filter(|n| *n > 0).map(Some).ok_or_else(|| {
            format!(
                "{}: `model_max_length` is {v}, not a number of tokens",
                folder.join("tokenizer_config.json").display()
            )
        }),
    }
}

/// The inputs that run `inputs` (token ids each) through a text encoder as one batch:
/// right-padded with `pad` to the longest, with the attention mask, `token_type_ids` when
/// `signature` takes them (each token's type as `types` gives it, a pair's second text 1; all
/// zero without), and `position_ids` (each row's from 0, padding included: a decoder's causal
/// attention keeps what follows a token out of its state) when it takes those.
pub fn text_batch(
    signature: &ModelSignature,
    inputs: &[Vec<u32>],
    types: Option<&[Vec<u32>]>,
    pad: u32,
) -> Vec<Tensor> {
    let longest = inputs.iter().map(Vec::len).max().unwrap_or(0);
    let shape = vec![inputs.len() as i64, longest as i64];
    let padded = |rows: &mut dyn Iterator<Item = (&[u32], i64)>| -> Vec<i64> {
        let mut out = Vec::with_capacity(inputs.len() * longest);
        for (row, fill) in rows {
            out.extend(row.iter().map(|&t| i64::from(t)));
            out.extend(std::iter::repeat_n(fill, longest - row.len()));
        }
        out
    };
    let ones: Vec<Vec<u32>> = inputs.iter().map(|i| vec![1; i.len()]).collect();
    let tensor = |name: &str, data: Vec<i64>| Tensor {
        name: name.into(),
        shape: shape.clone(),
        data: TensorData::Int64(data),
    };
    let takes = |name: &str| signature.inputs.iter().any(|i| i.name == name);
    let mut tensors = vec![
        tensor(
            "input_ids",
            padded(&mut inputs.iter().map(|i| (i.as_slice(), i64::from(pad)))),
        ),
        tensor("attention_mask", padded(&mut ones.iter().map(|i| (i.as_slice(), 0)))),
    ];
    if takes("token_type_ids") {
        let zeros: Vec<Vec<u32>> = inputs.iter().map(|i| vec![0; i.len()]).collect();
        let types = types.unwrap_or(&zeros);
        tensors.push(tensor(
            "token_type_ids",
            padded(&mut types.iter().map(|t| (t.as_slice(), 0))),
        ));
    }
    if takes("position_ids") {
        let positions = (0..inputs.len()).flat_map(|_| 0..longest as i64).collect();
        tensors.push(tensor("position_ids", positions));
    }
    tensors
}

/// Scale `vector` to length 1 (a zero vector stays zero), as sentence-transformers' Normalize
/// module does (`torch.nn.functional.normalize`, whose epsilon keeps zero from dividing).
pub fn normalize(vector: &mut [f32]) {
    let length = vector.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
    vector.iter_mut().for_each(|v| *v /= length);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundled_embedder_is_what_its_folder_says() {
        let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/embed/bert-mean-normalize");
        assert_eq!(Embedder::read(&folder).unwrap(), Some(Embedder::BUNDLED));
    }

    fn hidden(batch: usize, sequence: usize, values: Vec<f32>) -> Tensor {
        let size = values.len() / (batch * sequence);
        Tensor {
            name: HIDDEN_STATE.into(),
            shape: vec![batch as i64, sequence as i64, size as i64],
            data: TensorData::Fp32(values),
        }
    }

    #[test]
    fn each_pooling_reads_only_the_tokens_the_mask_keeps() {
        // Two inputs of 2 and 3 tokens, hidden size 2; the first's third token is padding.
        let states = hidden(2, 3, vec![1., 2., 3., 4., 100., 100., 1., 1., 2., 2., 6., 0.]);
        let pooled = |pooling| {
            let embedder = Embedder {
                pooling,
                normalize: false,
                max_seq_length: None,
            };
            embedder.pool(&states, &[2, 3]).unwrap()
        };
        assert_eq!(pooled(Pooling::Mean), vec![vec![2., 3.], vec![3., 1.]]);
        assert_eq!(pooled(Pooling::Cls), vec![vec![1., 2.], vec![1., 1.]]);
        assert_eq!(pooled(Pooling::LastToken), vec![vec![3., 4.], vec![6., 0.]]);
        let unit = Embedder {
            pooling: Pooling::LastToken,
            normalize: true,
            max_seq_length: None,
        };
        assert_eq!(unit.pool(&states, &[2, 3]).unwrap()[1], vec![1., 0.]);
        assert!(unit.pool(&states, &[2]).unwrap_err().contains("for 1 inputs"));
    }

    #[test]
    fn a_batch_is_padded_to_its_longest_with_its_mask() {
        let signature = |names: &[&str]| ModelSignature {
            inputs: names
                .iter()
                .map(|n| crate::core::signature::TensorSpec {
                    name: n.to_string(),
                    datatype: DataType::Int64,
                    shape: vec![-1, -1],
                    symbols: Vec::new(),
                })
                .collect(),
            outputs: Vec::new(),
        };
        let bert = signature(&["input_ids", "attention_mask", "token_type_ids"]);
        let tensors = Embedder::batch(&bert, &[vec![5, 6, 7], vec![8]], 0);
        let data: Vec<(&str, &TensorData)> = tensors.iter().map(|t| (t.name.as_str(), &t.data)).collect();
        assert_eq!(
            data,
            vec![
                ("input_ids", &TensorData::Int64(vec![5, 6, 7, 8, 0, 0])),
                ("attention_mask", &TensorData::Int64(vec![1, 1, 1, 1, 0, 0])),
                ("token_type_ids", &TensorData::Int64(vec![0; 6])),
            ]
        );
        assert!(tensors.iter().all(|t| t.shape == vec![2, 3]));
        let plain = signature(&["input_ids", "attention_mask"]);
        assert_eq!(Embedder::batch(&plain, &[vec![1]], 0).len(), 2);
        // A pair's second text is of type 1, and its padding of type 0.
        let types = [vec![0, 0, 1], vec![0]];
        let tensors = text_batch(&bert, &[vec![5, 6, 7], vec![8]], Some(&types), 0);
        assert_eq!(tensors[2].data, TensorData::Int64(vec![0, 0, 1, 0, 0, 0]));
        // A decoder's rows each count their positions from 0.
        let decoder = signature(&["input_ids", "attention_mask", "position_ids"]);
        let tensors = Embedder::batch(&decoder, &[vec![5, 6, 7], vec![8]], 0);
        assert_eq!(
            (tensors[2].name.as_str(), &tensors[2].data),
            ("position_ids", &TensorData::Int64(vec![0, 1, 2, 0, 1, 2]))
        );
    }

    #[test]
    fn a_folder_s_pooling_is_read_and_an_unserved_one_named() {
        let dir = std::env::temp_dir().join(format!("vramguard-embedder-{}", std::process::id()));
        let pooling = dir.join("1_Pooling");
        std::fs::create_dir_all(&pooling).unwrap();
        assert_eq!(Embedder::read(&dir).unwrap(), None);
        std::fs::write(
            dir.join("modules.json"),
            r#"[{"path": "", "type": "sentence_transformers.models.Transformer"},
                {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]"#,
        )
        .unwrap();
        std::fs::write(dir.join("sentence_bert_config.json"), r#"{"max_seq_length": 128}"#).unwrap();
        let config = pooling.join("config.json");
        std::fs::write(
            &config,
            r#"{"pooling_mode_lasttoken": true, "pooling_mode_cls_token": false}"#,
        )
        .unwrap();
        assert_eq!(
            Embedder::read(&dir).unwrap(),
            Some(Embedder {
                pooling: Pooling::LastToken,
                normalize: true,
                max_seq_length: Some(128)
            })
        );
        std::fs::write(&config, r#"{"pooling_mode_max_tokens": true}"#).unwrap();
        let err = Embedder::read(&dir).unwrap_err();
        assert!(
            err.ends_with("`pooling_mode_max_tokens` is not served (served: mean, cls, lasttoken)"),
            "{err}"
        );
        std::fs::write(
            &config,
            r#"{"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": true}"#,
        )
        .unwrap();
        assert!(Embedder::read(&dir).unwrap_err().contains("not their concatenation"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sentence_transformers_5_7_s_pooling_mode_and_max_length_are_read() {
        let scratch = crate::core::scratch::OwnDir::new("embedder-test").unwrap();
        let dir = scratch.path();
        std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
        // What 5.7 saves: its modules' new paths, `pooling_mode` and `embedding_dimension`, and
        // `max_seq_length` only as the tokenizer's `model_max_length`.
        std::fs::write(
            dir.join("modules.json"),
            r#"[{"path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
                {"path": "1_Pooling", "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
                {"path": "2_Normalize", "type": "sentence_transformers.sentence_transformer.modules.normalize.Normalize"}]"#,
        )
        .unwrap();
        std::fs::write(
            dir.join("sentence_bert_config.json"),
            r#"{"transformer_task": "feature-extraction", "module_output_name": "token_embeddings"}"#,
        )
        .unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), r#"{"model_max_length": 256}"#).unwrap();
        let config = dir.join("1_Pooling/config.json");
        let read = |pooling_mode: &str| {
            std::fs::write(
                &config,
                format!(r#"{{"embedding_dimension": 32, "pooling_mode": {pooling_mode}, "include_prompt": true}}"#),
            )
            .unwrap();
            Embedder::read(dir)
        };
        for (mode, pooling) in [
            (r#""mean""#, Pooling::Mean),
            (r#""cls""#, Pooling::Cls),
            (r#"["lasttoken"]"#, Pooling::LastToken),
        ] {
            let want = Embedder {
                pooling,
                normalize: true,
                max_seq_length: Some(256),
            };
            assert_eq!(read(mode).unwrap(), Some(want), "{mode}");
        }
        for mode in ["max", "mean_sqrt_len_tokens", "weightedmean"] {
            let err = read(&format!("\"{mode}\"")).unwrap_err();
            assert!(
                err.ends_with(&format!(
                    "`pooling_mode` \"{mode}\" is not served (served: mean, cls, lasttoken)"
                )),
                "{err}"
            );
        }
        let err = read(r#""median""#).unwrap_err();
        assert!(
            err.contains("`pooling_mode` \"median\" is not a pooling sentence-transformers names (cls, max, mean,"),
            "{err}"
        );
        assert!(
            read(r#"["mean", "max"]"#)
                .unwrap_err()
                .contains("not their concatenation")
        );
        assert!(
            read("3")
                .unwrap_err()
                .contains("`pooling_mode` is 3, not a pooling's name")
        );
        // `transformers`' "no limit" is none; an older folder's `max_seq_length` comes first.
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"model_max_length": 1000000000000000019884624838656}"#,
        )
        .unwrap();
        assert_eq!(read(r#""mean""#).unwrap().unwrap().max_seq_length, None);
        std::fs::write(dir.join("sentence_bert_config.json"), r#"{"max_seq_length": 128}"#).unwrap();
        assert_eq!(read(r#""mean""#).unwrap().unwrap().max_seq_length, Some(128));
    }
}
