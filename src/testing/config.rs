//! Config builders: YAML parsed and validated as `vramguard serve` would, and the plain
//! [`PoolConfig`] a pool started by hand needs.

use std::path::Path;
use std::time::Duration;

use crate::config::{Config, PoolConfig, Provider, RawConfig, parse_yaml};

/// `yaml` parsed and validated into a [`Config`], with relative model paths taken from the
/// project root (where `models/` is), whatever folder the test or bench runs in. Panics with
/// the config error, which names the key: a test's own config is wrong, not its subject.
/// Process-isolated pools start their workers from the `vramguard` binary Cargo built beside
/// the test or bench. Without `host.optimized_cache`, models are optimized into the process's
/// test cache ([`super::cache_home`]), never the user's.
pub fn validated(yaml: &str) -> Config {
    let raw: RawConfig = parse_yaml(yaml, "test.yaml").unwrap_or_else(|e| panic!("test config parses: {e}"));
    let own_cache = raw.host.optimized_cache.is_none();
    let mut config = raw
        .validate("test.yaml", Path::new(env!("CARGO_MANIFEST_DIR")))
        .unwrap_or_else(|e| panic!("test config validates: {e}"));
    config.worker_exe = built_binary();
    if own_cache {
        config.host_tier.optimized_cache = crate::config::optimized_cache_under(super::cache_home());
    }
    config
}

/// The `vramguard` binary of this build: beside the running test or bench (`target/debug/`,
/// which holds `deps/` where test executables are), when Cargo built it.
pub fn built_binary() -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let mut dir = exe.parent()?;
    if dir.ends_with("deps") {
        dir = dir.parent()?;
    }
    let binary = dir.join("vramguard");
    binary.exists().then_some(binary)
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
        isolation: crate::config::Isolation::Thread,
        idle_release: None,
        max_context: None,
        breaker: crate::core::breaker::BreakerConfig::default(),
        health: crate::config::HealthConfig::default(),
        fallback: None,
        cpus: None,
    }
}

/// The spec of a worker process for a CPU pool `pool` of one intra-op thread, loading ONNX
/// Runtime from `onnxruntime_library`.
pub fn cpu_worker(pool: &str, onnxruntime_library: &Path) -> crate::pool::process::WorkerSpec {
    crate::pool::process::WorkerSpec {
        pool: pool.into(),
        provider: "cpu".into(),
        cuda: None,
        device_index: 0,
        intra_threads: 1,
        arena_shrinkage: false,
        simulated: None,
        onnxruntime_library: onnxruntime_library.to_path_buf(),
        cpus: None,
        logs: Default::default(),
    }
}
