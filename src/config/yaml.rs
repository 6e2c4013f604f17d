//! The one place YAML is read and written: serde_yaml is deprecated upstream, and swapping it
//! must touch only this file.

use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::config::error::ConfigError;

/// Parse `text` into `T`; errors name `file` and, for schema errors, the key, line and column.
pub fn parse_yaml<T: DeserializeOwned>(text: &str, file: &str) -> Result<T, ConfigError> {
    serde_yaml::from_str(text).map_err(|e| ConfigError::Parse {
        file: file.to_string(),
        message: e.to_string(),
    })
}

/// Read a YAML file into `T`; errors name the file (and, for schema errors, the key).
pub fn read_yaml<T: DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        file: file.clone(),
        source,
    })?;
    parse_yaml(&text, &file)
}

/// Serialize to YAML (used by `config default`).
pub fn to_yaml<T: Serialize>(value: &T) -> String {
    serde_yaml::to_string(value).expect("config structs always serialize")
}
