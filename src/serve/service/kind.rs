//! What a model is: its [`Kind`], found once from its folder or file when it loads, holding
//! what that kind needs (its decoder layout, tokenizer, pooling, tower or Whisper front end), and
//! the [`Api`]s each kind answers. Every layer reads the kind instead of finding it again, and
//! a model of the wrong kind for an endpoint is refused with one wording ([`Api::needs`]).
//! [`kind_of`] makes the kind from what the model's folder and graph were found to be, with the
//! tokenizer ([`tokenizer_of`]) and chat template ([`chat_template`]) the kinds that read text
//! need.

use std::sync::Arc;

use tokenizers::Tokenizer;

use crate::config::{ModelConfig, TokenizerSource};
use crate::runtime::chat::ChatTemplate;
use crate::runtime::decoder::DecoderLayout;
use crate::runtime::embedder::Embedder;
use crate::runtime::folder::ModelFolder;
use crate::runtime::grammar::Grammars;
use crate::runtime::reranker::Reranker;
use crate::runtime::speech::SpeechModel;
use crate::runtime::tower::Tower;

/// A model that failed to load: the key under its `models[]` entry that is wrong, and why.
pub(super) type Invalid = (&'static str, String);

/// What a model is, and what its kind needs beside its graph.
#[derive(Debug, Clone)]
pub enum Kind {
    /// A graph run as sent: the tensor APIs (KServe's Open Inference Protocol, Triton's) only.
    Tensor,
    /// A decoder with past key values. With a tokenizer it generates text (`text`); without one
    /// it is run as a graph, its cache in the request's tensors.
    Decoder {
        /// Its KV-cache layout.
        layout: DecoderLayout,
        /// Its tokenizer, chat template and grammars, when it has a tokenizer.
        text: Option<Generator>,
    },
    /// A sentence-transformers folder (`modules.json` with a Pooling module): `/v1/embeddings`.
    Embedder {
        /// How its token vectors are pooled.
        embedder: Embedder,
        /// Its tokenizer (neither truncating nor padding: requests are refused or cut as asked).
        tokenizer: Arc<Tokenizer>,
    },
    /// A cross-encoder (a one-label sequence classifier): `/v1/rerank`.
    Reranker {
        /// How it scores a query and a document.
        reranker: Reranker,
        /// Its tokenizer (neither truncating nor padding).
        tokenizer: Arc<Tokenizer>,
    },
    /// A tower of a dual encoder (CLIP, SigLIP): `/v1/embeddings` of texts or images.
    Tower {
        /// Which tower, and how its vectors are read.
        tower: Tower,
        /// The text tower's tokenizer; an image tower has none.
        tokenizer: Option<Arc<Tokenizer>>,
    },
    /// A Whisper encoder with its folder (decoder, tokenizer, feature extractor):
    /// `/v1/audio/transcriptions` and `/v1/audio/translations`.
    Speech(Arc<SpeechModel>),
}

/// What a decoder needs to generate text.
#[derive(Debug, Clone)]
pub struct Generator {
    /// Its tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Its chat template, when it serves `/v1/chat/completions`.
    pub chat: Option<Arc<ChatTemplate>>,
    /// Its grammar compiler, for structured outputs.
    pub grammars: Arc<Grammars>,
}

/// The APIs a kind of model answers, for the one lookup that refuses a model of another kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions` and `/v1/completions`.
    Generation,
    /// `/v1/embeddings` of a sentence encoder.
    Embeddings,
    /// `/v1/rerank`.
    Rerank,
    /// `/v1/audio/transcriptions` and `/v1/audio/translations`.
    Transcription,
}

impl Api {
    /// What a model must be to answer it: the refusal of one that is not says "model `x` does
    /// not {this}".
    pub fn needs(self) -> &'static str {
        match self {
            Api::Generation => "generate text (it needs a decoder with past key values and `models[].tokenizer`)",
            Api::Embeddings => {
                "embed (it needs a sentence-transformers folder: `modules.json` with a Pooling module; or a dual encoder's tower: a graph giving `text_embeds` or `image_embeds`)"
            }
            Api::Rerank => {
                "rerank (it needs a cross-encoder's folder: a config.json of a one-label …ForSequenceClassification)"
            }
            Api::Transcription => {
                "transcribe (it needs a Whisper export: its encoder_model.onnx with the folder Optimum writes)"
            }
        }
    }
}

