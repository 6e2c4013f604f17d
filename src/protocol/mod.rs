//! The wire formats vramguard speaks and is spoken to in, below any server or client: the Open
//! Inference Protocol codec (JSON and binary tensors) and the header names. The HTTP API, remote
//! pools and the drill all use them from here, so none of them depends on another.

pub mod headers;
pub mod oip;
