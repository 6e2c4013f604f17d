//! `models:`: what is served, where its bytes come from, and what serves text generation.

use std::collections::HashSet;

use super::{Checker, Spec};
use crate::config::builtin::BuiltinChatTemplate;
use crate::config::error::ConfigError;
use crate::config::raw::{RawModel, RawProfile, RawResidency};
use crate::config::types::{
    Batching, ChatTemplateSource, ConfiguredProfile, ContextAxis, DEFAULT_MIN_RESIDENCY, Mode, ModelConfig, Residency,
    ServiceConfig, TokenizerSource,
};
use crate::core::model::{BuiltinModel, ModelSource};

/// `models:`, each named once; `serve` needs at least one.
pub(super) fn models(
    c: &Checker,
    raw: &[RawModel],
    services: &[ServiceConfig],
    mode: Mode,
) -> Result<Vec<ModelConfig>, ConfigError> {
    if raw.is_empty() && mode == Mode::Serve {
        return Err(c.err("models", "at least one model is needed"));
    }
    let mut names = HashSet::new();
    let mut models = Vec::new();
    for (i, m) in raw.iter().enumerate() {
        let key = format!("models[{i}]");
        c.unique_name(&mut names, &m.name, format!("{key}.name"))?;
        models.push(model(c, &key, m, services)?);
    }
    for (i, m) in models.iter().enumerate() {
        let named = [
            (
                "fallback_model",
                &m.fallback_model,
                "a model cannot be its own fallback",
            ),
            ("images", &m.images, "a model cannot be its own vision tower"),
        ];
        for (field, other, itself) in named {
            let Some(other) = other else {
                continue;
            };
            let key = format!("models[{i}].{field}");
            if other == &m.name {
                return Err(c.err(key, itself));
            }
            if !models.iter().any(|o| &o.name == other) {
                return Err(c.err(
                    key,
                    format!(
                        "no model `{other}`; models are: {}",
                        models.iter().map(|m| m.name.as_str()).collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
        }
    }
    Ok(models)
}

fn model(c: &Checker, key: &str, m: &RawModel, services: &[ServiceConfig]) -> Result<ModelConfig, ConfigError> {
    let source = match c.builtin_or_file(&format!("{key}.path"), &m.path, "model", |name| {
        BuiltinModel::from_name(name).ok_or_else(|| {
            format!(
                "no builtin model `{name}`; builtin models are: {}",
                BuiltinModel::ALL.map(|b| b.name()).join(", ")
            )
        })
    })? {
        Spec::Builtin(model) => ModelSource::Builtin(model),
        Spec::File(path) => ModelSource::File(path),
    };
    let context = m.context.as_ref().map(|ctx| ContextAxis {
        input: ctx.input.clone(),
        axis: ctx.axis,
        keep: ctx.keep,
    });
    let profile = m.memory_profile.as_ref().map(|p| profile(c, key, p)).transpose()?;
    let tokenizer = m.tokenizer.as_deref().map(|spec| tokenizer(c, key, spec)).transpose()?;
    let chat_template = m
        .chat_template
        .as_deref()
        .map(|spec| chat_template(c, key, spec, tokenizer.as_ref()))
        .transpose()?;
    let residency = match m.residency {
        None | Some(RawResidency::Resident) => Residency::Resident,
        Some(RawResidency::Pinned) => Residency::Pinned,
        Some(RawResidency::OnDemand) => Residency::OnDemand,
    };
    let idle_unload = m
        .idle_unload
        .map(|d| {
            let key = format!("{key}.idle_unload");
            if residency == Residency::Pinned {
                return Err(c.err(key, "a pinned model is never unloaded: drop idle_unload or the pin"));
            }
            c.longer_than_zero(key, d)
        })
        .transpose()?;
    let host_tier_warm = match m.host_tier {
        Some(crate::config::raw::RawHostTier::Warm) if residency != Residency::OnDemand => {
            return Err(c.err(
                format!("{key}.host_tier"),
                format!(
                    "`warm` pre-warms an on_demand model; a {} model's sessions are built at start",
                    residency.label()
                ),
            ));
        }
        Some(crate::config::raw::RawHostTier::Warm) => true,
        None => false,
    };
    let service_priority = match &m.service {
        Some(name) => match services.iter().find(|s| &s.name == name) {
            Some(service) => service.priority,
            None => {
                return Err(c.err(
                    format!("{key}.service"),
                    match services.is_empty() {
                        true => format!("no service `{name}`: declare it under `services:`"),
                        false => format!(
                            "no service `{name}`; services are: {}",
                            services.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", ")
                        ),
                    },
                ));
            }
        },
        None => services.iter().find(|s| s.name == m.name).map_or(0, |s| s.priority),
    };
    let min_residency = m.min_residency.map_or(DEFAULT_MIN_RESIDENCY, |d| d.0);
    let batching = m
        .batching
        .map(|b| {
            if b.max_batch == 0 {
                return Err(c.err(format!("{key}.batching.max_batch"), "must be at least 1"));
            }
            Ok(Batching {
                max_batch: b.max_batch,
                max_delay: c.longer_than_zero(format!("{key}.batching.max_delay"), b.max_delay)?,
            })
        })
        .transpose()?;
    Ok(ModelConfig {
        service: m.service.clone().unwrap_or_else(|| m.name.clone()),
        priority: m.priority.unwrap_or(service_priority),
        fallback_model: m.fallback_model.clone(),
        allow_substitute: m.allow_substitute,
        auto_truncate: m.auto_truncate,
        images: m.images.clone(),
        min_residency,
        batching,
        name: m.name.clone(),
        source,
        context,
        allow_shrink: m.allow_shrink,
        profile,
        tokenizer,
        chat_template,
        residency,
        idle_unload,
        host_tier_warm,
    })
}

fn profile(c: &Checker, key: &str, p: &RawProfile) -> Result<ConfiguredProfile, ConfigError> {
    for (field, v) in [
        ("per_token_bytes", p.per_token_bytes),
        ("per_token_squared_bytes", p.per_token_squared_bytes),
    ] {
        if !v.is_finite() || v < 0.0 {
            return Err(c.err(
                format!("{key}.memory_profile.{field}"),
                format!("expected a non-negative number of bytes, got {v}"),
            ));
        }
    }
    Ok(ConfiguredProfile {
        weights_bytes: p.weights.map(|w| w.bytes()),
        workspace_bytes: p.workspace.bytes(),
        per_token_bytes: p.per_token_bytes,
        per_token_squared_bytes: p.per_token_squared_bytes,
    })
}

/// A `tokenizer.json`, or `builtin:<model>` for the tokenizer a builtin decoder ships with.
fn tokenizer(c: &Checker, key: &str, spec: &str) -> Result<TokenizerSource, ConfigError> {
    let source = c.builtin_or_file(&format!("{key}.tokenizer"), spec, "tokenizer", |name| {
        BuiltinModel::from_name(name)
            .filter(|m| m.tokenizer().is_some())
            .ok_or_else(|| {
                format!(
                    "no builtin tokenizer `{name}`; builtin tokenizers are: {}",
                    BuiltinModel::ALL
                        .into_iter()
                        .filter(|m| m.tokenizer().is_some())
                        .map(|m| m.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
    })?;
    Ok(match source {
        Spec::Builtin(model) => TokenizerSource::Builtin(model),
        Spec::File(path) => TokenizerSource::File(path),
    })
}

/// A chat template renders a conversation into a prompt for the tokenizer, so it needs one.
fn chat_template(
    c: &Checker,
    key: &str,
    spec: &str,
    tokenizer: Option<&TokenizerSource>,
) -> Result<ChatTemplateSource, ConfigError> {
    let key = format!("{key}.chat_template");
    if tokenizer.is_none() {
        return Err(c.err(key, "a chat template needs `tokenizer` too: chat is text generation"));
    }
    let source = c.builtin_or_file(&key, spec, "chat template", |name| {
        BuiltinChatTemplate::from_name(name).ok_or_else(|| {
            format!(
                "unknown builtin chat template `{name}`; builtin: {}",
                BuiltinChatTemplate::ALL.map(|t| t.name()).join(", ")
            )
        })
    })?;
    Ok(match source {
        Spec::Builtin(template) => ChatTemplateSource::Builtin(template),
        Spec::File(path) => ChatTemplateSource::File(path),
    })
}
