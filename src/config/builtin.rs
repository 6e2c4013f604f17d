//! The closed sets a config names as `builtin:<name>`: the policies and chat templates shipped
//! in the binary. The names live here, below the layers that hold the text
//! ([`crate::policy::builtin`], [`crate::runtime::chat`]), so that validation can refuse an
//! unknown name before anything loads, and a name that passed can never be unknown later.

use std::fmt;

/// A policy shipped in the binary (`policy.path: builtin:<name>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BuiltinPolicy {
    /// `builtin:default`: vramguard's default admission policy.
    Default,
    /// `builtin:latency-first`: keep every request on the accelerator or refuse it quickly.
    LatencyFirst,
    /// `builtin:availability-first`: answer every request somewhere, moving to the CPU pool early.
    AvailabilityFirst,
}

impl BuiltinPolicy {
    /// Every builtin policy, in the order messages list them.
    pub const ALL: [BuiltinPolicy; 3] = [
        BuiltinPolicy::Default,
        BuiltinPolicy::LatencyFirst,
        BuiltinPolicy::AvailabilityFirst,
    ];

    /// Name after `builtin:` in a config (and the file stem under `policies/`).
    pub fn name(self) -> &'static str {
        match self {
            BuiltinPolicy::Default => "default",
            BuiltinPolicy::LatencyFirst => "latency-first",
            BuiltinPolicy::AvailabilityFirst => "availability-first",
        }
    }

    /// Look up by name.
    pub fn from_name(name: &str) -> Option<BuiltinPolicy> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// The bare name, so `builtin:{policy}` reads as the config wrote it.
impl fmt::Display for BuiltinPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A chat template shipped in the binary (`models[].chat_template: builtin:<name>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BuiltinChatTemplate {
    /// `builtin:chatml`: ChatML, with tools in the Hermes convention.
    Chatml,
}

impl BuiltinChatTemplate {
    /// Every builtin chat template.
    pub const ALL: [BuiltinChatTemplate; 1] = [BuiltinChatTemplate::Chatml];

    /// Name after `builtin:` in a config.
    pub fn name(self) -> &'static str {
        match self {
            BuiltinChatTemplate::Chatml => "chatml",
        }
    }

    /// Look up by name.
    pub fn from_name(name: &str) -> Option<BuiltinChatTemplate> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }
}

/// The bare name, so `builtin:{template}` reads as the config wrote it.
impl fmt::Display for BuiltinChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
