//! `exporter:`: the memory sampler, `vramguard exporter`'s listener, and the rules that give
//! processes a `service` label.

use std::time::Duration;

use super::Checker;
use crate::config::error::ConfigError;
use crate::config::raw::{RawExporter, RawServiceRule};
use crate::config::types::{ExporterConfig, ServiceMatch, ServiceRule};

/// `exporter:`.
pub(super) fn exporter(c: &Checker, e: &RawExporter) -> Result<ExporterConfig, ConfigError> {
    let listen = c.address("exporter.listen", &e.listen, "127.0.0.1:9842")?;
    let interval = e.sample_interval.get();
    if interval < Duration::from_millis(100) || interval > Duration::from_secs(3600) {
        return Err(c.err("exporter.sample_interval", "expected 100ms to 1h"));
    }
    let services = e
        .services
        .iter()
        .enumerate()
        .map(|(i, rule)| service_rule(c, &format!("exporter.services[{i}]"), rule))
        .collect::<Result<_, _>>()?;
    Ok(ExporterConfig {
        listen,
        sample_interval: interval,
        services,
    })
}

/// One rule: a service name and exactly one matcher, its regular expression compiled.
fn service_rule(c: &Checker, key: &str, rule: &RawServiceRule) -> Result<ServiceRule, ConfigError> {
    if rule.service.trim().is_empty() {
        return Err(c.err(format!("{key}.service"), "expected a service name"));
    }
    let regex = |field: &str, pattern: &str| {
        regex::Regex::new(pattern)
            .map_err(|e| c.err(format!("{key}.{field}"), format!("invalid regular expression: {e}")))
    };
    let matcher = match (&rule.process_name, &rule.cmdline, &rule.cgroup) {
        (Some(name), None, None) => ServiceMatch::ProcessName(name.clone()),
        (None, Some(pattern), None) => ServiceMatch::Cmdline(regex("cmdline", pattern)?),
        (None, None, Some(pattern)) => ServiceMatch::Cgroup(regex("cgroup", pattern)?),
        _ => {
            return Err(c.err(key, "give exactly one of `process_name`, `cmdline` or `cgroup`"));
        }
    };
    Ok(ServiceRule {
        service: rule.service.clone(),
        matcher,
    })
}
