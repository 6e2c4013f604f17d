//! The Open Inference Protocol (KServe v2) codec with the binary tensor data extension: pure
//! functions over bytes, tested without a socket. The server decodes requests ([`decode()`]) and
//! encodes answers ([`encode()`]); as a client of another server (remote pools, the drill) it
//! encodes requests ([`encode_request`]) and decodes answers ([`decode_response`]).

mod binary;
mod client;
mod cut;
mod decode;
mod encode;

pub use client::{decode_response, encode_request};
pub use decode::{DecodedRequest, RequestedOutput, decode};
pub use encode::{EncodedResponse, encode};

#[cfg(test)]
mod properties;
#[cfg(test)]
mod tests;
