//! [`Script`]: one compiled policy script and the sandbox it runs in.
//!
//! The script is compiled once; each request is one call of its `decide(req, state)` function.
//! Whatever goes wrong inside (a run-time error, a sandbox limit, a value that is not a decision)
//! becomes the configured fallback decision plus a [`PolicyError`] saying why, never a panic and
//! never a request left without an answer.

use std::cell::RefCell;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rhai::{AST, CallFnOptions, Dynamic, EvalAltResult, ImmutableString, ParseError, Position, Scope};

use super::accept::{count_of_float, count_of_int, not_blank};
use super::compiled::{self, Compiled};
use super::limits::{
    MAX_ARRAY_SIZE, MAX_CALL_DEPTH, MAX_EXPR_DEPTH, MAX_FUNCTIONS, MAX_MAP_SIZE, MAX_OPERATIONS, MAX_STRING_SIZE,
    MAX_VARIABLES,
};
use super::values::{self, List, Params, StateView, Table};

use crate::core::snapshot::{Decision, RequestInfo, Snapshot};

/// Why an evaluation fell back (the `kind` label of `vramguard_policy_errors_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyErrorKind {
    /// The script does not compile or lacks `fn decide(req, state)`.
    Compile,
    /// The script raised an error while running (bad arithmetic, missing property, `throw`…).
    Runtime,
    /// The script hit a sandbox limit (operations, call depth, string/array/map size).
    Limit,
    /// `decide` returned something that is not a valid decision.
    BadReturn,
}

impl PolicyErrorKind {
    /// `compile`, `runtime`, `limit` or `bad_return`.
    pub fn label(self) -> &'static str {
        match self {
            PolicyErrorKind::Compile => "compile",
            PolicyErrorKind::Runtime => "runtime",
            PolicyErrorKind::Limit => "limit",
            PolicyErrorKind::BadReturn => "bad_return",
        }
    }
}

impl prometheus_client::encoding::EncodeLabelValue for PolicyErrorKind {
    fn encode(&self, encoder: &mut prometheus_client::encoding::LabelValueEncoder<'_>) -> fmt::Result {
        fmt::Write::write_str(encoder, self.label())
    }
}

impl fmt::Display for PolicyErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// A policy failure, located as `path:line:col` when the script position is known.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{location}: {message}")]
pub struct PolicyError {
    /// What kind of failure.
    pub kind: PolicyErrorKind,
    /// `origin:line:col`, or just `origin` when no position applies.
    pub location: String,
    /// What went wrong, without the location.
    pub message: String,
}

impl PolicyError {
    fn new(kind: PolicyErrorKind, origin: &str, position: Position, message: impl Into<String>) -> Self {
        let location = match (position.line(), position.position()) {
            (Some(line), Some(col)) => format!("{origin}:{line}:{col}"),
            (Some(line), None) => format!("{origin}:{line}"),
            _ => origin.to_string(),
        };
        PolicyError {
            kind,
            location,
            message: message.into(),
        }
    }
}

/// What the configuration gives a policy besides its script.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySettings {
    /// The decision used whenever the script fails.
    pub fallback: Decision,
    /// Operator constants, visible to the script as `state.params`.
    pub params: Params,
}

impl Default for PolicySettings {
    /// Admit on failure (the router's bounded queues, breaker and failover still apply) and no
    /// params; what `policy check` and `policy eval` use.
    fn default() -> Self {
        PolicySettings {
            fallback: Decision::Admit { pool: None },
            params: Params::new(),
        }
    }
}

/// The outcome of one evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// What to do with the request: the script's decision, or the fallback when `error` is set.
    pub decision: Decision,
    /// Why the script's decision was not used; `None` when it was.
    pub error: Option<PolicyError>,
    /// Time spent, building the script's inputs included.
    pub duration: Duration,
}

impl Evaluation {
    /// True when the decision is the configured fallback because the script failed.
    pub fn used_fallback(&self) -> bool {
        self.error.is_some()
    }
}

/// A compiled policy script with its params and fallback.
///
/// Cheap to share (`Arc`) and to evaluate from many threads at once: evaluation takes `&self`
/// and every evaluation gets its own copies of the inputs.
#[derive(Debug, Clone)]
pub struct Script {
    program: Arc<Program>,
    /// `state.params`, converted once.
    params: Dynamic,
    /// The same, as the compiled evaluation reads them.
    compiled_params: compiled::Params,
    fallback: Decision,
}

