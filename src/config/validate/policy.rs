//! `policy:`: the admission script, its fallback decision and its params.

use super::{Checker, Spec};
use crate::config::builtin::BuiltinPolicy;
use crate::config::error::ConfigError;
use crate::config::raw::RawPolicy;
use crate::config::types::{PolicyConfig, PolicySource, PoolConfig};
use crate::core::snapshot::Decision;

/// `policy:`; a fallback that names a pool names one of `pools`.
pub(super) fn policy(c: &Checker, p: &RawPolicy, pools: &[PoolConfig]) -> Result<PolicyConfig, ConfigError> {
    let source = match c.builtin_or_file("policy.path", &p.path, "policy", |name| {
        BuiltinPolicy::from_name(name).ok_or_else(|| {
            format!(
                "no builtin policy `{name}`; builtin policies are: {}",
                BuiltinPolicy::ALL.map(BuiltinPolicy::name).join(", ")
            )
        })
    })? {
        Spec::Builtin(policy) => PolicySource::Builtin(policy),
        Spec::File(path) => PolicySource::File(path),
    };
    // The fallback is what runs when the script cannot decide, so it must be a decision that
    // can be carried out.
    match &p.fallback {
        Decision::Defer { ms } if *ms == 0 => {
            return Err(c.err("policy.fallback.ms", "a fallback deferral must wait longer than 0"));
        }
        Decision::ShrinkContext { tokens } if *tokens == 0 => {
            return Err(c.err(
                "policy.fallback.tokens",
                "a fallback shrink must keep at least one token",
            ));
        }
        Decision::Admit { pool: Some(pool) } | Decision::Redirect { pool }
            if !pools.iter().any(|x| &x.name == pool) =>
        {
            return Err(c.err("policy.fallback.pool", format!("no pool named `{pool}` in `pools`")));
        }
        _ => {}
    }
    for (key, value) in &p.params {
        if !(value.is_number() || value.is_boolean() || value.is_string()) {
            return Err(c.err(
                format!("policy.params.{key}"),
                "expected a number, a boolean or a string",
            ));
        }
    }
    let interval = p.watch_interval.get();
    Ok(PolicyConfig {
        source,
        fallback: p.fallback.clone(),
        watch_interval: (!interval.is_zero()).then_some(interval),
        params: p.params.clone(),
    })
}
