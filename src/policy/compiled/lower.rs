//! Lowering a script's syntax tree into [`Compiled`]'s nodes.

use std::collections::HashMap;
use std::sync::Arc;

use rhai::{AST, ASTFlags, ASTNode, Dynamic, Expr, FnCallExpr, ImmutableString, Stmt, Token};

use super::{Compiled, Function, Lit, N, Native, Op, S, Step};
use crate::core::snapshot::Decision;

impl Compiled {
    /// Lower `ast`'s functions; `None` when it has no `decide(req, state)` this can run (the
    /// caller then always evaluates on Rhai).
    pub(crate) fn new(ast: &AST) -> Option<Compiled> {
        let defs: Vec<_> = ast.iter_fn_def().collect();
        let index: HashMap<(ImmutableString, usize), usize> = defs
            .iter()
            .enumerate()
            .map(|(i, f)| ((f.name.clone(), f.params.len()), i))
            .collect();
        let decide = *index.get(&("decide".into(), 2))?;
        let functions = defs
            .iter()
            .map(|f| {
                let params: Vec<ImmutableString> = f.params.iter().cloned().collect();
                if f.this_type.is_some() {
                    return Function {
                        params: params.len(),
                        slots: params.len(),
                        body: vec![S::GiveUp],
                    };
                }
                // A function's body is reached through an AST holding only that function.
                let (name, arity) = (f.name.clone(), params.len());
                // (Not `clone_functions_only_filtered`: into an empty library it copies every
                // function, whatever the filter says.)
                let mut alone = ast.clone_functions_only();
                alone.retain_functions(|_, _, n, a| n == name && a == arity);
                let mut statements = Vec::new();
                alone.walk(&mut |path: &[ASTNode]| {
                    if let [ASTNode::Stmt(stmt)] = path {
                        statements.push((*stmt).clone());
                    }
                    true
                });
                let mut lowering = Lowering {
                    index: &index,
                    names: params.iter().cloned().zip(0..).map(|(n, s)| (n, s, false)).collect(),
                    slots: params.len(),
                };
                let body = lowering.block(&statements);
                Function {
                    params: params.len(),
                    slots: lowering.slots,
                    body,
                }
            })
            .collect();
        Some(Compiled { functions, decide })
    }
}

struct Lowering<'i> {
    index: &'i HashMap<(ImmutableString, usize), usize>,
    /// Names in scope, innermost last: name, slot, constant.
    names: Vec<(ImmutableString, usize, bool)>,
    slots: usize,
}

