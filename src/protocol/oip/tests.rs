use super::*;
use crate::core::tensor::{DataType, Tensor, TensorData};
use crate::runtime::onnx::{ModelSignature, TensorSpec};
use serde_json::{Map, Value};

fn signature() -> ModelSignature {
    ModelSignature {
        inputs: vec![TensorSpec {
            name: "x".into(),
            datatype: DataType::Fp32,
            shape: vec![-1, 2],
            symbols: vec![],
        }],
        outputs: vec![
            TensorSpec {
                name: "y".into(),
                datatype: DataType::Fp32,
                shape: vec![-1, 2],
                symbols: vec![],
            },
            TensorSpec {
                name: "z".into(),
                datatype: DataType::Int64,
                shape: vec![-1],
                symbols: vec![],
            },
        ],
    }
}

fn err(body: &str) -> String {
    decode(body.as_bytes(), None, &signature()).unwrap_err()
}

#[test]
fn json_request_decodes_in_model_order() {
    let body = r#"{"id":"7","inputs":[{"name":"x","shape":[2,2],"datatype":"FP32","data":[[1,2],[3,4]]}],
                  "outputs":[{"name":"z"}]}"#;
    let req = decode(body.as_bytes(), None, &signature()).unwrap();
    assert_eq!(req.id.as_deref(), Some("7"));
    assert_eq!(req.inputs[0].data, TensorData::Fp32(vec![1.0, 2.0, 3.0, 4.0]));
    assert_eq!(
        req.outputs,
        vec![RequestedOutput {
            name: "z".into(),
            binary: false
        }]
    );
}

