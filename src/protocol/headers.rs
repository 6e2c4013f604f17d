//! Header names of vramguard's HTTP API, in one place: the server reads and writes them, remote
//! pools forward them, the drill and doctor read them back. The contract's names, exactly.

/// Request id header, kept end to end.
pub const REQUEST_ID: &str = "x-request-id";
/// Header naming the pool that served the request.
pub const POOL_HEADER: &str = "x-vramguard-pool";
/// Header naming the admission decision.
pub const DECISION_HEADER: &str = "x-vramguard-decision";
/// Client deadline in milliseconds from arrival.
pub const DEADLINE_HEADER: &str = "x-vramguard-deadline-ms";
/// Client priority (integer, higher is more important).
pub const PRIORITY_HEADER: &str = "x-vramguard-priority";
/// `false` when the request must never be retried automatically once started.
pub const REPLAYABLE_HEADER: &str = "x-vramguard-replayable";
/// A client's key for executing a request at most once.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Set on a response that is the stored answer of an earlier request with the same key.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// Why the service is degraded, on every response while it is.
pub const DEGRADED_HEADER: &str = "x-vramguard-degraded";
/// `true` when the client allows its context to be cut (overrides `parameters.allow_shrink`).
pub const ALLOW_SHRINK_HEADER: &str = "x-vramguard-allow-shrink";
/// While degraded: the serving pool's limits, `max_context=N; concurrency=N; queue_capacity=N`.
pub const POOL_LIMITS_HEADER: &str = "x-vramguard-pool-limits";
/// While degraded: the serving pool's current delay estimate for a new request, milliseconds.
pub const ESTIMATED_DELAY_HEADER: &str = "x-vramguard-estimated-delay-ms";
/// What a shrink of a generation's prompt left out (`x-vramguard-context` has the counts).
pub const CONTEXT_CUT_HEADER: &str = "x-vramguard-context-cut";
/// `FROM->TO` tokens when the context was shrunk.
pub const CONTEXT_HEADER: &str = "x-vramguard-context";
/// `true` when the client allows the model's `fallback_model` to answer instead (overrides
/// `parameters.allow_substitute`).
pub const ALLOW_SUBSTITUTE_HEADER: &str = "x-vramguard-allow-substitute";
/// The model that answered: the one asked for, or its `fallback_model` when it stood in.
pub const MODEL_HEADER: &str = "x-vramguard-model";
/// Binary extension header: length of the JSON part.
pub const HEADER_LENGTH: &str = "inference-header-content-length";
