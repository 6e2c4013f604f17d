//! Exit statuses of the `vramguard` commands, in one leaf module so the command-line front end
//! (`cli`) and the commands it dispatches to (`policy::cli`) both use them without depending on
//! each other.

/// A configuration or policy the user must fix: unreadable, invalid, or a script that does not
/// compile or fails on representative input (EX_USAGE from sysexits.h).
pub const EXIT_CONFIG: u8 = 64;

/// The command ran but found failures: a failing test case, a decision that did not match, a
/// `doctor` check that failed.
pub const EXIT_FAILED: u8 = 1;
