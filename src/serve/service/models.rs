//! The models a service serves: each one's bytes, signature, memory profile and [`Kind`], read
//! and checked against its config before any port is bound.
use std::path::Path;
use std::sync::Arc;

use crate::config::{Config, ConfigError, ModelConfig};
use crate::core::model::{BuiltinModel, ModelBytes, ModelData, ModelSource};
use crate::core::snapshot::Estimate;
use crate::core::tensor::Tensor;
use crate::runtime::decoder::{CacheHints, DecoderLayout, PrefillLogits};
use crate::runtime::embedder::Embedder;
use crate::runtime::estimate::learned::{Learned, Observation};
use crate::runtime::estimate::{AxisRole, Dims, MemoryProfile, ProfileSource};
use crate::runtime::folder::ModelFolder;
use crate::runtime::onnx::ModelSignature;
use crate::runtime::onnx::facts;
use crate::runtime::reranker::Reranker;
use crate::runtime::tower::Tower;
use crate::telemetry::inference_stats::InferenceStats;

use super::BackendFactory;
use super::components::{Component, WeightsKey, components_of, weights_keys};
use super::kind::{Found, Invalid, Kind, chat_template, kind_of, tokenizer_of};

/// A model with its signature and memory profile.
#[derive(Debug, Clone)]
pub struct ModelEntry {
    /// Its configuration.
    pub config: ModelConfig,
    /// Inputs and outputs.
    pub signature: ModelSignature,
    /// What its runs need, for request estimates.
    pub profile: MemoryProfile,
    /// What its runs were seen to take.
    pub learned: Arc<Learned>,
    /// Its answered requests, for Triton's statistics extension.
    pub stats: Arc<InferenceStats>,
    /// The ONNX bytes and the folder of their external data, read once and shared by every
    /// pool's sessions.
    pub bytes: ModelBytes,
    /// What its folder says beside its graph: the token ids that end its answers (when it
    /// names none, the end tokens its tokenizer has by name do) and its sampling defaults.
    pub folder: ModelFolder,
    /// What it is, and what its kind needs beside its graph: found once, when it loads.
    pub kind: Kind,
    /// The graphs it runs, each with its weights: its profile's weights are their sum.
    pub components: Vec<Component>,
    /// The hash of everything its sessions are built from, when another configured model has
    /// weights of its sizes (`None`: none does, so none shares them): models with equal keys
    /// share one session per pool.
    pub weights_key: Option<WeightsKey>,
}

impl ModelEntry {
    /// Whether it serves text generation: a decoder with past key values and a tokenizer.
    pub fn generates_text(&self) -> bool {
        self.kind.generator().is_some()
    }

    /// Its smallest valid input: a decoder's first step of one token with an empty cache; the
    /// smallest size measured at start-up; else 1 along every dynamic axis. Health checks run
    /// it, and so does an idle pool giving its arena's memory back.
    pub fn probe_inputs(&self) -> Result<Vec<Tensor>, String> {
        if let Some(layout) = self.kind.decoder() {
            return Ok(crate::runtime::decoder::step_inputs(layout, &[0], 0, Vec::new()));
        }
        let dims = match &self.profile.source {
            ProfileSource::Measured { points, .. } if !points.is_empty() => Dims::new(&points[0].0),
            _ => Dims::new(&vec![1; self.profile.axes.len()]),
        };
        crate::runtime::estimate::measure::inputs_at(&self.signature, &self.profile.axes, &dims)
    }

    /// A request's size along each axis of the model's profile.
    pub fn dims_of(&self, inputs: &[Tensor]) -> Dims {
        self.profile.dims_of(inputs)
    }

    /// Context length and batch of a request's size: the context axis' length (0 without one)
    /// and the batch axis' (1 without one).
    pub fn tokens_and_batch(&self, dims: &Dims) -> (u64, u64) {
        let tokens = self.profile.axis_with(AxisRole::Context).map_or(0, |i| dims.get(i));
        let batch = self
            .profile
            .axis_with(AxisRole::Batch)
            .map_or(1, |i| dims.get(i).max(1));
        (tokens, batch)
    }

