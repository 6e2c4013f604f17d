//! What vramguard tells operators: the metric families of the process itself and of remote
//! pools (`metrics`; the others live in `pool::metrics` and `serve::metrics`), the sampler and the
//! scrape-time collector, log helpers, and the allocator settings that keep its own memory
//! bounded. Above pools (the collector reads their live state); below the request path.

pub mod exporter;
pub mod inference_stats;
pub mod logging;
pub mod malloc;
pub mod metrics;
pub mod services;
