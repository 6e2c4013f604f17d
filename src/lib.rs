//! vramguard: accelerator-memory exporter, scripted admission policy and ONNX Runtime worker
//! pools with CPU failover. The binary (`src/main.rs`) only parses the command line; everything
//! else lives here so integration tests and benches use the real code.
//!
//! The one module allowed `unsafe` is [`onnx::arena`], which calls ONNX Runtime's C API for what
//! the `ort` crate does not wrap.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod activity;
pub mod backend;
pub mod breaker;
pub mod chat;
pub mod cli;
pub mod clock;
pub mod config;
pub mod decoder;
pub mod degraded;
pub mod device;
pub mod doctor;
pub mod drill;
pub mod estimate;
pub mod exit;
pub mod exporter;
pub mod generate;
pub mod heap;
pub mod http;
pub mod idempotency;
pub mod lifecycle;
pub mod logging;
pub mod metrics;
pub mod model;
pub mod onnx;
pub mod policy;
pub mod pool;
pub mod recent;
pub mod remote;
pub mod router;
pub mod sequences;
pub mod service;
pub mod snapshot;
pub mod tensor;
