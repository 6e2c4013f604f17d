//! The connection layer under every HTTP listener (the API, the admin socket, the standalone
//! exporter): timeouts, caps on connections and bodies in flight, and the API's error body ([`ApiError`]), which it answers some requests with itself.
//! [`conn`] is its face: the accept loop, [`conn::Limits`] and the 413 message the router shares.

mod body;
pub mod conn;
mod limits;
mod refusal;
mod watch;

pub use refusal::ApiError;
