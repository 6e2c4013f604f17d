//! Encoding an inference response: outputs as JSON `data`, or as binary data after the JSON
//! header where the request asked, within the server's answer size cap.

use serde::Serialize;
use serde_json::{Map, Value};

use super::decode::DecodedRequest;
use crate::core::human::human_bytes;
use crate::core::tensor::{DataType, Tensor, TensorData};

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
    // Binary outputs go straight into the body after the JSON header, each written once: their
    // sizes are known before the header is (a 1×1024×64 FP32 answer is 256 KiB, and a blob
    // in between cost one more allocation, a zero-fill and a copy of it on every request).
    let mut binary_len = 0usize;
    let json_outputs = outputs
        .iter()
        .map(|t| {
            if binary_for(&t.name) {
                binary_len = binary_len.saturating_add(t.data.byte_len());
                OutputJson {
                    name: &t.name,
                    datatype: t.data.datatype().name(),
                    shape: &t.shape,
                    parameters: Some(serde_json::json!({ "binary_data_size": t.data.byte_len() })),
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
    let size = json_guess.saturating_add(binary_len);
    if size > max_bytes {
        return Err(format!(
            "the answer would take about {} ({} as JSON, {} binary), more than server.max_response_bytes ({}); \
             ask for fewer outputs (`outputs`), for binary data (`binary_data_output`), or for a smaller batch",
            human_bytes(size as u64),
            human_bytes(json_guess as u64),
            human_bytes(binary_len as u64),
            human_bytes(max_bytes as u64)
        ));
    }
    let mut body = Vec::with_capacity(size);
    serde_json::to_writer(&mut body, &response).expect("response JSON always serializes");
    if !outputs.iter().any(|t| binary_for(&t.name)) {
        return Ok(EncodedResponse { body, header_len: None });
    }
    let header_len = body.len();
    for t in outputs.iter().filter(|t| binary_for(&t.name)) {
        t.data.write_le_bytes(&mut body);
    }
    Ok(EncodedResponse {
        body,
        header_len: Some(header_len),
    })
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
