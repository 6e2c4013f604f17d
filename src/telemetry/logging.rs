//! Logs with `tracing`: human-readable by default, JSON lines with `--log-format json`; the level
//! comes from `RUST_LOG`, else from the command ([`DEFAULT_FILTERS`] for the servers). Worker
//! processes write to their parent's stderr in its format. Human lines are coloured only for a
//! person at a terminal: a log redirected to a file or a pipe, or any log under a non-empty
//! `NO_COLOR` (<https://no-color.org>), is plain text.

use std::io::IsTerminal;
use std::sync::OnceLock;

use tracing_subscriber::EnvFilter;

use crate::pool::process::WorkerLogs;

/// What a command logs when `RUST_LOG` sets nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Filters {
    /// Its own filter.
    pub own: &'static str,
    /// Its worker processes' (`None`: their own default, only what goes wrong inside them).
    pub workers: Option<&'static str>,
}

/// The servers' filters: ONNX Runtime logs every arena extension at info.
pub const DEFAULT_FILTERS: Filters = Filters {
    own: "info,ort=warn",
    workers: None,
};

/// Output format of the logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Human,
    /// One JSON object per line.
    Json,
}

/// The format and the workers' filter [`init_with`] installed, for the processes this one
/// starts.
static INSTALLED: OnceLock<(LogFormat, Option<&'static str>)> = OnceLock::new();

/// Install the global subscriber, logging to stderr (stdout stays for command output) at
/// `filters.own` when `RUST_LOG` is not set.
pub fn init_with(format: LogFormat, filters: Filters) {
    let _ = INSTALLED.set((format, filters.workers));
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(filters.own));
    let colour = colour(std::io::stderr().is_terminal(), std::env::var_os("NO_COLOR"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour);
    let result = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    // A second init (tests) keeps the first subscriber.
    let _ = result;
}

/// How the worker processes this process starts log: to the same stderr in the same format, at
/// the filter [`init_with`] was given for them (human lines at their default before it).
pub fn worker_logs() -> WorkerLogs {
    let (format, filter) = INSTALLED.get().copied().unwrap_or((LogFormat::Human, None));
    WorkerLogs {
        json: format == LogFormat::Json,
        filter: filter.map(str::to_string),
    }
}

/// Whether human log lines are coloured: only on a terminal, and not when `NO_COLOR` is set to
/// anything but the empty string.
fn colour(terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::colour;

    #[test]
    fn colour_is_for_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some("".into())), "an empty NO_COLOR is unset");
        assert!(!colour(true, Some("1".into())));
        assert!(!colour(false, None), "a file or a pipe gets plain text");
    }
}
