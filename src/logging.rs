//! Logs with `tracing`: human-readable by default, JSON lines with `--log-format json`; the level
//! comes from `RUST_LOG` (default `info,ort=warn`: ONNX Runtime logs every arena extension at info).

use tracing_subscriber::EnvFilter;

/// Output format of the logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Human,
    /// One JSON object per line.
    Json,
}

/// Install the global subscriber (logs go to stderr; stdout stays for command output).
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,ort=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    // A second init (tests) keeps the first subscriber.
    let _ = result;
}