impl Kind {
    /// Whether it answers `api`.
    pub fn serves(&self, api: Api) -> bool {
        match api {
            Api::Generation => self.generator().is_some(),
            Api::Embeddings => matches!(self, Kind::Embedder { .. } | Kind::Tower { .. }),
            Api::Rerank => matches!(self, Kind::Reranker { .. }),
            Api::Transcription => matches!(self, Kind::Speech(_)),
        }
    }

    /// Whether it answers any of the OpenAI-compatible APIs (`/v1/models` lists those).
    pub fn serves_openai(&self) -> bool {
        [Api::Generation, Api::Embeddings, Api::Rerank, Api::Transcription]
            .into_iter()
            .any(|api| self.serves(api))
    }

    /// Its decoder layout, when it is a decoder with past key values.
    pub fn decoder(&self) -> Option<&DecoderLayout> {
        match self {
            Kind::Decoder { layout, .. } => Some(layout),
            _ => None,
        }
    }

    /// What it generates text with, when it is a decoder with a tokenizer.
    pub fn generator(&self) -> Option<&Generator> {
        match self {
            Kind::Decoder { text, .. } => text.as_ref(),
            _ => None,
        }
    }

    /// Its tokenizer, whatever its kind (a Whisper's is its folder's, and not this).
    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        match self {
            Kind::Decoder { text, .. } => text.as_ref().map(|g| &g.tokenizer),
            Kind::Embedder { tokenizer, .. } | Kind::Reranker { tokenizer, .. } => Some(tokenizer),
            Kind::Tower { tokenizer, .. } => tokenizer.as_ref(),
            Kind::Tensor | Kind::Speech(_) => None,
        }
    }

    /// Its pooling and tokenizer, when it is a sentence encoder.
    pub fn embedder(&self) -> Option<(Embedder, &Arc<Tokenizer>)> {
        match self {
            Kind::Embedder { embedder, tokenizer } => Some((*embedder, tokenizer)),
            _ => None,
        }
    }

    /// Its scoring and tokenizer, when it is a cross-encoder.
    pub fn reranker(&self) -> Option<(Reranker, &Arc<Tokenizer>)> {
        match self {
            Kind::Reranker { reranker, tokenizer } => Some((*reranker, tokenizer)),
            _ => None,
        }
    }

    /// Its tower, when it is one of a dual encoder.
    pub fn tower(&self) -> Option<&Tower> {
        match self {
            Kind::Tower { tower, .. } => Some(tower),
            _ => None,
        }
    }

    /// Its Whisper, when it transcribes.
    pub fn speech(&self) -> Option<&Arc<SpeechModel>> {
        match self {
            Kind::Speech(speech) => Some(speech),
            _ => None,
        }
    }

    /// Its name in logs and `/status`.
    pub fn label(&self) -> &'static str {
        match self {
            Kind::Tensor => "tensor",
            Kind::Decoder { text: Some(_), .. } => "text generation",
            Kind::Decoder { text: None, .. } => "decoder",
            Kind::Embedder { .. } => "embeddings",
            Kind::Reranker { .. } => "rerank",
            Kind::Tower {
                tower: Tower::Text { .. },
                ..
            } => "text tower",
            Kind::Tower {
                tower: Tower::Image(..),
                ..
            } => "image tower",
            Kind::Speech(_) => "speech",
        }
    }
}

/// A kind found in a model's folder or graph, before its tokenizer is known.
pub(super) enum Found {
    /// A sentence-transformers folder's pooling.
    Embedder(Embedder),
    /// A cross-encoder's scoring.
    Reranker(Reranker),
    /// A dual encoder's tower.
    Tower(Tower),
    /// A Whisper with its folder.
    Speech(Arc<SpeechModel>),
}

