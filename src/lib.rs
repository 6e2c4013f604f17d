//! vramguard: accelerator-memory exporter, scripted admission policy and ONNX Runtime worker
//! pools with CPU failover. The binary (`src/main.rs`) only parses the command line; everything
//! else lives here so integration tests and benches use the real code.
//!
//! The modules are layers, declared below lowest first. A request passes through them from the
//! top down: [`net`] accepts the connection and enforces its limits, [`http`] decodes it with
//! [`protocol`], [`serve`] runs its lifecycle (the [`policy`] decides on a memory estimate from
//! [`runtime`] and the latest snapshot, the router picks a pool, one retry on the fallback), a
//! [`pool`] runs it on a worker through a [`core`] backend into ONNX Runtime ([`runtime`]) (or
//! hands it to a worker process or another server), and the answer goes back up the same way. Beside it, [`telemetry`] samples [`device`] memory into
//! the snapshot that `/metrics`, `/status` and the policy read. [`config`] is validated before
//! any of this starts; [`cmd`] holds the commands.
//!
//! `unsafe` is denied everywhere but in the few places that call C or share memory, each allowed
//! where it stands and saying why it is sound: ONNX Runtime's C API for what the `ort` crate does
//! not wrap ([`runtime::onnx::arena`] and its neighbours), the allocators' set-up
//! ([`telemetry::malloc`]), and the worker processes' shared memory and descriptors
//! ([`pool::process`]).
#![deny(unsafe_code)]
#![warn(missing_docs)]

// The layers, lowest first (one per paragraph, so that rustfmt keeps their order): a module
// imports only from its own layer and the ones before it, checked by `tests/it/layering.rs`.

// Plain data and the seams everything shares: backends, breaker, clock, models, snapshot, tensors.
pub mod core;

// The configuration: YAML read into raw structs, validated into types.
pub mod config;

// ONNX Runtime sessions and arena, decoders, chat templates, memory estimates.
pub mod runtime;

// Memory sources: NVML, the simulated accelerator, the host, process identity.
pub mod device;

// The Rhai admission policy: sandbox, state view, test cases, hot reload.
pub mod policy;

// The Open Inference Protocol codec and the header names.
pub mod protocol;

// Worker pools: bounded queues, worker threads, generations, degraded mode, and the backends
// that run elsewhere (a worker process, a remote server).
pub mod pool;

// Metrics, the sampler and scrape-time collector, logging, allocator settings.
pub mod telemetry;

// A request's life below any protocol: service, lifecycle, router, generation.
pub mod serve;

// The connection layer under every listener: timeouts, caps, its own refusals.
pub mod net;

// The HTTP API: Open Inference Protocol, OpenAI, admin, status.
pub mod http;

// The commands: command line, exit statuses, exporter, policy, doctor, drill.
pub mod cmd;

/// Scaffolding for tests and benches (the `test-util` feature): scratch folders, fakes, builders.
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