    /// The estimate for a run of `dims`: the profile's (or its refit's), never below what a run
    /// no larger in any dimension was seen to take.
    pub fn estimate(&self, dims: &Dims) -> Estimate {
        let (working, source) = self.learned.working(&self.profile, dims);
        self.profile.estimate_with(working, source)
    }

    /// The estimate for a request's inputs.
    pub fn estimate_inputs(&self, inputs: &[Tensor]) -> Estimate {
        self.estimate(&self.dims_of(inputs))
    }

    /// `dims` with `new_tokens` a generation adds on its context axis.
    pub fn with_new_tokens(&self, dims: Dims, new_tokens: u64) -> Dims {
        match self.profile.axis_with(AxisRole::Context) {
            Some(i) if new_tokens > 0 => dims.with(i, dims.get(i).saturating_add(new_tokens)),
            _ => dims,
        }
    }

    /// `dims` with its batch axis `generations` times what was sent (when more than one):
    /// generations that share a prompt's run each hold a KV cache of their own.
    pub fn with_generations(&self, dims: Dims, generations: u64) -> Dims {
        match self.profile.axis_with(AxisRole::Batch) {
            Some(i) if generations > 1 => dims.with(i, dims.get(i).max(1).saturating_mul(generations)),
            _ => dims,
        }
    }

    /// The estimate for `context_tokens` of context and `batch` items (a generation's prompt
    /// and its new tokens).
    pub fn estimate_tokens(&self, context_tokens: u64, batch: u64) -> Estimate {
        self.estimate(&self.profile.dims_for(context_tokens, batch))
    }

    /// Record what a run of `dims` was measured to take; true when a refit is due.
    pub fn observe(&self, dims: Dims, observation: Observation) -> bool {
        self.learned.observe(dims, observation)
    }
}

/// Read and check every configured model, in config order; the first that fails is refused
/// with its file and key (`models[i].…`).
pub(super) fn load_models(backends: &dyn BackendFactory, config: &Config) -> Result<Vec<ModelEntry>, ConfigError> {
    let invalid = |i: usize, key: &str, message: String| ConfigError::Invalid {
        file: config.source.clone(),
        key: format!("models[{i}].{key}"),
        message,
    };
    let models = config.models.iter().enumerate();
    let builtin_home = config.host_tier.builtin_models();
    let mut entries = models
        .map(|(i, m)| load_model(backends, m, &builtin_home).map_err(|(key, message)| invalid(i, key, message)))
        .collect::<Result<Vec<_>, _>>()?;
    let sized: Vec<_> = entries.iter().map(|e| (&e.bytes, e.components.as_slice())).collect();
    let keys = weights_keys(&sized).map_err(|(i, e)| invalid(i, "path", e))?;
    for (entry, key) in entries.iter_mut().zip(keys) {
        entry.weights_key = key;
    }
    for (i, entry) in entries.iter().enumerate() {
        check_images(entry, &entries).map_err(|message| invalid(i, "images", message))?;
    }
    Ok(entries)
}

/// A model that names a vision tower (`images`) is a text tower, and the model it names a
/// vision tower whose vectors are as long as its own (the same space).
fn check_images(entry: &ModelEntry, entries: &[ModelEntry]) -> Result<(), String> {
    let Some(name) = &entry.config.images else {
        return Ok(());
    };
    let vision = entries
        .iter()
        .find(|e| &e.config.name == name)
        .expect("validated: `images` names a model");
    let (Some(text @ Tower::Text { .. }), Some(image @ Tower::Image(..))) = (entry.kind.tower(), vision.kind.tower())
    else {
        return Err(format!(
            "`{}` must be a dual encoder's text tower (its graph gives `text_embeds`) and `{name}` its vision tower (`image_embeds`, with a preprocessor_config.json)",
            entry.config.name
        ));
    };
    match (text.dimensions(&entry.signature), image.dimensions(&vision.signature)) {
        (Some(t), Some(v)) if t != v => Err(format!(
            "`{}` gives vectors of {t} dimensions and `{name}` of {v}: not one space",
            entry.config.name
        )),
        _ => Ok(()),
    }
}

