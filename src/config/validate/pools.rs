//! `pools:`: where each model runs, with its queue, breaker and fallback; a `remote` pool
//! forwards to another Open Inference Protocol server instead.

use std::collections::HashSet;

use super::Checker;
use crate::config::error::ConfigError;
use crate::config::raw::{RawArenaExtendStrategy, RawIsolation, RawPool, RawProvider};
use crate::config::types::{
    CudaOptions, DEFAULT_IDLE_RELEASE, DeviceConfig, DeviceKind, HOST_DEVICE, HealthConfig, Isolation, Mode,
    ModelConfig, PoolConfig, Provider, RemoteOptions,
};
use crate::core::breaker::BreakerConfig;

/// `pools:`, each named once; `serve` needs at least one. Then what only the whole list can
/// tell: every fallback can take its pool's requests, and every model has a pool.
pub(super) fn pools(
    c: &Checker,
    raw: &[RawPool],
    devices: &[DeviceConfig],
    models: &[ModelConfig],
    mode: Mode,
) -> Result<Vec<PoolConfig>, ConfigError> {
    if raw.is_empty() && mode == Mode::Serve {
        return Err(c.err("pools", "at least one pool is needed"));
    }
    let mut names = HashSet::new();
    let mut pools = Vec::new();
    for (i, p) in raw.iter().enumerate() {
        let key = format!("pools[{i}]");
        c.unique_name(&mut names, &p.name, format!("{key}.name"))?;
        pools.push(pool(c, &key, p, devices, models)?);
    }
    fallbacks(c, &pools)?;
    every_model_served(c, models, &pools)?;
    one_process_per_simulated_device(c, &pools)?;
    Ok(pools)
}

fn pool(
    c: &Checker,
    key: &str,
    p: &RawPool,
    devices: &[DeviceConfig],
    models: &[ModelConfig],
) -> Result<PoolConfig, ConfigError> {
    let (provider, device) = placement(c, key, p, devices)?;
    if p.models.is_empty() {
        return Err(c.err(format!("{key}.models"), "a pool must serve at least one model"));
    }
    for (j, m) in p.models.iter().enumerate() {
        if !models.iter().any(|model| &model.name == m) {
            return Err(c.err(
                format!("{key}.models[{j}]"),
                format!("no model named `{m}` in `models`"),
            ));
        }
    }
    let workers = c.within(format!("{key}.workers"), p.workers, 1..=256)?;
    let intra_threads = c.within(format!("{key}.intra_threads"), p.intra_threads.unwrap_or(1), 1..=256)?;
    let queue_capacity = c.within(format!("{key}.queue.capacity"), p.queue.capacity, 1..=1_000_000)?;
    let max_wait = c.longer_than_zero(format!("{key}.queue.max_wait"), p.queue.max_wait)?;
    if p.max_context == Some(0) {
        return Err(c.err(
            format!("{key}.max_context"),
            "expected at least 1 token; leave it out for no limit",
        ));
    }
    let breaker = p.breaker.clone().unwrap_or_default();
    if breaker.failures == 0 {
        return Err(c.err(
            format!("{key}.breaker.failures"),
            "expected at least 1 failure to open the breaker",
        ));
    }
    let window = c.longer_than_zero(format!("{key}.breaker.window"), breaker.window)?;
    if p.health.is_some() && p.provider == RawProvider::Remote {
        return Err(c.err(
            format!("{key}.health"),
            "a remote pool is checked by `remote.health_interval` and `remote.health_timeout`",
        ));
    }
    let health = p.health.clone().unwrap_or_default();
    let health = HealthConfig {
        interval: c.longer_than_zero(format!("{key}.health.interval"), health.interval)?,
        timeout: c.longer_than_zero(format!("{key}.health.timeout"), health.timeout)?,
    };
    let arena_shrinkage = p.memory.as_ref().and_then(|m| m.arena_shrinkage).unwrap_or(false);
    let idle_release = match p.memory.as_ref().and_then(|m| m.idle_release) {
        Some(d) if d.0.is_zero() => None,
        Some(d) => Some(d.0),
        // A remote pool's memory is another server's to return.
        None => (!matches!(provider, Provider::Remote(_))).then_some(DEFAULT_IDLE_RELEASE),
    };
    let isolation = isolation(c, key, p, &provider)?;
    Ok(PoolConfig {
        name: p.name.clone(),
        provider,
        device,
        models: p.models.clone(),
        workers,
        intra_threads,
        queue_capacity,
        max_wait,
        arena_shrinkage,
        idle_release,
        max_context: p.max_context,
        breaker: BreakerConfig {
            failures: breaker.failures,
            window,
            cooldown: breaker.cooldown.get(),
        },
        health,
        fallback: p.fallback.clone(),
        isolation,
        cpus: c.cpus(format!("{key}.cpus"), p.cpus.as_ref())?,
    })
}

