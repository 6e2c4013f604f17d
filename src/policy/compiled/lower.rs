//! Lowering a script's syntax tree into [`Compiled`]'s nodes.

use std::collections::HashMap;
use std::sync::Arc;

use rhai::{AST, ASTFlags, ASTNode, Dynamic, Expr, FnCallExpr, ImmutableString, Stmt, Token};

use super::{Compiled, Field, Function, Id, List, Lit, N, Native, Op, S, Step};
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
        let mut code = Compiled {
            functions: Vec::with_capacity(defs.len()),
            decide,
            stmts: Vec::new(),
            nodes: Vec::new(),
            lists: Vec::new(),
            steps: Vec::new(),
            lits: Vec::new(),
            text: String::new(),
            maps: Vec::new(),
        };
        for f in &defs {
            let params: Vec<ImmutableString> = f.params.iter().cloned().collect();
            let mut lowering = Lowering {
                code: &mut code,
                index: &index,
                names: params.iter().cloned().zip(0..).map(|(n, s)| (n, s, false)).collect(),
                slots: params.len(),
            };
            let body = if f.this_type.is_some() {
                let give_up = lowering.push_stmt(S::GiveUp);
                lowering.list(&[give_up])
            } else {
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
                lowering.block(&statements)
            };
            let slots = lowering.slots;
            code.functions.push(Function {
                params: params.len(),
                slots,
                body,
            });
        }
        Some(code)
    }
}

struct Lowering<'c, 'i> {
    code: &'c mut Compiled,
    index: &'i HashMap<(ImmutableString, usize), usize>,
    /// Names in scope, innermost last: name, slot, constant.
    names: Vec<(ImmutableString, u32, bool)>,
    slots: usize,
}

/// An index that fits the tables' `u32`: a script is far smaller than that.
fn id(index: usize) -> u32 {
    u32::try_from(index).expect("a policy script's tables hold fewer than 2^32 entries")
}

impl Lowering<'_, '_> {
    fn push_stmt(&mut self, s: S) -> Id {
        self.code.stmts.push(s);
        id(self.code.stmts.len() - 1)
    }

    fn push(&mut self, n: N) -> Id {
        self.code.nodes.push(n);
        id(self.code.nodes.len() - 1)
    }

    /// `members` as a run of [`Compiled::lists`].
    fn list(&mut self, members: &[Id]) -> List {
        let start = id(self.code.lists.len());
        self.code.lists.extend_from_slice(members);
        List {
            start,
            len: id(members.len()),
        }
    }

