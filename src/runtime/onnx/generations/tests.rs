//! Generations on the decoder fixture with real ONNX Runtime: batches that join, skip and
//! leave, prompts prefilled together, the bytes of masked slots, and a decoder that rotates by
//! cache slot (Optimum's Gemma) batched as exactly as one that takes `position_ids`.

use super::super::{OrtBackend, SessionOptions, runtime};
use crate::core::backend::{DecodeRow, DecodeStep, Generations, RunMeta};
use crate::core::model::{BuiltinModel, ModelData};
use crate::core::tensor::TensorData;
use crate::runtime::decoder::{DecoderLayout, step_inputs};

/// The reference cases: prompt ids and greedy continuations (numpy, float64, no cache).
fn cases() -> Vec<(Vec<u32>, Vec<u32>)> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/models/decoder/reference.json")).unwrap();
    let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |v: &serde_json::Value| {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    reference["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (ids(&c["prompt_ids"]), ids(&c["greedy_ids"])))
        .collect()
}

fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |b, (i, &l)| if l > b.1 { (i, l) } else { b })
        .0 as u32
}

fn rows(logits: &crate::core::tensor::Tensor) -> Vec<Vec<f32>> {
    let TensorData::Fp32(values) = &logits.data else {
        panic!("{logits:?}")
    };
    let vocab = logits.shape[1] as usize;
    values.chunks(vocab).map(<[f32]>::to_vec).collect()
}

/// Sequences join at different steps, one skips a step (a masked slot), one ends early:
/// every row's greedy tokens are the references', so left padding, masks and the
/// re-arranged caches are right.
#[test]
fn a_batch_whose_rows_join_skip_and_leave_gives_each_row_its_reference_tokens() {
    let rt = runtime(None).expect("ONNX Runtime loads");
    let model = [("lm".to_string(), BuiltinModel::Decoder.data())];
    let mut backend = OrtBackend::load(rt, &model, &SessionOptions::quiet_cpu()).unwrap();
    let signature = super::super::signature(&backend.sessions["lm"].0).unwrap();
    let layout = DecoderLayout::detect(&signature, &Default::default()).unwrap().unwrap();
    let cases = cases();
    let meta = RunMeta::default();
    // Sequence i: its tokens so far, and the last logits it got.
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); cases.len()];
    let mut pending: Vec<Option<u32>> = vec![None; cases.len()];
    let prefill = |backend: &mut OrtBackend, i: usize| {
        let inputs = step_inputs(&layout, &cases[i].0, 0, Vec::new());
        let out = backend.prefill("lm", i as u64, inputs, &meta).unwrap();
        assert_eq!(out[0].shape, vec![1, 512], "one row of logits");
        argmax(&rows(&out[0])[0])
    };
    for step in 0..20 {
        // Sequence i joins at step 2 i; sequence 1 skips step 5; sequence 0 stops at 6 tokens.
        for (i, next) in pending.iter_mut().enumerate() {
            if step == 2 * i {
                *next = Some(prefill(&mut backend, i));
            }
        }
        let mut step_rows = Vec::new();
        let mut ended = Vec::new();
        for (i, next) in pending.iter_mut().enumerate() {
            let Some(token) = *next else { continue };
            if got[i].len() == cases[i].1.len() || (i == 0 && got[i].len() == 6) {
                ended.push(i as u64);
                *next = None;
                continue;
            }
            if i == 1 && step == 5 {
                continue;
            }
            got[i].push(token);
            step_rows.push(DecodeRow {
                seq: i as u64,
                token,
                past: (cases[i].0.len() + got[i].len() - 1) as u64,
            });
        }
        let decode = DecodeStep {
            rows: step_rows.clone(),
            ended,
            ..Default::default()
        };
        let out = backend.decode("lm", &decode, &meta).unwrap();
        for (row, logits) in step_rows.iter().zip(rows(&out[0])) {
            pending[row.seq as usize] = Some(argmax(&logits));
        }
    }
    assert_eq!(got[0], cases[0].1[..6].to_vec());
    for i in 1..cases.len() {
        let n = got[i].len();
        assert!(n >= 10, "sequence {i} ran {n} steps");
        assert_eq!(got[i], cases[i].1[..n].to_vec(), "sequence {i}");
    }
    let live: Vec<usize> = (0..cases.len()).filter(|&i| pending[i].is_some()).collect();
    assert!(!live.is_empty() && !live.contains(&0));
    assert_eq!(
        backend.generations.sequences("lm"),
        live.len(),
        "ended ones were dropped"
    );
    // A row whose cache is not held at its position fails the step and changes nothing.
    let seq = live[0] as u64;
    let wrong = DecodeStep {
        rows: vec![DecodeRow { seq, token: 5, past: 3 }],
        ended: vec![],
        ..Default::default()
    };
    let err = backend.decode("lm", &wrong, &meta).unwrap_err();
    assert_eq!(err, crate::core::backend::BackendError::CacheMissing(vec![seq]));
    assert_eq!(backend.generations.sequences("lm"), live.len());
}

