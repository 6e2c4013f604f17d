//! The connection layer under every HTTP listener (the API, the admin socket, the standalone
//! exporter): timeouts, caps on connections and bodies in flight, and its own error bodies.

pub mod conn;
