//! The integration tests, one binary (linked once, not once per file): real servers on
//! 127.0.0.1:0, real ONNX Runtime sessions, the real `vramguard` binary, and checks of the source
//! tree itself. `common` is the harness they share.

mod abuse;
mod batching;
mod budgets;
mod cli;
mod common;
mod connections;
mod counted;
mod doc_links;
mod drill;
mod embeddings;
mod estimates;
mod evict;
mod external_data;
mod failover;
mod file_lists;
mod generation;
mod health;
mod host_tier;
mod http;
mod isolation;
mod layering;
mod learned;
mod leftovers;
mod lifecycle;
mod memory;
mod openai_errors;
mod openai_surface;
mod picker;
mod placement;
mod policy;
mod prometheus;
mod real_models;
mod real_sampling;
mod remote;
mod residency;
mod simulated;
mod simulated_policy;
mod sizes;
mod status_page;
mod structured;
mod substitute;
mod text;
mod triton;
