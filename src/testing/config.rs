//! Config builders: YAML parsed and validated as `vramguard serve` would, and the plain
//! [`PoolConfig`] a pool started by hand needs.

use std::path::Path;
use std::time::Duration;

use crate::config::{Config, PoolConfig, Provider, RawConfig, parse_yaml};

/// `yaml` parsed and validated into a [`Config`], with relative model paths taken from the
/// project root (where `models/` is), whatever folder the test or bench runs in. Panics with
/// the config error, which names the key: a test's own config is wrong, not its subject.
pub fn validated(yaml: &str) -> Config {
    let raw: RawConfig = parse_yaml(yaml, "test.yaml").unwrap_or_else(|e| panic!("test config parses: {e}"));
    raw.validate("test.yaml", Path::new(env!("CARGO_MANIFEST_DIR")))
        .unwrap_or_else(|e| panic!("test config validates: {e}"))
}

/// A CPU pool `name` on `device` serving `models`: one worker of one intra-op thread, a queue
/// of 64 for 30 s, the default breaker, no fallback. Tests change what they are about with
/// struct update syntax (`PoolConfig { queue_capacity: 2, ..pool(…) }`).
pub fn pool(name: &str, device: &str, models: &[&str]) -> PoolConfig {
    PoolConfig {
        name: name.into(),
        provider: Provider::Cpu,
        device: device.into(),
        models: models.iter().map(|m| m.to_string()).collect(),
        workers: 1,
        intra_threads: 1,
        queue_capacity: 64,
        max_wait: Duration::from_secs(30),
        arena_shrinkage: false,
        idle_release: None,
        max_context: None,
        breaker: crate::core::breaker::BreakerConfig::default(),
        health: crate::config::HealthConfig::default(),
        fallback: None,
    }
}
