//! Serving a request below any protocol: assembling the service from its parts, one request's
//! life (policy, router, queue, retry, deadline), and each kind's request, handed down by its
//! protocol through its door: text generation (`generation`), the encoders' requests
//! (`encoders`: embeddings, rerank, a dual encoder's towers), transcriptions (`speech`) and a
//! tensor graph's (`tensors`); idempotency keys, and
//! [`metrics::Metrics`], every metric family registered together. Nothing here knows about HTTP
//! status codes; `http` maps outcomes to them.

pub mod batching;
pub mod encoders;
pub mod generation;
pub mod health;
pub mod idempotency;
pub mod idle;
pub mod lifecycle;
pub mod metrics;
pub mod ran;
pub mod residency;
pub mod router;
pub mod service;
pub mod speech;
pub mod status;
pub mod tensors;
pub mod workers;
