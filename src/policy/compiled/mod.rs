//! The common path of a policy without the interpreter.
//!
//! Rhai evaluates `decide` by walking its syntax tree over `Dynamic` values: `req` is built as
//! an object map for every request, a pool's record is copied out of `state.pools` when the
//! script reads it, and every property, operator and call goes through the engine's generic
//! look-ups. For the default policy's admit that is ~85 000 instructions (~5 µs), almost none of
//! them the policy's own arithmetic (`docs/performance.md`).
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
//! `lower.rs` turns the syntax tree into the nodes below; `eval.rs` evaluates them.

mod eval;
mod lower;

use std::sync::Arc;

use rhai::ImmutableString;

use crate::core::snapshot::Decision;

pub(super) use eval::Inputs;
pub(super) use lower::{Params, params};

/// Most nodes one evaluation may evaluate before giving up. A policy's common path takes a
/// few hundred; Rhai's own operations limit ([`crate::policy::MAX_OPERATIONS`]) is far above anything
/// this allows, so a script that would hit it is always Rhai's to stop.
const MAX_NODES: u32 = 4_000;
/// Deepest chain of script-function calls before giving up (Rhai's limit,
/// [`crate::policy::MAX_CALL_DEPTH`], is higher: recursion is Rhai's to stop).
const MAX_DEPTH: u32 = 8;

/// A script, lowered.
#[derive(Debug)]
pub(super) struct Compiled {
    functions: Vec<Function>,
    decide: usize,
}

#[derive(Debug)]
struct Function {
    /// Its parameters take the first slots of its frame.
    params: usize,
    /// Slots its frame needs: parameters and every `let`.
    slots: usize,
    body: Vec<S>,
}

/// A statement.
#[derive(Debug)]
enum S {
    Let(usize, N),
    Set(usize, N),
    Expr(N),
    If(N, Vec<S>, Vec<S>),
    Return(N),
    Block(Vec<S>),
    GiveUp,
}

/// An expression.
#[derive(Debug)]
enum N {
    Lit(Lit),
    Local(usize),
    Chain(Box<N>, Vec<Step>),
    Call(usize, Vec<N>),
    Native(Native, Vec<N>),
    Binary(Op, Box<(N, N)>),
    Neg(Box<N>),
    Not(Box<N>),
    And(Vec<N>),
    Or(Vec<N>),
    Coalesce(Vec<N>),
    Interpolated(Vec<N>),
    Block(Vec<S>),
    Map(Vec<(ImmutableString, N)>),
    GiveUp,
}

#[derive(Debug)]
enum Step {
    Property(ImmutableString),
    Index(N),
    Method(Native, Vec<N>),
}

#[derive(Debug, Clone)]
pub(super) enum Lit {
    Unit,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(ImmutableString),
    Decision(Arc<Decision>),
    Map(Arc<[(ImmutableString, Lit)]>),
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