/// A model's bytes carrying the [`CacheHints`] its graph and its `folder` give (unchanged when
/// they say nothing the signature does not), and those hints.
fn with_cache_hints(bytes: ModelBytes, folder: &ModelFolder) -> Result<(ModelBytes, CacheHints), String> {
    let hints = facts::cache_hints(bytes.data().graph, folder)?;
    if hints == CacheHints::default() {
        return Ok((bytes, hints));
    }
    let graph = facts::with_metadata(bytes.data().graph.to_vec(), &hints.to_metadata());
    Ok((bytes.with_graph(graph), hints))
}

/// Read model `m` (its graph, and the external data files it names, each checked; a builtin
/// folder written into `builtin_home`) and check it against its config.
fn load_model(backends: &dyn BackendFactory, m: &ModelConfig, builtin_home: &Path) -> Result<ModelEntry, Invalid> {
    let bytes = crate::core::model::load_bytes(&m.source, builtin_home).map_err(|e| ("path", e))?;
    let folder = match (bytes.data().folder, &m.source) {
        (Some(folder), _) => ModelFolder::read(folder),
        (None, ModelSource::Builtin(builtin)) => ModelFolder::bundled(*builtin),
        (None, ModelSource::File(_)) => Ok(ModelFolder::default()),
    }
    .map_err(|e| ("path", e))?;
    let (bytes, hints) = with_cache_hints(bytes, &folder).map_err(|e| ("path", format!("`{}`: {e}", m.source)))?;
    let external = crate::runtime::onnx::external_data(bytes.data().graph, bytes.data().folder)
        .map_err(|e| ("path", format!("`{}`: {e}", m.source)))?;
    if !external.files.is_empty() {
        tracing::info!(
            model = %m.name,
            files = ?external.files,
            bytes = %crate::core::human::human_bytes(external.bytes),
            "external data"
        );
    }
    let bytes = bytes.with_external_bytes(external.bytes);
    let embedder = match (bytes.data().folder, &m.source) {
        (Some(dir), _) => Embedder::read(dir).map_err(|e| ("path", e))?,
        (None, ModelSource::Builtin(BuiltinModel::Embedder)) => Some(Embedder::BUNDLED),
        (None, _) => None,
    };
    let (bytes, signature, decoder) = match embedder {
        Some(embedder) => pooled(backends, m, bytes, embedder)?,
        None => probed(backends, m, bytes, &hints)?,
    };
    check_context(m, &signature)?;
    if embedder.is_some() {
        Embedder::check(&signature).map_err(|e| {
            (
                "path",
                format!("`{}` has a sentence-transformers Pooling module, but {e}", m.source),
            )
        })?;
    }
    let reranker = match (bytes.data().folder, embedder) {
        (Some(dir), None) => Reranker::read(dir).map_err(|e| ("path", e))?,
        _ => None,
    };
    if reranker.is_some() {
        Reranker::check(&signature).map_err(|e| {
            (
                "path",
                format!(
                    "`{}`'s config.json is a one-label sequence classifier (a cross-encoder), but {e}",
                    m.source
                ),
            )
        })?;
    }
    if decoder.is_some() && m.context.is_some() {
        return Err((
            "context",
            "a decoder's context is its attention mask, read from the graph; remove `context`".to_string(),
        ));
    }
    let tower = Tower::read(bytes.data().folder, &signature).map_err(|e| ("path", format!("`{}`: {e}", m.source)))?;
    let signature = match &tower {
        Some(tower) => tower.pinned(signature),
        None => signature,
    };
    let speech = speech_of(bytes.data().folder, &signature).map_err(|e| ("path", format!("`{}`: {e}", m.source)))?;
    let mut profile = profile_of(backends, m, bytes.data(), &signature, decoder);
    let speech_folder = speech.as_ref().and(bytes.data().folder);
    let components = components_of(
        &m.source.to_string(),
        profile.weights_bytes,
        &external.files,
        speech_folder,
    );
    if let Some(speech) = &speech {
        // The measured graph is the encoder: the decoder's weights and a window's caches are
        // held beside it by every run.
        let decoder = bytes
            .data()
            .folder
            .map_or(0, crate::runtime::speech::SpeechModel::decoder_bytes);
        profile = profile.with_extra(decoder, speech.window_bytes() as f64);
        tracing::info!(
            model = %m.name,
            weights = %crate::core::human::human_bytes(profile.weights_bytes),
            decoder = %crate::core::human::human_bytes(decoder),
            window = %crate::core::human::human_bytes(speech.window_bytes()),
            "speech model: the decoder's weights and each window's caches added to the encoder's profile"
        );
    }
    check_batching(m, &profile, &signature, decoder.is_some())?;
    let reads_text = embedder.is_some() || reranker.is_some() || matches!(tower, Some(Tower::Text { .. }));
    if m.auto_truncate && !reads_text {
        return Err(("auto_truncate", "it reads no texts to embed or rerank".into()));
    }
    let tokenizer = tokenizer_of(m, decoder, reads_text, bytes.data().folder)?;
    let chat = chat_template(m).map_err(|e| ("chat_template", e))?;
    let found = [
        embedder.map(Found::Embedder),
        reranker.map(Found::Reranker),
        tower.map(Found::Tower),
        speech.map(Found::Speech),
    ];
    let kind = kind_of(m, &folder, decoder, (tokenizer, chat), found)?;
    Ok(ModelEntry {
        config: m.clone(),
        signature,
        learned: Arc::new(Learned::new(&profile)),
        stats: Arc::default(),
        profile,
        bytes,
        folder,
        kind,
        components,
        weights_key: None,
    })
}

