//! The production [`Backend`]: ONNX Runtime sessions, one per model, owned by one worker, built
//! at start or later by a load and dropped by an unload. A model whose weights are another's
//! runs on that one's session ([`Residency::share_model`]): one copy, each name with its own
//! generations' caches.

use std::collections::HashMap;

use ort::memory::Allocator;
use ort::session::{RunOptions, Session};

use super::generations::Generations;
use super::kernels::Kernels;
use super::speech::Speech;
use super::{OnnxRuntime, SessionOptions, arena, arena_allocator, build_held, run};
use crate::config::Provider;
use crate::core::backend::{self as seam, Arenas, Backend, BackendError, DecodeStep, Interrupts, Residency, RunMeta};
use crate::core::model::{ModelBytes, ModelData};
use crate::core::tensor::{Tensor, TensorView};
use crate::runtime::decoder::{CacheHints, DecoderLayout};

/// Build `name`'s session and find the arena it allocates from: the capped shared one for
/// simulated pools, its own for CPU and CUDA pools. Stats are optional: a provider without an
/// arena simply reports none. With them, the bytes the session uses its initializers in, when
/// it does (see [`build_held`]).
type Opened = ((Session, Option<Allocator>), Option<ModelBytes>);
fn open_session(
    rt: &OnnxRuntime,
    name: &str,
    model: ModelData<'_>,
    options: &SessionOptions,
) -> Result<Opened, String> {
    let held = build_held(rt, model, options).map_err(|e| format!("model `{name}`: {e}"))?;
    let allocator = arena_allocator(&held.session, options);
    Ok(((held.session, allocator), held.keeps))
}

/// The production [`Backend`]: one session per model, owned by one worker.
pub struct OrtBackend {
    /// What later loads build their sessions with.
    rt: &'static OnnxRuntime,
    options: SessionOptions,
    pub(super) sessions: HashMap<String, (Session, Option<Allocator>)>,
    last_stats: Option<arena::ArenaStats>,
    /// Every arena's, summed ([`Arenas::held_arena_stats`]).
    held_stats: Option<arena::ArenaStats>,
    last_model: Option<String>,
    /// One run at a time per backend, so one set of options: its terminate flag stops the run
    /// in progress (see [`Interrupts::interrupt_handle`]).
    run_options: std::sync::Arc<RunOptions>,
    /// Options of the runs that shrink the arena when the pool is idle (built on first use).
    shrinking: Option<RunOptions>,
    /// Models run since the arena was last shrunk.
    used: std::collections::HashSet<String>,
    /// The layouts of its decoders (models with past key values).
    pub(super) decoders: HashMap<String, DecoderLayout>,
    /// The KV caches of the generations it runs, where its sessions put them.
    pub(super) generations: Generations,
    /// The decoders of its speech models, by the name of their encoder's session.
    speech: HashMap<String, Speech>,
    /// The models that run on another's session, by name: the name that holds it. Sessions,
    /// layouts, speech decoders and kept bytes are under the holder's name; generations' caches
    /// under each model's own.
    shared: HashMap<String, String>,
    /// The ORT-format bytes of the sessions that use their initializers in place: kept while
    /// those sessions live (last, so dropped after every session).
    keeps: HashMap<String, ModelBytes>,
}

/// The name `model`'s session is held under: its own, or the one it shares.
fn holder<'a>(shared: &'a HashMap<String, String>, model: &'a str) -> &'a str {
    shared.get(model).map_or(model, String::as_str)
}

/// `model`'s session, its own or the one it shares, once [`OrtBackend::note_use`] found it.
fn session_of<'a>(
    sessions: &'a mut HashMap<String, (Session, Option<Allocator>)>,
    shared: &HashMap<String, String>,
    model: &str,
) -> &'a mut Session {
    let (session, _) = sessions
        .get_mut(holder(shared, model))
        .expect("noted: it has a session");
    session
}

/// `session`'s decoder layout, when it is a decoder with past key values, with the
/// [`CacheHints`] its model carries in its metadata.
fn decoder_of(session: &Session) -> Option<DecoderLayout> {
    let signature = super::signature(session).ok()?;
    let metadata = session.metadata().ok()?;
    let hints = CacheHints::from_metadata(|key| metadata.custom(key)).ok()?;
    DecoderLayout::detect(&signature, &hints)?.ok()
}

