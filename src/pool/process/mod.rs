//! Process isolation for accelerator pools (`pools[].isolation: process`): the pool's sessions live
//! in a worker process of their own, so a driver fault that poisons a process (a sticky CUDA
//! error), a crash or a hang takes that worker, never the gateway, the CPU pool or open
//! connections. `wire.rs` is what crosses the socket, `shm.rs` the shared memory a run's large
//! tensors cross in, `child.rs` the worker process, `worker.rs` the parent's handle on it,
//! `host.rs` where its workers come from, `conn.rs` a session connection there, shared by two
//! lanes, `expect.rs` when a lane looks for its run's answer, `backend.rs` one lane (a pool
//! worker's slot). The pool's supervisor of its worker process, which replaces a lost one, is the
//! pool's own (`pool/supervise.rs`).

mod backend;
pub mod child;
mod conn;
mod expect;
mod host;
mod shm;
mod wire;
mod worker;

pub use backend::ProcessBackend;
pub use child::{WorkerLogs, WorkerSpec};
pub use host::WorkerHost;
pub use worker::Worker;
