//! The window job on the fixture Whisper (`models/speech/whisper/`) and the clips of
//! `models/speech/audio/`, on the CPU; the tokens against `transformers` are in `reference.rs`
//! beside this file, and the backend's dispatch in `backend.rs`.

use std::path::{Path, PathBuf};

use super::*;
use crate::core::scratch::OwnDir;
use crate::runtime::audio::mel::LogMel;
use crate::runtime::onnx::SessionOptions;
use crate::runtime::speech::Task;

pub(super) fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/speech/whisper")
}

/// A Whisper's window jobs as a CPU backend runs them: its encoder's session, its decoder, the
/// backend's kernels and run options.
pub(super) struct Harness {
    encoder: Session,
    speech: Speech,
    kernels: Kernels,
    options: RunOptions,
}

impl Harness {
    /// The Whisper of `folder`.
    pub(super) fn open(folder: &Path) -> Harness {
        let rt = super::super::runtime(None).expect("ONNX Runtime loads");
        let options = SessionOptions::quiet_cpu();
        let graph = std::fs::read(folder.join("encoder_model.onnx")).unwrap();
        let encoder = build_session(rt, &graph[..], &options).unwrap();
        let speech = Speech::open(rt, &encoder, Some(folder), &options)
            .unwrap()
            .expect("a Whisper");
        Harness {
            encoder,
            speech,
            kernels: Kernels::new(rt, &options).unwrap(),
            options: RunOptions::new().unwrap(),
        }
    }

    /// A window job of `inputs`, every output.
    pub(super) fn run(&mut self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, BackendError> {
        let Harness {
            encoder,
            speech,
            kernels,
            options,
        } = self;
        speech.transcribe(encoder, kernels, inputs, &[], options)
    }
}

/// The window features of clip `name` of `models/speech/audio/`.
fn clip(whisper: &Whisper, name: &str) -> Vec<f32> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/speech/audio")
        .join(name);
    let samples = crate::runtime::audio::decode(std::fs::read(path).unwrap(), 16_000, 60).unwrap();
    LogMel::new(whisper.mel).unwrap().features(&samples)
}

/// A window job's inputs: one row per `(features, prompt, max_new_tokens)`, greedy.
pub(super) fn inputs(rows: &[(&[f32], Vec<i64>, i64)]) -> Vec<Tensor> {
    let n = rows.len() as i64;
    let p = rows[0].1.len() as i64;
    let tensor = |name: &str, shape: Vec<i64>, data| Tensor {
        name: name.into(),
        shape,
        data,
    };
    vec![
        tensor(
            INPUT_FEATURES,
            vec![n, 80, 3000],
            TensorData::Fp32(rows.iter().flat_map(|r| r.0.iter().copied()).collect()),
        ),
        tensor(
            DECODER_INPUT_IDS,
            vec![n, p],
            TensorData::Int64(rows.iter().flat_map(|r| r.1.clone()).collect()),
        ),
        tensor(
            MAX_NEW_TOKENS,
            vec![n],
            TensorData::Int64(rows.iter().map(|r| r.2).collect()),
        ),
        tensor(TEMPERATURE, vec![n], TensorData::Fp32(vec![0.0; n as usize])),
        tensor(SEED, vec![n], TensorData::Int64(vec![0; n as usize])),
    ]
}

/// Each row's outputs: its tokens (padding left out), language, sum of log-probabilities and
/// no-speech probability.
pub(super) fn rows(outputs: &[Tensor]) -> Vec<(Vec<i64>, i64, f32, f32)> {
    let [tokens, language, logprob, no_speech] = outputs else {
        panic!("four outputs: {outputs:?}")
    };
    let (TensorData::Int64(t), TensorData::Int64(l), TensorData::Fp32(s), TensorData::Fp32(p)) =
        (&tokens.data, &language.data, &logprob.data, &no_speech.data)
    else {
        panic!("output types: {outputs:?}")
    };
    let width = tokens.shape[1] as usize;
    (0..l.len())
        .map(|i| {
            let row = t[i * width..(i + 1) * width]
                .iter()
                .copied()
                .filter(|&x| x >= 0)
                .collect();
            (row, l[i], s[i], p[i])
        })
        .collect()
}

#[test]
fn four_windows_in_one_run_each_give_what_they_give_alone() {
    let whisper = Whisper::read(&fixture()).unwrap().unwrap();
    let mut job = Harness::open(&fixture());
    let (gpu, memory) = (clip(&whisper, "gpu-16k.wav"), clip(&whisper, "memory-16k.wav"));
    let prompt = |task, language| whisper.prompt(task, language, false, &[]).unwrap();
    // Different clips, languages (one detected) and tasks, and limits that end rows early.
    let batch = [
        (&gpu[..], prompt(Task::Transcribe, Some("en")), 444),
        (&memory[..], prompt(Task::Transcribe, None), 120),
        (&memory[..], prompt(Task::Translate, Some("de")), 444),
        (&gpu[..], prompt(Task::Transcribe, Some("fr")), 7),
    ];
    let together = rows(&job.run(inputs(&batch)).unwrap());
    for (i, row) in batch.iter().enumerate() {
        let alone = rows(&job.run(inputs(std::slice::from_ref(row))).unwrap());
        let (tokens, language, logprob, no_speech) = &together[i];
        assert_eq!(tokens, &alone[0].0, "row {i}'s tokens");
        assert_eq!(language, &alone[0].1, "row {i}'s language");
        assert!(
            (logprob - alone[0].2).abs() < 1e-3 * logprob.abs().max(1.0),
            "row {i}: {logprob} alone {}",
            alone[0].2
        );
        assert!((no_speech - alone[0].3).abs() < 1e-5, "row {i}");
        assert!(tokens.len() <= row.2 as usize, "row {i} keeps to its limit");
    }
    assert_eq!(
        together[3].0.len(),
        7,
        "a limit of 7 gives 7 tokens (no end token came)"
    );
    assert_ne!(
        together[0].0,
        together[2].0[..],
        "different clips transcribe differently"
    );
    let en = i64::from(whisper.language_token("en").unwrap());
    assert_eq!(together[0].1, en);
    assert!(
        whisper.language_name(together[1].1 as u32).is_some(),
        "a language was detected"
    );
}

