//! Where vramguard's threads run: `server.cpus` for its own (HTTP, policy, telemetry), each
//! local pool's `cpus` for its sessions. Checked against the CPUs it was started on, which is
//! also where a pool without `cpus` runs. And how soon those CPUs wake while it serves:
//! `server.cpu_wake_latency`.

use std::path::Path;

use crate::config::{Config, ConfigError, Provider};
use crate::core::cpus::CpuSet;
use crate::core::wakeup::{self, WakeLimit};

/// `server.cpu_wake_latency`: the kernel's CPU latency request, opened before anything is
/// loaded, so that a server that cannot hold it refuses to start, naming the key, instead of
/// serving without what it was asked for.
pub(super) fn wake_limit(config: &Config) -> Result<Option<WakeLimit>, ConfigError> {
    let Some(limit) = config.server.cpu_wake_latency else {
        return Ok(None);
    };
    let held = WakeLimit::open(Path::new(wakeup::DEVICE), limit, wakeup::HOLD).map_err(|why| ConfigError::Invalid {
        file: config.source.clone(),
        key: "server.cpu_wake_latency".into(),
        message: format!(
            "{why}: it takes root or write access to it; without the key, how deep idle CPUs sleep is the kernel's choice"
        ),
    })?;
    tracing::info!(
        limit_us = limit.as_micros() as u64,
        hold_s = wakeup::HOLD.as_secs_f64(),
        "idle CPUs kept within this wake-up latency while requests are in flight ({})",
        wakeup::DEVICE
    );
    Ok(Some(held))
}

/// Check every `cpus` against the CPUs the calling thread may run on, move the calling thread
/// (and so every thread it starts from now on) to `server.cpus`, and give each local pool
/// without `cpus` those it was started on: a pool's threads and worker process are placed
/// explicitly, never by inheriting the server's.
pub(super) fn place(config: &mut Config) -> Result<(), ConfigError> {
    let invalid = |key: String, message: String| ConfigError::Invalid {
        file: config.source.clone(),
        key,
        message,
    };
    let started = CpuSet::current().map_err(|why| invalid("server.cpus".into(), why))?;
    let outside = |set: &CpuSet| {
        set.outside(&started).map(|missing| {
            format!(
                "CPUs {missing} are not among those vramguard may run on ({started}); start it on them, or name others"
            )
        })
    };
    if let Some(set) = &config.server.cpus
        && let Some(why) = outside(set)
    {
        return Err(invalid("server.cpus".into(), why));
    }
    for (i, pool) in config.pools.iter().enumerate() {
        if let Some(set) = &pool.cpus
            && let Some(why) = outside(set)
        {
            return Err(invalid(format!("pools[{i}].cpus"), why));
        }
    }
    if let Some(set) = &config.server.cpus {
        set.apply_to_this_thread()
            .map_err(|why| invalid("server.cpus".into(), why))?;
        tracing::info!(cpus = %set, "vramguard's own threads placed");
    }
    for pool in config.pools.iter_mut() {
        if !matches!(pool.provider, Provider::Remote(_)) {
            pool.cpus.get_or_insert_with(|| started.clone());
        }
    }
    Ok(())
}
