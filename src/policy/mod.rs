//! The admission policy: a Rhai script (`policies/*.rhai`) that looks at one request and the
//! latest [`Snapshot`](crate::core::snapshot::Snapshot) and returns a
//! [`Decision`](crate::core::snapshot::Decision): admit, defer, shrink the context, redirect or reject.
//!
//! - [`Script`] compiles a script once and evaluates it per request in a sandbox; any
//!   failure yields the configured fallback decision and a [`PolicyError`] of a known kind.
//! - [`StateView`] is the script's `state`, converted once per snapshot (see `values.rs` for why
//!   that matters: it is most of the cost of an evaluation otherwise).
//! - [`PolicyHandle`] is what the server holds: the current script, hot reload that refuses a
//!   script failing to compile or failing its own test cases, and what `/status` shows. It loads
//!   from a [`PolicySource`](crate::config::PolicySource): a file, or a builtin policy read from
//!   the binary (see `source.rs`, [`load_script`]).
//! - [`smoke_test`] evaluates a script once per model and pool before it is trusted (`serve`
//!   at start, `policy check`), since a misspelt property only fails at run time.
//! - [`cases`] runs the test cases kept beside the policies (`policies/tests/*.yaml`);
//!   the `vramguard policy check|test|eval` command (`cmd::policy`) is built on them.
//!
//! The files: `script.rs` (compiling and the sandbox, whose limits are `limits.rs`), `compiled/`
//! (the fast evaluation of the policy's common shapes, Rhai's answer otherwise), `values.rs` (`req`
//! and `state` as Rhai values), `accept.rs` (what the decision constructors accept), `handle.rs`
//! (the running policy and hot reload), `source.rs` (where a script comes from), `builtin.rs` (the
//! policies in the binary), `smoke.rs` (trying a script before it is trusted), `cases.rs` (test
//! cases) and `recent.rs` (the last decisions, for `/status`).

mod accept;
pub mod builtin;
pub mod cases;
mod compiled;
mod handle;
mod limits;
pub mod recent;
mod script;
mod smoke;
mod source;
mod values;

pub use handle::{LoadedPolicy, PolicyHandle, PolicyStatus, settings_for};
pub use limits::{
    MAX_ARRAY_SIZE, MAX_CALL_DEPTH, MAX_EXPR_DEPTH, MAX_FUNCTIONS, MAX_MAP_SIZE, MAX_OPERATIONS, MAX_STRING_SIZE,
    MAX_VARIABLES,
};
pub use script::{Evaluation, PolicyError, PolicyErrorKind, PolicySettings, Script};
pub use smoke::{
    SmokeError, configured_estimate, configured_services, configured_snapshot, smoke_requests, smoke_test,
};
pub use source::{LoadError, load_script};
pub use values::{List, LiveLoad, Params, PoolLoadNow, ServiceNow, StateView, Table};

#[cfg(test)]
mod tests;
