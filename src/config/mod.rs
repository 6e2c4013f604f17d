//! Configuration: parse YAML into raw structs (unknown keys are errors), then validate into
//! typed structs. Everything here runs before any port is bound, and every error names the file
//! and the key path.
//!
//! A tour, in the order a config travels: `yaml.rs` reads the text (the one place serde_yaml is
//! called) into the structs of `raw.rs`, which mirror the file key for key; `validate/` checks
//! them, one file per section, into the types of `types.rs`, which the rest of the crate reads;
//! `load.rs` ties the steps together for a file or the embedded default. `units.rs` parses sizes
//! and durations, `builtin.rs` names what `builtin:<name>` may name, `error.rs` says what failed.

mod builtin;
mod error;
mod load;
mod raw;
mod types;
mod units;
mod validate;
mod yaml;

// The rest of the crate names everything as `crate::config::…`; the files above are this
// module's own business.
pub use builtin::{BuiltinChatTemplate, BuiltinPolicy};
pub use error::ConfigError;
pub use load::{DEFAULT_CONFIG_YAML, embedded_raw};
pub use raw::{
    RawArenaExtendStrategy, RawBatching, RawBreaker, RawConfig, RawContext, RawCuda, RawDevice, RawDeviceKind,
    RawExporter, RawHealth, RawHost, RawHostTier, RawIdempotency, RawModel, RawOnnxRuntime, RawPolicy, RawPool,
    RawPoolMemory, RawProfile, RawProvider, RawQueue, RawRemote, RawResidency, RawServer, RawService, RawServiceRule,
    RawTimeouts,
};
pub use types::{
    AdminSocket, Batching, ChatTemplateSource, Config, ConfiguredProfile, ContextAxis, CudaOptions,
    DEFAULT_MIN_RESIDENCY, DeviceConfig, DeviceKind, ExporterConfig, HOST_DEVICE, HealthConfig, HostTierConfig,
    IdempotencyConfig, Isolation, Keep, Mode, ModelConfig, PolicyConfig, PolicySource, PoolConfig, Provider,
    RemoteOptions, Residency, ServerConfig, ServiceClass, ServiceConfig, ServiceMatch, ServiceRule, Timeouts,
    TokenizerSource, current_uid, default_admin_socket, default_optimized_cache, optimized_cache_under,
};
pub use units::{ByteSize, HumanDuration, format_duration, format_size, parse_duration, parse_size};
pub use yaml::{parse_yaml, read_yaml, to_yaml};

// `config` depends on `model`, never the other way round: `ModelSource` lives beside the models it
// names and is re-exported here, where the validated config uses it.
pub use crate::core::model::ModelSource;

#[cfg(test)]
mod tests;
