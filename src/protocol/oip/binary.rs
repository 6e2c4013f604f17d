//! The binary tensor data extension's framing, read the same way in requests and in answers: a
//! JSON header of `Inference-Header-Content-Length` bytes, then the tensors' raw bytes in the
//! order the header lists them, each tensor claiming `binary_data_size` of them. A tensor
//! without that parameter carries its elements as JSON `data` instead.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::core::tensor::{DataType, TensorData};

/// A tensor as a header lists it: a request's input or an answer's output, whose data is
/// inline JSON or binary data after the header.
#[derive(Deserialize)]
pub(super) struct TensorJson<'a> {
    pub(super) name: String,
    pub(super) shape: Vec<i64>,
    pub(super) datatype: String,
    #[serde(default)]
    pub(super) parameters: Map<String, Value>,
    #[serde(default, borrow)]
    pub(super) data: Option<&'a RawValue>,
}

/// The JSON header and the binary data after it. `header_len` is the
/// `Inference-Header-Content-Length` header (absent: the whole body is JSON); `what` names the
/// body in the message (`body`, `answer`).
pub(super) fn split_header<'a>(
    body: &'a [u8],
    header_len: Option<usize>,
    what: &str,
) -> Result<(&'a [u8], &'a [u8]), String> {
    let json_len = header_len.unwrap_or(body.len());
    if json_len > body.len() {
        return Err(format!(
            "Inference-Header-Content-Length is {json_len} but the {what} has only {} bytes",
            body.len()
        ));
    }
    Ok(body.split_at(json_len))
}

/// A tensor's `parameters.binary_data_size`, if it has one; `what` names the tensor.
pub(super) fn binary_data_size(parameters: &Map<String, Value>, what: &str) -> Result<Option<usize>, String> {
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
/// front of `binary`, or its JSON `data` (`raw`, the array's text); `what` names the tensor in
/// the message.
pub(super) fn tensor_data(
    what: &str,
    datatype: DataType,
    binary_size: Option<usize>,
    raw: Option<&str>,
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
        (None, Some(raw)) => TensorData::from_json(datatype, raw).map_err(|e| format!("{what}: {e}")),
        (None, None) => Err(format!("{what}: has no `data` and no binary_data_size")),
    }
}
