//! Decoding inference requests and encoding responses (Open Inference Protocol / KServe v2 with
//! the binary tensor data extension). Pure functions over bytes, tested without a socket.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::onnx::ModelSignature;
use crate::tensor::{DataType, Tensor, TensorData};

/// An output the client asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestedOutput {
    /// Output name.
    pub name: String,
    /// Return it as raw bytes after the JSON header.
    pub binary: bool,
}

/// A decoded, validated inference request.
#[derive(Debug)]
pub struct DecodedRequest {
    /// The client's `id`, echoed back.
    pub id: Option<String>,
    /// Request-level `parameters`.
    pub parameters: Map<String, Value>,
    /// Inputs in the model's declaration order.
    pub inputs: Vec<Tensor>,
    /// Outputs asked for; empty means all, in the model's order.
    pub outputs: Vec<RequestedOutput>,
    /// `binary_data_output`: default encoding for outputs not listed.
    pub binary_by_default: bool,
    /// `parameters.allow_shrink`: whether the client allows its context to be cut, when it said.
    pub allow_shrink: Option<bool>,
}

#[derive(Deserialize)]
struct RequestJson<'a> {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    parameters: Map<String, Value>,
    #[serde(borrow)]
    inputs: Vec<InputJson<'a>>,
    #[serde(default)]
    outputs: Option<Vec<OutputRequestJson>>,
}

#[derive(Deserialize)]
struct InputJson<'a> {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    parameters: Map<String, Value>,
    #[serde(default, borrow)]
    data: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct OutputRequestJson {
    name: String,
    #[serde(default)]
    parameters: Map<String, Value>,
}

/// A boolean parameter: `None` when absent (or null).
fn optional_flag(params: &Map<String, Value>, key: &str) -> Result<Option<bool>, String> {
    match params.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(format!("parameter `{key}` must be true or false, got {other}")),
    }
}

fn flag(params: &Map<String, Value>, key: &str) -> Result<bool, String> {
    Ok(optional_flag(params, key)?.unwrap_or(false))
}

