//! The sandbox's limits: what one evaluation of a policy script may take. The script's engine
//! (`script.rs`) is built with them, and the compiled evaluation (`compiled/`) keeps within
//! them too.

/// Most operations (roughly: expressions evaluated) one evaluation may take. A realistic policy
/// takes a few hundred; this stops a runaway loop in well under a millisecond.
pub const MAX_OPERATIONS: u64 = 50_000;
/// Deepest script-function call chain (recursion).
pub const MAX_CALL_DEPTH: usize = 32;
/// Deepest expression nesting at the top level and inside functions.
pub const MAX_EXPR_DEPTH: (usize, usize) = (64, 32);
/// Longest string a script may build, in bytes.
pub const MAX_STRING_SIZE: usize = 4096;
/// Most elements in an array a script builds.
pub const MAX_ARRAY_SIZE: usize = 1024;
/// Most properties in an object map a script builds. Rhai checks it when a map is combined,
/// passed to or returned from a function; growing one key at a time is bounded by
/// [`MAX_OPERATIONS`] instead.
pub const MAX_MAP_SIZE: usize = 256;
/// Most variables alive at once.
pub const MAX_VARIABLES: usize = 256;
/// Most functions in one script.
pub const MAX_FUNCTIONS: usize = 256;
