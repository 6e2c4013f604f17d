//! Where a configuration comes from: a file, or the default embedded in the binary.

use std::path::Path;

use crate::config::error::ConfigError;
use crate::config::raw::{RawArenaExtendStrategy, RawConfig, RawCuda, RawDeviceKind, RawProvider};
use crate::config::types::{Config, Mode};
use crate::config::yaml::{parse_yaml, read_yaml};

/// The embedded default configuration (simulated accelerator flavour); see [`Config::embedded`].
pub const DEFAULT_CONFIG_YAML: &str = include_str!("../../config/default.yaml");

impl Config {
    /// Load and validate a config file for `serve`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Self::load_for(path, Mode::Serve)
    }

    /// Load and validate a config file for `mode`.
    pub fn load_for(path: &Path, mode: Mode) -> Result<Config, ConfigError> {
        let raw: RawConfig = read_yaml(path)?;
        let base = path.parent().unwrap_or(Path::new("."));
        raw.validate_for(&path.display().to_string(), base, mode)
    }

    /// The embedded default; on a machine where NVML sees a GPU its accelerator is a CUDA pool.
    pub fn embedded(nvidia_gpu: bool) -> Config {
        embedded_raw(nvidia_gpu)
            .validate("<embedded default>", Path::new("."))
            .expect("the embedded default config is valid (checked by tests)")
    }
}

/// The embedded default as raw YAML structs, adapted to the machine.
pub fn embedded_raw(nvidia_gpu: bool) -> RawConfig {
    let mut raw: RawConfig = parse_yaml(DEFAULT_CONFIG_YAML, "<embedded default>")
        .expect("the embedded default config parses (checked by tests)");
    if nvidia_gpu {
        // Same names, so policies written for `gpu` work on both kinds of machine.
        for device in raw.devices.iter_mut().filter(|d| d.kind == RawDeviceKind::Simulated) {
            device.kind = RawDeviceKind::Nvidia;
            device.capacity = None;
            device.index = Some(0);
        }
        for pool in raw.pools.iter_mut().filter(|p| p.provider == RawProvider::Simulated) {
            pool.provider = RawProvider::Cuda;
            pool.cuda = Some(RawCuda {
                gpu_mem_limit: None,
                arena_extend_strategy: Some(RawArenaExtendStrategy::SameAsRequested),
            });
        }
    }
    raw
}