/// Decode a request body. `header_len` is the `Inference-Header-Content-Length` header: the
/// JSON part's length when binary tensor data follows it.
pub fn decode(body: &[u8], header_len: Option<usize>, signature: &ModelSignature) -> Result<DecodedRequest, String> {
    let json_len = header_len.unwrap_or(body.len());
    if json_len > body.len() {
        return Err(format!(
            "Inference-Header-Content-Length is {json_len} but the body has only {} bytes",
            body.len()
        ));
    }
    let (json, mut binary) = body.split_at(json_len);
    let request: RequestJson = serde_json::from_slice(json).map_err(|e| format!("malformed request JSON: {e}"))?;

    let mut inputs: Vec<Option<Tensor>> = vec![None; signature.inputs.len()];
    for input in request.inputs {
        let name = &input.name;
        let index = signature.inputs.iter().position(|s| &s.name == name).ok_or_else(|| {
            format!(
                "unknown input `{name}`; the model's inputs are: {}",
                signature.input_names()
            )
        })?;
        if inputs[index].is_some() {
            return Err(format!("input `{name}` is given twice"));
        }
        let spec = &signature.inputs[index];
        let datatype = DataType::from_name(&input.datatype).ok_or_else(|| {
            format!(
                "input `{name}`: datatype `{}` is not supported (expected {})",
                input.datatype, spec.datatype
            )
        })?;
        if datatype != spec.datatype {
            return Err(format!(
                "input `{name}`: datatype is {datatype} but the model expects {}",
                spec.datatype
            ));
        }
        if input.shape.len() != spec.shape.len() {
            return Err(format!(
                "input `{name}`: shape {:?} has rank {} but the model expects rank {} ({:?})",
                input.shape,
                input.shape.len(),
                spec.shape.len(),
                spec.shape
            ));
        }
        for (axis, (&got, &want)) in input.shape.iter().zip(&spec.shape).enumerate() {
            if got < 0 {
                return Err(format!("input `{name}`: dimension {axis} is negative ({got})"));
            }
            // Every element takes at least a byte of the body, so no real axis is longer; a
            // zero-element tensor could otherwise claim any length and reach the estimate.
            if got as u64 > body.len() as u64 {
                return Err(format!(
                    "input `{name}`: dimension {axis} is {got}, longer than a {}-byte request can carry (shape {:?})",
                    body.len(),
                    input.shape
                ));
            }
            if want >= 0 && got != want {
                return Err(format!(
                    "input `{name}`: dimension {axis} is {got} but the model requires {want} (shape {:?})",
                    spec.shape
                ));
            }
        }
        let expected = Tensor::element_count(&input.shape)
            .ok_or_else(|| format!("input `{name}`: shape {:?} is too large", input.shape))?;
        let binary_size = match input.parameters.get("binary_data_size") {
            None => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| format!("input `{name}`: binary_data_size must be a non-negative integer"))?,
            ),
        };
        let data = match (binary_size, input.data) {
            (Some(_), Some(_)) => {
                return Err(format!(
                    "input `{name}`: has both `data` and binary_data_size; send one"
                ));
            }
            (Some(size), None) => {
                if header_len.is_none() {
                    return Err(format!(
                        "input `{name}`: binary_data_size is set but the request has no Inference-Header-Content-Length header"
                    ));
                }
                if size > binary.len() {
                    return Err(format!(
                        "input `{name}`: binary_data_size is {size} but only {} bytes of binary data remain",
                        binary.len()
                    ));
                }
                let (bytes, rest) = binary.split_at(size);
                binary = rest;
                TensorData::from_le_bytes(datatype, bytes).map_err(|e| format!("input `{name}`: {e}"))?
            }
            (None, Some(raw)) => {
                TensorData::from_json(datatype, raw.get()).map_err(|e| format!("input `{name}`: {e}"))?
            }
            (None, None) => return Err(format!("input `{name}`: has no `data` and no binary_data_size")),
        };
        if data.len() != expected {
            return Err(format!(
                "input `{name}`: shape {:?} needs {expected} elements but {} were given",
                input.shape,
                data.len()
            ));
        }
        inputs[index] = Some(Tensor {
            name: input.name,
            shape: input.shape,
            data,
        });
    }
    if !binary.is_empty() {
        return Err(format!(
            "{} bytes of binary data are not claimed by any input",
            binary.len()
        ));
    }
    let missing: Vec<&str> = signature
        .inputs
        .iter()
        .zip(&inputs)
        .filter(|(_, t)| t.is_none())
        .map(|(s, _)| s.name.as_str())
        .collect();
    if !missing.is_empty() {
        return Err(format!("missing input(s): {}", missing.join(", ")));
    }

    let binary_by_default = flag(&request.parameters, "binary_data_output")?;
    let allow_shrink = optional_flag(&request.parameters, "allow_shrink")?;
    let mut outputs = Vec::new();
    for out in request.outputs.unwrap_or_default() {
        if !signature.outputs.iter().any(|s| s.name == out.name) {
            return Err(format!(
                "unknown output `{}`; the model's outputs are: {}",
                out.name,
                signature
                    .outputs
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        if outputs.iter().any(|o: &RequestedOutput| o.name == out.name) {
            return Err(format!("output `{}` is requested twice", out.name));
        }
        let binary = match out.parameters.get("binary_data") {
            None => binary_by_default,
            Some(_) => flag(&out.parameters, "binary_data").map_err(|e| format!("output `{}`: {e}", out.name))?,
        };
        outputs.push(RequestedOutput { name: out.name, binary });
    }
    Ok(DecodedRequest {
        id: request.id,
        parameters: request.parameters,
        inputs: inputs
            .into_iter()
            .map(|t| t.expect("every input checked present"))
            .collect(),
        outputs,
        binary_by_default,
        allow_shrink,
    })
}

#[derive(Serialize)]
struct ResponseJson<'a> {
    model_name: &'a str,
    model_version: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    parameters: &'a Map<String, Value>,
    outputs: Vec<OutputJson<'a>>,
}

#[derive(Serialize)]
struct OutputJson<'a> {
    name: &'a str,
    datatype: &'static str,
    shape: &'a [i64],
    #[serde(skip_serializing_if = "Option::is_none")]
    parameters: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<&'a TensorData>,
}

