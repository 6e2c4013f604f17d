//! The rewrite on the decoder fixture and on graphs in each exporter's shape, run by ONNX
//! Runtime before and after: the last position's logits must be the same bits.

use super::super::proto::{Dim, FLOAT, FLOAT16, Graph, Message, attribute_int, node, tensor, value_info};
use super::super::{SessionOptions, build_session, run, runtime, signature};
use super::last_position_logits;
use crate::core::model::BuiltinModel;
use crate::core::tensor::{Tensor, TensorData};
use crate::runtime::decoder::{DecoderLayout, step_inputs};

/// Hidden size and vocabulary of the graphs built here.
const HIDDEN: usize = 64;
const VOCAB: usize = 96;

/// Numbers in [-1, 1) from a fixed seed (no `rand` in tests that compare bits).
fn numbers(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn f32_tensor(name: &str, dims: &[u64], values: &[f32]) -> Message {
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    tensor(name, dims, FLOAT, &raw)
}

/// A model of `graph` importing ONNX opset 17 and ONNX Runtime's own operators.
fn model(graph: &Graph) -> Vec<u8> {
    let mut model = Message::default();
    model.int(1, 8).message(7, &graph.to_message("lm"));
    for (domain, version) in [("", 17), ("com.microsoft", 1)] {
        let mut set = Message::default();
        set.text(1, domain).int(2, version);
        model.message(8, &set);
    }
    model.0
}

/// A graph from `x` `[batch, sequence, HIDDEN]` to `logits` `[batch, sequence, VOCAB]` of
/// `elem_type`, through `nodes`.
fn graph(nodes: Vec<Message>, initializers: Vec<Message>, elem_type: u64) -> Graph {
    let mut graph = Graph::default();
    let (batch, sequence) = (Dim::Symbolic("batch"), Dim::Symbolic("sequence"));
    graph.input(value_info("x", FLOAT, &[batch, sequence, Dim::Fixed(HIDDEN as u64)]));
    for n in nodes {
        graph.node(n);
    }
    for t in initializers {
        graph.initializer(t);
    }
    graph.output(value_info(
        "logits",
        elem_type,
        &[batch, sequence, Dim::Fixed(VOCAB as u64)],
    ));
    graph
}

fn microsoft(mut node: Message) -> Message {
    node.text(7, "com.microsoft");
    node
}

/// The last position's logits of `bytes` and of its rewrite, for `positions` positions of
/// `rows` rows, as bits; and the rewritten model's declared `logits` shape.
fn before_and_after(bytes: &[u8], rows: usize, positions: usize) -> (Vec<u32>, Vec<u32>, Vec<i64>) {
    let rewritten = last_position_logits(bytes).expect("rewritten");
    let x = Tensor {
        name: "x".into(),
        shape: vec![rows as i64, positions as i64, HIDDEN as i64],
        data: TensorData::Fp32(numbers(7, rows * positions * HIDDEN)),
    };
    let last_logits = |bytes: &[u8]| {
        let rt = runtime(None).expect("ONNX Runtime loads");
        let mut session = build_session(rt, bytes, &SessionOptions::quiet_cpu()).expect("a session");
        let shape = signature(&session).unwrap().outputs[0].shape.clone();
        let out = run(&mut session, vec![x.clone()], &[], None).expect("runs").remove(0);
        let bits: Vec<u32> = match out.data {
            TensorData::Fp32(v) => v.iter().map(|f| f.to_bits()).collect(),
            TensorData::Fp16(v) => v.iter().map(|f| u32::from(f.to_bits())).collect(),
            other => panic!("{other:?}"),
        };
        let (positions, vocab) = (out.shape[1] as usize, out.shape[2] as usize);
        let last: Vec<u32> = bits
            .chunks(positions * vocab)
            .flat_map(|row| row[(positions - 1) * vocab..].to_vec())
            .collect();
        (last, shape)
    };
    let ((before, _), (after, shape)) = (last_logits(bytes), last_logits(&rewritten));
    (before, after, shape)
}

#[test]
fn an_lm_head_on_a_final_norm_gives_the_same_last_logits_from_one_position() {
    // The GenAI builder's shape: SkipSimplifiedLayerNormalization, then `lm_head.MatMul.weight`.
    let nodes = vec![
        microsoft(node(
            &["x", "x", "norm.weight"],
            "normed",
            "SkipSimplifiedLayerNormalization",
            &[],
        )),
        node(&["normed", "lm_head.MatMul.weight"], "logits", "MatMul", &[]),
    ];
    let weights = vec![
        f32_tensor("norm.weight", &[HIDDEN as u64], &numbers(1, HIDDEN)),
        f32_tensor(
            "lm_head.MatMul.weight",
            &[HIDDEN as u64, VOCAB as u64],
            &numbers(2, HIDDEN * VOCAB),
        ),
    ];
    let model = model(&graph(nodes, weights, FLOAT));
    for (rows, positions) in [1, 2, 9, 33].into_iter().flat_map(|p| [(1, p), (2, p)]) {
        let (before, after, shape) = before_and_after(&model, rows, positions);
        assert_eq!(before, after, "{rows} rows of {positions} positions");
        assert_eq!(shape, [-1, 1, VOCAB as i64]);
    }
}

#[test]
fn a_tied_soft_capped_head_cast_to_fp16_gives_the_same_last_logits() {
    // Optimum's tied embedding (a Transpose of it), a bias, Gemma 2's soft-capping written as
    // Div by a Constant, Tanh and Mul by an initializer, and a Cast at the end.
    let mut cap = Message::default();
    cap.text(1, "value")
        .message(5, &f32_tensor("", &[], &[30.0]))
        .int(20, 4);
    let nodes = vec![
        node(&["embed.weight"], "tied", "Transpose", &[]),
        node(&[], "cap", "Constant", &[cap]),
        node(&["x", "tied"], "projected", "MatMul", &[]),
        node(&["projected", "bias"], "biased", "Add", &[]),
        node(&["biased", "cap"], "scaled", "Div", &[]),
        node(&["scaled"], "capped", "Tanh", &[]),
        node(&["capped", "cap_again"], "soft", "Mul", &[]),
        node(&["soft"], "logits", "Cast", &[attribute_int("to", FLOAT16 as i64)]),
    ];
    let weights = vec![
        f32_tensor(
            "embed.weight",
            &[VOCAB as u64, HIDDEN as u64],
            &numbers(3, HIDDEN * VOCAB),
        ),
        f32_tensor("bias", &[1, 1, VOCAB as u64], &numbers(4, VOCAB)),
        f32_tensor("cap_again", &[], &[30.0]),
    ];
    let model = model(&graph(nodes, weights, FLOAT16));
    for (rows, positions) in [1, 5, 17].into_iter().flat_map(|p| [(1, p), (2, p)]) {
        let (before, after, shape) = before_and_after(&model, rows, positions);
        assert_eq!(before, after, "{rows} rows of {positions} positions");
        assert_eq!(shape, [-1, 1, VOCAB as i64]);
    }
}

#[test]
fn an_int4_head_gives_the_same_last_logits() {
    // The builder's `-p int4`: MatMulNBits, 4-bit blocks of 32 with their scales.
    let block = 32;
    let blocks = HIDDEN / block;
    let quantized: Vec<u8> = (0..VOCAB * HIDDEN / 2).map(|i| (i * 37 % 251) as u8).collect();
    let scales: Vec<f32> = numbers(5, VOCAB * blocks)
        .iter()
        .map(|s| s.abs() * 0.1 + 0.01)
        .collect();
    let attributes = [("K", HIDDEN), ("N", VOCAB), ("bits", 4), ("block_size", block)]
        .map(|(name, value)| attribute_int(name, value as i64));
    let nodes = vec![microsoft(node(
        &["x", "lm_head.q", "lm_head.scales"],
        "logits",
        "MatMulNBits",
        &attributes,
    ))];
    let weights = vec![
        tensor(
            "lm_head.q",
            &[VOCAB as u64, blocks as u64, (block / 2) as u64],
            2,
            &quantized,
        ),
        f32_tensor("lm_head.scales", &[(VOCAB * blocks) as u64], &scales),
    ];
    let model = model(&graph(nodes, weights, FLOAT));
    for (rows, positions) in [1, 3, 12].into_iter().flat_map(|p| [(1, p), (2, p)]) {
        let (before, after, shape) = before_and_after(&model, rows, positions);
        assert_eq!(before, after, "{rows} rows of {positions} positions");
        assert_eq!(shape, [-1, 1, VOCAB as i64]);
    }
}

/// The decoder fixture's prompt run of `ids` on `bytes`: the last position's logits and
/// every `present.*` value.
fn prompt_run(bytes: &[u8], ids: &[u32]) -> (Vec<f32>, Vec<Tensor>) {
    let rt = runtime(None).expect("ONNX Runtime loads");
    let mut session = build_session(rt, bytes, &SessionOptions::quiet_cpu()).expect("a session");
    let layout = DecoderLayout::detect(&signature(&session).unwrap(), &Default::default())
        .unwrap()
        .unwrap();
    let mut outputs = run(&mut session, step_inputs(&layout, ids, 0, Vec::new()), &[], None).expect("runs");
    let at = outputs.iter().position(|t| t.name == "logits").unwrap();
    let logits = outputs.remove(at);
    let vocab = logits.shape[2] as usize;
    let TensorData::Fp32(values) = logits.data else {
        panic!("FP32 logits")
    };
    (values[values.len() - vocab..].to_vec(), outputs)
}

#[test]
fn the_decoder_fixtures_prompt_run_keeps_its_last_logits_and_caches() {
    let original = BuiltinModel::Decoder.bytes();
    let rewritten = last_position_logits(original).expect("the fixture's LM head is found");
    let ids: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 256).collect();
    let (logits, caches) = prompt_run(original, &ids);
    let (short_logits, short_caches) = prompt_run(&rewritten, &ids);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&logits), bits(&short_logits));
    assert_eq!(caches, short_caches);
    // What admission reads: one position of logits, the same cache layout.
    let rt = runtime(None).unwrap();
    let session = build_session(rt, rewritten.as_slice(), &SessionOptions::quiet_cpu()).unwrap();
    let spec = signature(&session).unwrap();
    let logits = spec.outputs.iter().find(|t| t.name == "logits").unwrap();
    assert_eq!(logits.shape[1], 1);
}

