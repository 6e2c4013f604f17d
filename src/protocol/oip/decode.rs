//! Decoding an inference request against the model's signature: every input named, typed and
//! shaped as the model declares, every output asked for one the model has. Each refusal names
//! the tensor and the reason, since the client sees it as a 400.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::binary::{TensorJson, binary_data_size, split_header, tensor_data};
use super::cut::{Cut, data_text, parse};
use crate::core::tensor::{DataType, Tensor};
use crate::runtime::onnx::{ModelSignature, TensorSpec};

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
    /// `parameters.allow_substitute`: whether the client allows the model's `fallback_model`
    /// to answer instead, when it said.
    pub allow_substitute: Option<bool>,
}

#[derive(Deserialize)]
struct RequestJson<'a> {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    parameters: Map<String, Value>,
    #[serde(borrow)]
    inputs: Vec<TensorJson<'a>>,
    #[serde(default)]
    outputs: Option<Vec<OutputRequestJson>>,
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
    let (json, mut binary) = split_header(body, header_len, "body")?;
    let cut = Cut::new(json, "inputs");
    let request: RequestJson = parse(cut.as_ref(), json).map_err(|e| format!("malformed request JSON: {e}"))?;

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
        inputs[index] = Some(decode_input(
            input,
            cut.as_ref(),
            spec,
            body.len(),
            header_len.is_some(),
            &mut binary,
        )?);
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
    let allow_substitute = optional_flag(&request.parameters, "allow_substitute")?;
    let outputs = requested_outputs(request.outputs.unwrap_or_default(), signature, binary_by_default)?;
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
        allow_substitute,
    })
}

/// One input, checked against the model's `spec`, its data taken from its JSON `data` (read
/// through `cut`, the header serde read, where there is one) or from the front of `binary`.
/// `body_len` is the whole body's (no real axis is longer); binary data needs the request to
/// have an `Inference-Header-Content-Length` header (`has_header_len`).
fn decode_input(
    input: TensorJson<'_>,
    cut: Option<&Cut<'_>>,
    spec: &TensorSpec,
    body_len: usize,
    has_header_len: bool,
    binary: &mut &[u8],
) -> Result<Tensor, String> {
    let name = &input.name;
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
    check_shape(name, &input.shape, spec, body_len)?;
    let expected = Tensor::element_count(&input.shape)
        .ok_or_else(|| format!("input `{name}`: shape {:?} is too large", input.shape))?;
    let what = format!("input `{name}`");
    let binary_size = binary_data_size(&input.parameters, &what)?;
    let data = input.data.map(|raw| data_text(cut, raw));
    if binary_size.is_some() {
        if data.is_some() {
            return Err(format!("{what}: has both `data` and binary_data_size; send one"));
        }
        if !has_header_len {
            return Err(format!(
                "{what}: binary_data_size is set but the request has no Inference-Header-Content-Length header"
            ));
        }
    }
    let data = tensor_data(&what, datatype, binary_size, data, binary)?;
    if data.len() != expected {
        return Err(format!(
            "{what}: shape {:?} needs {expected} elements but {} were given",
            input.shape,
            data.len()
        ));
    }
    Ok(Tensor {
        name: input.name,
        shape: input.shape,
        data,
    })
}

/// An input's shape against the model's: the same rank, no negative axis, no axis longer than
/// the body could carry, and the model's fixed axes as declared.
fn check_shape(name: &str, shape: &[i64], spec: &TensorSpec, body_len: usize) -> Result<(), String> {
    if shape.len() != spec.shape.len() {
        return Err(format!(
            "input `{name}`: shape {:?} has rank {} but the model expects rank {} ({:?})",
            shape,
            shape.len(),
            spec.shape.len(),
            spec.shape
        ));
    }
    for (axis, (&got, &want)) in shape.iter().zip(&spec.shape).enumerate() {
        if got < 0 {
            return Err(format!("input `{name}`: dimension {axis} is negative ({got})"));
        }
        // Every element takes at least a byte of the body, so no real axis is longer; a
        // zero-element tensor could otherwise claim any length and reach the estimate.
        if got as u64 > body_len as u64 {
            return Err(format!(
                "input `{name}`: dimension {axis} is {got}, longer than a {body_len}-byte request can carry (shape {shape:?})",
            ));
        }
        if want >= 0 && got != want {
            return Err(format!(
                "input `{name}`: dimension {axis} is {got} but the model requires {want} (shape {:?})",
                spec.shape
            ));
        }
    }
    Ok(())
}

/// The outputs asked for, each one the model has and named once, binary or JSON as asked (the
/// request's `binary_data_output` when the output does not say).
fn requested_outputs(
    asked: Vec<OutputRequestJson>,
    signature: &ModelSignature,
    binary_by_default: bool,
) -> Result<Vec<RequestedOutput>, String> {
    let mut outputs = Vec::new();
    for out in asked {
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
    Ok(outputs)
}
