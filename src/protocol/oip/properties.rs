//! Property tests: whatever a client sends, decoding answers a named error (a 400) or a
//! request, never a panic; and a decoded request's tensors hold what their shapes say.

use super::*;
use crate::core::tensor::{DataType, Tensor};
use crate::runtime::onnx::{ModelSignature, TensorSpec};
use proptest::prelude::*;
use serde_json::{Value, json};

fn signature() -> ModelSignature {
    ModelSignature {
        inputs: vec![
            TensorSpec {
                name: "x".into(),
                datatype: DataType::Fp32,
                shape: vec![-1, -1, 4],
                symbols: vec![],
            },
            TensorSpec {
                name: "ids".into(),
                datatype: DataType::Int64,
                shape: vec![-1],
                symbols: vec![],
            },
        ],
        outputs: vec![TensorSpec {
            name: "y".into(),
            datatype: DataType::Fp16,
            shape: vec![-1],
            symbols: vec![],
        }],
    }
}

/// Any JSON value, nested up to a few levels.
fn json_tree() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("JSON numbers are finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        "[a-z_]{0,12}".prop_map(Value::String),
        prop_oneof![
            Just("x"),
            Just("ids"),
            Just("y"),
            Just("FP32"),
            Just("INT64"),
            Just("binary_data_size")
        ]
        .prop_map(|s| Value::String(s.into())),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("inputs".to_string()),
                    Just("outputs".to_string()),
                    Just("name".to_string()),
                    Just("shape".to_string()),
                    Just("datatype".to_string()),
                    Just("data".to_string()),
                    Just("parameters".to_string()),
                    Just("binary_data_output".to_string()),
                    Just("binary_data".to_string()),
                    Just("binary_data_size".to_string()),
                    Just("id".to_string()),
                    "[a-z]{1,6}",
                ],
                inner,
                0..6,
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// The `x` input: valid (data matching the shape), zero elements with an axis of any
/// length, or arbitrary shape, type and data.
fn x_input() -> impl Strategy<Value = Value> {
    let big = prop_oneof![0i64..6, Just(i64::MAX), Just(1i64 << 62), any::<i64>()];
    let valid = (0i64..4, 0i64..4).prop_map(
        |(a, b)| json!({"name": "x", "shape": [a, b, 4], "datatype": "FP32", "data": vec![0.5; (a * b * 4) as usize]}),
    );
    let empty = (big.clone(), 0usize..3).prop_map(|(n, zero_at)| {
        let mut shape = vec![n, n, 4];
        shape[zero_at] = 0;
        json!({"name": "x", "shape": shape, "datatype": "FP32", "data": []})
    });
    let data = prop::collection::vec(
        prop_oneof![
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| json!(f)),
            (-3i64..3).prop_map(|n| json!(n)),
            Just(json!(1e39)),
            Just(json!(true)),
            Just(json!("a")),
            Just(json!([1, [2]])),
        ],
        0..40,
    );
    let datatype = prop_oneof![
        Just("FP32"),
        Just("INT64"),
        Just("FP16"),
        Just("BOOL"),
        Just("BYTES"),
        Just("")
    ];
    let arbitrary = (prop::collection::vec(big, 0..5), data, datatype)
        .prop_map(|(shape, data, dt)| json!({"name": "x", "shape": shape, "datatype": dt, "data": data}));
    prop_oneof![valid, empty, arbitrary]
}

/// A request that is nearly right: real input names and types, arbitrary shapes and data,
/// `ids` as JSON or as binary data of any length.
fn near_request() -> impl Strategy<Value = (Vec<u8>, Option<usize>)> {
    let binary = prop::collection::vec(any::<u8>(), 0..64);
    let id_shape = prop_oneof![Just(vec![3i64]), prop::collection::vec(-1i64..5, 0..3)];
    (x_input(), id_shape, binary, any::<bool>(), 0usize..80).prop_map(|(x, id_shape, binary, use_binary, size)| {
        let ids = if use_binary {
            json!({"name": "ids", "shape": id_shape, "datatype": "INT64",
                       "parameters": {"binary_data_size": size}})
        } else {
            json!({"name": "ids", "shape": id_shape, "datatype": "INT64", "data": [1, 2, 3]})
        };
        let header = json!({"inputs": [x, ids]}).to_string();
        let mut body = header.clone().into_bytes();
        let header_len = use_binary.then(|| {
            body.extend_from_slice(&binary);
            header.len()
        });
        (body, header_len)
    })
}

/// What must hold of any decode: no panic (the caller of this function would see it), and
/// on success every tensor's data matches its shape and declared type.
fn check(body: &[u8], header_len: Option<usize>) {
    if let Ok(request) = decode(body, header_len, &signature()) {
        for (tensor, spec) in request.inputs.iter().zip(&signature().inputs) {
            assert_eq!(Tensor::element_count(&tensor.shape), Some(tensor.data.len()));
            assert_eq!(tensor.data.datatype(), spec.datatype);
            assert!(tensor.shape.iter().all(|&d| d >= 0 && d as u64 <= body.len() as u64));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..512),
                                   header_len in prop::option::of(0usize..600)) {
        check(&body, header_len);
    }

    #[test]
    fn arbitrary_json_trees_never_panic(tree in json_tree()) {
        let body = tree.to_string();
        check(body.as_bytes(), None);
        // Wrapped as the inputs of a request, too.
        let wrapped = json!({"inputs": [tree]}).to_string();
        check(wrapped.as_bytes(), None);
        // Where the codec reads the `data` arrays apart, serde would have read the same.
        for doc in [body, wrapped] {
            super::cut::tests::loses_nothing(&doc, "inputs");
            super::cut::tests::loses_nothing(&doc, "outputs");
        }
    }

    #[test]
    fn nearly_valid_requests_decode_or_name_what_is_wrong((body, header_len) in near_request()) {
        check(&body, header_len);
        if let Err(message) = decode(&body, header_len, &signature()) {
            prop_assert!(!message.is_empty());
        }
    }
}
