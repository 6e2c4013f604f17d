//! The encoders' requests below any protocol: one file per kind of model that encodes, each a
//! [`Job`] made from its API's request (as plain values) and its model's kind, holding that
//! kind's own work: its pre-processing, the tensors and output of its runs, and the answer it
//! reads from them. `embed` is a sentence encoder's (`/v1/embeddings`), `rerank` a
//! cross-encoder's (`/v1/rerank`), `tower` a dual encoder's tower's (`/v1/embeddings` of texts
//! and images). Every one goes through the one door, `job`'s [`run`]: prepared off the async
//! threads, run through the lifecycle, answered with where it ran. `tokens` is a text's tokens
//! within its model's limit (each kind's that reads text); a tower answers with `embed`'s
//! vectors, cut as `embed` cuts them.

pub mod embed;
mod job;
pub mod rerank;
mod tokens;
pub mod tower;

pub use job::{Done, Failure, Invalid, Job, Run, run};
