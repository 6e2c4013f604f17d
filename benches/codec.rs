//! The JSON tensor codec: decoding the `data` of an FP32 input as clients send it, at the
//! bundled encoder's seq 128 (8192 numbers) and seq 1024 (65536), in the two spellings clients
//! use: the shortest text that reads back as the same `f32` (`-0.3`, as Rust, JavaScript and
//! Triton's client write it) and the `f64` repr of that value (`-0.30000001192092896`, as
//! Python's `json` writes numpy's `tolist()`); and activations a model would hand on, every
//! value different (mostly 7 or 8 significant digits in the shortest text), which cost a parser
//! more per number than the encoder input's 13 short values.
//!
//! Then a whole request of that input, as the server decodes it (`protocol::oip::decode`:
//! the header read, each `data` array parsed once the datatype is known), the same request
//! with its tensor as binary data, and an answer of the same size as binary data, as the
//! server encodes it (`protocol::oip::encode`).
//!
//! `cargo bench --bench codec`.

use criterion::{Criterion, Throughput};
use std::hint::black_box;
use vramguard::core::tensor::{DataType, Tensor, TensorData};
use vramguard::protocol::oip;
use vramguard::runtime::onnx::{ModelSignature, TensorSpec};
use vramguard::serve::generation::Rng;
use vramguard::testing::bench::{ENCODER_DIM, encoder_input};

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    for seq in [128usize, 1024] {
        let values = encoder_input(seq);
        let shortest = format!("[{}]", values.iter().map(f32::to_string).collect::<Vec<_>>().join(", "));
        let python = format!(
            "[{}]",
            values
                .iter()
                .map(|v| format!("{:?}", f64::from(*v)))
                .collect::<Vec<_>>()
                .join(", ")
        );
        // Activations as a model hands them on: every value different, mostly 7 or 8 digits
        // (the encoder input above cycles through 13 short ones).
        let activations = activations(seq * ENCODER_DIM);
        let activations_json = format!(
            "[{}]",
            activations.iter().map(f32::to_string).collect::<Vec<_>>().join(", ")
        );
        for (spelling, json, want) in [
            ("shortest", &shortest, &values),
            ("python", &python, &values),
            ("activations", &activations_json, &activations),
        ] {
            let decoded = TensorData::from_json(DataType::Fp32, json).unwrap();
            assert_eq!(decoded, TensorData::Fp32(want.clone()), "{spelling} reads back exactly");
            let mut group = criterion.benchmark_group(format!("decode_fp32/seq{seq}"));
            group.throughput(Throughput::Bytes(json.len() as u64));
            group.bench_function(spelling, |b| {
                b.iter(|| TensorData::from_json(DataType::Fp32, black_box(json)).unwrap())
            });
            group.finish();
        }
        decode_request(&mut criterion, seq, &shortest);
        decode_binary_request(&mut criterion, seq);
        encode_binary_response(&mut criterion, seq, &activations);
    }
    criterion.final_summary();
}

/// `n` values spread as a layer's activations are (roughly normal, mostly within ±3), from a
/// fixed seed: the same every run.
fn activations(n: usize) -> Vec<f32> {
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    // The sum of four uniforms, centred and scaled: close enough to normal for text lengths.
    (0..n)
        .map(|_| (((0..4).map(|_| rng.next_f64()).sum::<f64>() - 2.0) * 1.7) as f32)
        .collect()
}

/// The encoder's signature, as the server reads it from the model.
fn encoder_signature() -> ModelSignature {
    ModelSignature {
        inputs: vec![TensorSpec {
            name: "input".into(),
            datatype: DataType::Fp32,
            shape: vec![-1, -1, ENCODER_DIM as i64],
            symbols: vec![],
        }],
        outputs: vec![TensorSpec {
            name: "pooled".into(),
            datatype: DataType::Fp32,
            shape: vec![-1, ENCODER_DIM as i64],
            symbols: vec![],
        }],
    }
}

/// A request as the overhead bench's JSON client sends it, decoded as the server does.
fn decode_request(criterion: &mut Criterion, seq: usize, data: &str) {
    let signature = encoder_signature();
    let body = format!(
        "{{\"inputs\": [{{\"name\": \"input\", \"shape\": [1, {seq}, {ENCODER_DIM}], \"datatype\": \"FP32\", \"data\": {data}}}], \
         \"outputs\": [{{\"name\": \"pooled\"}}]}}"
    );
    let decoded = oip::decode(body.as_bytes(), None, &signature).unwrap();
    assert_eq!(decoded.inputs[0].data.len(), seq * ENCODER_DIM);
    let mut group = criterion.benchmark_group(format!("decode_request/seq{seq}"));
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function("shortest", |b| {
        b.iter(|| oip::decode(black_box(body.as_bytes()), None, &signature).unwrap())
    });
    group.finish();
}

/// A request as the overhead bench's binary client sends it (the JSON header, then the
/// tensor's bytes), decoded as the server does.
fn decode_binary_request(criterion: &mut Criterion, seq: usize) {
    let signature = encoder_signature();
    let (header_len, body) = vramguard::testing::bench::encoder_binary_body(seq);
    let decoded = oip::decode(&body, Some(header_len), &signature).unwrap();
    assert_eq!(decoded.inputs[0].data, TensorData::Fp32(encoder_input(seq)));
    let mut group = criterion.benchmark_group(format!("decode_binary_request/seq{seq}"));
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function("fp32", |b| {
        b.iter(|| oip::decode(black_box(&body), Some(header_len), &signature).unwrap())
    });
    group.finish();
}

/// An answer holding one `[1, seq, 64]` FP32 output as binary data, as the overhead bench's
/// binary client asks for it (`binary_data_output`), encoded as the server does.
fn encode_binary_response(criterion: &mut Criterion, seq: usize, values: &[f32]) {
    let outputs = vec![Tensor {
        name: "hidden".into(),
        shape: vec![1, seq as i64, ENCODER_DIM as i64],
        data: TensorData::Fp32(values.to_vec()),
    }];
    let request = oip::DecodedRequest {
        id: None,
        parameters: Default::default(),
        inputs: Vec::new(),
        outputs: Vec::new(),
        binary_by_default: true,
        allow_shrink: None,
        allow_substitute: None,
    };
    let parameters = Default::default();
    let encoded = oip::encode("encoder", Some("req-1"), &parameters, &outputs, &request, usize::MAX).unwrap();
    let header_len = encoded.header_len.expect("a binary answer has a JSON header");
    assert_eq!(encoded.body.len() - header_len, seq * ENCODER_DIM * 4);
    let mut group = criterion.benchmark_group(format!("encode_binary_response/seq{seq}"));
    group.throughput(Throughput::Bytes(encoded.body.len() as u64));
    group.bench_function("fp32", |b| {
        b.iter(|| {
            oip::encode(
                "encoder",
                Some("req-1"),
                &parameters,
                black_box(&outputs),
                &request,
                usize::MAX,
            )
            .unwrap()
        })
    });
    group.finish();
}