impl Lowering<'_> {
    fn block(&mut self, statements: &[Stmt]) -> Vec<S> {
        let scope = self.names.len();
        let out = statements.iter().map(|s| self.stmt(s)).collect();
        self.names.truncate(scope);
        out
    }

    fn local(&self, name: &str) -> Option<(usize, bool)> {
        self.names
            .iter()
            .rev()
            .find(|(n, ..)| n.as_str() == name)
            .map(|&(_, slot, constant)| (slot, constant))
    }

    fn script_fn(&self, name: &str, arity: usize) -> Option<usize> {
        self.index.get(&(name.into(), arity)).copied()
    }

    fn stmt(&mut self, stmt: &Stmt) -> S {
        match stmt {
            Stmt::Noop(..) => S::Expr(N::Lit(Lit::Unit)),
            Stmt::Expr(expr) => S::Expr(self.expr(expr)),
            Stmt::FnCall(call, ..) => S::Expr(self.call(call)),
            Stmt::Block(block) => S::Block(self.block(block.statements())),
            Stmt::If(flow, ..) => S::If(
                self.expr(&flow.expr),
                self.block(flow.body.statements()),
                self.block(flow.branch.statements()),
            ),
            Stmt::Var(var, flags, ..) if !flags.contains(ASTFlags::EXPORTED) => {
                let value = self.expr(&var.1);
                let slot = self.slots;
                self.slots += 1;
                self.names
                    .push((var.0.name.clone(), slot, flags.contains(ASTFlags::CONSTANT)));
                S::Let(slot, value)
            }
            Stmt::Assignment(assignment) => {
                let (op, target) = &**assignment;
                match &target.lhs {
                    Expr::Variable(var, ..) if !op.is_op_assignment() && var.2.is_empty() => match self.local(&var.1) {
                        Some((slot, false)) => S::Set(slot, self.expr(&target.rhs)),
                        _ => S::GiveUp,
                    },
                    _ => S::GiveUp,
                }
            }
            Stmt::Return(value, flags, ..) if !flags.contains(ASTFlags::BREAK) => {
                S::Return(value.as_ref().map_or(N::Lit(Lit::Unit), |e| self.expr(e)))
            }
            _ => S::GiveUp,
        }
    }

    fn expr(&mut self, expr: &Expr) -> N {
        match expr {
            Expr::DynamicConstant(value, ..) => lit(value).map_or(N::GiveUp, N::Lit),
            Expr::BoolConstant(b, ..) => N::Lit(Lit::Bool(*b)),
            Expr::IntegerConstant(i, ..) => N::Lit(Lit::Int(*i)),
            Expr::FloatConstant(f, ..) => N::Lit(Lit::Float(**f)),
            Expr::StringConstant(s, ..) => N::Lit(Lit::Str(s.clone())),
            Expr::Unit(..) => N::Lit(Lit::Unit),
            Expr::InterpolatedString(parts, ..) => N::Interpolated(parts.iter().map(|p| self.expr(p)).collect()),
            // A literal over the sandbox's map size is Rhai's to refuse.
            Expr::Map(map, ..) if map.0.len() > crate::policy::MAX_MAP_SIZE => N::GiveUp,
            Expr::Map(map, ..) => N::Map(map.0.iter().map(|(k, v)| (k.name.clone(), self.expr(v))).collect()),
            Expr::Variable(var, ..) if var.2.is_empty() => {
                self.local(&var.1).map_or(N::GiveUp, |(slot, _)| N::Local(slot))
            }
            Expr::Stmt(block) => N::Block(self.block(block.statements())),
            Expr::FnCall(call, ..) => self.call(call),
            Expr::And(operands, ..) => N::And(operands.iter().map(|e| self.expr(e)).collect()),
            Expr::Or(operands, ..) => N::Or(operands.iter().map(|e| self.expr(e)).collect()),
            Expr::Coalesce(operands, ..) => N::Coalesce(operands.iter().map(|e| self.expr(e)).collect()),
            Expr::Dot(chain, flags, ..) | Expr::Index(chain, flags, ..) if !flags.contains(ASTFlags::NEGATED) => {
                let mut steps = Vec::new();
                let indexing = matches!(expr, Expr::Index(..));
                match self.steps(&chain.rhs, indexing, *flags, &mut steps) {
                    Some(()) => N::Chain(Box::new(self.expr(&chain.lhs)), steps),
                    None => N::GiveUp,
                }
            }
            _ => N::GiveUp,
        }
    }

    /// The steps of a chain after its root: `rhs` is what follows a `.` (`indexing` false) or a
    /// `[` (true) whose node has `flags`. Rhai nests a chain to the right: after `[`, `rhs` is
    /// the index itself when the chain ends there (`BREAK`), or a `.`/`[` node whose left side
    /// is the index and whose right side goes on; after `.`, it is the property or method, or a
    /// `.`/`[` node whose left side is.
    fn steps(&mut self, rhs: &Expr, indexing: bool, flags: ASTFlags, steps: &mut Vec<Step>) -> Option<()> {
        let next = match rhs {
            Expr::Dot(x, f, ..) | Expr::Index(x, f, ..) => Some((x, *f, matches!(rhs, Expr::Index(..)))),
            _ => None,
        };
        match (indexing, next) {
            (true, Some((x, f, index))) if !flags.contains(ASTFlags::BREAK) => {
                if f.contains(ASTFlags::NEGATED) {
                    return None;
                }
                steps.push(Step::Index(self.expr(&x.lhs)));
                self.steps(&x.rhs, index, f, steps)
            }
            (true, _) => {
                steps.push(Step::Index(self.expr(rhs)));
                Some(())
            }
            (false, Some((x, f, index))) => {
                if f.contains(ASTFlags::NEGATED) {
                    return None;
                }
                steps.push(self.member(&x.lhs)?);
                self.steps(&x.rhs, index, f, steps)
            }
            (false, None) => {
                steps.push(self.member(rhs)?);
                Some(())
            }
        }
    }

    /// A property or method after a `.`.
    fn member(&mut self, expr: &Expr) -> Option<Step> {
        match expr {
            Expr::Property(p, ..) => Some(Step::Property(p.2.clone())),
            Expr::MethodCall(call, ..) => {
                let arity = call.args.len();
                // A script function of that name would be called instead (with `this`).
                let shadowed =
                    self.script_fn(&call.name, arity).is_some() || self.script_fn(&call.name, arity + 1).is_some();
                let native = Native::of(&call.name, arity + 1).filter(|_| !shadowed && call.namespace.is_empty())?;
                Some(Step::Method(native, call.args.iter().map(|a| self.expr(a)).collect()))
            }
            _ => None,
        }
    }

    fn call(&mut self, call: &FnCallExpr) -> N {
        if !call.namespace.is_empty() || call.capture_parent_scope {
            return N::GiveUp;
        }
        let args: Vec<N> = call.args.iter().map(|a| self.expr(a)).collect();
        if let Some(token) = &call.op_token {
            let mut args = args.into_iter();
            return match (token, args.next(), args.next(), args.next()) {
                (Token::Minus | Token::UnaryMinus, Some(x), None, None) => N::Neg(Box::new(x)),
                (Token::Bang, Some(x), None, None) => N::Not(Box::new(x)),
                (token, Some(x), Some(y), None) => match binary(token) {
                    Some(op) => N::Binary(op, Box::new((x, y))),
                    None => N::GiveUp,
                },
                _ => N::GiveUp,
            };
        }
        if let Some(f) = self.script_fn(&call.name, args.len()) {
            return N::Call(f, args);
        }
        match Native::of(&call.name, args.len()) {
            Some(native) => N::Native(native, args),
            None => N::GiveUp,
        }
    }
}

