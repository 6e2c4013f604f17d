//! The rewrite on the BERT embedder of `models/embed/` (Optimum's `feature-extraction`
//! export), run by ONNX Runtime before and after: each pooling's vectors from the graph equal
//! the host's pooling of the exported graph's `last_hidden_state`.

use super::super::proto::{Dim, FLOAT, Graph, INT64, model, node, value_info};
use super::super::{SessionOptions, build_session, run, runtime, signature};
use super::pooled_embedding;
use crate::core::model::BuiltinModel;
use crate::core::tensor::Tensor;
use crate::runtime::embedder::{EMBEDDING, Embedder, HIDDEN_STATE, Pooling};

fn fixture() -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/embed/bert-cls/model.onnx");
    std::fs::read(path).expect("the committed fixture")
}

/// The output `wanted` of `bytes` run on `inputs`, and the graph's declared outputs.
fn output(bytes: &[u8], inputs: &[Tensor], wanted: &str) -> (Tensor, Vec<(String, Vec<i64>)>) {
    let rt = runtime(None).expect("ONNX Runtime loads");
    let mut session = build_session(rt, bytes, &SessionOptions::quiet_cpu()).expect("a session");
    let declared = signature(&session).unwrap().outputs;
    let declared = declared.into_iter().map(|o| (o.name, o.shape)).collect();
    let out = run(&mut session, inputs.to_vec(), &[wanted.to_string()], None).expect("runs");
    (out.into_iter().next().unwrap(), declared)
}

#[test]
fn each_pooling_in_the_graph_gives_the_host_s_vectors() {
    let exported = fixture();
    // Three rows of 7, 2 and 5 tokens, right-padded: the padding must change nothing.
    let rows: Vec<Vec<u32>> = vec![vec![2, 40, 41, 42, 43, 44, 3], vec![2, 3], vec![2, 50, 60, 70, 3]];
    let lengths: Vec<usize> = rows.iter().map(Vec::len).collect();
    let plain = signature(
        &build_session(
            runtime(None).unwrap(),
            exported.as_slice(),
            &SessionOptions::quiet_cpu(),
        )
        .unwrap(),
    )
    .unwrap();
    let inputs = Embedder::batch(&plain, &rows, 0);
    let (hidden, _) = output(&exported, &inputs, HIDDEN_STATE);
    for pooling in [Pooling::Mean, Pooling::Cls, Pooling::LastToken] {
        for normalize in [false, true] {
            let embedder = Embedder {
                pooling,
                normalize,
                max_seq_length: None,
            };
            let on_host = embedder.pool(&hidden, &lengths).unwrap();
            let rewritten = pooled_embedding(&exported, pooling, normalize).expect("rewritten");
            let (pooled, declared) = output(&rewritten, &inputs, EMBEDDING);
            // `last_hidden_state` is no longer an output: nothing but the vectors comes back.
            assert_eq!(declared, [(EMBEDDING.to_string(), vec![-1, 32])]);
            assert_eq!(pooled.shape, [3, 32]);
            let in_graph = embedder.vectors(&pooled, &lengths).unwrap();
            for (row, (graph, host)) in in_graph.iter().zip(&on_host).enumerate() {
                let far = graph.iter().zip(host).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(far <= 1e-6, "{pooling:?} normalize {normalize} row {row}: {far}");
                if pooling != Pooling::Mean {
                    // One token's state picked out, and scaled the same way: the same bits
                    // before normalization.
                    assert!(normalize || graph == host, "{pooling:?} row {row}");
                }
            }
        }
    }
}

#[test]
fn a_graph_the_rewrite_cannot_pool_is_kept_with_the_reason() {
    let reason = |bytes: &[u8]| pooled_embedding(bytes, Pooling::Mean, true).expect_err("kept");
    let once = pooled_embedding(&fixture(), Pooling::Mean, true).unwrap();
    assert!(reason(&once).contains("already has a value named"), "{}", reason(&once));
    assert!(reason(BuiltinModel::Encoder.bytes()).contains("attention_mask"));
    // Before opset 13 Unsqueeze and ReduceSum take their axes as attributes.
    let mut graph = Graph::default();
    let (batch, sequence) = (Dim::Symbolic("batch"), Dim::Symbolic("sequence"));
    graph
        .input(value_info("attention_mask", INT64, &[batch, sequence]))
        .node(node(&["attention_mask"], HIDDEN_STATE, "Cast", &[]))
        .output(value_info(HIDDEN_STATE, FLOAT, &[batch, sequence, Dim::Fixed(4)]));
    let old = model(&graph.to_message("g"), 7, 12);
    assert!(reason(&old).contains("opset 12"), "{}", reason(&old));
    let current = model(&graph.to_message("g"), 7, 17);
    assert!(pooled_embedding(&current, Pooling::Cls, false).is_ok());
    let mut no_output = Graph::default();
    no_output
        .input(value_info("attention_mask", INT64, &[batch, sequence]))
        .output(value_info("attention_mask", INT64, &[batch, sequence]));
    let no_output = model(&no_output.to_message("g"), 7, 17);
    assert!(reason(&no_output).contains("no output `last_hidden_state`"));
}
