//! The exporter: one background sampler asks every memory source for a reading, attributes
//! processes to services, adds the pools' state, and publishes one [`Snapshot`] that `/metrics`,
//! `/status` and the policy all read. A scrape never waits on a driver call: it encodes
//! the latest snapshot plus the pools' live queues through [`LiveCollector`].
//!
//! `sampler.rs` takes the samples, `attribution.rs` names a process's service, `store.rs` holds
//! the latest sample, `collector.rs` encodes it at scrape time (with `family.rs`), and
//! `response.rs` answers `/metrics` in the format the client accepts.
//!
//! [`Snapshot`]: crate::core::snapshot::Snapshot

mod attribution;
mod collector;
pub(super) mod family;
mod response;
mod sampler;
mod store;

pub use attribution::{UNMATCHED_SERVICE, attribute};
pub use collector::{LiveCollector, accelerator_usage_ratio};
pub use response::metrics_response;
pub use sampler::{Sampler, pool_arena};
pub use store::{Sample, SnapshotStore};

#[cfg(test)]
mod tests;