#[test]
fn graphs_whose_lm_head_is_not_plain_are_kept_with_the_reason() {
    let weights = || {
        vec![f32_tensor(
            "w",
            &[HIDDEN as u64, VOCAB as u64],
            &numbers(6, HIDDEN * VOCAB),
        )]
    };
    let kept =
        |nodes: Vec<Message>| last_position_logits(&model(&graph(nodes, weights(), FLOAT))).expect_err("kept as it is");
    let err = kept(vec![
        node(&["x", "w"], "projected", "MatMul", &[]),
        node(&["projected"], "logits", "Softmax", &[]),
    ]);
    assert!(err.contains("`logits` is an output of Softmax"), "{err}");
    // Logits added to themselves: neither operand is the same at every position.
    let err = kept(vec![
        node(&["x", "w"], "projected", "MatMul", &[]),
        node(&["projected", "projected"], "logits", "Add", &[]),
    ]);
    assert!(err.contains("`logits` is an output of Add"), "{err}");
    // The LM head's output read elsewhere too: shortening it would change that reader.
    let err = kept(vec![
        node(&["x", "w"], "projected", "MatMul", &[]),
        node(&["projected"], "logits", "Identity", &[]),
        node(&["projected"], "elsewhere", "Relu", &[]),
    ]);
    assert!(err.contains("`projected` is used by more than"), "{err}");
    let err = kept(vec![node(&["x", "w"], "logits", "Gemm", &[])]);
    assert!(err.contains("Gemm"), "{err}");
    // Two activations multiplied: no weight on either side.
    let err = kept(vec![node(&["x", "x"], "logits", "MatMul", &[])]);
    assert!(err.contains("neither an LM head"), "{err}");
    let err = last_position_logits(b"\x0a\xff").expect_err("not a model");
    assert!(err.contains("not an ONNX model"), "{err}");
    // Already one position: nothing to do.
    let once = last_position_logits(BuiltinModel::Decoder.bytes()).unwrap();
    let err = last_position_logits(&once).expect_err("kept");
    assert!(err.contains("already has a value named"), "{err}");
    // No logits at all.
    let err = last_position_logits(BuiltinModel::Encoder.bytes()).expect_err("kept");
    assert!(err.contains("no output `logits`"), "{err}");
}