/// The batch's masked slots (left padding, a late row's slot) are reported as bytes held by
/// no sequence, and trimmed when the row that needed them leaves; with them the batch's shape
/// (rows held, prompts run and not joined yet included, and the slots they share).
#[test]
fn the_bytes_of_masked_slots_are_reported_and_trimmed_when_rows_leave() {
    let rt = runtime(None).expect("ONNX Runtime loads");
    let model = [("lm".to_string(), BuiltinModel::Decoder.data())];
    let mut backend = OrtBackend::load(rt, &model, &SessionOptions::quiet_cpu()).unwrap();
    let layout = backend.decoders["lm"];
    let per_slot = layout.kv_bytes_per_token();
    let meta = RunMeta::default();
    for (seq, prompt) in [(1u64, vec![5u32, 6]), (2, (10..20).collect())] {
        backend
            .prefill("lm", seq, step_inputs(&layout, &prompt, 0, Vec::new()), &meta)
            .unwrap();
    }
    let mut step = |rows: Vec<DecodeRow>, ended: Vec<u64>| {
        let out = backend
            .decode(
                "lm",
                &DecodeStep {
                    rows,
                    ended,
                    ..Default::default()
                },
                &meta,
            )
            .unwrap();
        assert_eq!(out[1].name, DecodeStep::PADDING);
        let [bytes] = DecodeStep::reported(&out, DecodeStep::PADDING).expect("the padding's bytes");
        let [rows, slots] = DecodeStep::reported(&out, DecodeStep::BATCH).expect("the batch's shape");
        (bytes / per_slot, (rows, slots))
    };
    let row = |seq, past| DecodeRow { seq, token: 7, past };
    // Only the long one steps: the short one's prompt waits to join, and counts.
    assert_eq!(step(vec![row(2, 10)], vec![]), (0, (2, 11)));
    // Both: 12 slots, the short one padded by 9 on the left.
    assert_eq!(step(vec![row(1, 2), row(2, 11)], vec![]), (9, (2, 12)));
    // The short one is late: a masked slot of its own.
    assert_eq!(step(vec![row(2, 12)], vec![]), (10, (2, 13)));
    // The long one ends; with the next step the batch is trimmed to the short one's slots.
    assert_eq!(step(vec![], vec![2]), (10, (1, 13)));
    assert_eq!(step(vec![row(1, 3)], vec![]), (1, (1, 5)));
    assert_eq!(step(vec![], vec![1]), (0, (0, 0)));
}