/// `isolation`, by default `process` for accelerator pools and `thread` for `cpu` ones.
fn isolation(c: &Checker, key: &str, p: &RawPool, provider: &Provider) -> Result<Isolation, ConfigError> {
    match (p.isolation, provider) {
        (Some(_), Provider::Remote(_)) => Err(c.err(
            format!("{key}.isolation"),
            "a remote pool runs no sessions here: its server is its own process",
        )),
        (_, Provider::Remote(_)) | (None, Provider::Cpu) | (Some(RawIsolation::Thread), _) => Ok(Isolation::Thread),
        (None, _) | (Some(RawIsolation::Process), _) => Ok(Isolation::Process),
    }
}

/// A simulated device's capacity is one ONNX Runtime arena, which lives in one process: a
/// process-isolated pool on it must be the only pool there.
fn one_process_per_simulated_device(c: &Checker, pools: &[PoolConfig]) -> Result<(), ConfigError> {
    for (i, pool) in pools.iter().enumerate() {
        if pool.provider != Provider::Simulated || pool.isolation != Isolation::Process {
            continue;
        }
        if let Some(other) = pools
            .iter()
            .find(|o| o.name != pool.name && o.provider == Provider::Simulated && o.device == pool.device)
        {
            return Err(c.err(
                format!("pools[{i}].isolation"),
                format!(
                    "simulated device `{}` is also used by pool `{}`: its capacity is one arena, which one worker process holds; give both pools `isolation: thread`",
                    pool.device, other.name
                ),
            ));
        }
    }
    Ok(())
}

/// The provider with its options, and the device it runs on: each provider takes only its own
/// options and a device of its own kind.
fn placement(c: &Checker, key: &str, p: &RawPool, devices: &[DeviceConfig]) -> Result<(Provider, String), ConfigError> {
    if p.cuda.is_some() && p.provider != RawProvider::Cuda {
        return Err(c.err(format!("{key}.cuda"), "only `cuda` pools take CUDA options"));
    }
    if p.provider != RawProvider::Remote {
        if p.url.is_some() {
            return Err(c.err(format!("{key}.url"), "only `remote` pools take a url"));
        }
        if p.remote.is_some() {
            return Err(c.err(format!("{key}.remote"), "only `remote` pools take remote options"));
        }
    }
    let device = |provider: &str, want: &str| -> Result<(String, DeviceKind), ConfigError> {
        let name = p.device.as_deref().ok_or_else(|| {
            c.err(
                format!("{key}.device"),
                format!("a `{provider}` pool needs a {want} device"),
            )
        })?;
        let device = devices.iter().find(|d| d.name == name).ok_or_else(|| {
            c.err(
                format!("{key}.device"),
                format!("no device named `{name}` in `devices`"),
            )
        })?;
        Ok((name.to_string(), device.kind))
    };
    match p.provider {
        RawProvider::Cpu => {
            if let Some(d) = p.device.as_deref().filter(|d| *d != HOST_DEVICE) {
                return Err(c.err(
                    format!("{key}.device"),
                    format!("a `cpu` pool runs on `host`, not `{d}`"),
                ));
            }
            Ok((Provider::Cpu, HOST_DEVICE.to_string()))
        }
        RawProvider::Cuda => {
            let (name, kind) = device("cuda", "nvidia")?;
            if !matches!(kind, DeviceKind::Nvidia { .. }) {
                return Err(c.err(format!("{key}.device"), format!("`{name}` is not an `nvidia` device")));
            }
            let raw = p.cuda.clone().unwrap_or_default();
            let options = CudaOptions {
                gpu_mem_limit: raw.gpu_mem_limit.map(|l| l.bytes()),
                same_as_requested: raw.arena_extend_strategy == Some(RawArenaExtendStrategy::SameAsRequested),
            };
            Ok((Provider::Cuda(options), name))
        }
        RawProvider::Simulated => {
            let (name, kind) = device("simulated", "simulated")?;
            if !matches!(kind, DeviceKind::Simulated { .. }) {
                return Err(c.err(format!("{key}.device"), format!("`{name}` is not a `simulated` device")));
            }
            Ok((Provider::Simulated, name))
        }
        RawProvider::Remote => remote(c, key, p),
    }
}