/// The speech model of a graph that takes Whisper's `input_features` with a Whisper folder.
fn speech_of(
    folder: Option<&std::path::Path>,
    signature: &ModelSignature,
) -> Result<Option<Arc<crate::runtime::speech::SpeechModel>>, String> {
    match folder {
        Some(dir) if signature.inputs.iter().any(|i| i.name == "input_features") => {
            Ok(crate::runtime::speech::SpeechModel::read(dir)?.map(Arc::new))
        }
        _ => Ok(None),
    }
}

/// `m`'s signature and decoder layout, read by one probe session. A decoder's graph (its inputs
/// take past key values) is rewritten first so that its prompt run computes the last position's
/// logits only, and probed as rewritten: these bytes are what every pool builds its sessions
/// from. A graph the rewrite does not understand, or whose rewrite ONNX Runtime does not read
/// as a decoder whose prompt run gives one position, is probed as exported, and the log says why.
fn probed(
    backends: &dyn BackendFactory,
    m: &ModelConfig,
    bytes: ModelBytes,
    hints: &CacheHints,
) -> Result<(ModelBytes, ModelSignature, Option<DecoderLayout>), Invalid> {
    if facts::takes_past_key_values(bytes.data().graph) {
        let rewritten = crate::runtime::onnx::last_position_logits(bytes.data().graph).and_then(|short| {
            let data = ModelData {
                graph: &short,
                ..bytes.data()
            };
            let signature = backends.signature(m, data)?;
            match DecoderLayout::detect(&signature, hints) {
                Some(Ok(read)) if read.prefill_logits == PrefillLogits::LastPosition => Ok((short, signature, read)),
                other => Err(format!(
                    "the rewritten graph reads as {other:?}, not as a decoder whose prompt run gives one position"
                )),
            }
        });
        match rewritten {
            Ok((short, signature, read)) => {
                tracing::info!(model = %m.name, "the prompt's run computes the last position's logits only (its LM head is given that position alone)");
                return Ok((bytes.with_graph(short), signature, Some(read)));
            }
            Err(reason) => tracing::warn!(
                model = %m.name,
                %reason,
                "the prompt's run computes every position's logits, as exported (no LM head to give the last position alone)"
            ),
        }
    }
    let signature = backends
        .signature(m, bytes.data())
        .map_err(|e| ("path", format!("`{}` cannot be served: {e}", m.source)))?;
    let decoder = DecoderLayout::detect(&signature, hints)
        .transpose()
        .map_err(|e| ("path", format!("`{}`: {e}", m.source)))?;
    Ok((bytes, signature, decoder))
}

