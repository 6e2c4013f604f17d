//! The commands: the command line itself, exit statuses, and each command that is more than a
//! call into the layers below (`exporter`, `policy`, `doctor`, `drill`), and `signal`, which they
//! stop on.

pub mod cli;
pub mod doctor;
pub mod drill;
pub mod exit;
pub mod exporter;
pub mod policy;
pub mod signal;