    fn exprs<'e>(&mut self, exprs: impl IntoIterator<Item = &'e Expr>) -> List {
        let members: Vec<Id> = exprs.into_iter().map(|e| self.expr(e)).collect();
        self.list(&members)
    }

    fn block(&mut self, statements: &[Stmt]) -> List {
        let scope = self.names.len();
        let members: Vec<Id> = statements.iter().map(|s| self.stmt(s)).collect();
        self.names.truncate(scope);
        self.list(&members)
    }

    fn local(&self, name: &str) -> Option<(u32, bool)> {
        self.names
            .iter()
            .rev()
            .find(|(n, ..)| n.as_str() == name)
            .map(|&(_, slot, constant)| (slot, constant))
    }

    fn script_fn(&self, name: &str, arity: usize) -> Option<usize> {
        self.index.get(&(name.into(), arity)).copied()
    }

    fn stmt(&mut self, stmt: &Stmt) -> Id {
        let s = match stmt {
            Stmt::Noop(..) => S::Expr(self.push(N::Unit)),
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
                let slot = id(self.slots);
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
            Stmt::Return(value, flags, ..) if !flags.contains(ASTFlags::BREAK) => S::Return(match value {
                Some(e) => self.expr(e),
                None => self.push(N::Unit),
            }),
            _ => S::GiveUp,
        };
        self.push_stmt(s)
    }

    /// A constant: numbers and booleans in the node, text in [`Compiled::text`], the rest in
    /// [`Compiled::lits`].
    fn constant(&mut self, lit: Lit) -> Id {
        let n = match lit {
            Lit::Unit => N::Unit,
            Lit::Bool(b) => N::Bool(b),
            Lit::Int(i) => N::Int(i),
            Lit::Float(f) => N::Float(f),
            Lit::Str(s) => {
                let start = id(self.code.text.len());
                self.code.text.push_str(&s);
                N::Text(start, id(s.len()))
            }
            lit => {
                self.code.lits.push(lit);
                N::Lit(id(self.code.lits.len() - 1))
            }
        };
        self.push(n)
    }

    fn expr(&mut self, expr: &Expr) -> Id {
        let n = match expr {
            Expr::DynamicConstant(value, ..) => match lit(value) {
                Some(lit) => return self.constant(lit),
                None => N::GiveUp,
            },
            Expr::BoolConstant(b, ..) => N::Bool(*b),
            Expr::IntegerConstant(i, ..) => N::Int(*i),
            Expr::FloatConstant(f, ..) => N::Float(**f),
            Expr::StringConstant(s, ..) => return self.constant(Lit::Str(s.clone())),
            Expr::Unit(..) => N::Unit,
            Expr::InterpolatedString(parts, ..) => N::Interpolated(self.exprs(parts.iter())),
            // A literal over the sandbox's map size is Rhai's to refuse.
            Expr::Map(map, ..) if map.0.len() > crate::policy::MAX_MAP_SIZE => N::GiveUp,
            Expr::Map(map, ..) => {
                let entries: Box<[(ImmutableString, Id)]> =
                    map.0.iter().map(|(k, v)| (k.name.clone(), self.expr(v))).collect();
                self.code.maps.push(entries);
                N::Map(id(self.code.maps.len() - 1))
            }
            Expr::Variable(var, ..) if var.2.is_empty() => {
                self.local(&var.1).map_or(N::GiveUp, |(slot, _)| N::Local(slot))
            }
            Expr::Stmt(block) => N::Block(self.block(block.statements())),
            Expr::FnCall(call, ..) => return self.call(call),
            Expr::And(operands, ..) => N::And(self.exprs(operands.iter())),
            Expr::Or(operands, ..) => N::Or(self.exprs(operands.iter())),
            Expr::Coalesce(operands, ..) => N::Coalesce(self.exprs(operands.iter())),
            Expr::Dot(chain, flags, ..) | Expr::Index(chain, flags, ..) if !flags.contains(ASTFlags::NEGATED) => {
                let root = self.expr(&chain.lhs);
                let mut steps = Vec::new();
                let indexing = matches!(expr, Expr::Index(..));
                match self.steps(&chain.rhs, indexing, *flags, &mut steps) {
                    Some(()) => {
                        // A chain's steps go in one run, after any nested chain's.
                        let start = id(self.code.steps.len());
                        let len = id(steps.len());
                        self.code.steps.extend(steps);
                        N::Chain(root, List { start, len })
                    }
                    None => N::GiveUp,
                }
            }
            _ => N::GiveUp,
        };
        self.push(n)
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
            Expr::Property(p, ..) => Some(match Field::of(&p.2) {
                Some(field) => Step::Field(field),
                None => Step::Name(p.2.clone()),
            }),
            Expr::MethodCall(call, ..) => {
                let arity = call.args.len();
                // A script function of that name would be called instead (with `this`).
                let shadowed =
                    self.script_fn(&call.name, arity).is_some() || self.script_fn(&call.name, arity + 1).is_some();
                let native = Native::of(&call.name, arity + 1).filter(|_| !shadowed && call.namespace.is_empty())?;
                Some(Step::Method(native, self.exprs(call.args.iter())))
            }
            _ => None,
        }
    }

    fn call(&mut self, call: &FnCallExpr) -> Id {
        if !call.namespace.is_empty() || call.capture_parent_scope {
            return self.push(N::GiveUp);
        }
        let args: Vec<Id> = call.args.iter().map(|a| self.expr(a)).collect();
        let n = if let Some(token) = &call.op_token {
            match (token, args.as_slice()) {
                (Token::Minus | Token::UnaryMinus, &[x]) => N::Neg(x),
                (Token::Bang, &[x]) => N::Not(x),
                (token, &[x, y]) => match binary(token) {
                    Some(op) => N::Binary(op, x, y),
                    None => N::GiveUp,
                },
                _ => N::GiveUp,
            }
        } else if let Some(f) = self.script_fn(&call.name, args.len()) {
            N::Call(id(f), self.list(&args))
        } else {
            match Native::of(&call.name, args.len()) {
                Some(native) => N::Native(native, self.list(&args)),
                None => N::GiveUp,
            }
        };
        self.push(n)
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
        return Some(Lit::Decision(value.clone().cast::<Decision>()));
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