/// What compiling produced; shared by every copy of a [`Script`] whatever its params.
#[derive(Debug)]
struct Program {
    ast: AST,
    /// Its common path lowered (`compiled.rs`): what an evaluation tries first.
    compiled: Option<Compiled>,
    origin: String,
}

impl Script {
    /// Compile `source` (named `origin` in errors, normally its path) and check it defines
    /// `fn decide(req, state)`.
    pub fn compile(source: &str, origin: &str, settings: &PolicySettings) -> Result<Self, PolicyError> {
        let mut ast = sandbox().compile(source).map_err(|e| compile_error(origin, &e))?;
        lint(&ast, source, origin)?;
        ast.set_source(origin);
        let params = values::params(&settings.params)
            .map_err(|message| PolicyError::new(PolicyErrorKind::Compile, origin, Position::NONE, message))?;
        Ok(Script {
            program: Arc::new(Program {
                compiled: Compiled::new(&ast),
                ast,
                origin: origin.to_string(),
            }),
            compiled_params: compiled::params(&params),
            params,
            fallback: settings.fallback.clone(),
        })
    }

    /// The same compiled script with other params (a test case's own); the AST is shared.
    pub fn with_params(&self, params: &Params) -> Result<Self, PolicyError> {
        let params = values::params(params).map_err(|message| {
            PolicyError::new(PolicyErrorKind::Compile, &self.program.origin, Position::NONE, message)
        })?;
        Ok(Script {
            program: Arc::clone(&self.program),
            compiled_params: compiled::params(&params),
            params,
            fallback: self.fallback.clone(),
        })
    }

    /// The name used in errors (normally the script's path).
    pub fn origin(&self) -> &str {
        &self.program.origin
    }

    /// The decision used when the script fails.
    pub fn fallback(&self) -> &Decision {
        &self.fallback
    }

    /// Decide for one request against a snapshot, converting the snapshot for this call only.
    /// On the request path prefer [`Script::decide_view`] with a [`StateView`] built once per
    /// snapshot (the server's `Service::policy_view` keeps one per sample).
    pub fn decide(&self, req: &RequestInfo, state: &Snapshot) -> Evaluation {
        let started = Instant::now();
        let view = StateView::new(state);
        self.evaluate(started, req, &view)
    }

    /// Decide for one request against a prepared [`StateView`].
    pub fn decide_view(&self, req: &RequestInfo, view: &StateView) -> Evaluation {
        self.evaluate(Instant::now(), req, view)
    }

    /// Evaluate, timing from `started` (callers that prepared the view count that in too).
    pub(super) fn evaluate(&self, started: Instant, req: &RequestInfo, view: &StateView) -> Evaluation {
        // Rhai reports errors as values, but a panic inside it must still not take the request
        // down with it: the sandbox and the AST are only read here, so unwinding leaves them intact.
        let outcome = catch_unwind(AssertUnwindSafe(|| self.run(req, view))).unwrap_or_else(|panic| {
            let what = crate::core::human::panic_message(panic.as_ref());
            Err(self.error(
                PolicyErrorKind::Runtime,
                Position::NONE,
                format!("script engine panicked: {what}"),
            ))
        });
        let (decision, error) = match outcome {
            Ok(decision) => (decision, None),
            Err(error) => (self.fallback.clone(), Some(error)),
        };
        Evaluation {
            decision,
            error,
            duration: started.elapsed(),
        }
    }

    fn run(&self, req: &RequestInfo, view: &StateView) -> Result<Decision, PolicyError> {
        match self.run_compiled(req, view) {
            Some(decision) => self.checked(decision, view),
            None => self.run_interpreted(req, view),
        }
    }

    /// The compiled evaluation's decision, or `None` where it leaves the script to Rhai.
    pub(crate) fn run_compiled(&self, req: &RequestInfo, view: &StateView) -> Option<Decision> {
        let compiled = self.program.compiled.as_ref()?;
        compiled.decide(&compiled::Inputs {
            req,
            view,
            params: &self.compiled_params,
        })
    }

