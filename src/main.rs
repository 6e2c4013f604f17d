//! The `vramguard` binary: parse the command line and hand over to the library.
#![forbid(unsafe_code)]

use clap::Parser;

/// Rust's allocations go to mimalloc; its options are set at start (`telemetry::malloc`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    vramguard::cmd::cli::run(vramguard::cmd::cli::Cli::parse())
}
