//! The bottom layer: plain data and the seams everything above shares. Nothing here knows about
//! configuration files, ONNX Runtime, HTTP or the policy language.

pub mod backend;
pub mod blocking;
pub mod breaker;
pub mod clock;
pub mod cpus;
pub mod human;
pub mod metrics;
pub mod model;
pub mod rng;
pub mod scratch;
pub mod signature;
pub mod snapshot;
pub mod tensor;
pub mod tool_call;
pub mod wakeup;
