//! What goes wrong loading a configuration.

/// What went wrong loading a configuration, always naming the file and, when known, the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{file}: cannot read: {source}")]
    Read {
        /// The file.
        file: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML did not match the schema (the message carries key path, line and column).
    #[error("{file}: {message}")]
    Parse {
        /// The file.
        file: String,
        /// serde_yaml's message: key path, what was expected, line and column.
        message: String,
    },
    /// A value parsed but is impossible.
    #[error("{file}: {key}: {message}")]
    Invalid {
        /// The file.
        file: String,
        /// Dotted key path, e.g. `pools[1].queue.capacity`.
        key: String,
        /// What was expected.
        message: String,
    },
}