/// Prompts of different lengths prefilled as one left-padded run, then stepped as a batch:
/// every row's greedy tokens are its reference's.
#[test]
fn prompts_prefilled_together_give_each_its_reference_tokens() {
    let rt = runtime(None).expect("ONNX Runtime loads");
    let model = [("lm".to_string(), BuiltinModel::Decoder.data())];
    let mut backend = OrtBackend::load(rt, &model, &SessionOptions::quiet_cpu()).unwrap();
    let layout = backend.decoders["lm"];
    let cases = cases();
    let meta = RunMeta::default();
    let seqs: Vec<u64> = (0..cases.len() as u64).collect();
    let inputs = cases
        .iter()
        .flat_map(|(prompt, _)| step_inputs(&layout, prompt, 0, Vec::new()))
        .collect();
    let out = backend.prefill_many("lm", &seqs, inputs, &meta).unwrap();
    assert_eq!(out.len(), cases.len());
    let mut next: Vec<u32> = out.iter().map(|t| argmax(&rows(t)[0])).collect();
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); cases.len()];
    for _ in 0..cases[0].1.len() {
        let step_rows: Vec<DecodeRow> = (0..cases.len())
            .map(|i| {
                got[i].push(next[i]);
                DecodeRow {
                    seq: i as u64,
                    token: next[i],
                    past: (cases[i].0.len() + got[i].len() - 1) as u64,
                }
            })
            .collect();
        let out = backend
            .decode(
                "lm",
                &DecodeStep {
                    rows: step_rows,
                    ended: vec![],
                    ..Default::default()
                },
                &meta,
            )
            .unwrap();
        next = rows(&out[0]).iter().map(|l| argmax(l)).collect();
    }
    for (i, (_, reference)) in cases.iter().enumerate() {
        assert_eq!(&got[i], reference, "sequence {i}");
    }
}

/// A decoder exported without `position_ids` (Optimum's Gemma, which rotates each token by its
/// cache slot) batches exactly: before the graph took `position_ids`, the slots' shifts moved
/// their rotary positions and the logits by up to 1e-1.
#[test]
fn a_decoder_without_position_ids_gives_batched_rows_their_logits_alone() {
    let rt = runtime(None).expect("ONNX Runtime loads");
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gemma_optimum.onnx");
    let bytes = std::fs::read(path).unwrap();
    let model = [("g".to_string(), ModelData::inline(&bytes))];
    let backend = OrtBackend::load(rt, &model, &SessionOptions::quiet_cpu()).unwrap();
    batched_rows_get_their_logits_alone(backend);
}

/// ONNX Runtime GenAI's build (`GroupQueryAttention`, a dynamic head size) pads its batch on
/// the right: rows that join, skip a step and outlive a row that leaves get their logits alone.
#[test]
fn a_group_query_attention_decoder_gives_batched_rows_their_logits_alone() {
    batched_rows_get_their_logits_alone(group_query_attention("llama-genai"));
}

/// GenAI's build of a sliding-window model (Gemma 2: layer 0 keeps a window of 8 positions,
/// layer 1 the sequence) batched on the right: its rows, which outgrow the window, get their
/// logits alone when they join, skip a step once their window is full (the masked slot must
/// not evict from it), leave and fork. Before, its first prompt's run failed ("KV cache
/// capacity (0) must be at least local_window_size (8)").
#[test]
fn a_sliding_window_decoder_gives_batched_and_forked_rows_their_logits_alone() {
    let backend = group_query_attention("gemma2-genai");
    let window = backend.decoders["g"].window.expect("layer 0 keeps a window");
    assert_eq!((window.size, window.layers), (8, 0b01));
    batched_rows_get_their_logits_alone(backend);
    forks_get_their_prompts_logits(group_query_attention("gemma2-genai"));
}

/// Optimum's export of the same Gemma 2, whose mask applies the window by cache slot, batched
/// on the left: a row that skips a step once its window is full moves its masked slot before
/// its first position, so its window spans its own positions and its logits are its alone.
#[test]
fn a_sliding_window_mask_by_slot_gives_batched_rows_their_logits_alone() {
    let backend = from_folder("gemma2-optimum");
    assert_eq!(backend.decoders["g"].slot_window, Some(8));
    batched_rows_get_their_logits_alone(backend);
}