/// An encoded response body; `header_len` is set when binary data follows the JSON.
#[derive(Debug)]
pub struct EncodedResponse {
    /// The body.
    pub body: Vec<u8>,
    /// Value for `Inference-Header-Content-Length`, when binary data is appended.
    pub header_len: Option<usize>,
}

/// Encode outputs (already in the requested order) as a response body.
pub fn encode(
    model: &str,
    id: Option<&str>,
    parameters: &Map<String, Value>,
    outputs: &[Tensor],
    request: &DecodedRequest,
) -> Result<EncodedResponse, String> {
    let binary_for = |name: &str| {
        request
            .outputs
            .iter()
            .find(|o| o.name == name)
            .map_or(request.binary_by_default, |o| o.binary)
    };
    // JSON has no NaN or infinity (serde would write `null`, which reads as a different
    // answer): the client is told and can ask for the output as binary data.
    for t in outputs.iter().filter(|t| !binary_for(&t.name)) {
        if let Some((index, value)) = t.data.first_non_finite() {
            return Err(format!(
                "output `{}` has a non-finite value ({value} at element {index}), which JSON cannot carry; \
                 ask for it as binary data (`\"parameters\": {{\"binary_data\": true}}` on the output)",
                t.name
            ));
        }
    }
    let mut blob = Vec::new();
    let json_outputs = outputs
        .iter()
        .map(|t| {
            if binary_for(&t.name) {
                let before = blob.len();
                t.data.write_le_bytes(&mut blob);
                OutputJson {
                    name: &t.name,
                    datatype: t.data.datatype().name(),
                    shape: &t.shape,
                    parameters: Some(serde_json::json!({ "binary_data_size": blob.len() - before })),
                    data: None,
                }
            } else {
                OutputJson {
                    name: &t.name,
                    datatype: t.data.datatype().name(),
                    shape: &t.shape,
                    parameters: None,
                    data: Some(&t.data),
                }
            }
        })
        .collect();
    let response = ResponseJson {
        model_name: model,
        model_version: "1",
        id,
        parameters,
        outputs: json_outputs,
    };
    let mut body = serde_json::to_vec(&response).expect("response JSON always serializes");
    if blob.is_empty() && !outputs.iter().any(|t| binary_for(&t.name)) {
        return Ok(EncodedResponse { body, header_len: None });
    }
    let header_len = body.len();
    body.extend_from_slice(&blob);
    Ok(EncodedResponse {
        body,
        header_len: Some(header_len),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::onnx::TensorSpec;

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
        assert!(
            input("[2]", "FP32", "[1,2]").starts_with("input `x`: shape [2] has rank 1 but the model expects rank 2")
        );
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
        // FP32 cannot hold 1e39: refused, not turned into infinity.
        assert_eq!(
            input("[1,2]", "FP32", "[1,1e39]"),
            "input `x`: value 1e39 is not a valid FP32 element (element 1)"
        );
        assert!(
            err(r#"{"inputs":[{"name":"w","shape":[1],"datatype":"FP32","data":[1]}]}"#)
                .starts_with("unknown input `w`")
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
            let body =
                format!(r#"{{"inputs":[{{"name":"x","shape":[1,2],"datatype":"FP32","data":[1,2]}}]{parameters}}}"#);
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
        let encoded = encode("m", None, &Map::new(), &[out], &req).unwrap();
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
        let err = encode("m", None, &Map::new(), std::slice::from_ref(&nan), &json_req).unwrap_err();
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
        let encoded = encode("m", None, &Map::new(), &[nan], &binary_req).unwrap();
        let blob = &encoded.body[encoded.header_len.unwrap()..];
        assert!(f32::from_le_bytes(blob[4..8].try_into().unwrap()).is_nan());
    }
}