/// A `remote` pool: a plain-HTTP base URL, no device, no ONNX Runtime settings (the remote
/// server has its own), timeouts that bound something.
fn remote(c: &Checker, key: &str, p: &RawPool) -> Result<(Provider, String), ConfigError> {
    let onnxruntime_only = [
        ("device", p.device.is_some()),
        ("intra_threads", p.intra_threads.is_some()),
        ("memory", p.memory.is_some()),
        ("cpus", p.cpus.is_some()),
    ];
    if let Some((field, _)) = onnxruntime_only.iter().find(|(_, given)| *given) {
        return Err(c.err(
            format!("{key}.{field}"),
            "a `remote` pool runs on the remote server, which has its own devices and ONNX Runtime settings; remove it",
        ));
    }
    let raw = p.url.as_deref().ok_or_else(|| {
        c.err(
            format!("{key}.url"),
            "a `remote` pool needs the url of the server it forwards to (http://host:port)",
        )
    })?;
    let bad = |why: &str| c.err(format!("{key}.url"), format!("`{raw}` {why}"));
    let uri: axum::http::Uri = raw
        .parse()
        .map_err(|_| bad("is not a URL; expected http://host:port"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(bad(
                "uses https, which remote pools do not speak; put them on a private network or a TLS-terminating sidecar and use http",
            ));
        }
        _ => return Err(bad("is not an http:// URL")),
    }
    let authority = uri.authority().ok_or_else(|| bad("has no host"))?;
    if authority.as_str().contains('@') {
        return Err(bad("carries credentials, which would end up in logs and metrics"));
    }
    if uri.query().is_some() {
        return Err(bad(
            "has a query; the base URL is the server's, requests go to <url>/v2/...",
        ));
    }
    let options = p.remote.clone().unwrap_or_default();
    let bounded = |field: &str, d| c.longer_than_zero(format!("{key}.remote.{field}"), d);
    let options = RemoteOptions {
        url: format!("http://{authority}{}", uri.path().trim_end_matches('/')),
        timeout: bounded("timeout", options.timeout)?,
        connect_timeout: bounded("connect_timeout", options.connect_timeout)?,
        health_interval: bounded("health_interval", options.health_interval)?,
        health_timeout: bounded("health_timeout", options.health_timeout)?,
    };
    Ok((Provider::Remote(options), authority.to_string()))
}

/// A fallback must be another pool that serves everything this one does, so a retry never
/// lands where the model is missing.
fn fallbacks(c: &Checker, pools: &[PoolConfig]) -> Result<(), ConfigError> {
    for (i, p) in pools.iter().enumerate() {
        let Some(name) = &p.fallback else { continue };
        let key = format!("pools[{i}].fallback");
        let target = pools
            .iter()
            .find(|q| &q.name == name)
            .ok_or_else(|| c.err(key.clone(), format!("no pool named `{name}` in `pools`")))?;
        if target.name == p.name {
            return Err(c.err(key, "a pool cannot be its own fallback"));
        }
        if let Some(m) = p.models.iter().find(|m| !target.models.contains(m)) {
            return Err(c.err(
                key,
                format!("pool `{name}` does not serve model `{m}`, which `{}` serves", p.name),
            ));
        }
    }
    Ok(())
}

/// A model no pool serves is a mistake (a typo in a pool's `models`), not a way to disable it.
fn every_model_served(c: &Checker, models: &[ModelConfig], pools: &[PoolConfig]) -> Result<(), ConfigError> {
    match models
        .iter()
        .position(|m| !pools.iter().any(|p| p.models.contains(&m.name)))
    {
        Some(i) => Err(c.err(
            format!("models[{i}]"),
            format!("model `{}` is served by no pool", models[i].name),
        )),
        None => Ok(()),
    }
}