/// Model `m`'s kind, from what its folder and graph were found to be (at most one of `found`,
/// which only a decoder's layout may stand beside: a decoder is what is none of the others) and
/// its tokenizer and chat template (what `tokenizer_of` read: one for each kind that reads text).
pub(super) fn kind_of(
    m: &ModelConfig,
    folder: &ModelFolder,
    decoder: Option<DecoderLayout>,
    (tokenizer, chat): (Option<Arc<Tokenizer>>, Option<Arc<crate::runtime::chat::ChatTemplate>>),
    found: [Option<Found>; 4],
) -> Result<Kind, Invalid> {
    let mut found = found.into_iter().flatten();
    let needed = |what: &str| {
        // tokenizer_of reads one for every kind that reads text, or refuses the model.
        tokenizer
            .clone()
            .ok_or_else(|| ("tokenizer", format!("`{}` {what} but has no tokenizer", m.source)))
    };
    let kind = match found.next() {
        Some(Found::Embedder(embedder)) => Kind::Embedder {
            embedder,
            tokenizer: needed("embeds")?,
        },
        Some(Found::Reranker(reranker)) => Kind::Reranker {
            reranker,
            tokenizer: needed("reranks")?,
        },
        Some(Found::Tower(tower)) => Kind::Tower { tower, tokenizer },
        Some(Found::Speech(speech)) => Kind::Speech(speech),
        None => match decoder {
            Some(layout) => {
                let text = tokenizer.map(|tokenizer| {
                    let eos = folder.end_tokens(&tokenizer);
                    let grammars = Arc::new(crate::runtime::grammar::Grammars::new(Arc::clone(&tokenizer), eos));
                    Generator {
                        tokenizer,
                        chat,
                        grammars,
                    }
                });
                Kind::Decoder { layout, text }
            }
            None => Kind::Tensor,
        },
    };
    if let Some(other) = found.next() {
        let what = match other {
            Found::Embedder(_) => "a sentence-transformers folder",
            Found::Reranker(_) => "a cross-encoder's folder",
            Found::Tower(_) => "a dual encoder's tower",
            Found::Speech(_) => "a Whisper folder",
        };
        return Err((
            "path",
            format!("`{}` is a model of two kinds: {} and {what}", m.source, kind.label()),
        ));
    }
    Ok(kind)
}

/// Model `m`'s tokenizer: the configured one, for a decoder with past key values, an embedder
/// or a cross-encoder (which `embeds` covers: models that encode text); the folder's
/// `tokenizer.json` for the last two when none is configured. Their tokenizer neither truncates
/// nor pads as its file may say: a request too long is refused or cut as the client asks, and a
/// batch is padded to its longest.
pub(super) fn tokenizer_of(
    m: &ModelConfig,
    decoder: Option<DecoderLayout>,
    embeds: bool,
    dir: Option<&std::path::Path>,
) -> Result<Option<Arc<Tokenizer>>, Invalid> {
    let beside = dir.map(|d| TokenizerSource::File(d.join("tokenizer.json")));
    let source = match (&m.tokenizer, decoder, embeds) {
        (None, _, false) => return Ok(None),
        (Some(_), None, false) => {
            return Err((
                "tokenizer",
                format!(
                    "`{}` is not a decoder with past key values (inputs `input_ids`, `attention_mask`, `past_key_values.N.key/value`), a sentence-transformers folder (`modules.json`) nor a cross-encoder's (`config.json` of a one-label sequence classifier), so it cannot use a tokenizer",
                    m.source
                ),
            ));
        }
        (Some(source), _, _) => source,
        (None, _, true) => beside.as_ref().ok_or_else(|| {
            (
                "tokenizer",
                format!(
                    "`{}` embeds or reranks but has no folder to find `tokenizer.json` in; set `tokenizer`",
                    m.source
                ),
            )
        })?,
    };
    let mut tokenizer = match source {
        TokenizerSource::Builtin(model) => {
            Tokenizer::from_bytes(model.tokenizer().expect("validated: it ships a tokenizer"))
        }
        TokenizerSource::File(path) => Tokenizer::from_file(path),
    }
    .map_err(|e| ("tokenizer", format!("cannot read `{source}`: {e}")))?;
    if embeds {
        tokenizer
            .with_truncation(None)
            .map_err(|e| ("tokenizer", format!("`{source}`: {e}")))?
            .with_padding(None);
    }
    Ok(Some(Arc::new(tokenizer)))
}