/// An embedder's signature, read by one probe session. Its graph is rewritten first so that it
/// pools (and normalizes) into `sentence_embedding` itself, and probed as rewritten: only the
/// vectors come back from a run, and the memory profile is measured on that graph. A graph the
/// rewrite cannot pool is probed as exported, its `last_hidden_state` pooled on the host, and
/// the log says why.
fn pooled(
    backends: &dyn BackendFactory,
    m: &ModelConfig,
    bytes: ModelBytes,
    embedder: Embedder,
) -> Result<(ModelBytes, ModelSignature, Option<DecoderLayout>), Invalid> {
    use crate::runtime::embedder::EMBEDDING;
    let rewritten = crate::runtime::onnx::pooled_embedding(bytes.data().graph, embedder.pooling, embedder.normalize)
        .and_then(|pooled| {
            let data = ModelData {
                graph: &pooled,
                ..bytes.data()
            };
            let signature = backends.signature(m, data)?;
            Embedder::check(&signature)?;
            match Embedder::output(&signature) {
                EMBEDDING => Ok((pooled, signature)),
                other => Err(format!("the rewritten graph gives `{other}`, not `{EMBEDDING}`")),
            }
        });
    match rewritten {
        Ok((pooled, signature)) => {
            tracing::info!(model = %m.name, pooling = embedder.pooling.label(), normalize = embedder.normalize,
                "the graph pools: a run gives `{EMBEDDING}` [batch, hidden], not every token's state");
            Ok((bytes.with_graph(pooled), signature, None))
        }
        Err(reason) => {
            tracing::warn!(
                model = %m.name,
                %reason,
                "the graph is run as exported: every token's state (`last_hidden_state`) comes back and is pooled on the host"
            );
            let signature = backends
                .signature(m, bytes.data())
                .map_err(|e| ("path", format!("`{}` cannot be served: {e}", m.source)))?;
            Ok((bytes, signature, None))
        }
    }
}

