//! The common path of a policy without the interpreter.
//!
//! Rhai evaluates `decide` by walking its syntax tree over `Dynamic` values: `req` is built as
//! an object map for every request, a pool's record is copied out of `state.pools` when the
//! script reads it, and every property, operator and call goes through the engine's generic
//! look-ups. For the default policy's admit that is ~85 000 instructions (~5 µs), almost none of
//! them the policy's own arithmetic (`docs/performance-log.md`).
//!
//! This module lowers the same syntax tree once, when the script is compiled, into nodes of its
//! own that read `req` and `state` straight from [`RequestInfo`], the [`Snapshot`] and the pools'
//! live load, with plain Rust values. It knows what policies are made of: `let`, assignment,
//! `if`, `return`, blocks, integer and float arithmetic and comparisons with Rhai's exact rules
//! (checked integers, its relative-epsilon float comparisons), strings and interpolation,
//! property and index chains, `in`, `??`, `&&`, `||`, calls of the script's own functions, the
//! decision constructors and a few methods (`get`, `len`, `is_empty`, `to_float`, `to_int`,
//! `floor`).
//!
//! It gives up on everything else, and on any error: a construct it does not know (it becomes
//! a node that gives up when reached), a value of a type it does not handle, a missing property,
//! an overflow, a decision constructor refusing its argument, more work than a policy's common
//! path takes. Giving up costs nothing but the time spent: the caller then evaluates the script
//! on Rhai, which gives the answer, errors and their positions included, that Rhai alone would
//! have. That is sound because a policy is a pure function of `req`, `state` and `params`: it
//! runs only functions, which see only their arguments, and nothing here has side effects
//! (`print` and `debug` are calls it does not know, so a script that prints is left to Rhai).
//! `policy::tests::evaluators` holds the two to the same answers.
//!
//! The nodes sit in flat tables (each subtree's nodes together, in the order they were
//! written) and property names are resolved to a [`Field`] when the script is compiled. In the
//! server at seq 1024 requests come milliseconds apart with ONNX Runtime's run between, so an
//! evaluation starts with none of this in the caches, and a walk that chases a pointer per node
//! and reads each property name's text from the heap pays a miss for each, one after another
//! (`docs/performance.md#cold-caches`).
//!
//! `lower.rs` turns the syntax tree into the nodes below; `eval.rs` evaluates them; `field.rs`
//! names the properties of `req` and `state`.

mod eval;
mod field;
mod lower;

use rhai::ImmutableString;

use crate::core::snapshot::Decision;

pub(super) use eval::Inputs;
use field::Field;
pub(super) use lower::{Params, params};

/// Most nodes one evaluation may evaluate before giving up. A policy's common path takes a
/// few hundred; Rhai's own operations limit ([`crate::policy::MAX_OPERATIONS`]) is far above anything
/// this allows, so a script that would hit it is always Rhai's to stop.
const MAX_NODES: u32 = 4_000;
/// Deepest chain of script-function calls before giving up (Rhai's limit,
/// [`crate::policy::MAX_CALL_DEPTH`], is higher: recursion is Rhai's to stop).
const MAX_DEPTH: u32 = 8;

/// A script, lowered: every function's statements and expressions in the tables below, which
/// refer to each other by index.
#[derive(Debug)]
pub(super) struct Compiled {
    functions: Vec<Function>,
    decide: usize,
    stmts: Vec<S>,
    nodes: Vec<N>,
    /// The members of every [`List`]: indexes into `stmts` (a block) or `nodes` (arguments,
    /// operands, parts).
    lists: Vec<u32>,
    /// The steps of every chain, each chain's together.
    steps: Vec<Step>,
    /// Constants other than numbers, booleans and strings: decisions and maps.
    lits: Vec<Lit>,
    /// The text of every string constant, one after another.
    text: String,
    /// The entries of map literals.
    maps: Vec<Box<[(ImmutableString, Id)]>>,
}

/// An index into [`Compiled::stmts`] or [`Compiled::nodes`].
type Id = u32;

/// A run of [`Compiled::lists`] (or of [`Compiled::steps`], for a chain).
#[derive(Debug, Clone, Copy)]
struct List {
    start: u32,
    len: u32,
}

impl List {
    fn range(self) -> std::ops::Range<usize> {
        self.start as usize..(self.start + self.len) as usize
    }
}

#[derive(Debug)]
struct Function {
    /// Its parameters take the first slots of its frame.
    params: usize,
    /// Slots its frame needs: parameters and every `let`.
    slots: usize,
    /// Its statements.
    body: List,
}

/// A statement.
#[derive(Debug)]
enum S {
    Let(u32, Id),
    Set(u32, Id),
    Expr(Id),
    If(Id, List, List),
    Return(Id),
    Block(List),
    GiveUp,
}

/// An expression.
#[derive(Debug)]
enum N {
    Unit,
    Bool(bool),
    Int(i64),
    Float(f64),
    /// A string constant: a run of [`Compiled::text`].
    Text(u32, u32),
    /// A constant of [`Compiled::lits`].
    Lit(u32),
    Local(u32),
    /// A root and its steps.
    Chain(Id, List),
    Call(u32, List),
    Native(Native, List),
    Binary(Op, Id, Id),
    Neg(Id),
    Not(Id),
    And(List),
    Or(List),
    Coalesce(List),
    Interpolated(List),
    Block(List),
    /// A map literal of [`Compiled::maps`].
    Map(u32),
    GiveUp,
}

#[derive(Debug)]
enum Step {
    /// `.name` where `name` is a property of `req` or `state`'s records (or of a map, a table).
    Field(Field),
    /// `.name` for any other name: only a map, a table or the params can have it.
    Name(ImmutableString),
    Index(Id),
    Method(Native, List),
}

#[derive(Debug, Clone)]
pub(super) enum Lit {
    Unit,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(ImmutableString),
    Decision(Decision),
    Map(std::sync::Arc<[(ImmutableString, Lit)]>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Native {
    Admit,
    Defer,
    Shrink,
    Redirect,
    MakeRoom,
    Reject,
    Contains,
    Get,
    Len,
    IsEmpty,
    ToFloat,
    ToInt,
    Floor,
}

impl Native {
    /// The native a call of `name` with `arity` arguments (the receiver of a method included)
    /// may be, when it is one of ours.
    fn of(name: &str, arity: usize) -> Option<Native> {
        Some(match (name, arity) {
            ("admit", 0 | 1) => Native::Admit,
            ("defer", 1) => Native::Defer,
            ("shrink_context", 1) => Native::Shrink,
            ("redirect", 1) => Native::Redirect,
            ("make_room", 1 | 2) => Native::MakeRoom,
            ("reject", 1) => Native::Reject,
            ("contains", 2) => Native::Contains,
            ("get", 2) => Native::Get,
            ("len", 1) => Native::Len,
            ("is_empty", 1) => Native::IsEmpty,
            ("to_float", 1) => Native::ToFloat,
            ("to_int", 1) => Native::ToInt,
            ("floor", 1) => Native::Floor,
            _ => return None,
        })
    }
}