/// A backend serving ONNX Runtime GenAI's build of the real fixture `folder` as `g`: batched
/// on the right.
fn group_query_attention(folder: &str) -> OrtBackend {
    let backend = from_folder(folder);
    assert_eq!(backend.decoders["g"].padding, crate::runtime::decoder::Padding::Right);
    backend
}

/// A backend serving the real fixture `folder` as `g`, with what its folder and operators say.
fn from_folder(folder: &str) -> OrtBackend {
    let rt = runtime(None).expect("ONNX Runtime loads");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/real")
        .join(folder);
    let dir = dir.as_path();
    let bytes = std::fs::read(dir.join("model.onnx")).unwrap();
    let folder = crate::runtime::folder::ModelFolder::read(dir).unwrap();
    let hints = crate::runtime::onnx::facts::cache_hints(&bytes, &folder).unwrap();
    let graph = crate::runtime::onnx::facts::with_metadata(bytes, &hints.to_metadata());
    let data = ModelData {
        graph: &graph,
        folder: Some(dir),
        external_bytes: 0,
        owner: None,
        file: None,
    };
    OrtBackend::load(rt, &[("g".to_string(), data)], &SessionOptions::quiet_cpu()).unwrap()
}

/// A prompt run once and forked into three sequences, beside a batch already running: each
/// copy steps as the prompt's own sequence does (the logits of the prompt alone), on the
/// fixture (padded on the left) and on GenAI's build (on the right). A fork of a sequence not
/// held copies nothing: its sequences are missing.
#[test]
fn forked_sequences_each_get_the_logits_of_their_prompt_alone() {
    let rt = runtime(None).expect("ONNX Runtime loads");
    let fixture = [("g".to_string(), BuiltinModel::Decoder.data())];
    let left = OrtBackend::load(rt, &fixture, &SessionOptions::quiet_cpu()).unwrap();
    for backend in [left, group_query_attention("llama-genai")] {
        forks_get_their_prompts_logits(backend);
    }
}

fn forks_get_their_prompts_logits(mut backend: OrtBackend) {
    let layout = backend.decoders["g"];
    let meta = RunMeta::default();
    let (prompt, other): (&[u32], &[u32]) = (&[12, 300, 41], &[5, 17, 230, 41, 9, 77, 3, 410]);
    let steps = 6;
    let decode = |backend: &mut OrtBackend, step: DecodeStep| rows(&backend.decode("g", &step, &meta).unwrap()[0]);
    let row = |seq, token, past| DecodeRow { seq, token, past };
    // The prompt alone, greedy.
    let out = backend
        .prefill("g", 1, step_inputs(&layout, prompt, 0, Vec::new()), &meta)
        .unwrap();
    let mut alone = rows(&out[0]);
    for k in 0..steps {
        let past = (prompt.len() + k) as u64;
        let step = DecodeStep {
            rows: vec![row(1, argmax(&alone[k]), past)],
            ..Default::default()
        };
        alone.extend(decode(&mut backend, step));
    }
    let ended = DecodeStep {
        ended: vec![1],
        ..Default::default()
    };
    backend.decode("g", &ended, &meta).unwrap();
    // A longer sequence in the batch first; then the prompt run once, as 10, forked as 11, 12.
    let out = backend
        .prefill("g", 20, step_inputs(&layout, other, 0, Vec::new()), &meta)
        .unwrap();
    let other_token = argmax(&rows(&out[0])[0]);
    decode(
        &mut backend,
        DecodeStep {
            rows: vec![row(20, other_token, other.len() as u64)],
            ..Default::default()
        },
    );
    let out = backend
        .prefill("g", 10, step_inputs(&layout, prompt, 0, Vec::new()), &meta)
        .unwrap();
    assert_eq!(rows(&out[0])[0], alone[0]);
    let forks = vec![crate::core::backend::Fork {
        from: 10,
        to: vec![11, 12],
    }];
    for k in 0..steps {
        let past = (prompt.len() + k) as u64;
        let token = argmax(&alone[k]);
        let step = DecodeStep {
            rows: (10..13).map(|seq| row(seq, token, past)).collect(),
            forks: if k == 0 { forks.clone() } else { Vec::new() },
            ..Default::default()
        };
        for (seq, logits) in (10..13).zip(decode(&mut backend, step)) {
            let diff = logits
                .iter()
                .zip(&alone[k + 1])
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(
                diff < 1e-4,
                "sequence {seq}, step {k}: logits differ from alone by {diff}"
            );
        }
    }
    assert_eq!(
        backend.generations.sequences("g"),
        4,
        "the prompt's, its two copies and the other"
    );
    let unheld = DecodeStep {
        rows: vec![row(31, 5, prompt.len() as u64)],
        forks: vec![crate::core::backend::Fork { from: 30, to: vec![31] }],
        ..Default::default()
    };
    let err = backend.decode("g", &unheld, &meta).unwrap_err();
    assert_eq!(err, crate::core::backend::BackendError::CacheMissing(vec![31]));
}