/// `batching` needs a batch axis that every input has (members are stacked along it), and is
/// for single runs: a decoder's generations are batched step by step already.
fn check_batching(
    m: &ModelConfig,
    profile: &MemoryProfile,
    signature: &ModelSignature,
    decoder: bool,
) -> Result<(), Invalid> {
    if m.batching.is_none() {
        return Ok(());
    }
    if decoder {
        return Err((
            "batching",
            "a decoder's generations already share each step's run (continuous batching); remove `batching`"
                .to_string(),
        ));
    }
    let Some(batch) = profile.axis_with(AxisRole::Batch).map(|i| &profile.axes[i]) else {
        return Err((
            "batching",
            format!(
                "`{}` has no batch axis (a dynamic first dimension its inputs share) to stack requests along; remove `batching`",
                m.source
            ),
        ));
    };
    let lacks = |name: &str| profile.batch_axis_of(signature, name).is_none();
    if let Some(input) = signature.inputs.iter().find(|i| lacks(&i.name)) {
        return Err((
            "batching",
            format!(
                "input `{}` of `{}` does not have the batch axis `{}`, so requests cannot be stacked; remove `batching`",
                input.name, m.source, batch.name
            ),
        ));
    }
    Ok(())
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
    data: ModelData<'_>,
    signature: &ModelSignature,
    decoder: Option<DecoderLayout>,
) -> MemoryProfile {
    let profile = match (&m.profile, decoder) {
        (None, Some(layout)) => {
            // The cache for every position (a windowed layer's, its window's, per sequence),
            // and the logits of the prompt's positions (of its last alone when the graph was
            // rewritten for it).
            let (kv, logits) = (layout.kv_bytes_per_token(), layout.logits_bytes_per_position());
            let window = layout.kv_window_bytes();
            let (per_token, per_sequence) = match layout.prefill_logits {
                PrefillLogits::EveryPosition => (kv + logits, window),
                PrefillLogits::LastPosition => (kv, logits + window),
            };
            MemoryProfile::per_token(
                data.stored_bytes(),
                per_token as f64,
                per_sequence as f64,
                ProfileSource::KvCache {
                    layers: layout.layers,
                    kv_heads: layout.kv_heads,
                    head_size: layout.head_size,
                    kv_bytes_per_token: kv,
                    kv_window_bytes: window,
                    prefill_logits: layout.prefill_logits,
                },
            )
        }
        _ => match &m.profile {
            Some(p) => MemoryProfile::configured(p, data.stored_bytes(), m.context.as_ref(), signature),
            None => backends.measure_profile(m, data, signature),
        },
    };
    match &profile.source {
        ProfileSource::Unmeasured { reason } => tracing::warn!(
            model = %m.name,
            %reason,
            "memory profile not measured; estimates count weights only until runs are observed (or set models[].memory_profile)"
        ),
        _ => tracing::info!(
            model = %m.name,
            weights = %crate::core::human::human_bytes(profile.weights_bytes),
            workspace = %crate::core::human::human_bytes(profile.workspace_bytes.round() as u64),
            working = %profile.formula(),
            measure_ms = match &profile.source {
                ProfileSource::Measured { measure_ms, .. } => *measure_ms,
                _ => 0,
            },
            "memory profile"
        ),
    }
    profile
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::tensor::DataType;
    use crate::runtime::onnx::TensorSpec;

    fn batched(yaml_model: &str) -> ModelConfig {
        let yaml = format!(
            "models: [{{name: m, path: 'builtin:encoder', batching: {{max_batch: 4, max_delay: 5ms}}{yaml_model}}}]\n\
             pools: [{{name: cpu, provider: cpu, models: [m]}}]\n"
        );
        crate::testing::config::validated(&yaml).models[0].clone()
    }

    fn spec(name: &str, shape: Vec<i64>, symbols: &[&str]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            datatype: DataType::Fp32,
            shape,
            symbols: symbols.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn profile(signature: &ModelSignature, context: Option<&crate::config::ContextAxis>) -> MemoryProfile {
        let configured = crate::config::ConfiguredProfile {
            weights_bytes: Some(1),
            workspace_bytes: 0,
            per_token_bytes: 1.0,
            per_token_squared_bytes: 0.0,
        };
        MemoryProfile::configured(&configured, 1, context, signature)
    }

    #[test]
    fn batching_needs_a_batch_axis_every_input_has() {
        let m = batched("");
        // Its inputs all share the batch axis, by where the estimate reads it or by name.
        let shared = ModelSignature {
            inputs: vec![
                spec("a", vec![-1, 8], &["batch", ""]),
                spec("b", vec![-1, 8], &["batch", ""]),
            ],
            outputs: vec![],
        };
        assert_eq!(check_batching(&m, &profile(&shared, None), &shared, false), Ok(()));
        // A second input without it cannot be stacked.
        let lacking = ModelSignature {
            inputs: vec![spec("a", vec![-1, 8], &["batch", ""]), spec("scale", vec![1], &[""])],
            outputs: vec![],
        };
        let (key, why) = check_batching(&m, &profile(&lacking, None), &lacking, false).unwrap_err();
        assert_eq!(key, "batching");
        assert!(why.contains("input `scale`"), "{why}");
        // No dynamic input at all: no batch axis.
        let fixed = ModelSignature {
            inputs: vec![spec("a", vec![], &[])],
            outputs: vec![],
        };
        let (_, why) = check_batching(&m, &profile(&fixed, None), &fixed, false).unwrap_err();
        assert!(why.contains("has no batch axis"), "{why}");
        // Not configured: nothing to check.
        let plain = ModelConfig { batching: None, ..m };
        assert_eq!(check_batching(&plain, &profile(&fixed, None), &fixed, false), Ok(()));
    }
}
