//! The protocol's client side, used by remote pools and the drill: a request encoded as another
//! server of the protocol expects it, and that server's answer decoded back into tensors.

use serde::Deserialize;
use serde_json::Value;

use super::binary::{TensorJson, binary_data_size, split_header, tensor_data};
use super::cut::{Cut, data_text, parse};
use crate::core::tensor::{DataType, Tensor};

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

#[derive(Deserialize)]
struct ResponseIn<'a> {
    #[serde(borrow)]
    outputs: Vec<TensorJson<'a>>,
}

/// Decode an inference response from another server of the protocol (JSON or binary outputs).
/// `asked` are the outputs the request named: they come back in that order, and one missing is
/// an error; when empty, every output in the server's order. The message says what is wrong
/// with the answer (the server's fault, not the client's).
pub fn decode_response(body: &[u8], header_len: Option<usize>, asked: &[String]) -> Result<Vec<Tensor>, String> {
    let (json, mut binary) = split_header(body, header_len, "answer")?;
    let cut = Cut::new(json, "outputs");
    let response: ResponseIn = parse(cut.as_ref(), json).map_err(|e| format!("malformed response JSON: {e}"))?;
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
        let raw = if binary_size.is_some() {
            None
        } else {
            out.data.map(|raw| data_text(cut.as_ref(), raw))
        };
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