#[test]
fn every_bad_input_names_the_tensor_and_reason() {
    let input = |shape: &str, dt: &str, data: &str| {
        err(&format!(
            r#"{{"inputs":[{{"name":"x","shape":{shape},"datatype":"{dt}","data":{data}}}]}}"#
        ))
    };
    assert_eq!(
        input("[1,2]", "INT32", "[1,2]"),
        "input `x`: datatype is INT32 but the model expects FP32"
    );
    assert_eq!(
        input("[1,2]", "BYTES", "[1,2]"),
        "input `x`: datatype `BYTES` is not supported (expected FP32)"
    );
    assert!(input("[2]", "FP32", "[1,2]").starts_with("input `x`: shape [2] has rank 1 but the model expects rank 2"));
    assert_eq!(
        input("[1,3]", "FP32", "[1,2,3]"),
        "input `x`: dimension 1 is 3 but the model requires 2 (shape [-1, 2])"
    );
    assert_eq!(
        input("[2,2]", "FP32", "[1,2,3]"),
        "input `x`: shape [2, 2] needs 4 elements but 3 were given"
    );
    assert!(input("[1,2]", "FP32", "[1,\"a\"]").starts_with("input `x`: invalid type: string"));
    assert_eq!(
        input("[-1,2]", "FP32", "[1,2]"),
        "input `x`: dimension 0 is negative (-1)"
    );
    // A zero-element tensor claiming an absurd axis (issue 10): refused before any estimate.
    assert!(
        input("[4611686018427387904,0]", "FP32", "[]")
            .starts_with("input `x`: dimension 0 is 4611686018427387904, longer than a 85-byte request can carry"),
        "{}",
        input("[4611686018427387904,0]", "FP32", "[]")
    );
    // Broken text inside a data array is the tensor's to name (the codec reads the array).
    assert_eq!(input("[1,2]", "FP32", "[1, 2x]"), "input `x`: expected `,` or `]`");
    assert_eq!(input("[1,2]", "FP32", "[1, nul]"), "input `x`: expected ident");
    // FP32 cannot hold 1e39: refused, not turned into infinity.
    assert_eq!(
        input("[1,2]", "FP32", "[1,1e39]"),
        "input `x`: value 1e39 is not a valid FP32 element (element 1)"
    );
    assert!(
        err(r#"{"inputs":[{"name":"w","shape":[1],"datatype":"FP32","data":[1]}]}"#).starts_with("unknown input `w`")
    );
    assert_eq!(err(r#"{"inputs":[]}"#), "missing input(s): x");
    assert!(err("{not json").starts_with("malformed request JSON"));
    assert!(
        err(r#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[1,2]}],"outputs":[{"name":"q"}]}"#)
            .starts_with("unknown output `q`")
    );
}

#[test]
fn allow_shrink_is_read_from_the_request_parameters_when_given() {
    let with = |parameters: &str| {
        let body = format!(r#"{{"inputs":[{{"name":"x","shape":[1,2],"datatype":"FP32","data":[1,2]}}]{parameters}}}"#);
        decode(body.as_bytes(), None, &signature()).map(|r| r.allow_shrink)
    };
    assert_eq!(with(""), Ok(None));
    assert_eq!(with(r#","parameters":{"allow_shrink":null}"#), Ok(None));
    assert_eq!(with(r#","parameters":{"allow_shrink":true}"#), Ok(Some(true)));
    assert_eq!(with(r#","parameters":{"allow_shrink":false}"#), Ok(Some(false)));
    assert_eq!(
        with(r#","parameters":{"allow_shrink":"yes"}"#),
        Err("parameter `allow_shrink` must be true or false, got \"yes\"".into())
    );
}

#[test]
fn binary_inputs_and_outputs_follow_the_json_header() {
    let json = r#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","parameters":{"binary_data_size":8}}],
                   "parameters":{"binary_data_output":true}}"#;
    let mut body = json.as_bytes().to_vec();
    body.extend_from_slice(&1.5f32.to_le_bytes());
    body.extend_from_slice(&(-2f32).to_le_bytes());
    let req = decode(&body, Some(json.len()), &signature()).unwrap();
    assert_eq!(req.inputs[0].data, TensorData::Fp32(vec![1.5, -2.0]));
    assert!(req.binary_by_default);

    let out = Tensor {
        name: "y".into(),
        shape: vec![1, 2],
        data: TensorData::Fp32(vec![1.5, -2.0]),
    };
    let encoded = encode("m", None, &Map::new(), &[out], &req, usize::MAX).unwrap();
    let header_len = encoded.header_len.unwrap();
    let header: Value = serde_json::from_slice(&encoded.body[..header_len]).unwrap();
    assert_eq!(header["outputs"][0]["parameters"]["binary_data_size"], 8);
    assert_eq!(&encoded.body[header_len..], &body[json.len()..]);

    let short = decode(&body[..body.len() - 1], Some(json.len()), &signature()).unwrap_err();
    assert_eq!(
        short,
        "input `x`: binary_data_size is 8 but only 7 bytes of binary data remain"
    );
    let no_header = decode(json.as_bytes(), None, &signature()).unwrap_err();
    assert!(no_header.contains("no Inference-Header-Content-Length"), "{no_header}");
}

#[test]
fn a_forwarded_request_decodes_as_sent_and_its_binary_answer_decodes_back() {
    let x = Tensor {
        name: "x".into(),
        shape: vec![2, 2],
        data: TensorData::Fp32(vec![1.0, -2.5, f32::MAX, 0.0]),
    };
    let (body, header_len) = encode_request("req-7", std::slice::from_ref(&x), &["z".into(), "y".into()]);
    let req = decode(&body, Some(header_len), &signature()).unwrap();
    assert_eq!(req.id.as_deref(), Some("req-7"));
    assert_eq!(req.inputs, vec![x.clone()]);
    assert_eq!(
        req.outputs
            .iter()
            .map(|o| (o.name.as_str(), o.binary))
            .collect::<Vec<_>>(),
        [("z", true), ("y", true)]
    );
    // The server answers in its own order; the outputs come back in the order asked.
    let z = Tensor {
        name: "z".into(),
        shape: vec![3],
        data: TensorData::Int64(vec![1, -2, 3]),
    };
    let encoded = encode(
        "m",
        req.id.as_deref(),
        &Map::new(),
        &[x.clone(), z.clone()],
        &req,
        usize::MAX,
    )
    .unwrap();
    let asked = ["z".to_string(), "x".to_string()];
    let back = decode_response(&encoded.body, encoded.header_len, &asked).unwrap();
    assert_eq!(back, vec![z.clone(), x.clone()]);
    // JSON answers (KServe's default) decode too.
    let json = br#"{"outputs":[{"name":"z","shape":[3],"datatype":"INT64","data":[1,-2,3]}]}"#;
    assert_eq!(decode_response(json, None, &[]).unwrap(), vec![z]);
}

#[test]
fn a_broken_answer_is_named_not_trusted() {
    let bad = |body: &[u8], header_len: Option<usize>| decode_response(body, header_len, &["y".into()]).unwrap_err();
    assert!(bad(b"<html>", None).starts_with("malformed response JSON"));
    let header = r#"{"outputs":[{"name":"y","shape":[1,2],"datatype":"FP32","parameters":{"binary_data_size":8}}]}"#;
    let mut body = header.as_bytes().to_vec();
    body.extend_from_slice(&[0; 4]);
    assert_eq!(
        bad(&body, Some(header.len())),
        "output `y`: binary_data_size is 8 but only 4 bytes of binary data remain"
    );
    assert_eq!(
        bad(
            br#"{"outputs":[{"name":"y","shape":[1,3],"datatype":"FP32","data":[1,2]}]}"#,
            None
        ),
        "output `y`: shape [1, 3] needs 3 elements but 2 came"
    );
    assert_eq!(
        bad(
            br#"{"outputs":[{"name":"q","shape":[1],"datatype":"FP32","data":[1]}]}"#,
            None
        ),
        "output `y` was asked for but not returned"
    );
}

#[test]
fn non_finite_outputs_are_refused_in_json_and_carried_in_binary() {
    let nan = Tensor {
        name: "y".into(),
        shape: vec![1, 3],
        data: TensorData::Fp32(vec![1.0, f32::NAN, f32::INFINITY]),
    };
    let json_req = decode(
        br#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[1,2]}]}"#,
        None,
        &signature(),
    )
    .unwrap();
    let err = encode(
        "m",
        None,
        &Map::new(),
        std::slice::from_ref(&nan),
        &json_req,
        usize::MAX,
    )
    .unwrap_err();
    assert!(
        err.starts_with("output `y` has a non-finite value (NaN at element 1), which JSON cannot carry"),
        "{err}"
    );
    let binary_req = decode(
        br#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[1,2]}],"parameters":{"binary_data_output":true}}"#,
        None,
        &signature(),
    )
    .unwrap();
    let encoded = encode("m", None, &Map::new(), &[nan], &binary_req, usize::MAX).unwrap();
    let blob = &encoded.body[encoded.header_len.unwrap()..];
    assert!(f32::from_le_bytes(blob[4..8].try_into().unwrap()).is_nan());
}
