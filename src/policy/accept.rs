//! What the decision constructors (`admit(pool)`, `defer(ms)`, `shrink_context(tokens)`,
//! `make_room(pool, bytes)`, `redirect(pool)`, `reject(reason)`) accept. Rhai's constructors
//! (`script.rs`) and the compiled evaluation (`compiled/eval.rs`) both ask these, so the two
//! refuse exactly the same values.

/// Milliseconds, tokens or bytes given as an integer: ≥ 0.
pub(super) fn count_of_int(value: i64) -> Option<u64> {
    u64::try_from(value).ok()
}

/// The same given as a float (so that `defer(base * 1.5)` works): finite and ≥ 0, truncated
/// toward zero.
pub(super) fn count_of_float(value: f64) -> Option<u64> {
    (value.is_finite() && value >= 0.0 && value < u64::MAX as f64).then_some(value as u64)
}

/// A pool name or a rejection's reason: not blank.
pub(super) fn not_blank(text: &str) -> bool {
    !text.trim().is_empty()
}