    /// The evaluation on Rhai: what answers whenever the compiled one gives up, and the
    /// reference it is tested against (`policy::tests::evaluators`).
    pub(crate) fn run_interpreted(&self, req: &RequestInfo, view: &StateView) -> Result<Decision, PolicyError> {
        let args = (values::request(req), view.to_dynamic(&self.params));
        // `eval_ast(false)`: only functions matter; top-level statements never run, so each
        // call costs just the call (and a script cannot keep state between requests).
        let options = CallFnOptions::new().eval_ast(false).rewind_scope(true);
        let call = |scope: &mut Scope<'static>| {
            sandbox().call_fn_with_options::<Dynamic>(options, scope, &self.program.ast, "decide", args)
        };
        // Every variable of an evaluation lives in its scope; a fresh one grew its buffers from
        // nothing each time (a handful of reallocations per request). A thread keeps one and
        // empties it first, so nothing of one evaluation is seen by the next, even after a panic.
        let value = SCOPE
            .with(|cell| match cell.try_borrow_mut() {
                Ok(mut scope) => call(scope.clear()),
                Err(_) => call(&mut Scope::new()),
            })
            .map_err(|e| self.runtime_error(&e))?;
        self.to_decision(value, view)
    }

    fn to_decision(&self, value: Dynamic, view: &StateView) -> Result<Decision, PolicyError> {
        let value = value.flatten();
        if !value.is::<Decision>() {
            let type_name = sandbox().map_type_name(value.type_name());
            let mut shown = value.to_string();
            if shown.len() > 80 {
                let cut = (0..=80).rev().find(|i| shown.is_char_boundary(*i)).unwrap_or(0);
                shown.truncate(cut);
                shown.push('…');
            }
            return Err(self.error(
                PolicyErrorKind::BadReturn,
                Position::NONE,
                format!(
                    "decide returned {type_name} `{shown}`, expected a decision: admit(), admit(pool), defer(ms), \
                     shrink_context(tokens), redirect(pool) or reject(reason)"
                ),
            ));
        }
        self.checked(value.cast::<Decision>(), view)
    }

    /// `decision`, unless it names a pool the state does not have.
    pub(crate) fn checked(&self, decision: Decision, view: &StateView) -> Result<Decision, PolicyError> {
        if let Decision::Admit { pool: Some(pool) } | Decision::Redirect { pool } = &decision
            && !view.has_pool(pool)
        {
            let known: Vec<&str> = view.pool_names().collect();
            return Err(self.error(
                PolicyErrorKind::BadReturn,
                Position::NONE,
                format!(
                    "{} names unknown pool `{pool}` (state.pools has: {})",
                    decision.action(),
                    known.join(", ")
                ),
            ));
        }
        Ok(decision)
    }

    fn error(&self, kind: PolicyErrorKind, position: Position, message: impl Into<String>) -> PolicyError {
        PolicyError::new(kind, &self.program.origin, position, message)
    }

    fn runtime_error(&self, err: &EvalAltResult) -> PolicyError {
        // Errors inside nested calls come wrapped once per call level; the innermost error says
        // what happened, and the innermost known position says where.
        let mut position = err.position();
        let mut root = err;
        while let EvalAltResult::ErrorInFunctionCall(_, _, inner, _) | EvalAltResult::ErrorInModule(_, inner, _) = root
        {
            root = inner;
            if !root.position().is_none() {
                position = root.position();
            }
        }
        let (kind, message) = match root {
            EvalAltResult::ErrorTooManyOperations(_) => (
                PolicyErrorKind::Limit,
                format!("too many operations (limit {MAX_OPERATIONS}): an endless loop?"),
            ),
            EvalAltResult::ErrorStackOverflow(_) => (
                PolicyErrorKind::Limit,
                format!("call depth over {MAX_CALL_DEPTH}: unbounded recursion?"),
            ),
            EvalAltResult::ErrorDataTooLarge(what, _) => (
                PolicyErrorKind::Limit,
                format!(
                    "{what} over the sandbox limit (strings {MAX_STRING_SIZE} bytes, arrays \
                     {MAX_ARRAY_SIZE} elements, maps {MAX_MAP_SIZE} properties)"
                ),
            ),
            EvalAltResult::ErrorTooManyVariables(_) => {
                (PolicyErrorKind::Limit, format!("more than {MAX_VARIABLES} variables"))
            }
            EvalAltResult::ErrorTooManyModules(_) | EvalAltResult::ErrorTerminated(..) => {
                (PolicyErrorKind::Limit, without_position(root))
            }
            EvalAltResult::ErrorRuntime(value, _) if value.is::<InvalidDecision>() => {
                let message = value
                    .clone()
                    .try_cast::<InvalidDecision>()
                    .map(|d| d.0)
                    .unwrap_or_default();
                (PolicyErrorKind::BadReturn, message)
            }
            other => (PolicyErrorKind::Runtime, without_position(other)),
        };
        self.error(kind, position, message)
    }
}