/// The speech model `name` is when its session is a Whisper encoder and its folder holds the
/// rest of it (its decoder's sessions opened).
fn speech_of(
    rt: &'static OnnxRuntime,
    name: &str,
    session: &Session,
    model: ModelData<'_>,
    options: &SessionOptions,
) -> Result<Option<Speech>, String> {
    Speech::open(rt, session, model.folder, options).map_err(|e| format!("model `{name}`: {e}"))
}

/// `memory.enable_memory_arena_shrinkage`'s value for the arena `options`' sessions use.
fn arena_of(options: &SessionOptions) -> String {
    match &options.provider {
        Provider::Cuda(_) => format!("gpu:{}", options.device_index),
        _ => "cpu:0".to_string(),
    }
}

impl OrtBackend {
    /// Build sessions for every `(name, model)` under `options`.
    pub fn load(
        rt: &'static OnnxRuntime,
        models: &[(String, ModelData<'_>)],
        options: &SessionOptions,
    ) -> Result<OrtBackend, String> {
        let mut sessions = HashMap::new();
        let mut decoders = HashMap::new();
        let mut keeps = HashMap::new();
        let mut speech = HashMap::new();
        for (name, model) in models {
            let (opened, kept) = open_session(rt, name, *model, options)?;
            if let Some(model) = speech_of(rt, name, &opened.0, *model, options)? {
                speech.insert(name.clone(), model);
            }
            if let Some(bytes) = kept {
                keeps.insert(name.clone(), bytes);
            }
            if let Some(layout) = decoder_of(&opened.0) {
                decoders.insert(name.clone(), layout);
            }
            sessions.insert(name.clone(), opened);
        }
        let mut run_options = RunOptions::new().map_err(|e| e.to_string())?;
        if options.arena_shrinkage {
            run_options
                .set("memory.enable_memory_arena_shrinkage", arena_of(options))
                .map_err(|e| e.to_string())?;
        }
        let run_options = std::sync::Arc::new(run_options);
        let mut backend = OrtBackend {
            rt,
            options: options.clone(),
            sessions,
            last_stats: None,
            held_stats: None,
            last_model: None,
            run_options,
            shrinking: None,
            used: Default::default(),
            decoders,
            generations: Generations::new(Kernels::new(rt, options)?),
            speech,
            shared: HashMap::new(),
            keeps,
        };
        // Statistics before the first run show what loading the weights reserved.
        backend.refresh_arena_stats();
        Ok(backend)
    }
}

impl OrtBackend {
    /// Note `model` as the last used and as used since the last release, when it has a session.
    /// (A model that shares another's session notes that one.)
    fn note_use(&mut self, model: &str) -> Result<(), BackendError> {
        let held = holder(&self.shared, model);
        if !self.sessions.contains_key(held) {
            return Err(BackendError::Runtime(format!(
                "this worker has no session for `{model}`"
            )));
        }
        self.last_model = Some(held.to_string());
        if !self.used.contains(held) {
            self.used.insert(held.to_string());
        }
        Ok(())
    }
}

impl OrtBackend {
    /// `model`'s decoder layout, for a generation's runs (noted as used).
    fn decoder(&mut self, model: &str) -> Result<DecoderLayout, BackendError> {
        self.note_use(model)?;
        self.decoders
            .get(holder(&self.shared, model))
            .copied()
            .ok_or_else(|| BackendError::InvalidInput(format!("model `{model}` is not a decoder with past key values")))
    }
}

impl Backend for OrtBackend {
    fn run(
        &mut self,
        model: &str,
        mut inputs: Vec<Tensor>,
        outputs: &[String],
        _: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        self.note_use(model)?;
        let held = holder(&self.shared, model);
        // A decoder's first pass run whole (a probe, a pool that keeps no caches): its windowed
        // layers' caches start at their window's slots.
        if let Some(layout) = self.decoders.get(held) {
            crate::runtime::decoder::open_windows(layout, &mut inputs);
        }
        let (session, _) = self.sessions.get_mut(held).expect("noted: it has a session");
        if let Some(speech) = self.speech.get_mut(held)
            && Speech::wants_decoding(&inputs)
        {
            let kernels = self.generations.kernels();
            return speech.transcribe(session, kernels, inputs, outputs, &self.run_options);
        }
        run(session, inputs, outputs, Some(&self.run_options))
    }

    fn run_views(
        &mut self,
        model: &str,
        inputs: &[TensorView<'_>],
        outputs: &[String],
        _: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        // A windowed decoder's first pass has its windows opened by `run`.
        let fresh = |v: &TensorView<'_>| v.name.starts_with("past_key_values.") && v.shape.get(2) == Some(&0);
        let held = holder(&self.shared, model);
        let windowed = self.decoders.get(held).is_some_and(|l| l.window.is_some()) && inputs.iter().any(fresh);
        let speech =
            self.speech.contains_key(held) && inputs.iter().any(|v| v.name == super::speech::DECODER_INPUT_IDS);
        if speech || windowed {
            let owned = inputs.iter().map(TensorView::to_tensor).collect::<Result<_, _>>();
            return self.run(
                model,
                owned.map_err(BackendError::InvalidInput)?,
                outputs,
                &RunMeta::default(),
            );
        }
        self.note_use(model)?;
        let session = session_of(&mut self.sessions, &self.shared, model);
        super::run_views(session, inputs, outputs, Some(&self.run_options))
    }

    fn residency(&mut self) -> Option<&mut dyn Residency> {
        Some(self)
    }

    fn generations(&mut self) -> Option<&mut dyn seam::Generations> {
        Some(self)
    }

    fn arenas(&mut self) -> Option<&mut dyn Arenas> {
        Some(self)
    }

    /// Its sessions live in this process: they go only with it.
    fn liveness(&self) -> Option<&dyn seam::Liveness> {
        None
    }

    fn interrupts(&mut self) -> Option<&mut dyn Interrupts> {
        Some(self)
    }
}

impl seam::Generations for OrtBackend {
    fn prefill(
        &mut self,
        model: &str,
        seq: u64,
        inputs: Vec<Tensor>,
        _: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        let layout = self.decoder(model)?;
        let session = session_of(&mut self.sessions, &self.shared, model);
        self.generations
            .prefill(session, &layout, model, seq, inputs, &self.run_options)
    }

    fn prefill_many(
        &mut self,
        model: &str,
        seqs: &[u64],
        inputs: Vec<Tensor>,
        _: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        let layout = self.decoder(model)?;
        let session = session_of(&mut self.sessions, &self.shared, model);
        self.generations
            .prefill_many(session, &layout, model, seqs, inputs, &self.run_options)
    }

    fn decode(&mut self, model: &str, step: &DecodeStep, _: &RunMeta) -> Result<Vec<Tensor>, BackendError> {
        let layout = self.decoder(model)?;
        let session = session_of(&mut self.sessions, &self.shared, model);
        self.generations
            .decode(session, &layout, model, step, &self.run_options)
    }
}

impl Residency for OrtBackend {
    fn load_model(&mut self, name: &str, model: ModelData<'_>) -> Result<(), String> {
        let (session, kept) = open_session(self.rt, name, model, &self.options)?;
        // Its own session from now on, not the one it shared.
        self.shared.remove(name);
        match speech_of(self.rt, name, &session.0, model, &self.options)? {
            Some(speech) => self.speech.insert(name.to_string(), speech),
            None => self.speech.remove(name),
        };
        self.generations.forget(name);
        match decoder_of(&session.0) {
            Some(layout) => self.decoders.insert(name.to_string(), layout),
            None => self.decoders.remove(name),
        };
        // The session it replaces goes before the bytes it may use.
        self.sessions.insert(name.to_string(), session);
        match kept {
            Some(bytes) => self.keeps.insert(name.to_string(), bytes),
            None => self.keeps.remove(name),
        };
        Ok(())
    }

    fn unload_model(&mut self, name: &str) {
        self.generations.forget(name);
        if self.shared.remove(name).is_some() {
            // Its holder's session stays: only its name goes.
            return;
        }
        let mut sharers: Vec<String> = self
            .shared
            .iter()
            .filter(|(_, h)| *h == name)
            .map(|(n, _)| n.clone())
            .collect();
        sharers.sort();
        if let Some(heir) = sharers.first() {
            // Another name still runs on this session: it holds it from now on.
            self.hand_over(name, heir);
            return;
        }
        self.sessions.remove(name);
        self.keeps.remove(name);
        self.decoders.remove(name);
        self.speech.remove(name);
        if self.last_model.as_deref() == Some(name) {
            self.last_model = None;
        }
    }

    fn share_model(&mut self, name: &str, with: &str) -> Result<(), String> {
        let held = holder(&self.shared, with).to_string();
        if held == name {
            return Ok(());
        }
        if !self.sessions.contains_key(&held) {
            return Err(format!("this worker has no session of `{with}` for `{name}` to share"));
        }
        // A session of its own goes first (a name that others share hands it over to them).
        self.unload_model(name);
        let held = holder(&self.shared, with).to_string();
        self.shared.insert(name.to_string(), held);
        Ok(())
    }

    fn release_memory(&mut self, probe: &dyn Fn(&str) -> Option<Vec<Tensor>>) {
        // ONNX Runtime's arena shrinks only at the end of a run whose options ask it to: each
        // session used since the last time runs once on its smallest inputs with them.
        if self.shrinking.is_none() {
            let made = RunOptions::new().and_then(|mut o| {
                o.set("memory.enable_memory_arena_shrinkage", arena_of(&self.options))?;
                Ok(o)
            });
            match made {
                Ok(options) => self.shrinking = Some(options),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot build the options that shrink the arena");
                    return;
                }
            }
        }
        for model in std::mem::take(&mut self.used) {
            let (Some((session, _)), Some(inputs)) = (self.sessions.get_mut(&model), probe(&model)) else {
                continue;
            };
            if let Err(e) = run(session, inputs, &[], self.shrinking.as_ref()) {
                tracing::debug!(%model, error = %e, "the run that shrinks the arena failed");
            }
        }
    }
}

impl OrtBackend {
    /// The session `from` holds (and what goes with it) is held under `heir`'s name, which
    /// shared it; every other name that shared it follows.
    fn hand_over(&mut self, from: &str, heir: &str) {
        self.shared.remove(heir);
        for held in self.shared.values_mut().filter(|h| *h == from) {
            *held = heir.to_string();
        }
        if let Some(session) = self.sessions.remove(from) {
            self.sessions.insert(heir.to_string(), session);
        }
        if let Some(bytes) = self.keeps.remove(from) {
            self.keeps.insert(heir.to_string(), bytes);
        }
        if let Some(layout) = self.decoders.remove(from) {
            self.decoders.insert(heir.to_string(), layout);
        }
        if let Some(speech) = self.speech.remove(from) {
            self.speech.insert(heir.to_string(), speech);
        }
        if self.used.remove(from) {
            self.used.insert(heir.to_string());
        }
        if self.last_model.as_deref() == Some(from) {
            self.last_model = Some(heir.to_string());
        }
    }
}

impl Interrupts for OrtBackend {
    fn clear_interrupt(&mut self) {
        if let Err(e) = self.run_options.unterminate() {
            tracing::warn!(error = %e, "cannot clear the run options' terminate flag");
        }
    }

    fn interrupt_handle(&self) -> seam::Interrupt {
        let run_options = std::sync::Arc::clone(&self.run_options);
        std::sync::Arc::new(move || {
            let _ = run_options.terminate();
        })
    }
}

impl Arenas for OrtBackend {
    fn arena_stats(&self) -> Option<arena::ArenaStats> {
        self.last_stats
    }

    fn held_arena_stats(&self) -> Option<arena::ArenaStats> {
        self.held_stats
    }

    fn refresh_arena_stats_for(&mut self, model: &str) {
        self.last_model = Some(holder(&self.shared, model).to_string());
        self.refresh_arena_stats();
    }

    fn refresh_arena_stats(&mut self) {
        // Each arena read once: the one of the model that ran last (before any ran, the first
        // with one) is what runs are measured in; all of them, those of the small graphs that
        // move generations' caches (a cache they moved lies there) and those of speech models'
        // decoders, are what it holds.
        // A simulated pool's sessions share one arena: it is read, and counts, once.
        let simulated = self.options.provider == Provider::Simulated;
        let (mut last, mut held) = (None, None::<arena::ArenaStats>);
        for (name, (_, allocator)) in &self.sessions {
            let is_last = self.last_model.as_deref().map_or(last.is_none(), |m| m == name);
            if simulated && !is_last {
                continue;
            }
            let Some(stats) = allocator.as_ref().and_then(|a| arena::allocator_stats(a).ok()) else {
                continue;
            };
            if is_last {
                last = Some(stats);
            }
            held = Some(held.map_or(stats, |h| h.plus(stats)));
        }
        if last.is_some() {
            self.last_stats = last;
        }
        if !simulated {
            let decoders = self.speech.values().flat_map(Speech::arena_stats);
            held = held
                .into_iter()
                .chain(self.generations.kernel_arena_stats())
                .chain(decoders)
                .reduce(arena::ArenaStats::plus);
        }
        self.held_stats = held;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::model::BuiltinModel;
    use crate::core::tensor::{DataType, TensorData};

    #[test]
    fn inputs_run_in_place_or_decoded_give_the_answer_of_owned_ones() {
        let rt = super::super::runtime(None).expect("ONNX Runtime loads");
        let options = SessionOptions::quiet_cpu();
        let model = [("encoder".to_string(), BuiltinModel::Encoder.data())];
        let mut backend = OrtBackend::load(rt, &model, &options).unwrap();
        let values: Vec<f32> = (0..16 * 64).map(|i| (i % 11) as f32 * 0.1 - 0.5).collect();
        let owned = Tensor {
            name: "input".into(),
            shape: vec![1, 16, 64],
            data: TensorData::Fp32(values.clone()),
        };
        let outputs = ["pooled".to_string()];
        let expected = backend
            .run("encoder", vec![owned.clone()], &outputs, &RunMeta::default())
            .unwrap();
        // The same bytes aligned (read in place) and one byte off (decoded first).
        let mut bytes = vec![0u8; 1 + values.len() * 4 + 3];
        for offset in [0, 1] {
            let at = bytes.as_ptr().align_offset(4) + offset;
            let end = at + values.len() * 4;
            owned.data.write_le_bytes_to(&mut bytes[at..end]);
            let view = TensorView {
                name: "input",
                datatype: DataType::Fp32,
                shape: &owned.shape,
                bytes: &bytes[at..end],
            };
            let got = backend
                .run_views("encoder", &[view], &outputs, &RunMeta::default())
                .unwrap();
            assert_eq!(got, expected, "offset {offset}");
        }
    }

    /// A model that shares another's session runs on it (one session is held), keeps it when
    /// the other goes, and loses it when it goes itself.
    #[test]
    fn a_shared_session_is_held_once_and_stays_while_a_name_runs_on_it() {
        let rt = super::super::runtime(None).expect("ONNX Runtime loads");
        let model = [("a".to_string(), BuiltinModel::Encoder.data())];
        let mut backend = OrtBackend::load(rt, &model, &SessionOptions::quiet_cpu()).unwrap();
        let input = || Tensor {
            name: "input".into(),
            shape: vec![1, 4, 64],
            data: TensorData::Fp32(vec![0.1; 4 * 64]),
        };
        let run = |b: &mut OrtBackend, name: &str| b.run(name, vec![input()], &[], &RunMeta::default());
        assert!(backend.share_model("b", "nobody").is_err(), "nothing to share");
        backend.share_model("b", "a").unwrap();
        assert_eq!(backend.sessions.len(), 1, "one session for two names");
        assert_eq!(run(&mut backend, "b").unwrap(), run(&mut backend, "a").unwrap());
        backend.unload_model("a");
        assert!(run(&mut backend, "a").is_err(), "`a` is gone");
        assert!(run(&mut backend, "b").is_ok(), "`b` keeps the session");
        assert_eq!(backend.sessions.len(), 1);
        backend.share_model("a", "b").unwrap();
        backend.unload_model("b");
        backend.unload_model("a");
        assert!(backend.sessions.is_empty() && backend.shared.is_empty());
        assert!(run(&mut backend, "b").is_err());
    }

    /// A Whisper folder's encoder carries its decoder: features alone run the encoder (what the
    /// memory probe sends), a prompt with them a window job, through `run` and `run_views`.
    #[test]
    fn a_whisper_encoder_runs_alone_or_as_a_window_job() {
        use super::super::speech::{DECODER_INPUT_IDS, INPUT_FEATURES, MAX_NEW_TOKENS, SEED, TEMPERATURE};
        let rt = super::super::runtime(None).expect("ONNX Runtime loads");
        let folder = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/speech/whisper");
        let graph = std::fs::read(folder.join("encoder_model.onnx")).unwrap();
        let model = ModelData {
            graph: &graph,
            folder: Some(&folder),
            external_bytes: 0,
            owner: None,
            file: None,
        };
        let mut backend = OrtBackend::load(rt, &[("whisper".into(), model)], &SessionOptions::quiet_cpu()).unwrap();
        let tensor = |name: &str, shape: Vec<i64>, data| Tensor {
            name: name.into(),
            shape,
            data,
        };
        let features = tensor(
            INPUT_FEATURES,
            vec![1, 80, 3000],
            TensorData::Fp32(vec![-0.5; 80 * 3000]),
        );
        let encoded = backend
            .run("whisper", vec![features.clone()], &[], &RunMeta::default())
            .unwrap();
        assert_eq!(encoded.len(), 1);
        assert_eq!(encoded[0].shape, [1, 1500, 48], "last_hidden_state");
        // <|startoftranscript|><|en|><|transcribe|><|notimestamps|>
        let job = vec![
            features,
            tensor(
                DECODER_INPUT_IDS,
                vec![1, 4],
                TensorData::Int64(vec![512, 513, 613, 617]),
            ),
            tensor(MAX_NEW_TOKENS, vec![1], TensorData::Int64(vec![5])),
            tensor(TEMPERATURE, vec![1], TensorData::Fp32(vec![0.0])),
            tensor(SEED, vec![1], TensorData::Int64(vec![0])),
        ];
        let wanted = ["no_speech_prob".to_string(), "tokens".to_string()];
        let owned = backend
            .run("whisper", job.clone(), &wanted, &RunMeta::default())
            .unwrap();
        assert_eq!(owned[0].name, "no_speech_prob");
        assert_eq!(owned[1].shape[0], 1);
        let bytes: Vec<Vec<u8>> = job
            .iter()
            .map(|t| {
                let mut b = vec![0u8; t.data.byte_len()];
                t.data.write_le_bytes_to(&mut b);
                b
            })
            .collect();
        let views: Vec<TensorView<'_>> = job
            .iter()
            .zip(&bytes)
            .map(|(t, b)| TensorView {
                name: &t.name,
                datatype: t.data.datatype(),
                shape: &t.shape,
                bytes: b,
            })
            .collect();
        let viewed = backend
            .run_views("whisper", &views, &wanted, &RunMeta::default())
            .unwrap();
        assert_eq!(viewed, owned);
        // What it holds counts the decoder's arena beside the encoder's.
        backend.refresh_arena_stats_for("whisper");
        let reserved = |s: Option<arena::ArenaStats>| s.expect("CPU sessions have arenas").reserved_bytes;
        let (encoder, held) = (reserved(backend.arena_stats()), reserved(backend.held_arena_stats()));
        assert!(held > encoder, "held {held} bytes, the encoder's arena {encoder}");
    }

    /// A CPU session has an arena of its own: what a worker holds is every session's, not the
    /// one that ran last (a pool of an encoder and a classifier read 3.8 KB reserved on an
    /// H200 while the encoder's arena held its runs' blocks).
    #[test]
    fn what_a_backend_holds_is_every_sessions_arena_and_a_run_is_measured_in_its_own() {
        let rt = super::super::runtime(None).expect("ONNX Runtime loads");
        let options = SessionOptions::quiet_cpu();
        let models = [
            ("encoder".to_string(), BuiltinModel::Encoder.data()),
            ("classifier".to_string(), BuiltinModel::Classifier.data()),
        ];
        let mut backend = OrtBackend::load(rt, &models, &options).unwrap();
        let reserved = |s: Option<arena::ArenaStats>| s.expect("CPU sessions have arenas").reserved_bytes;
        let seq = 512;
        let long = Tensor {
            name: "input".into(),
            shape: vec![1, seq as i64, 64],
            data: TensorData::Fp32(vec![0.01; seq * 64]),
        };
        backend.run("encoder", vec![long], &[], &RunMeta::default()).unwrap();
        backend.refresh_arena_stats_for("encoder");
        let encoder = reserved(backend.arena_stats());
        // 16·n² bytes of attention scores at n = 512: 4 MiB, kept by the arena (no shrinkage).
        assert!(
            encoder >= 4 << 20,
            "the encoder's arena after seq {seq}: {encoder} bytes"
        );
        let features = Tensor {
            name: "features".into(),
            shape: vec![1, 16],
            data: TensorData::Fp32(vec![0.1; 16]),
        };
        backend
            .run("classifier", vec![features], &[], &RunMeta::default())
            .unwrap();
        backend.refresh_arena_stats_for("classifier");
        backend.refresh_arena_stats();
        let classifier = reserved(backend.arena_stats());
        assert!(
            classifier < encoder,
            "the last run's arena is the classifier's: {classifier} bytes"
        );
        assert_eq!(
            reserved(backend.held_arena_stats()),
            encoder + classifier,
            "what the backend holds is both arenas"
        );
    }
}
