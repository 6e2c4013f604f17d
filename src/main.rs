//! The `vramguard` binary: parse the command line and hand over to the library.
#![forbid(unsafe_code)]

use clap::Parser;

fn main() -> std::process::ExitCode {
    vramguard::cmd::cli::run(vramguard::cmd::cli::Cli::parse())
}
