//! `services:`: who the memory belongs to, each named once, with its budgets; and the implicit
//! service of every model that names none (its own name, no budget).

use std::collections::HashSet;

use super::Checker;
use crate::config::error::ConfigError;
use crate::config::raw::RawService;
use crate::config::types::{ModelConfig, ServiceConfig};

/// The `services[]` entries as written.
pub(super) fn declared(c: &Checker, raw: &[RawService]) -> Result<Vec<ServiceConfig>, ConfigError> {
    let mut names = HashSet::new();
    let mut services = Vec::new();
    for (i, s) in raw.iter().enumerate() {
        let key = format!("services[{i}]");
        c.unique_name(&mut names, &s.name, format!("{key}.name"))?;
        if s.concurrency == Some(0) {
            return Err(c.err(
                format!("{key}.concurrency"),
                "must be at least 1 (leave it out for no limit)",
            ));
        }
        if let Some(size) = s.device_memory
            && size.bytes() == 0
        {
            return Err(c.err(
                format!("{key}.device_memory"),
                "must be more than 0 bytes (leave it out for no budget)",
            ));
        }
        services.push(ServiceConfig {
            name: s.name.clone(),
            device_memory: s.device_memory.map(|b| b.bytes()),
            concurrency: s.concurrency,
            priority: s.priority.unwrap_or(0),
            class: s.class.unwrap_or_default(),
            configured: true,
        });
    }
    Ok(services)
}

/// `declared`, then the implicit service of each model whose service is not declared.
pub(super) fn with_implicit(mut services: Vec<ServiceConfig>, models: &[ModelConfig]) -> Vec<ServiceConfig> {
    for model in models {
        if !services.iter().any(|s| s.name == model.service) {
            services.push(ServiceConfig {
                name: model.service.clone(),
                ..ServiceConfig::implicit_default()
            });
        }
    }
    services
}
