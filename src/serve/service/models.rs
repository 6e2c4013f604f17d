//! The models a service serves: each one's bytes, signature, memory profile, decoder layout,
//! tokenizer and chat template, read and checked against its config before any port is bound.

use std::sync::Arc;

use crate::config::{Config, ConfigError, ModelConfig};
use crate::runtime::decoder::DecoderLayout;
use crate::runtime::estimate::{MemoryProfile, ProfileSource};
use crate::runtime::onnx::ModelSignature;

use super::BackendFactory;

/// A model with its signature and memory profile.
#[derive(Debug, Clone)]
pub struct ModelEntry {
    /// Its configuration.
    pub config: ModelConfig,
    /// Inputs and outputs.
    pub signature: ModelSignature,
    /// What its runs need, for request estimates.
    pub profile: MemoryProfile,
    /// The ONNX bytes, read once and shared by every pool's sessions.
    pub bytes: ModelBytes,
    /// Its KV-cache layout, when it is a decoder with past key values.
    pub decoder: Option<DecoderLayout>,
    /// Its tokenizer, when it is a decoder that serves text generation.
    pub tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    /// Its chat template, when it serves `/v1/chat/completions`.
    pub chat: Option<Arc<crate::runtime::chat::ChatTemplate>>,
}

/// A model's serialized bytes (borrowed for builtin models), shared by every pool's workers and
/// kept for rebuilding a worker's backend; `Debug` shows only the size.
#[derive(Clone)]
pub struct ModelBytes(Arc<std::borrow::Cow<'static, [u8]>>);

impl ModelBytes {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for ModelBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ModelBytes({} bytes)", self.0.len())
    }
}

impl ModelEntry {
    /// Context length and batch of a request's inputs: the context axis' length (0 without
    /// one) and the first axis of the context input (or of the first input).
    pub fn shape_of(&self, inputs: &[crate::core::tensor::Tensor]) -> (u64, u64) {
        let dim = |name: &str, axis: usize| {
            inputs
                .iter()
                .find(|t| t.name == name)
                .and_then(|t| t.shape.get(axis))
                .map_or(0, |d| (*d).max(0) as u64)
        };
        if self.decoder.is_some() {
            // The cache holds every position the attention mask covers: past and new tokens.
            return (dim("attention_mask", 1), dim("input_ids", 0).max(1));
        }
        match &self.config.context {
            Some(ctx) => {
                let batch = if ctx.axis == 0 { 1 } else { dim(&ctx.input, 0) };
                (dim(&ctx.input, ctx.axis), batch.max(1))
            }
            None => {
                let first = self.signature.inputs.first().map(|s| s.name.as_str()).unwrap_or("");
                (0, dim(first, 0).max(1))
            }
        }
    }

    /// The estimate for a request's inputs.
    pub fn estimate(&self, inputs: &[crate::core::tensor::Tensor]) -> crate::core::snapshot::Estimate {
        let (tokens, batch) = self.shape_of(inputs);
        self.profile.estimate(tokens, batch)
    }
}

/// Read and check every configured model, in config order; the first that fails is refused
/// with its file and key (`models[i].…`).
pub(super) fn load_models(backends: &dyn BackendFactory, config: &Config) -> Result<Vec<ModelEntry>, ConfigError> {
    let models = config.models.iter().enumerate();
    models
        .map(|(i, m)| {
            load_model(backends, m).map_err(|(key, message)| ConfigError::Invalid {
                file: config.source.clone(),
                key: format!("models[{i}].{key}"),
                message,
            })
        })
        .collect()
}

