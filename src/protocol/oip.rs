//! Decoding inference requests and encoding responses (Open Inference Protocol / KServe v2 with
//! the binary tensor data extension). Pure functions over bytes, tested without a socket.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::core::tensor::{DataType, Tensor, TensorData};
use crate::runtime::onnx::ModelSignature;

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
        let what = format!("input `{name}`");
        let binary_size = binary_data_size(&input.parameters, &what)?;
        if binary_size.is_some() {
            if input.data.is_some() {
                return Err(format!("{what}: has both `data` and binary_data_size; send one"));
            }
            if header_len.is_none() {
                return Err(format!(
                    "{what}: binary_data_size is set but the request has no Inference-Header-Content-Length header"
                ));
            }
        }
        let data = tensor_data(&what, datatype, binary_size, input.data, &mut binary)?;
        if data.len() != expected {
            return Err(format!(
                "{what}: shape {:?} needs {expected} elements but {} were given",
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
    max_bytes: usize,
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
    // One allocation of about the final size: growing by doubling would hold up to twice the
    // answer at the moment of each copy, and answers can be hundreds of MB of JSON numbers.
    let json_guess: usize = outputs
        .iter()
        .filter(|t| !binary_for(&t.name))
        .map(|t| t.data.len().saturating_mul(json_bytes_per_element(t.data.datatype())))
        .fold(512, usize::saturating_add);
    let size = json_guess.saturating_add(blob.len());
    if size > max_bytes {
        return Err(format!(
            "the answer would take about {} ({} as JSON, {} binary), more than server.max_response_bytes ({}); \
             ask for fewer outputs (`outputs`), for binary data (`binary_data_output`), or for a smaller batch",
            crate::telemetry::logging::human_bytes(size as u64),
            crate::telemetry::logging::human_bytes(json_guess as u64),
            crate::telemetry::logging::human_bytes(blob.len() as u64),
            crate::telemetry::logging::human_bytes(max_bytes as u64)
        ));
    }
    let mut body = Vec::with_capacity(size);
    serde_json::to_writer(&mut body, &response).expect("response JSON always serializes");
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

/// A request as a client of the protocol sends it (what a remote pool forwards): every input
/// as binary tensor data after the JSON header, every output asked for as binary data, `id`
/// set to the request id. Returns the body and the JSON header's length (the value of
/// `Inference-Header-Content-Length`).
pub fn encode_request(id: &str, inputs: &[Tensor], outputs: &[String]) -> (Vec<u8>, usize) {
    let blob_len: usize = inputs.iter().map(|t| t.data.len() * t.data.datatype().size()).sum();
    let json_inputs: Vec<Value> = inputs
        .iter()
        .map(|t| {
            serde_json::json!({
                "name": t.name,
                "shape": t.shape,
                "datatype": t.data.datatype().name(),
                "parameters": {"binary_data_size": t.data.len() * t.data.datatype().size()},
            })
        })
        .collect();
    let mut header = serde_json::json!({
        "id": id,
        "inputs": json_inputs,
        "parameters": {"binary_data_output": true},
    });
    if !outputs.is_empty() {
        header["outputs"] = outputs
            .iter()
            .map(|name| serde_json::json!({"name": name, "parameters": {"binary_data": true}}))
            .collect();
    }
    let mut body = serde_json::to_vec(&header).expect("request JSON always serializes");
    let header_len = body.len();
    body.reserve_exact(blob_len);
    for t in inputs {
        t.data.write_le_bytes(&mut body);
    }
    (body, header_len)
}

/// A tensor's `parameters.binary_data_size`, if it has one; `what` names the tensor.
fn binary_data_size(parameters: &Map<String, Value>, what: &str) -> Result<Option<usize>, String> {
    parameters
        .get("binary_data_size")
        .map(|v| {
            v.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| format!("{what}: binary_data_size must be a non-negative integer"))
        })
        .transpose()
}

/// A tensor's elements, requests and responses alike: its `binary_data_size` bytes taken off the
/// front of `binary`, or its JSON `data`; `what` names the tensor in the message.
fn tensor_data(
    what: &str,
    datatype: DataType,
    binary_size: Option<usize>,
    raw: Option<&RawValue>,
    binary: &mut &[u8],
) -> Result<TensorData, String> {
    match (binary_size, raw) {
        (Some(size), _) => {
            if size > binary.len() {
                return Err(format!(
                    "{what}: binary_data_size is {size} but only {} bytes of binary data remain",
                    binary.len()
                ));
            }
            let (bytes, rest) = binary.split_at(size);
            *binary = rest;
            TensorData::from_le_bytes(datatype, bytes).map_err(|e| format!("{what}: {e}"))
        }
        (None, Some(raw)) => TensorData::from_json(datatype, raw.get()).map_err(|e| format!("{what}: {e}")),
        (None, None) => Err(format!("{what}: has no `data` and no binary_data_size")),
    }
}

#[derive(Deserialize)]
struct ResponseIn<'a> {
    #[serde(borrow)]
    outputs: Vec<OutputIn<'a>>,
}

#[derive(Deserialize)]
struct OutputIn<'a> {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    parameters: Map<String, Value>,
    #[serde(default, borrow)]
    data: Option<&'a RawValue>,
}

