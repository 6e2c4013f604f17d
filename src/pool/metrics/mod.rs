//! The metric families the pools record into, each with its labels, registration and the
//! series it creates at 0: `runs.rs` (allocator failures, queue waits, bytes crossing, breaker
//! recoveries, and the handles one pool records into), `health.rs`
//! (health checks), `workers.rs` (worker processes) and `residency.rs` (models held, loads and
//! unloads). `serve::metrics::Metrics` registers them with every other family.

mod health;
mod residency;
mod runs;
mod workers;

pub use health::{CheckResult, HealthCheckLabels, HealthMetrics};
pub use residency::{
    LoadLabels, LoadReason, LoadSource, ModelMetrics, ResidencyMetrics, SourceLabels, TierMetrics, TierModelLabels,
    UnloadLabels, UnloadReason,
};
pub use runs::{AllocFailureLabels, PoolMetrics, RunMetrics, TransferLabels};
pub use workers::{RestartLabels, RestartReason, WorkerHandles, WorkerMetrics};