/// A model that failed to load: the key under its `models[]` entry that is wrong, and why.
type Invalid = (&'static str, String);

/// Read model `m` and check it against its config.
fn load_model(backends: &dyn BackendFactory, m: &ModelConfig) -> Result<ModelEntry, Invalid> {
    let bytes = crate::core::model::load_bytes(&m.source).map_err(|e| ("path", e))?;
    let signature = backends
        .signature(m, &bytes)
        .map_err(|e| ("path", format!("`{}` cannot be served: {e}", m.source)))?;
    check_context(m, &signature)?;
    let decoder = crate::runtime::decoder::DecoderLayout::detect(&signature)
        .transpose()
        .map_err(|e| ("path", format!("`{}`: {e}", m.source)))?;
    if decoder.is_some() && m.context.is_some() {
        return Err((
            "context",
            "a decoder's context is its attention mask, read from the graph; remove `context`".to_string(),
        ));
    }
    let profile = profile_of(backends, m, &bytes, &signature, decoder);
    let tokenizer = tokenizer_of(m, decoder)?;
    let chat = chat_template(m).map_err(|e| ("chat_template", e))?;
    Ok(ModelEntry {
        config: m.clone(),
        signature,
        profile,
        bytes: ModelBytes(Arc::new(bytes)),
        decoder,
        tokenizer,
        chat,
    })
}

/// A configured context axis must name an input of the model, exist in its shape and be
/// dynamic, since requests are cut along it.
fn check_context(m: &ModelConfig, signature: &ModelSignature) -> Result<(), Invalid> {
    let Some(ctx) = &m.context else {
        return Ok(());
    };
    let input = signature.inputs.iter().find(|s| s.name == ctx.input).ok_or_else(|| {
        (
            "context.input",
            format!(
                "model `{}` has no input `{}`; its inputs are: {}",
                m.name,
                ctx.input,
                signature.input_names()
            ),
        )
    })?;
    if ctx.axis >= input.shape.len() {
        return Err((
            "context.axis",
            format!(
                "input `{}` has rank {}, so axis {} does not exist",
                ctx.input,
                input.shape.len(),
                ctx.axis
            ),
        ));
    }
    if input.shape[ctx.axis] != -1 {
        return Err((
            "context.axis",
            format!(
                "axis {} of `{}` is fixed at {}; a context axis must be dynamic",
                ctx.axis, ctx.input, input.shape[ctx.axis]
            ),
        ));
    }
    Ok(())
}

/// What model `m`'s runs need: a decoder's KV cache read from its graph, the configured
/// profile, or a measurement (logged, since every estimate rests on it).
fn profile_of(
    backends: &dyn BackendFactory,
    m: &ModelConfig,
    bytes: &[u8],
    signature: &ModelSignature,
    decoder: Option<DecoderLayout>,
) -> MemoryProfile {
    let profile = match (&m.profile, decoder) {
        (None, Some(layout)) => MemoryProfile {
            weights_bytes: bytes.len() as u64,
            workspace_bytes: 0.0,
            // The cache for every position, and the logits of a prompt's positions.
            per_token_bytes: (layout.kv_bytes_per_token() + layout.logits_bytes_per_token()) as f64,
            per_token_squared_bytes: 0.0,
            source: ProfileSource::KvCache {
                layers: layout.layers,
                kv_heads: layout.kv_heads,
                head_size: layout.head_size,
                kv_bytes_per_token: layout.kv_bytes_per_token(),
            },
        },
        _ => match &m.profile {
            Some(p) => MemoryProfile {
                weights_bytes: p.weights_bytes.unwrap_or(bytes.len() as u64),
                workspace_bytes: p.workspace_bytes as f64,
                per_token_bytes: p.per_token_bytes,
                per_token_squared_bytes: p.per_token_squared_bytes,
                source: ProfileSource::Config,
            },
            None => backends.measure_profile(m, bytes, signature),
        },
    };
    match &profile.source {
        ProfileSource::Unmeasured { reason } => tracing::warn!(
            model = %m.name,
            %reason,
            "memory profile not measured; estimates count weights only (set models[].memory_profile)"
        ),
        _ => tracing::info!(
            model = %m.name,
            weights = %crate::telemetry::logging::human_bytes(profile.weights_bytes),
            workspace = %crate::telemetry::logging::human_bytes(profile.workspace_bytes.round() as u64),
            per_token_bytes = format_args!("{:.1}", profile.per_token_bytes),
            per_token_squared_bytes = format_args!("{:.1}", profile.per_token_squared_bytes),
            "memory profile"
        ),
    }
    profile
}

/// Model `m`'s tokenizer, when it is configured: only a decoder with past key values can use one.
fn tokenizer_of(
    m: &ModelConfig,
    decoder: Option<DecoderLayout>,
) -> Result<Option<Arc<tokenizers::Tokenizer>>, Invalid> {
    match (&m.tokenizer, decoder) {
        (None, _) => Ok(None),
        (Some(_), None) => Err((
            "tokenizer",
            format!(
                "`{}` is not a decoder with past key values (inputs `input_ids`, `attention_mask`, `past_key_values.N.key/value`), so it cannot generate text",
                m.source
            ),
        )),
        (Some(path), Some(_)) => tokenizers::Tokenizer::from_file(path)
            .map(|t| Some(Arc::new(t)))
            .map_err(|e| ("tokenizer", format!("cannot read `{}`: {e}", path.display()))),
    }
}

/// The chat template of model `m`: the configured one, else the `chat_template` of the
/// `tokenizer_config.json` beside its tokenizer (how Hugging Face ships models), else none.
fn chat_template(m: &ModelConfig) -> Result<Option<Arc<crate::runtime::chat::ChatTemplate>>, String> {
    use crate::runtime::chat::ChatTemplate;
    let Some(tokenizer) = &m.tokenizer else {
        return Ok(None);
    };
    let template = match &m.chat_template {
        Some(source) => Some(ChatTemplate::load(source)?),
        None => {
            let beside = tokenizer.with_file_name("tokenizer_config.json");
            match std::fs::read_to_string(&beside) {
                Ok(text) => ChatTemplate::from_tokenizer_config(&text, &beside.display().to_string())?,
                Err(_) => None,
            }
        }
    };
    if let Some(t) = &template {
        tracing::info!(model = %m.name, template = %t.origin, "chat template");
    }
    Ok(template.map(Arc::new))
}