#[test]
fn the_pair_of_decoders_gives_what_the_merged_one_gives() {
    let whisper = Whisper::read(&fixture()).unwrap().unwrap();
    let pair = OwnDir::new("whisper-pair").unwrap();
    for entry in std::fs::read_dir(fixture()).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() && path.file_name().unwrap() != "decoder_model_merged.onnx" {
            std::fs::copy(&path, pair.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    let gpu = clip(&whisper, "gpu-16k.wav");
    let row = [(
        &gpu[..],
        whisper.prompt(Task::Transcribe, Some("en"), true, &[]).unwrap(),
        60,
    )];
    let merged = rows(&Harness::open(&fixture()).run(inputs(&row)).unwrap());
    let split = rows(&Harness::open(pair.path()).run(inputs(&row)).unwrap());
    assert_eq!(merged[0].0, split[0].0);
    assert!(!merged[0].0.is_empty());
}

#[test]
fn bad_window_jobs_are_refused_naming_what_is_wrong() {
    let whisper = Whisper::read(&fixture()).unwrap().unwrap();
    let mut job = Harness::open(&fixture());
    let gpu = clip(&whisper, "gpu-16k.wav");
    let prompt = whisper.prompt(Task::Transcribe, Some("en"), false, &[]).unwrap();
    let mut refused = |rows: &[(&[f32], Vec<i64>, i64)], edit: &dyn Fn(&mut Vec<Tensor>)| {
        let mut inputs = inputs(rows);
        edit(&mut inputs);
        match job.run(inputs) {
            Err(BackendError::InvalidInput(message)) => message,
            other => panic!("{other:?}"),
        }
    };
    let e = refused(&[(&gpu, prompt.clone(), 445)], &|_| {});
    assert!(e.contains("448 positions"), "{e}");
    let e = refused(&[(&gpu, prompt[1..].to_vec(), 10)], &|_| {});
    assert!(e.contains("<|startoftranscript|>"), "{e}");
    let e = refused(&[(&gpu, vec![prompt[0], 99_999], 10)], &|_| {});
    assert!(e.contains("99999"), "{e}");
    let e = refused(&[(&gpu, prompt.clone(), 10)], &|i| i.retain(|t| t.name != SEED));
    assert!(e.contains("`seed`"), "{e}");
}

#[test]
fn an_interrupt_stops_the_window_job() {
    let whisper = Whisper::read(&fixture()).unwrap().unwrap();
    let mut job = Harness::open(&fixture());
    let gpu = clip(&whisper, "gpu-16k.wav");
    let row = [(
        &gpu[..],
        whisper.prompt(Task::Transcribe, Some("en"), false, &[]).unwrap(),
        444,
    )];
    // What `Interrupts::interrupt_handle` does from another thread: every run of the job,
    // each step's included, is under these options.
    job.options.terminate().unwrap();
    let result = job.run(inputs(&row));
    assert!(matches!(result, Err(BackendError::Cancelled)), "{result:?}");
    job.options.unterminate().unwrap();
    assert!(job.run(inputs(&row)).is_ok());
}

#[test]
fn sampled_rows_follow_their_seeds_alone_or_batched() {
    let whisper = Whisper::read(&fixture()).unwrap().unwrap();
    let mut job = Harness::open(&fixture());
    let gpu = clip(&whisper, "gpu-16k.wav");
    let prompt = whisper.prompt(Task::Transcribe, Some("en"), true, &[]).unwrap();
    let mut sampled = |seeds: &[i64]| {
        let rows_in: Vec<_> = seeds.iter().map(|_| (&gpu[..], prompt.clone(), 40)).collect();
        let mut inputs = inputs(&rows_in);
        inputs.retain(|t| t.name != TEMPERATURE && t.name != SEED);
        let n = seeds.len() as i64;
        inputs.push(Tensor {
            name: TEMPERATURE.into(),
            shape: vec![n],
            data: TensorData::Fp32(vec![1.0; seeds.len()]),
        });
        inputs.push(Tensor {
            name: SEED.into(),
            shape: vec![n],
            data: TensorData::Int64(seeds.to_vec()),
        });
        let out = job.run(inputs).unwrap();
        rows(&out).into_iter().map(|r| r.0).collect::<Vec<_>>()
    };
    let batched = sampled(&[1, 2, 1]);
    assert_eq!(batched[0], batched[2], "one seed, one draw");
    assert_ne!(batched[0], batched[1], "another seed, another draw");
    assert_eq!(
        sampled(&[2])[0],
        batched[1],
        "a row's draw is its own, batched or alone"
    );
}
