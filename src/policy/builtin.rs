//! The policies shipped inside the binary (`policy.path: builtin:<name>`), with their test
//! cases, so the embedded default config needs no file on disk. They are loaded and tested
//! from memory (see `source.rs`), never written out.

use crate::config::BuiltinPolicy;

/// A policy shipped in the binary: its script and its test cases, as the text of
/// `policies/<name>.rhai` and `policies/tests/<name>.yaml` at build time.
#[derive(Debug, Clone, Copy)]
pub struct Builtin {
    /// The Rhai script.
    pub script: &'static str,
    /// The YAML test cases.
    pub cases: &'static str,
}

/// The script and test cases of `policy`: every name the config accepts has both, since the
/// match must cover each [`BuiltinPolicy`].
pub fn get(policy: BuiltinPolicy) -> Builtin {
    match policy {
        BuiltinPolicy::Default => Builtin {
            script: include_str!("../../policies/default.rhai"),
            cases: include_str!("../../policies/tests/default.yaml"),
        },
        BuiltinPolicy::LatencyFirst => Builtin {
            script: include_str!("../../policies/latency-first.rhai"),
            cases: include_str!("../../policies/tests/latency-first.yaml"),
        },
        BuiltinPolicy::AvailabilityFirst => Builtin {
            script: include_str!("../../policies/availability-first.rhai"),
            cases: include_str!("../../policies/tests/availability-first.yaml"),
        },
    }
}

/// Params a builtin policy gets unless the config sets them (`policy.params` overrides each):
/// a config that names no policy, or only `path: builtin:…`, still runs.
pub fn default_params(policy: BuiltinPolicy) -> super::Params {
    let mut params = super::Params::new();
    let mut set = |k: &str, v: serde_json::Value| {
        params.insert(k.to_string(), v);
    };
    set("reserve_bytes", "32MiB".into());
    set("min_context_tokens", 16.into());
    set("defer_ms", 25.into());
    set("defer_max_queue", 4.into());
    if policy != BuiltinPolicy::LatencyFirst {
        set("cpu_pool", "cpu".into());
    }
    if policy == BuiltinPolicy::AvailabilityFirst {
        set("pressure_bytes", "64MiB".into());
        set("max_gpu_queue", 2.into());
    }
    params
}
