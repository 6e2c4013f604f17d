//! The policies shipped inside the binary (`policy.path: builtin:<name>`), with their test
//! cases, so the embedded default config needs no file on disk.

use std::path::{Path, PathBuf};

/// Names accepted after `builtin:`.
pub const NAMES: [&str; 3] = ["default", "latency-first", "availability-first"];

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

/// Write the builtin policy `name` and its test cases under `dir` (`<dir>/<name>.rhai`,
/// `<dir>/tests/<name>.yaml`) so it loads, and is tested, exactly like a policy file. Returns
/// the script's path.
pub fn materialize(name: &str, dir: &Path) -> std::io::Result<PathBuf> {
    let (_, script, cases) = FILES
        .iter()
        .find(|(n, _, _)| *n == name)
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("no builtin policy `{name}`")))?;
    std::fs::create_dir_all(dir.join("tests"))?;
    let path = dir.join(format!("{name}.rhai"));
    std::fs::write(&path, script)?;
    std::fs::write(dir.join("tests").join(format!("{name}.yaml")), cases)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_policy_loads_and_passes_its_own_cases() {
        let dir = std::env::temp_dir().join(format!("vramguard-builtin-test-{}", std::process::id()));
        for name in NAMES {
            let path = materialize(name, &dir).unwrap();
            let handle = super::super::PolicyHandle::load(&path, super::super::PolicySettings::default())
                .unwrap_or_else(|e| panic!("builtin:{name}: {e}"));
            assert!(handle.current().cases >= 8, "builtin:{name} has too few cases");
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}
