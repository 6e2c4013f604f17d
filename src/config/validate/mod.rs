//! Validation: a [`RawConfig`] becomes a [`Config`], one function per section, in the order the
//! sections are checked (the first error wins, so the order is part of what operators see).
//! Every error names the file and the key path; the checks that recur (ranges, durations,
//! sizes, files that must exist) are [`Checker`]'s, so each reads and words the same everywhere.

mod devices;
mod exporter;
mod models;
mod policy;
mod pools;
mod server;
mod services;

use std::collections::HashSet;
use std::fmt::Display;
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::error::ConfigError;
use crate::config::raw::RawConfig;
use crate::config::types::{Config, Mode};
use crate::config::units::{ByteSize, HumanDuration};
use crate::core::cpus::{CpuList, CpuSet};

impl RawConfig {
    /// Validate into a [`Config`] for `serve`; `base` resolves relative paths (models,
    /// tokenizers, templates, the policy, the ONNX Runtime library).
    pub fn validate(&self, file: &str, base: &Path) -> Result<Config, ConfigError> {
        self.validate_for(file, base, Mode::Serve)
    }

    /// Validate into a [`Config`] for `mode`.
    pub fn validate_for(&self, file: &str, base: &Path, mode: Mode) -> Result<Config, ConfigError> {
        let c = Checker { file, base };
        let exporter = exporter::exporter(&c, &self.exporter)?;
        let server = server::server(&c, &self.server)?;
        let devices = devices::devices(&c, &self.devices)?;
        let declared = services::declared(&c, &self.services)?;
        let models = models::models(&c, &self.models, &declared, mode)?;
        let services = services::with_implicit(declared, &models);
        let pools = pools::pools(&c, &self.pools, &devices, &models, mode)?;
        let policy = policy::policy(&c, &self.policy, &pools)?;
        Ok(Config {
            source: file.to_string(),
            server,
            onnxruntime_library: self.onnxruntime.library.as_ref().map(|p| base.join(p)),
            devices,
            models,
            services,
            pools,
            host_reserve: self.host.reserve.bytes(),
            host_tier: host_tier(&c, &self.host)?,
            exporter,
            policy,
            worker_exe: None,
        })
    }
}

/// The file being checked and the folder its relative paths start from; it words the errors.
struct Checker<'a> {
    file: &'a str,
    base: &'a Path,
}

/// A key that takes `builtin:<name>` or a path (a model, a chat template, the policy).
enum Spec<T> {
    /// Shipped in the binary.
    Builtin(T),
    /// A file that exists, resolved against the config file's folder.
    File(PathBuf),
}

impl Checker<'_> {
    fn err(&self, key: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            file: self.file.to_string(),
            key: key.into(),
            message: message.into(),
        }
    }

    /// Names are labels and URL segments, so they are plain words, and unique in their section.
    fn unique_name<'n>(&self, seen: &mut HashSet<&'n str>, name: &'n str, key: String) -> Result<(), ConfigError> {
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            return Err(self.err(
                key,
                format!("expected a non-empty name of letters, digits, `-`, `_` or `.`, got `{name}`"),
            ));
        }
        if !seen.insert(name) {
            return Err(self.err(key, format!("`{name}` is defined twice")));
        }
        Ok(())
    }

    /// `value`, if `range` holds it: counts and durations alike, worded `expected 1 to 256`.
    fn within<T: PartialOrd + Display + Copy>(
        &self,
        key: impl Into<String>,
        value: T,
        range: RangeInclusive<T>,
    ) -> Result<T, ConfigError> {
        if range.contains(&value) {
            Ok(value)
        } else {
            Err(self.err(
                key,
                format!("expected {} to {}, got {value}", range.start(), range.end()),
            ))
        }
    }

    /// A duration that bounds something: zero would time out at once, or loop without pause.
    fn longer_than_zero(&self, key: impl Into<String>, d: HumanDuration) -> Result<Duration, ConfigError> {
        if d.get().is_zero() {
            return Err(self.err(key, "must be longer than 0"));
        }
        Ok(d.get())
    }

    /// A CPU list that names CPUs (which exist is checked when `serve` starts, on its machine).
    fn cpus(&self, key: impl Into<String>, list: Option<&CpuList>) -> Result<Option<CpuSet>, ConfigError> {
        list.map(|l| l.parse().map_err(|why| self.err(key, why))).transpose()
    }

    /// A size of at least `min`.
    fn at_least(&self, key: impl Into<String>, size: ByteSize, min: ByteSize) -> Result<u64, ConfigError> {
        if size < min {
            return Err(self.err(key, format!("must be at least {min}")));
        }
        Ok(size.bytes())
    }

    /// A listen address; `example` shows the shape expected.
    fn address(&self, key: &str, text: &str, example: &str) -> Result<SocketAddr, ConfigError> {
        text.parse()
            .map_err(|_| self.err(key, format!("expected an address like `{example}`, got `{text}`")))
    }

    /// `path`, relative to the config file, which must be a file: checked now, so a typo fails
    /// before any port is bound rather than when the first request needs the file.
    fn existing_file(&self, key: &str, path: &str, what: &str) -> Result<PathBuf, ConfigError> {
        let path = self.base.join(path);
        if !path.is_file() {
            return Err(self.err(key, format!("{what} file `{}` does not exist", path.display())));
        }
        Ok(path)
    }

    /// `builtin:<name>`, looked up by `builtin` (whose error says which names there are), or
    /// else an [existing file](Self::existing_file).
    fn builtin_or_file<T>(
        &self,
        key: &str,
        spec: &str,
        what: &str,
        builtin: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<Spec<T>, ConfigError> {
        match spec.strip_prefix("builtin:") {
            Some(name) => builtin(name).map(Spec::Builtin).map_err(|e| self.err(key, e)),
            None => self.existing_file(key, spec, what).map(Spec::File),
        }
    }
}

/// `host.model_cache` and `host.optimized_cache` (relative to the config file).
fn host_tier(
    c: &Checker,
    host: &crate::config::raw::RawHost,
) -> Result<crate::config::types::HostTierConfig, ConfigError> {
    let optimized_cache = match &host.optimized_cache {
        Some(dir) => c.base.join(dir),
        None => crate::config::types::default_optimized_cache(),
    };
    if optimized_cache.exists() && !optimized_cache.is_dir() {
        return Err(c.err(
            "host.optimized_cache",
            format!("{} is not a folder", optimized_cache.display()),
        ));
    }
    Ok(crate::config::types::HostTierConfig {
        budget: host.model_cache.map(|b| b.bytes()),
        optimized_cache,
    })
}
