//! The wire formats vramguard speaks and is spoken to in, below any server or client: the Open
//! Inference Protocol codec (JSON and binary tensors), the header names and the `/status`
//! document. The HTTP API, remote pools, the drill and doctor all use them from here, so none of
//! them depends on another.

pub mod headers;
pub mod oip;
pub mod status;
