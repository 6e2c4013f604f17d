//! What vramguard tells operators: metric handles and label types, the sampler and the
//! scrape-time collector, log helpers, and the allocator settings that keep its own memory
//! bounded. Above pools (the collector reads their live state); below the request path.

pub mod estimates;
pub mod exporter;
pub mod failover_labels;
pub mod health;
pub mod inference_stats;
pub mod logging;
pub mod malloc;
pub mod metrics;
mod pools;
pub mod residency;
pub mod services;
pub mod waits;
pub mod workers;