/// Three prompts of `backend`'s decoder `g`: rows that join a longer batch, skip a step and
/// outlive a row that leaves get the logits they get alone, to float rounding.
fn batched_rows_get_their_logits_alone(mut backend: OrtBackend) {
    let layout = backend.decoders["g"];
    let prompts: [&[u32]; 3] = [&[5, 17, 230, 41, 9, 77, 3, 410], &[12, 300], &[99, 8, 64, 150, 21]];
    let steps = 12;
    let meta = RunMeta::default();
    // A step's logits, one row per row sent (none when it only ends sequences).
    let step = |backend: &mut OrtBackend, rows_: Vec<DecodeRow>, ended: Vec<u64>| {
        let any = !rows_.is_empty();
        let out = backend
            .decode(
                "g",
                &DecodeStep {
                    rows: rows_,
                    ended,
                    ..Default::default()
                },
                &meta,
            )
            .unwrap();
        if any { rows(&out[0]) } else { Vec::new() }
    };
    // Each prompt alone: the logits of its prompt's run and of each step after it.
    let mut alone: Vec<Vec<Vec<f32>>> = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let seq = 100 + i as u64;
        let out = backend
            .prefill("g", seq, step_inputs(&layout, prompt, 0, Vec::new()), &meta)
            .unwrap();
        let mut logits = rows(&out[0]);
        for k in 0..steps {
            let token = argmax(&logits[k]);
            let past = (prompt.len() + k) as u64;
            logits.extend(step(&mut backend, vec![DecodeRow { seq, token, past }], Vec::new()));
        }
        step(&mut backend, Vec::new(), vec![seq]);
        alone.push(logits);
    }
    // Together: sequence i joins at step 2 i, 1 skips steps 5 and 14 (past 8 positions: a
    // sliding window's is full), 0 leaves after 6 tokens; each is fed the tokens it chose
    // alone, so its logits can be compared at every step.
    let mut got: Vec<Vec<Vec<f32>>> = vec![Vec::new(); prompts.len()];
    let mut left = false;
    for at in 0..2 * prompts.len() + steps {
        for (i, prompt) in prompts.iter().enumerate() {
            if at == 2 * i {
                let out = backend
                    .prefill("g", i as u64, step_inputs(&layout, prompt, 0, Vec::new()), &meta)
                    .unwrap();
                got[i] = rows(&out[0]);
            }
        }
        let (mut step_rows, mut ended) = (Vec::new(), Vec::new());
        for (i, prompt) in prompts.iter().enumerate() {
            let k = got[i].len();
            if k == 0 || (i == 1 && (at == 5 || at == 14)) || k > steps {
                continue;
            }
            if i == 0 && k == 7 {
                ended.extend((!left).then_some(0));
                left = true;
                continue;
            }
            let token = argmax(&alone[i][k - 1]);
            let past = (prompt.len() + k - 1) as u64;
            step_rows.push(DecodeRow {
                seq: i as u64,
                token,
                past,
            });
        }
        let seqs: Vec<usize> = step_rows.iter().map(|r| r.seq as usize).collect();
        for (i, logits) in seqs.into_iter().zip(step(&mut backend, step_rows, ended)) {
            got[i].push(logits);
        }
    }
    for (i, logits) in got.iter().enumerate() {
        for (k, (g, a)) in logits.iter().zip(&alone[i]).enumerate() {
            let diff = g.iter().zip(a).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            // Rounding is relative: the real fixtures' logits reach hundreds.
            let scale = a.iter().fold(1f32, |m, x| m.max(x.abs()));
            assert!(
                diff < 1e-4 * scale,
                "sequence {i}, step {k}: logits differ from alone by {diff} (largest {scale})"
            );
        }
    }
    assert!(left, "sequence 0 left the batch");
    assert_eq!(got.iter().map(Vec::len).collect::<Vec<_>>(), [7, steps + 1, steps + 1]);
}

