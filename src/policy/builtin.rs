//! The policies shipped inside the binary (`policy.path: builtin:<name>`), with their test
//! cases, so the embedded default config needs no file on disk. They are loaded and tested
//! from memory (see `source.rs`), never written out.

/// Names accepted after `builtin:` (the config validates `policy.path` against them).
pub use crate::config::BUILTIN_POLICIES as NAMES;

/// A policy shipped in the binary: its script and its test cases, as the text of
/// `policies/<name>.rhai` and `policies/tests/<name>.yaml` at build time.
#[derive(Debug, Clone, Copy)]
pub struct Builtin {
    /// The Rhai script.
    pub script: &'static str,
    /// The YAML test cases.
    pub cases: &'static str,
}

/// The builtin policy `name`, if there is one.
pub fn get(name: &str) -> Option<Builtin> {
    FILES
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|&(_, script, cases)| Builtin { script, cases })
}

const FILES: [(&str, &str, &str); 3] = [
    (
        "default",
        include_str!("../../policies/default.rhai"),
        include_str!("../../policies/tests/default.yaml"),
    ),
    (
        "latency-first",
        include_str!("../../policies/latency-first.rhai"),
        include_str!("../../policies/tests/latency-first.yaml"),
    ),
    (
        "availability-first",
        include_str!("../../policies/availability-first.rhai"),
        include_str!("../../policies/tests/availability-first.yaml"),
    ),
];

/// Params a builtin policy gets unless the config sets them (`policy.params` overrides each):
/// a config that names no policy, or only `path: builtin:…`, still runs.
pub fn default_params(name: &str) -> super::Params {
    let mut params = super::Params::new();
    let mut set = |k: &str, v: serde_json::Value| {
        params.insert(k.to_string(), v);
    };
    set("reserve_bytes", "32MiB".into());
    set("min_context_tokens", 16.into());
    set("defer_ms", 25.into());
    set("defer_max_queue", 4.into());
    if name != "latency-first" {
        set("cpu_pool", "cpu".into());
    }
    if name == "availability-first" {
        set("pressure_bytes", "64MiB".into());
        set("max_gpu_queue", 2.into());
    }
    params
}