/// Rhai's message for `err` without the ` (line L, position C)` it appends: the location is
/// reported separately, in the `path:line:col` form editors understand.
fn without_position(err: &EvalAltResult) -> String {
    let text = err.to_string();
    let position = err.position();
    if position.is_none() {
        return text;
    }
    text.strip_suffix(&format!(" ({position})"))
        .map(str::to_string)
        .unwrap_or(text)
}

fn compile_error(origin: &str, err: &ParseError) -> PolicyError {
    PolicyError::new(
        PolicyErrorKind::Compile,
        origin,
        err.position(),
        err.err_type().to_string(),
    )
}

/// The compile-time checks Rhai does not do: `decide` must exist and take `(req, state)`.
fn lint(ast: &AST, source: &str, origin: &str) -> Result<(), PolicyError> {
    let arities: Vec<usize> = ast
        .iter_functions()
        .filter(|f| f.name == "decide")
        .map(|f| f.params.len())
        .collect();
    if arities.contains(&2) {
        return Ok(());
    }
    // Rhai keeps no position for function definitions; the first `fn decide` in the text is it.
    let position = source
        .lines()
        .enumerate()
        .find_map(|(i, line)| line.find("fn decide").map(|col| (i + 1, col + 1)))
        .map_or(Position::NONE, |(line, col)| {
            let clamp = |n: usize| u16::try_from(n).unwrap_or(u16::MAX);
            Position::new(clamp(line), clamp(col))
        });
    let message = match arities.first() {
        None => "the script must define `fn decide(req, state)`".to_string(),
        Some(n) => format!("`decide` must take exactly 2 parameters (req, state), it takes {n}"),
    };
    Err(PolicyError::new(PolicyErrorKind::Compile, origin, position, message))
}

/// Raised by a decision constructor given an impossible value (negative milliseconds, an empty
/// pool name…); reported as [`PolicyErrorKind::BadReturn`] at the constructor's position.
#[derive(Debug, Clone)]
struct InvalidDecision(String);

fn invalid(message: String) -> Box<EvalAltResult> {
    EvalAltResult::ErrorRuntime(Dynamic::from(InvalidDecision(message)), Position::NONE).into()
}

fn non_negative(function: &str, what: &str, value: i64) -> Result<u64, Box<EvalAltResult>> {
    count_of_int(value).ok_or_else(|| invalid(format!("{function}({what}): {what} must be ≥ 0, got {value}")))
}

fn non_negative_float(function: &str, what: &str, value: f64) -> Result<u64, Box<EvalAltResult>> {
    count_of_float(value).ok_or_else(|| {
        invalid(format!(
            "{function}({what}): {what} must be a finite number ≥ 0, got {value}"
        ))
    })
}

fn pool_name(function: &str, pool: ImmutableString) -> Result<String, Box<EvalAltResult>> {
    if !not_blank(&pool) {
        Err(invalid(format!("{function}(pool): the pool name is empty")))
    } else {
        Ok(pool.to_string())
    }
}

fn admit_on(pool: ImmutableString) -> Result<Decision, Box<EvalAltResult>> {
    Ok(Decision::Admit {
        pool: Some(pool_name("admit", pool)?),
    })
}

fn defer(ms: Result<u64, Box<EvalAltResult>>) -> Result<Decision, Box<EvalAltResult>> {
    Ok(Decision::Defer { ms: ms? })
}

fn shrink(tokens: Result<u64, Box<EvalAltResult>>) -> Result<Decision, Box<EvalAltResult>> {
    match tokens? {
        0 => Err(invalid("shrink_context(tokens): tokens must be ≥ 1".to_string())),
        tokens => Ok(Decision::ShrinkContext { tokens }),
    }
}

fn redirect(pool: ImmutableString) -> Result<Decision, Box<EvalAltResult>> {
    Ok(Decision::Redirect {
        pool: pool_name("redirect", pool)?,
    })
}

fn make_room(
    pool: ImmutableString,
    bytes: Option<Result<u64, Box<EvalAltResult>>>,
) -> Result<Decision, Box<EvalAltResult>> {
    Ok(Decision::MakeRoom {
        pool: pool_name("make_room", pool)?,
        bytes: bytes.transpose()?,
    })
}