/// A prompt longer than a piece runs in pieces, each attending to the cache the ones before it
/// left: its last logits are those of the prompt run whole (to float32 rounding), and so are
/// the greedy tokens after it, with pieces of 512 (the default), of 100, and of 1 (a token at a
/// time, as decoding steps would take it), whatever a piece's boundary cuts.
#[test]
fn a_long_prompt_run_in_pieces_gives_the_logits_and_tokens_of_one_run() {
    let rt = runtime(None).expect("ONNX Runtime loads");
    let model = [("lm".to_string(), BuiltinModel::Decoder.data())];
    let mut backend = OrtBackend::load(rt, &model, &SessionOptions::quiet_cpu()).unwrap();
    let layout = backend.decoders["lm"];
    let meta = RunMeta::default();
    let prompt: Vec<u32> = (0..1300u32).map(|i| 5 + (i * 37 + i / 7) % 500).collect();
    // Pieces are what runs: a prompt past a piece, never one within it or one with padding.
    let inputs = step_inputs(&layout, &prompt, 0, Vec::new());
    assert_eq!(
        super::prefill::chunkable(&layout, &inputs, 512).map(|ids| ids.len()),
        Some(1300)
    );
    assert!(super::prefill::chunkable(&layout, &inputs, 1300).is_none());
    let mut padded = inputs.clone();
    padded[1].data = TensorData::Int64([vec![0], vec![1; 1299]].concat());
    assert!(super::prefill::chunkable(&layout, &padded, 512).is_none());
    let mut run = |chunk: usize, seq: u64| {
        backend.generations.chunk_prompts_by(chunk);
        let inputs = step_inputs(&layout, &prompt, 0, Vec::new());
        let first = rows(&backend.prefill("lm", seq, inputs, &meta).unwrap()[0]).remove(0);
        let mut tokens = vec![argmax(&first)];
        for past in prompt.len()..prompt.len() + 6 {
            let token = *tokens.last().unwrap();
            let step = DecodeStep {
                rows: vec![DecodeRow {
                    seq,
                    token,
                    past: past as u64,
                }],
                ended: vec![],
                ..Default::default()
            };
            let out = backend.decode("lm", &step, &meta).unwrap();
            tokens.push(argmax(&rows(&out[0])[0]));
        }
        let end = DecodeStep {
            rows: vec![],
            ended: vec![seq],
            ..Default::default()
        };
        backend.decode("lm", &end, &meta).unwrap();
        (first, tokens)
    };
    let (whole, whole_tokens) = run(usize::MAX, 1);
    for (chunk, seq) in [(512, 2), (100, 3), (1, 4)] {
        let (logits, tokens) = run(chunk, seq);
        let worst = whole
            .iter()
            .zip(&logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "pieces of {chunk}: logits differ by {worst}");
        assert_eq!(tokens, whole_tokens, "pieces of {chunk}");
    }
}