/// The chat template of model `m`: the configured one, else the `chat_template.jinja` or the
/// `chat_template` of the `tokenizer_config.json` beside its tokenizer (how Hugging Face ships
/// models), else none.
pub(super) fn chat_template(m: &ModelConfig) -> Result<Option<Arc<ChatTemplate>>, String> {
    let Some(tokenizer) = &m.tokenizer else {
        return Ok(None);
    };
    let template = match &m.chat_template {
        Some(source) => Some(ChatTemplate::load(source)?),
        None => match tokenizer
            .file()
            .map(|file| file.with_file_name("tokenizer_config.json"))
        {
            Some(beside) => match std::fs::read_to_string(&beside) {
                Ok(text) => {
                    let jinja = beside.with_file_name("chat_template.jinja");
                    let jinja_name = jinja.display().to_string();
                    let separate = std::fs::read_to_string(&jinja).ok().map(|t| (t, jinja_name.as_str()));
                    ChatTemplate::from_tokenizer_files(&text, &beside.display().to_string(), separate)?
                }
                Err(_) => None,
            },
            None => None,
        },
    };
    if let Some(t) = &template {
        tracing::info!(model = %m.name, template = %t.origin, "chat template");
    }
    Ok(template.map(Arc::new))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> ModelConfig {
        let yaml = "models: [{name: m, path: 'builtin:embedder', tokenizer: 'builtin:embedder'}]\n\
                    pools: [{name: cpu, provider: cpu, models: [m]}]\n";
        crate::testing::config::validated(yaml).models[0].clone()
    }

    fn tokenizer() -> Arc<Tokenizer> {
        let bytes = crate::core::model::BuiltinModel::Embedder.tokenizer().unwrap();
        Arc::new(Tokenizer::from_bytes(bytes).unwrap())
    }

    fn text_tower() -> Tower {
        Tower::Text {
            max_positions: None,
            pad: None,
            output: "text_embeds",
        }
    }

    #[test]
    fn a_kind_is_what_was_found_and_answers_its_apis_only() {
        let (m, folder) = (model(), ModelFolder::default());
        let found = [Some(Found::Embedder(Embedder::BUNDLED)), None, None, None];
        let kind = kind_of(&m, &folder, None, (Some(tokenizer()), None), found).unwrap();
        assert!(kind.embedder().is_some() && kind.tokenizer().is_some());
        assert!(kind.serves(Api::Embeddings) && kind.serves_openai());
        assert!(!kind.serves(Api::Generation) && !kind.serves(Api::Rerank) && !kind.serves(Api::Transcription));
        let tensor = kind_of(&m, &folder, None, (None, None), [None, None, None, None]).unwrap();
        assert!(matches!(tensor, Kind::Tensor) && !tensor.serves_openai());
    }

    #[test]
    fn a_model_found_to_be_of_two_kinds_is_refused_naming_both() {
        let (m, folder) = (model(), ModelFolder::default());
        let found = [
            Some(Found::Embedder(Embedder::BUNDLED)),
            None,
            Some(Found::Tower(text_tower())),
            None,
        ];
        let (key, message) = kind_of(&m, &folder, None, (Some(tokenizer()), None), found).unwrap_err();
        assert_eq!(key, "path");
        assert!(
            message.ends_with("is a model of two kinds: embeddings and a dual encoder's tower"),
            "{message}"
        );
    }

    #[test]
    fn a_kind_that_reads_text_without_a_tokenizer_is_refused_naming_the_key() {
        let (m, folder) = (model(), ModelFolder::default());
        let found = [Some(Found::Embedder(Embedder::BUNDLED)), None, None, None];
        let (key, message) = kind_of(&m, &folder, None, (None, None), found).unwrap_err();
        assert_eq!(
            (key, message.ends_with("embeds but has no tokenizer")),
            ("tokenizer", true)
        );
    }
}
