//! The property names of `req` and `state`'s records, resolved once when a script is compiled,
//! so that an evaluation compares a small number instead of reading a name's text.

macro_rules! fields {
    ($($variant:ident = $name:literal,)*) => {
        /// A property that some record of `req` or `state` has (`docs/policy.md` lists them).
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(super) enum Field {
            $($variant,)*
        }

        impl Field {
            /// The field named `name`, when a record has one.
            pub(super) fn of(name: &str) -> Option<Field> {
                Some(match name {
                    $($name => Field::$variant,)*
                    _ => return None,
                })
            }

            pub(super) fn name(self) -> &'static str {
                match self {
                    $(Field::$variant => $name,)*
                }
            }
        }
    };
}

fields! {
    // req
    Id = "id",
    Model = "model",
    Pool = "pool",
    Service = "service",
    ContextTokens = "context_tokens",
    MaxNewTokens = "max_new_tokens",
    Batch = "batch",
    Priority = "priority",
    Replayable = "replayable",
    AllowShrink = "allow_shrink",
    DeadlineMs = "deadline_ms",
    Estimate = "estimate",
    Dims = "dims",
    LoadBytes = "load_bytes",
    EvictableBytes = "evictable_bytes",
    // req.estimate
    WeightsBytes = "weights_bytes",
    ContextBytes = "context_bytes",
    WorkspaceBytes = "workspace_bytes",
    TotalBytes = "total_bytes",
    Source = "source",
    // state
    Devices = "devices",
    Pools = "pools",
    Services = "services",
    Models = "models",
    Host = "host",
    Degraded = "degraded",
    Params = "params",
    Processes = "processes",
    // state.devices[..]
    Kind = "kind",
    UsedBytes = "used_bytes",
    FreeBytes = "free_bytes",
    ReservedBytes = "reserved_bytes",
    ActiveBytes = "active_bytes",
    HeadroomBytes = "headroom_bytes",
    // state.host
    MemAvailableBytes = "mem_available_bytes",
    MemTotalBytes = "mem_total_bytes",
    ReserveBytes = "reserve_bytes",
    // state.services[..]
    Class = "class",
    Running = "running",
    Concurrency = "concurrency",
    BudgetBytes = "budget_bytes",
    MemoryBytes = "memory_bytes",
    // state.models[..] and their pools
    Residency = "residency",
    Resident = "resident",
    Busy = "busy",
    IdleMs = "idle_ms",
    LoadedMsAgo = "loaded_ms_ago",
    HostTier = "host_tier",
    ReloadMs = "reload_ms",
    // state.pools[..]
    Provider = "provider",
    Device = "device",
    Breaker = "breaker",
    QueueDepth = "queue_depth",
    QueueOldestAgeMs = "queue_oldest_age_ms",
    Inflight = "inflight",
    AllocFailuresRecent = "alloc_failures_recent",
    EstDelayMs = "est_delay_ms",
    MaxContext = "max_context",
    SequencesWaiting = "sequences_waiting",
    SequencesRunning = "sequences_running",
    KvCacheBytes = "kv_cache_bytes",
}

#[cfg(test)]
mod tests {
    use super::Field;

    #[test]
    fn every_field_reads_back_from_its_name() {
        for name in ["id", "context_tokens", "headroom_bytes", "kv_cache_bytes", "processes"] {
            assert_eq!(Field::of(name).map(Field::name), Some(name));
        }
        assert_eq!(Field::of("no_such_field"), None);
    }
}