fn binary(token: &Token) -> Option<Op> {
    Some(match token {
        Token::Plus => Op::Add,
        Token::Minus => Op::Sub,
        Token::Multiply => Op::Mul,
        Token::Divide => Op::Div,
        Token::Modulo => Op::Rem,
        Token::EqualsTo => Op::Eq,
        Token::NotEqualsTo => Op::Ne,
        Token::LessThan => Op::Lt,
        Token::LessThanEqualsTo => Op::Le,
        Token::GreaterThan => Op::Gt,
        Token::GreaterThanEqualsTo => Op::Ge,
        _ => return None,
    })
}

/// A constant the optimizer folded (a decision such as `admit()`, a map literal), when it is a
/// value this module handles.
fn lit(value: &Dynamic) -> Option<Lit> {
    if value.is_unit() {
        return Some(Lit::Unit);
    }
    if let Ok(b) = value.as_bool() {
        return Some(Lit::Bool(b));
    }
    if let Ok(i) = value.as_int() {
        return Some(Lit::Int(i));
    }
    if let Ok(f) = value.as_float() {
        return Some(Lit::Float(f));
    }
    if value.is_string() {
        return value.clone().into_immutable_string().ok().map(Lit::Str);
    }
    if value.is::<Decision>() {
        return Some(Lit::Decision(Arc::new(value.clone().cast::<Decision>())));
    }
    if value.is_map() {
        let map = value.as_map_ref().ok()?;
        let entries: Option<Vec<_>> = map.iter().map(|(k, v)| Some((k.as_str().into(), lit(v)?))).collect();
        return Some(Lit::Map(entries?.into()));
    }
    None
}

/// `state.params` as this module reads them: each value a [`Lit`], or `None` for one it does not
/// handle (reading that one gives up).
pub(crate) fn params(params: &Dynamic) -> Params {
    match params.as_map_ref() {
        Ok(map) => map.iter().map(|(k, v)| (k.as_str().into(), lit(v))).collect(),
        Err(_) => Arc::new([]),
    }
}

/// `state.params`, converted once per script.
pub(crate) type Params = Arc<[(ImmutableString, Option<Lit>)]>;