fn reject(reason: ImmutableString) -> Result<Decision, Box<EvalAltResult>> {
    if !not_blank(&reason) {
        Err(invalid("reject(reason): give the client a reason".to_string()))
    } else {
        Ok(Decision::Reject {
            reason: reason.to_string(),
        })
    }
}

thread_local! {
    /// The scope this thread's evaluations run in, emptied before each (see [`Script::run`]).
    static SCOPE: RefCell<Scope<'static>> = RefCell::new(Scope::new());
}

/// The one Rhai engine every policy runs in: sandboxed, with the decision constructors and the
/// read-only views registered. Built on first use; it is only read afterwards.
fn sandbox() -> &'static rhai::Engine {
    static ENGINE: OnceLock<rhai::Engine> = OnceLock::new();
    ENGINE.get_or_init(build_sandbox)
}

fn build_sandbox() -> rhai::Engine {
    let mut engine = rhai::Engine::new();
    engine.set_optimization_level(rhai::OptimizationLevel::Full);

    // No way out: no `eval` (code from strings), no modules, no I/O. `print`/`debug` are the only
    // output and go to the log at debug level.
    engine
        .disable_symbol("eval")
        .disable_symbol("import")
        .disable_symbol("export")
        .set_module_resolver(rhai::module_resolvers::DummyModuleResolver::new())
        .on_print(|text| tracing::debug!(target: "vramguard::policy::script", "{text}"))
        .on_debug(|text, source, position| {
            tracing::debug!(target: "vramguard::policy::script", "{}:{position}: {text}", source.unwrap_or("policy"))
        });

    // Bounded work and memory per evaluation.
    engine
        .set_max_operations(MAX_OPERATIONS)
        .set_max_call_levels(MAX_CALL_DEPTH)
        .set_max_expr_depths(MAX_EXPR_DEPTH.0, MAX_EXPR_DEPTH.1)
        .set_max_string_size(MAX_STRING_SIZE)
        .set_max_array_size(MAX_ARRAY_SIZE)
        .set_max_map_size(MAX_MAP_SIZE)
        .set_max_variables(MAX_VARIABLES)
        .set_max_functions(MAX_FUNCTIONS)
        .set_max_modules(0);

    // Typos fail loudly: an undefined variable is a compile error, a missing property a run-time
    // error (Rhai's defaults would quietly yield `()` for both).
    engine.set_strict_variables(true).set_fail_on_invalid_map_property(true);

    engine
        .register_type_with_name::<Decision>("Decision")
        .register_fn("admit", || Decision::Admit { pool: None })
        .register_fn("admit", admit_on)
        .register_fn("defer", |ms: i64| defer(non_negative("defer", "ms", ms)))
        .register_fn("defer", |ms: f64| defer(non_negative_float("defer", "ms", ms)))
        .register_fn("shrink_context", |tokens: i64| {
            shrink(non_negative("shrink_context", "tokens", tokens))
        })
        .register_fn("shrink_context", |tokens: f64| {
            shrink(non_negative_float("shrink_context", "tokens", tokens))
        })
        .register_fn("redirect", redirect)
        .register_fn("make_room", |pool: ImmutableString| make_room(pool, None))
        .register_fn("make_room", |pool: ImmutableString, bytes: i64| {
            make_room(pool, Some(non_negative("make_room", "bytes", bytes)))
        })
        .register_fn("make_room", |pool: ImmutableString, bytes: f64| {
            make_room(pool, Some(non_negative_float("make_room", "bytes", bytes)))
        })
        .register_fn("reject", reject)
        .register_fn("to_string", |d: &mut Decision| d.to_string())
        .register_fn("to_debug", |d: &mut Decision| d.to_string());

    engine
        .register_type_with_name::<Table>("Table")
        .register_indexer_get(|t: &mut Table, name: &str| t.index(name))
        .register_fn("contains", |t: &mut Table, name: &str| t.contains(name))
        .register_fn("get", |t: &mut Table, name: &str| t.get(name))
        .register_fn("keys", Table::keys)
        .register_fn("values", Table::values)
        .register_fn("len", Table::len)
        .register_fn("is_empty", Table::is_empty)
        .register_fn("to_string", Table::render)
        .register_fn("to_debug", Table::render);

    engine
        .register_type_with_name::<List>("List")
        .register_indexer_get(List::index)
        .register_iterator::<List>()
        .register_fn("len", List::len)
        .register_fn("is_empty", List::is_empty)
        .register_fn("to_array", List::copy_to_array)
        .register_fn("to_string", List::render)
        .register_fn("to_debug", List::render);

    engine
}
