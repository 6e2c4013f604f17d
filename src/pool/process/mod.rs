//! Process isolation for accelerator pools (`pools[].isolation: process`): the pool's sessions
//! live in a worker process of their own, so a driver fault that poisons a process (a sticky
//! CUDA error), a crash or a hang takes that worker, never the gateway, the CPU pool or open
//! connections. `wire` is what crosses the socket, `child` the worker process, `host` the
//! parent's handle on it, `backend` a pool worker's sessions there, `supervise` the thread
//! that replaces a lost worker.

mod backend;
pub mod child;
mod host;
mod supervise;
mod wire;

pub use backend::ProcessBackend;
pub use child::WorkerSpec;
pub use host::{Worker, WorkerHost};
pub use supervise::Lost;
