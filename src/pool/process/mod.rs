//! Process isolation for accelerator pools (`pools[].isolation: process`): the pool's sessions
//! live in a worker process of their own, so a driver fault that poisons a process (a sticky
//! CUDA error), a crash or a hang takes that worker, never the gateway, the CPU pool or open
//! connections. `wire` is what crosses the socket, `shm` the shared memory a run's large
//! tensors cross in, `child` the worker process, `worker` the parent's handle on it, `host`
//! where its workers come from, `conn` a session connection there, shared by two lanes,
//! `expect` when a lane looks for its run's answer, `backend` one lane (a pool worker's slot),
//! `supervise` the thread that replaces a lost worker.

mod backend;
pub mod child;
mod conn;
mod expect;
mod host;
mod shm;
mod supervise;
mod wire;
mod worker;

pub use backend::ProcessBackend;
pub use child::{WorkerLogs, WorkerSpec};
pub use host::WorkerHost;
pub use supervise::Lost;
pub use worker::Worker;
