//! `server:`: the HTTP listener, its limits and the admin API.

use std::path::PathBuf;
use std::time::Duration;

use super::Checker;
use crate::config::error::ConfigError;
use crate::config::raw::{RawIdempotency, RawServer, RawTimeouts};
use crate::config::types::{AdminSocket, IdempotencyConfig, ServerConfig, Timeouts, default_admin_socket};
use crate::config::units::{ByteSize, HumanDuration};

const DAY: Duration = Duration::from_secs(24 * 3600);

/// `server:`, its limits each within what a server can honour.
pub(super) fn server(c: &Checker, s: &RawServer) -> Result<ServerConfig, ConfigError> {
    let listen = c.address("server.listen", &s.listen, "127.0.0.1:8080")?;
    let body_limit = c.at_least("server.body_limit", s.body_limit, ByteSize(1024))?;
    let max_response_bytes = c.at_least("server.max_response_bytes", s.max_response_bytes, ByteSize(1024))?;
    let admin_socket = admin_socket(c, s.admin_socket.as_deref())?;
    if let Some(var) = &s.admin_token_env
        && var.trim().is_empty()
    {
        return Err(c.err("server.admin_token_env", "expected an environment variable name"));
    }
    let idempotency = idempotency(c, &s.idempotency)?;
    let timeouts = timeouts(c, &s.timeouts)?;
    let max_connections = c.within("server.max_connections", s.max_connections, 1..=1_000_000)?;
    Ok(ServerConfig {
        listen,
        body_limit: usize::try_from(body_limit).unwrap_or(usize::MAX),
        max_response_bytes: usize::try_from(max_response_bytes).unwrap_or(usize::MAX),
        admin_token_env: s.admin_token_env.clone(),
        admin_socket,
        shutdown_grace: s.shutdown_grace.get(),
        idempotency,
        timeouts,
        max_connections,
        max_receiving_bytes: max_receiving_bytes(c, s)?,
        cpus: c.cpus("server.cpus", s.cpus.as_ref())?,
        // The deepest idle states of server CPUs take a few hundred µs to leave: past 100 ms a
        // limit keeps no CPU out of any.
        cpu_wake_latency: s
            .cpu_wake_latency
            .map(|d| {
                c.within(
                    "server.cpu_wake_latency",
                    d,
                    HumanDuration(Duration::ZERO)..=HumanDuration(Duration::from_millis(100)),
                )
            })
            .transpose()?
            .map(HumanDuration::get),
    })
}

fn admin_socket(c: &Checker, configured: Option<&str>) -> Result<AdminSocket, ConfigError> {
    Ok(match configured.map(str::trim) {
        None => AdminSocket::Default(default_admin_socket()),
        Some("off") => AdminSocket::Off,
        Some("") => return Err(c.err("server.admin_socket", "expected a path, or `off`")),
        Some(path) => AdminSocket::At(PathBuf::from(path)),
    })
}

fn idempotency(c: &Checker, i: &RawIdempotency) -> Result<IdempotencyConfig, ConfigError> {
    let max_entries = c.within("server.idempotency.max_entries", i.max_entries, 1..=1_000_000)?;
    // Clients retry within minutes; a day covers any sane retry schedule, and past it a key
    // that still replays is more likely a client reusing keys by mistake.
    let ttl = c.within(
        "server.idempotency.ttl",
        i.ttl,
        HumanDuration(Duration::from_secs(1))..=HumanDuration(DAY),
    )?;
    Ok(IdempotencyConfig {
        max_entries,
        ttl: ttl.get(),
    })
}

fn timeouts(c: &Checker, t: &RawTimeouts) -> Result<Timeouts, ConfigError> {
    // Zero would close every connection at once; past a day a timeout no longer bounds
    // anything an operator would wait for.
    let check = |key: &str, d: HumanDuration| {
        c.within(
            format!("server.timeouts.{key}"),
            d,
            HumanDuration(Duration::from_millis(1))..=HumanDuration(DAY),
        )
        .map(HumanDuration::get)
    };
    Ok(Timeouts {
        header_read: check("header_read", t.header_read)?,
        body_read: check("body_read", t.body_read)?,
        idle: check("idle", t.idle)?,
    })
}

fn max_receiving_bytes(c: &Checker, s: &RawServer) -> Result<u64, ConfigError> {
    let receiving = s.max_receiving_bytes;
    if receiving < s.body_limit {
        return Err(c.err(
            "server.max_receiving_bytes",
            format!(
                "must be at least server.body_limit ({}), or a body of the largest allowed size could never be received; got {receiving}",
                s.body_limit
            ),
        ));
    }
    if receiving.bytes() > 1 << 40 {
        return Err(c.err(
            "server.max_receiving_bytes",
            format!("expected at most 1TiB, got {receiving}"),
        ));
    }
    Ok(receiving.bytes())
}
