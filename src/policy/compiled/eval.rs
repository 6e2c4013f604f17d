//! Evaluating [`Compiled`]'s nodes against one request and state.

use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;

use rhai::ImmutableString;

use super::{Compiled, Lit, MAX_DEPTH, MAX_NODES, N, Native, Op, S, Step};
use crate::core::snapshot::{
    Decision, DeviceState, Estimate, HostState, ModelOnPoolState, ModelState, PoolState, RequestInfo, ServiceState,
};
use crate::policy::accept;
use crate::policy::values::{LiveLoad, PoolLoadNow, ServiceNow, StateView};

/// Why an evaluation stopped before its end.
enum Stop<'a> {
    /// Leave it to Rhai.
    GiveUp,
    /// `return`, unwinding to the function's call.
    Return(V<'a>),
}

type R<'a, T> = Result<T, Stop<'a>>;

/// A value during an evaluation; records of `req` and `state` are read where they are.
#[derive(Clone)]
enum V<'a> {
    Unit,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(&'a str),
    Own(ImmutableString),
    Decision(Arc<Decision>),
    Map(Rc<[(ImmutableString, V<'a>)]>),
    Req,
    Estimate(&'a Estimate),
    Counts(&'a BTreeMap<String, u64>),
    OwnCounts(Rc<BTreeMap<String, u64>>),
    State,
    Params,
    Table(Table<'a>),
    Pool(&'a PoolState, Option<Rc<PoolLoadNow>>),
    Device(&'a DeviceState),
    Host(&'a HostState),
    Service(&'a ServiceState, Option<Rc<ServiceNow>>),
    Model(&'a ModelState),
    ModelPool(&'a ModelOnPoolState),
}

#[derive(Clone, Copy)]
enum Table<'a> {
    Devices,
    Pools,
    Services,
    Models,
    ModelPools(&'a ModelState),
}

impl<'a> V<'a> {
    fn str(&self) -> Option<&str> {
        match self {
            V::Str(s) => Some(s),
            V::Own(s) => Some(s.as_str()),
            _ => None,
        }
    }
}

fn int(v: u64) -> V<'static> {
    V::Int(i64::try_from(v).unwrap_or(i64::MAX))
}

fn from_lit<'a>(lit: &Lit) -> V<'a> {
    match lit {
        Lit::Unit => V::Unit,
        Lit::Bool(b) => V::Bool(*b),
        Lit::Int(i) => V::Int(*i),
        Lit::Float(f) => V::Float(*f),
        Lit::Str(s) => V::Own(s.clone()),
        Lit::Decision(d) => V::Decision(Arc::clone(d)),
        Lit::Map(m) => V::Map(m.iter().map(|(k, v)| (k.clone(), from_lit(v))).collect()),
    }
}

/// One evaluation's inputs.
pub(crate) struct Inputs<'a> {
    pub req: &'a RequestInfo,
    pub view: &'a StateView,
    pub params: &'a [(ImmutableString, Option<Lit>)],
}

struct Eval<'a, 'c> {
    code: &'c Compiled,
    inputs: &'c Inputs<'a>,
    live: Option<&'a dyn LiveLoad>,
    stack: Vec<V<'a>>,
    frame: usize,
    nodes: u32,
    depth: u32,
}

impl Compiled {
    /// `decide` for `inputs`, or `None` to leave it to Rhai.
    pub(crate) fn decide(&self, inputs: &Inputs<'_>) -> Option<Decision> {
        let mut eval = Eval {
            code: self,
            inputs,
            live: inputs.view.live(),
            stack: Vec::with_capacity(32),
            frame: 0,
            nodes: 0,
            depth: 0,
        };
        eval.stack.extend([V::Req, V::State]);
        match eval.call(self.decide, 0) {
            Ok(V::Decision(d)) => Some(Arc::unwrap_or_clone(d)),
            _ => None,
        }
    }
}

impl<'a> Eval<'a, '_> {
    /// Call script function `f` with the arguments on the stack from `base` on.
    fn call(&mut self, f: usize, base: usize) -> R<'a, V<'a>> {
        let function = &self.code.functions[f];
        // Rhai counts every variable alive in all frames against its limit; this stack holds
        // at least as many (every `let` of each frame, and arguments on their way), so one far
        // below the limit is always within Rhai's.
        let crowded = base + function.slots > crate::policy::MAX_VARIABLES / 2;
        if self.stack.len() - base != function.params || self.depth >= MAX_DEPTH || crowded {
            return Err(Stop::GiveUp);
        }
        self.depth += 1;
        let outer = self.frame;
        self.stack.resize(base + function.slots, V::Unit);
        self.frame = base;
        let result = match self.block(&function.body) {
            Ok(v) | Err(Stop::Return(v)) => Ok(v),
            Err(Stop::GiveUp) => Err(Stop::GiveUp),
        };
        self.stack.truncate(base);
        self.frame = outer;
        self.depth -= 1;
        result
    }

    fn count(&mut self) -> R<'a, ()> {
        self.nodes += 1;
        if self.nodes > MAX_NODES {
            return Err(Stop::GiveUp);
        }
        Ok(())
    }

    fn block(&mut self, statements: &[S]) -> R<'a, V<'a>> {
        let mut value = V::Unit;
        for s in statements {
            value = self.stmt(s)?;
        }
        Ok(value)
    }

    fn stmt(&mut self, s: &S) -> R<'a, V<'a>> {
        self.count()?;
        match s {
            S::Let(slot, n) | S::Set(slot, n) => {
                let v = self.expr(n)?;
                self.stack[self.frame + slot] = v;
                Ok(V::Unit)
            }
            S::Expr(n) => self.expr(n),
            S::If(guard, then, otherwise) => match self.expr(guard)? {
                V::Bool(true) => self.block(then),
                V::Bool(false) => self.block(otherwise),
                _ => Err(Stop::GiveUp),
            },
            S::Return(n) => {
                let v = self.expr(n)?;
                Err(Stop::Return(v))
            }
            S::Block(b) => self.block(b),
            S::GiveUp => Err(Stop::GiveUp),
        }
    }

    fn expr(&mut self, n: &N) -> R<'a, V<'a>> {
        self.count()?;
        match n {
            N::Lit(l) => Ok(from_lit(l)),
            N::Local(slot) => Ok(self.stack[self.frame + slot].clone()),
            N::Chain(root, steps) => {
                let mut v = self.expr(root)?;
                for step in steps {
                    v = match step {
                        Step::Property(name) => self.member(&v, name)?,
                        Step::Index(index) => {
                            let key = self.expr(index)?;
                            match key.str() {
                                Some(name) => self.member(&v, name)?,
                                None => return Err(Stop::GiveUp),
                            }
                        }
                        Step::Method(native, args) => {
                            let base = self.push(Some(v), args)?;
                            self.native_on_stack(*native, base)?
                        }
                    };
                }
                Ok(v)
            }
            N::Call(f, args) => {
                let base = self.push(None, args)?;
                self.call(*f, base)
            }
            N::Native(native, args) => {
                let base = self.push(None, args)?;
                self.native_on_stack(*native, base)
            }
            N::Binary(op, operands) => {
                let x = self.expr(&operands.0)?;
                let y = self.expr(&operands.1)?;
                binary_op(*op, &x, &y)
            }
            N::Neg(x) => match self.expr(x)? {
                V::Int(i) => i.checked_neg().map(V::Int).ok_or(Stop::GiveUp),
                V::Float(f) => Ok(V::Float(-f)),
                _ => Err(Stop::GiveUp),
            },
            N::Not(x) => match self.expr(x)? {
                V::Bool(b) => Ok(V::Bool(!b)),
                _ => Err(Stop::GiveUp),
            },
            N::And(operands) => {
                for o in operands {
                    match self.expr(o)? {
                        V::Bool(true) => {}
                        V::Bool(false) => return Ok(V::Bool(false)),
                        _ => return Err(Stop::GiveUp),
                    }
                }
                Ok(V::Bool(true))
            }
            N::Or(operands) => {
                for o in operands {
                    match self.expr(o)? {
                        V::Bool(false) => {}
                        V::Bool(true) => return Ok(V::Bool(true)),
                        _ => return Err(Stop::GiveUp),
                    }
                }
                Ok(V::Bool(false))
            }
            N::Coalesce(operands) => {
                let mut v = V::Unit;
                for o in operands {
                    v = self.expr(o)?;
                    if !matches!(v, V::Unit) {
                        break;
                    }
                }
                Ok(v)
            }
            N::Interpolated(parts) => {
                let mut text = String::new();
                for p in parts {
                    match self.expr(p)? {
                        V::Int(i) => text.push_str(&i.to_string()),
                        V::Bool(b) => text.push_str(if b { "true" } else { "false" }),
                        v => text.push_str(v.str().ok_or(Stop::GiveUp)?),
                    }
                }
                if text.len() > crate::policy::MAX_STRING_SIZE {
                    return Err(Stop::GiveUp);
                }
                Ok(V::Own(text.into()))
            }
            N::Block(b) => self.block(b),
            N::Map(entries) => {
                let mut map = Vec::with_capacity(entries.len());
                for (k, v) in entries {
                    map.push((k.clone(), self.expr(v)?));
                }
                Ok(V::Map(map.into()))
            }
            N::GiveUp => Err(Stop::GiveUp),
        }
    }

    /// Push `first`, then the values of `nodes`, onto the stack; they start at the index
    /// returned. (Arguments go where a call's frame will be, with no allocation of their own.
    /// Whatever stops part-way leaves them to the enclosing call, which truncates its frame.)
    fn push(&mut self, first: Option<V<'a>>, nodes: &[N]) -> R<'a, usize> {
        let base = self.stack.len();
        self.stack.extend(first);
        for n in nodes {
            let v = self.expr(n)?;
            self.stack.push(v);
        }
        Ok(base)
    }

    /// [`Eval::native`] on the values on the stack from `base` on, which it then pops.
    fn native_on_stack(&mut self, native: Native, base: usize) -> R<'a, V<'a>> {
        let result = self.native(native, &self.stack[base..]);
        self.stack.truncate(base);
        result
    }

    /// `v.name` (and `v["name"]`): a field of a record, an entry of a table or map.
    fn member(&self, v: &V<'a>, name: &str) -> R<'a, V<'a>> {
        self.field(v, name)?.ok_or(Stop::GiveUp)
    }

    /// `v.name`, or `None` when `v` has no such entry (or is not something with entries). An
    /// entry that is there but that this evaluation does not represent (`state.processes`, a
    /// param that is an array or a map) gives up: saying it is absent would make `in` and
    /// `get` answer differently from Rhai.
    fn field(&self, v: &V<'a>, name: &str) -> R<'a, Option<V<'a>>> {
        let unrepresented = match v {
            V::State => name == "processes",
            V::Params => (self.inputs.params.iter()).any(|(k, value)| k.as_str() == name && value.is_none()),
            _ => false,
        };
        match unrepresented {
            true => Err(Stop::GiveUp),
            false => Ok(self.entry(v, name)),
        }
    }

    /// [`Eval::field`] for the entries it represents.
    fn entry(&self, v: &V<'a>, name: &str) -> Option<V<'a>> {
        let snapshot = self.inputs.view.snapshot();
        Some(match v {
            V::Req => request_field(self.inputs.req, name)?,
            V::Estimate(e) => match name {
                "weights_bytes" => int(e.weights_bytes),
                "context_bytes" => int(e.context_bytes),
                "workspace_bytes" => int(e.workspace_bytes),
                "total_bytes" => int(e.total_bytes),
                "source" => V::Str(e.source.label()),
                _ => return None,
            },
            V::Counts(counts) => int(*counts.get(name)?),
            V::OwnCounts(counts) => int(*counts.get(name)?),
            V::State => match name {
                "devices" => V::Table(Table::Devices),
                "pools" => V::Table(Table::Pools),
                "services" => V::Table(Table::Services),
                "models" => V::Table(Table::Models),
                "host" => V::Host(&snapshot.host),
                "degraded" => V::Bool(snapshot.degraded),
                "params" => V::Params,
                _ => return None,
            },
            V::Params => {
                let (_, value) = self.inputs.params.iter().find(|(k, _)| k.as_str() == name)?;
                from_lit(value.as_ref()?)
            }
            V::Table(table) => match table {
                Table::Devices => V::Device(snapshot.devices.get(name)?),
                Table::Pools => {
                    let pool = snapshot.pools.get(name)?;
                    V::Pool(pool, self.live.and_then(|l| l.pool_load(name)).map(Rc::new))
                }
                Table::Services => {
                    let service = snapshot.services.get(name)?;
                    V::Service(service, self.live.and_then(|l| l.service_now(name)).map(Rc::new))
                }
                Table::Models => V::Model(snapshot.models.get(name)?),
                Table::ModelPools(model) => V::ModelPool(model.pools.get(name)?),
            },
            V::Pool(p, live) => pool_field(p, live.as_deref(), name)?,
            V::Device(d) => match name {
                "kind" => V::Str(d.kind.label()),
                "total_bytes" => int(d.total_bytes),
                "used_bytes" => int(d.used_bytes),
                "free_bytes" => int(d.free_bytes),
                "reserved_bytes" => int(d.reserved_bytes),
                "active_bytes" => int(d.active_bytes),
                "headroom_bytes" => int(d.headroom_bytes),
                _ => return None,
            },
            V::Host(h) => match name {
                "mem_available_bytes" => int(h.mem_available_bytes),
                "mem_total_bytes" => int(h.mem_total_bytes),
                "reserve_bytes" => int(h.reserve_bytes),
                _ => return None,
            },
            V::Service(s, live) => match name {
                "class" => V::Str(&s.class),
                "priority" => V::Int(s.priority),
                "running" => int(live.as_ref().map_or(s.running, |now| now.running)),
                "concurrency" => int(s.concurrency),
                "budget_bytes" => int(s.budget_bytes),
                "memory_bytes" => match live {
                    Some(now) => V::OwnCounts(Rc::new(now.memory_bytes.clone())),
                    None => V::Counts(&s.memory_bytes),
                },
                _ => return None,
            },
            V::Model(m) => match name {
                "priority" => V::Int(m.priority),
                "residency" => V::Str(&m.residency),
                "pools" => V::Table(Table::ModelPools(m)),
                _ => return None,
            },
            V::ModelPool(p) => match name {
                "resident" => V::Bool(p.resident),
                "busy" => int(p.busy),
                "idle_ms" => int(p.idle_ms),
                "loaded_ms_ago" => int(p.loaded_ms_ago),
                "weights_bytes" => int(p.weights_bytes),
                _ => return None,
            },
            V::Map(entries) => entries.iter().find(|(k, _)| k.as_str() == name)?.1.clone(),
            _ => return None,
        })
    }

    /// Whether `v` is something with named entries (a map, a record or a table).
    fn has_entries(v: &V<'a>) -> bool {
        !matches!(
            v,
            V::Unit | V::Bool(_) | V::Int(_) | V::Float(_) | V::Str(_) | V::Own(_) | V::Decision(_)
        )
    }

    fn native(&self, native: Native, args: &[V<'a>]) -> R<'a, V<'a>> {
        let give_up = Err(Stop::GiveUp);
        let decision = |d: Decision| Ok(V::Decision(Arc::new(d)));
        match (native, args) {
            (Native::Admit, []) => decision(Decision::Admit { pool: None }),
            (Native::Admit, [pool]) => decision(Decision::Admit {
                pool: Some(pool_name(pool)?),
            }),
            (Native::Defer, [ms]) => decision(Decision::Defer { ms: amount(ms)? }),
            (Native::Shrink, [tokens]) => match amount(tokens)? {
                0 => give_up,
                tokens => decision(Decision::ShrinkContext { tokens }),
            },
            (Native::Redirect, [pool]) => decision(Decision::Redirect { pool: pool_name(pool)? }),
            (Native::MakeRoom, [pool]) => decision(Decision::MakeRoom {
                pool: pool_name(pool)?,
                bytes: None,
            }),
            (Native::MakeRoom, [pool, bytes]) => decision(Decision::MakeRoom {
                pool: pool_name(pool)?,
                bytes: Some(amount(bytes)?),
            }),
            (Native::Reject, [reason]) => match reason.str() {
                Some(r) if accept::not_blank(r) => decision(Decision::Reject { reason: r.to_string() }),
                _ => give_up,
            },
            (Native::Contains, [container, key]) if Self::has_entries(container) => {
                let key = key.str().ok_or(Stop::GiveUp)?;
                Ok(V::Bool(self.field(container, key)?.is_some()))
            }
            (Native::Get, [container, key]) if Self::has_entries(container) => {
                let key = key.str().ok_or(Stop::GiveUp)?;
                Ok(self.field(container, key)?.unwrap_or(V::Unit))
            }
            (Native::Len | Native::IsEmpty, [v]) => {
                let snapshot = self.inputs.view.snapshot();
                let len = match v {
                    V::Table(Table::Devices) => snapshot.devices.len(),
                    V::Table(Table::Pools) => snapshot.pools.len(),
                    V::Table(Table::Services) => snapshot.services.len(),
                    V::Table(Table::Models) => snapshot.models.len(),
                    V::Table(Table::ModelPools(m)) => m.pools.len(),
                    V::Counts(c) => c.len(),
                    V::OwnCounts(c) => c.len(),
                    V::Map(m) => m.len(),
                    V::Params => self.inputs.params.len(),
                    V::Str(_) | V::Own(_) => v.str().map_or(0, |s| s.chars().count()),
                    _ => return give_up,
                };
                Ok(match native {
                    Native::Len => V::Int(i64::try_from(len).unwrap_or(i64::MAX)),
                    _ => V::Bool(len == 0),
                })
            }
            (Native::ToFloat, [V::Int(i)]) => Ok(V::Float(*i as f64)),
            (Native::ToInt, [V::Float(f)]) => {
                if f.is_nan() || *f > i64::MAX as f64 || *f < i64::MIN as f64 {
                    give_up
                } else {
                    Ok(V::Int(*f as i64))
                }
            }
            (Native::Floor, [V::Float(f)]) => Ok(V::Float(f.floor())),
            _ => give_up,
        }
    }
}

fn request_field<'a>(req: &'a RequestInfo, name: &str) -> Option<V<'a>> {
    Some(match name {
        "id" => V::Str(&req.id),
        "model" => V::Str(&req.model),
        "pool" => V::Str(&req.pool),
        "service" => V::Str(&req.service),
        "context_tokens" => int(req.context_tokens),
        "max_new_tokens" => int(req.max_new_tokens),
        "batch" => int(req.batch),
        "priority" => V::Int(req.priority),
        "replayable" => V::Bool(req.replayable),
        "allow_shrink" => V::Bool(req.allow_shrink),
        "deadline_ms" => int(req.deadline_ms),
        "estimate" => V::Estimate(&req.estimate),
        "dims" => V::Counts(&req.dims),
        "load_bytes" => int(req.load_bytes),
        "evictable_bytes" => int(req.evictable_bytes),
        _ => return None,
    })
}

/// A pool's field, its load read live when the server keeps it so (as `values::Table::read`).
fn pool_field<'a>(p: &'a PoolState, live: Option<&PoolLoadNow>, name: &str) -> Option<V<'a>> {
    Some(match (name, live) {
        ("provider", _) => V::Str(p.provider.label()),
        ("device", _) => V::Str(&p.device),
        ("breaker", Some(l)) => V::Str(l.breaker.label()),
        ("breaker", None) => V::Str(p.breaker.label()),
        ("queue_depth", l) => int(l.map_or(p.queue_depth, |l| l.queue_depth)),
        ("queue_oldest_age_ms", l) => int(l.map_or(p.queue_oldest_age_ms, |l| l.queue_oldest_age_ms)),
        ("inflight", l) => int(l.map_or(p.inflight, |l| l.inflight)),
        ("concurrency", _) => int(p.concurrency),
        ("alloc_failures_recent", l) => int(l.map_or(p.alloc_failures_recent, |l| l.alloc_failures_recent)),
        ("est_delay_ms", l) => int(l.map_or(p.est_delay_ms, |l| l.est_delay_ms)),
        ("max_context", _) => int(p.max_context),
        ("sequences_waiting", l) => int(l.map_or(p.sequences_waiting, |l| l.sequences_waiting)),
        ("sequences_running", l) => int(l.map_or(p.sequences_running, |l| l.sequences_running)),
        ("kv_cache_bytes", l) => int(l.map_or(p.kv_cache_bytes, |l| l.kv_cache_bytes)),
        _ => return None,
    })
}

/// A pool name a decision constructor accepts.
fn pool_name<'a>(v: &V<'a>) -> R<'a, String> {
    match v.str() {
        Some(pool) if accept::not_blank(pool) => Ok(pool.to_string()),
        _ => Err(Stop::GiveUp),
    }
}

/// Milliseconds, tokens or bytes a decision constructor accepts.
fn amount<'a>(v: &V<'a>) -> R<'a, u64> {
    match v {
        V::Int(i) => accept::count_of_int(*i),
        V::Float(f) => accept::count_of_float(*f),
        _ => None,
    }
    .ok_or(Stop::GiveUp)
}

/// Rhai's built-in operators on the values they are built in for: integers checked, floats
/// (and an integer with a float) compared within a relative epsilon as a checked build does.
fn binary_op<'a>(op: Op, x: &V<'a>, y: &V<'a>) -> R<'a, V<'a>> {
    let give_up = Err(Stop::GiveUp);
    match (x, y) {
        (V::Int(a), V::Int(b)) => {
            let (a, b) = (*a, *b);
            Ok(match op {
                Op::Add => V::Int(a.checked_add(b).ok_or(Stop::GiveUp)?),
                Op::Sub => V::Int(a.checked_sub(b).ok_or(Stop::GiveUp)?),
                Op::Mul => V::Int(a.checked_mul(b).ok_or(Stop::GiveUp)?),
                Op::Div if b == 0 => return give_up,
                Op::Div => V::Int(a.checked_div(b).ok_or(Stop::GiveUp)?),
                Op::Rem => V::Int(a.checked_rem(b).ok_or(Stop::GiveUp)?),
                Op::Eq => V::Bool(a == b),
                Op::Ne => V::Bool(a != b),
                Op::Lt => V::Bool(a < b),
                Op::Le => V::Bool(a <= b),
                Op::Gt => V::Bool(a > b),
                Op::Ge => V::Bool(a >= b),
            })
        }
        (V::Float(_) | V::Int(_), V::Float(_) | V::Int(_)) => {
            let float = |v: &V| match v {
                V::Float(f) => *f,
                V::Int(i) => *i as f64,
                _ => unreachable!("matched as a number"),
            };
            let (a, b) = (float(x), float(y));
            Ok(match op {
                Op::Add => V::Float(a + b),
                Op::Sub => V::Float(a - b),
                Op::Mul => V::Float(a * b),
                Op::Div => V::Float(a / b),
                Op::Rem => V::Float(a % b),
                compare => V::Bool(float_compare(compare, a, b)),
            })
        }
        (V::Bool(a), V::Bool(b)) => Ok(V::Bool(match op {
            Op::Eq => a == b,
            Op::Ne => a != b,
            _ => return give_up,
        })),
        _ => match (x.str(), y.str()) {
            (Some(a), Some(b)) => Ok(match op {
                Op::Add if a.len() + b.len() > crate::policy::MAX_STRING_SIZE => return give_up,
                Op::Add => V::Own(format!("{a}{b}").into()),
                Op::Eq => V::Bool(a == b),
                Op::Ne => V::Bool(a != b),
                Op::Lt => V::Bool(a < b),
                Op::Le => V::Bool(a <= b),
                Op::Gt => V::Bool(a > b),
                Op::Ge => V::Bool(a >= b),
                _ => return give_up,
            }),
            _ => give_up,
        },
    }
}

/// A checked Rhai build's float comparison: equal within a relative `f64::EPSILON`.
fn float_compare(op: Op, x: f64, y: f64) -> bool {
    let max = if x * y == 0.0 { 1.0 } else { x.abs().max(y.abs()) };
    if max == 0.0 {
        return matches!(op, Op::Eq | Op::Ge | Op::Le);
    }
    match op {
        Op::Eq => (x - y).abs() / max <= f64::EPSILON,
        Op::Ne => (x - y).abs() / max > f64::EPSILON,
        Op::Gt => (x - y) / max > f64::EPSILON,
        Op::Ge => (x - y) / max > -f64::EPSILON,
        Op::Lt => (y - x) / max > f64::EPSILON,
        Op::Le => (y - x) / max > -f64::EPSILON,
        _ => unreachable!("only comparisons"),
    }
}