/// Decode an inference response from another server of the protocol (JSON or binary outputs).
/// `asked` are the outputs the request named: they come back in that order, and one missing is
/// an error; when empty, every output in the server's order. The message says what is wrong
/// with the answer (the server's fault, not the client's).
pub fn decode_response(body: &[u8], header_len: Option<usize>, asked: &[String]) -> Result<Vec<Tensor>, String> {
    let json_len = header_len.unwrap_or(body.len());
    if json_len > body.len() {
        return Err(format!(
            "Inference-Header-Content-Length is {json_len} but the answer has only {} bytes",
            body.len()
        ));
    }
    let (json, mut binary) = body.split_at(json_len);
    let response: ResponseIn = serde_json::from_slice(json).map_err(|e| format!("malformed response JSON: {e}"))?;
    let mut tensors = Vec::with_capacity(response.outputs.len());
    for out in response.outputs {
        let name = &out.name;
        let datatype = DataType::from_name(&out.datatype)
            .ok_or_else(|| format!("output `{name}`: datatype `{}` is not supported", out.datatype))?;
        let expected = Tensor::element_count(&out.shape)
            .filter(|_| out.shape.iter().all(|&d| d >= 0))
            .ok_or_else(|| format!("output `{name}`: shape {:?} is not a tensor shape", out.shape))?;
        let what = format!("output `{name}`");
        let binary_size = binary_data_size(&out.parameters, &what)?;
        // A server that sends both: its binary data is what it means.
        let raw = if binary_size.is_some() { None } else { out.data };
        let data = tensor_data(&what, datatype, binary_size, raw, &mut binary)?;
        if data.len() != expected {
            return Err(format!(
                "{what}: shape {:?} needs {expected} elements but {} came",
                out.shape,
                data.len()
            ));
        }
        tensors.push(Tensor {
            name: out.name,
            shape: out.shape,
            data,
        });
    }
    if asked.is_empty() {
        return Ok(tensors);
    }
    asked
        .iter()
        .map(|name| {
            let at = tensors
                .iter()
                .position(|t| &t.name == name)
                .ok_or_else(|| format!("output `{name}` was asked for but not returned"))?;
            Ok(tensors.swap_remove(at))
        })
        .collect()
}

/// About how many bytes one element takes written as JSON, with its comma.
fn json_bytes_per_element(datatype: DataType) -> usize {
    match datatype {
        DataType::Bool => 6,
        DataType::Uint8 | DataType::Int8 => 4,
        DataType::Int16 | DataType::Int32 => 7,
        DataType::Int64 => 12,
        DataType::Fp16 | DataType::Fp32 => 12,
        DataType::Fp64 => 20,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::onnx::TensorSpec;

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
        let bad =
            |body: &[u8], header_len: Option<usize>| decode_response(body, header_len, &["y".into()]).unwrap_err();
        assert!(bad(b"<html>", None).starts_with("malformed response JSON"));
        let header =
            r#"{"outputs":[{"name":"y","shape":[1,2],"datatype":"FP32","parameters":{"binary_data_size":8}}]}"#;
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
}

/// Property tests: whatever a client sends, decoding answers a named error (a 400) or a
/// request, never a panic; and a decoded request's tensors hold what their shapes say.
#[cfg(test)]
mod properties {
    use super::*;
    use crate::runtime::onnx::TensorSpec;
    use proptest::prelude::*;
    use serde_json::json;

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
        let valid = (0i64..4, 0i64..4).prop_map(|(a, b)| {
            json!({"name": "x", "shape": [a, b, 4], "datatype": "FP32", "data": vec![0.5; (a * b * 4) as usize]})
        });
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
            check(json!({"inputs": [tree]}).to_string().as_bytes(), None);
        }

        #[test]
        fn nearly_valid_requests_decode_or_name_what_is_wrong((body, header_len) in near_request()) {
            check(&body, header_len);
            if let Err(message) = decode(&body, header_len, &signature()) {
                prop_assert!(!message.is_empty());
            }
        }
    }
}
