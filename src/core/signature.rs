//! What a model declares it takes and gives: plain types read from a runtime's session by the
//! runtime layer, and used by everything above it (decoding requests, estimates, decoders).

use crate::core::tensor::DataType;

/// One input or output as the model declares it (`-1` for a dynamic axis).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    /// Name.
    pub name: String,
    /// Datatype.
    pub datatype: DataType,
    /// Dimensions, `-1` where dynamic.
    pub shape: Vec<i64>,
    /// Symbolic names of the dimensions (empty where the model gives none).
    pub symbols: Vec<String>,
}

/// A model's signature, read from its session.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSignature {
    /// Inputs in declaration order.
    pub inputs: Vec<TensorSpec>,
    /// Outputs in declaration order.
    pub outputs: Vec<TensorSpec>,
}

impl ModelSignature {
    /// The input names, comma-separated, for messages that list what exists.
    pub fn input_names(&self) -> String {
        self.inputs
            .iter()
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}
