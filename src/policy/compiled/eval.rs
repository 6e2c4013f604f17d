//! Evaluating [`Compiled`]'s nodes against one request and state.

use std::collections::BTreeMap;
use std::rc::Rc;

use rhai::ImmutableString;

use super::{Compiled, Field, Id, List, Lit, MAX_DEPTH, MAX_NODES, N, Native, Op, S, Step};
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

/// A value during an evaluation; records of `req` and `state`, and the script's constants, are
/// read where they are.
#[derive(Clone)]
enum V<'a> {
    Unit,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(&'a str),
    Own(ImmutableString),
    /// A decision the script wrote as a constant (`admit()`).
    Decided(&'a Decision),
    /// One it made (`redirect(pool)`).
    Made(Rc<Decision>),
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

/// A property or entry name: a [`Field`] when the script wrote `.name` for a name some record
/// has (resolved when it was compiled), else the name's text. A table or map reads the text; a
/// record reads the field, and only a name found at run time that a record is asked for
/// (`req["pool"]`) is looked up among the fields, so indexing a table by a name
/// (`state.pools[req.pool]`) costs no such look-up.
#[derive(Clone, Copy)]
enum Key<'k> {
    Field(Field),
    Name(&'k str),
}

impl<'k> Key<'k> {
    fn field(self) -> Option<Field> {
        match self {
            Key::Field(field) => Some(field),
            Key::Name(name) => Field::of(name),
        }
    }

    fn name(self) -> &'k str {
        match self {
            Key::Field(field) => field.name(),
            Key::Name(name) => name,
        }
    }
}

fn int(v: u64) -> V<'static> {
    V::Int(i64::try_from(v).unwrap_or(i64::MAX))
}

fn from_lit(lit: &Lit) -> V<'_> {
    match lit {
        Lit::Unit => V::Unit,
        Lit::Bool(b) => V::Bool(*b),
        Lit::Int(i) => V::Int(*i),
        Lit::Float(f) => V::Float(*f),
        Lit::Str(s) => V::Str(s.as_str()),
        Lit::Decision(d) => V::Decided(d),
        Lit::Map(m) => V::Map(m.iter().map(|(k, v)| (k.clone(), from_lit(v))).collect()),
    }
}

/// One evaluation's inputs.
pub(crate) struct Inputs<'a> {
    pub req: &'a RequestInfo,
    pub view: &'a StateView,
    pub params: &'a [(ImmutableString, Option<Lit>)],
}

struct Eval<'a> {
    code: &'a Compiled,
    inputs: &'a Inputs<'a>,
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
            Ok(V::Decided(d)) => Some(d.clone()),
            Ok(V::Made(d)) => Some(Rc::unwrap_or_clone(d)),
            _ => None,
        }
    }

    fn members(&self, list: List) -> &[u32] {
        &self.lists[list.range()]
    }
}

impl<'a> Eval<'a> {
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
        let result = match self.block(function.body) {
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

    fn block(&mut self, statements: List) -> R<'a, V<'a>> {
        let code = self.code;
        let mut value = V::Unit;
        for &s in code.members(statements) {
            value = self.stmt(s)?;
        }
        Ok(value)
    }

    fn stmt(&mut self, s: Id) -> R<'a, V<'a>> {
        self.count()?;
        match &self.code.stmts[s as usize] {
            &S::Let(slot, n) | &S::Set(slot, n) => {
                let v = self.expr(n)?;
                self.stack[self.frame + slot as usize] = v;
                Ok(V::Unit)
            }
            &S::Expr(n) => self.expr(n),
            &S::If(guard, then, otherwise) => match self.expr(guard)? {
                V::Bool(true) => self.block(then),
                V::Bool(false) => self.block(otherwise),
                _ => Err(Stop::GiveUp),
            },
            &S::Return(n) => {
                let v = self.expr(n)?;
                Err(Stop::Return(v))
            }
            &S::Block(b) => self.block(b),
            S::GiveUp => Err(Stop::GiveUp),
        }
    }

    /// The value of each of `operands` in turn until one is not `go_on` (`&&` and `||`).
    fn logical(&mut self, operands: List, go_on: bool) -> R<'a, V<'a>> {
        let code = self.code;
        for &o in code.members(operands) {
            match self.expr(o)? {
                V::Bool(b) if b == go_on => {}
                V::Bool(b) => return Ok(V::Bool(b)),
                _ => return Err(Stop::GiveUp),
            }
        }
        Ok(V::Bool(go_on))
    }

    fn expr(&mut self, n: Id) -> R<'a, V<'a>> {
        self.count()?;
        let code = self.code;
        match &code.nodes[n as usize] {
            N::Unit => Ok(V::Unit),
            &N::Bool(b) => Ok(V::Bool(b)),
            &N::Int(i) => Ok(V::Int(i)),
            &N::Float(f) => Ok(V::Float(f)),
            &N::Text(start, len) => Ok(V::Str(&code.text[start as usize..(start + len) as usize])),
            &N::Lit(l) => Ok(from_lit(&code.lits[l as usize])),
            &N::Local(slot) => Ok(self.stack[self.frame + slot as usize].clone()),
            &N::Chain(root, steps) => {
                let mut v = self.expr(root)?;
                for step in &code.steps[steps.range()] {
                    v = match step {
                        &Step::Field(field) => self.member(&v, Key::Field(field))?,
                        Step::Name(name) => self.member(&v, Key::Name(name))?,
                        &Step::Index(index) => {
                            let key = self.expr(index)?;
                            match key.str() {
                                Some(name) => self.member(&v, Key::Name(name))?,
                                None => return Err(Stop::GiveUp),
                            }
                        }
                        &Step::Method(native, args) => {
                            let base = self.push(Some(v), args)?;
                            self.native_on_stack(native, base)?
                        }
                    };
                }
                Ok(v)
            }
            &N::Call(f, args) => {
                let base = self.push(None, args)?;
                self.call(f as usize, base)
            }
            &N::Native(native, args) => {
                let base = self.push(None, args)?;
                self.native_on_stack(native, base)
            }
            &N::Binary(op, x, y) => {
                let x = self.expr(x)?;
                let y = self.expr(y)?;
                binary_op(op, &x, &y)
            }
            &N::Neg(x) => match self.expr(x)? {
                V::Int(i) => i.checked_neg().map(V::Int).ok_or(Stop::GiveUp),
                V::Float(f) => Ok(V::Float(-f)),
                _ => Err(Stop::GiveUp),
            },
            &N::Not(x) => match self.expr(x)? {
                V::Bool(b) => Ok(V::Bool(!b)),
                _ => Err(Stop::GiveUp),
            },
            &N::And(operands) => self.logical(operands, true),
            &N::Or(operands) => self.logical(operands, false),
            &N::Coalesce(operands) => {
                let mut v = V::Unit;
                for &o in code.members(operands) {
                    v = self.expr(o)?;
                    if !matches!(v, V::Unit) {
                        break;
                    }
                }
                Ok(v)
            }
            &N::Interpolated(parts) => {
                let mut text = String::new();
                for &p in code.members(parts) {
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
            &N::Block(b) => self.block(b),
            &N::Map(m) => {
                let entries = &code.maps[m as usize];
                let mut map = Vec::with_capacity(entries.len());
                for (k, v) in entries.iter() {
                    map.push((k.clone(), self.expr(*v)?));
                }
                Ok(V::Map(map.into()))
            }
            N::GiveUp => Err(Stop::GiveUp),
        }
    }

    /// Push `first`, then the values of `nodes`, onto the stack; they start at the index
    /// returned. (Arguments go where a call's frame will be, with no allocation of their own.
    /// Whatever stops part-way leaves them to the enclosing call, which truncates its frame.)
    fn push(&mut self, first: Option<V<'a>>, nodes: List) -> R<'a, usize> {
        let code = self.code;
        let base = self.stack.len();
        self.stack.extend(first);
        for &n in code.members(nodes) {
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
    fn member(&self, v: &V<'a>, key: Key<'_>) -> R<'a, V<'a>> {
        self.field(v, key)?.ok_or(Stop::GiveUp)
    }

    /// `v.name`, or `None` when `v` has no such entry (or is not something with entries). An
    /// entry that is there but that this evaluation does not represent (`state.processes`, a
    /// param that is an array or a map) gives up: saying it is absent would make `in` and
    /// `get` answer differently from Rhai.
    fn field(&self, v: &V<'a>, key: Key<'_>) -> R<'a, Option<V<'a>>> {
        match v {
            V::State if key.field() == Some(Field::Processes) => Err(Stop::GiveUp),
            V::Params => {
                let name = key.name();
                match self.inputs.params.iter().find(|(k, _)| k.as_str() == name) {
                    Some((_, Some(value))) => Ok(Some(from_lit(value))),
                    Some((_, None)) => Err(Stop::GiveUp),
                    None => Ok(None),
                }
            }
            _ => Ok(self.entry(v, key)),
        }
    }

    /// [`Eval::field`] for the entries it represents.
    fn entry(&self, v: &V<'a>, key: Key<'_>) -> Option<V<'a>> {
        let inputs = self.inputs;
        let snapshot = inputs.view.snapshot();
        Some(match v {
            // Records: only their fields.
            V::Req => request_field(inputs.req, key.field()?)?,
            V::Estimate(e) => match key.field()? {
                Field::WeightsBytes => int(e.weights_bytes),
                Field::ContextBytes => int(e.context_bytes),
                Field::WorkspaceBytes => int(e.workspace_bytes),
                Field::TotalBytes => int(e.total_bytes),
                Field::Source => V::Str(e.source.label()),
                _ => return None,
            },
            V::State => match key.field()? {
                Field::Devices => V::Table(Table::Devices),
                Field::Pools => V::Table(Table::Pools),
                Field::Services => V::Table(Table::Services),
                Field::Models => V::Table(Table::Models),
                Field::Host => V::Host(&snapshot.host),
                Field::Degraded => V::Bool(snapshot.degraded),
                Field::Params => V::Params,
                _ => return None,
            },
            V::Pool(p, live) => pool_field(p, live.as_deref(), key.field()?)?,
            V::Device(d) => match key.field()? {
                Field::Kind => V::Str(d.kind.label()),
                Field::TotalBytes => int(d.total_bytes),
                Field::UsedBytes => int(d.used_bytes),
                Field::FreeBytes => int(d.free_bytes),
                Field::ReservedBytes => int(d.reserved_bytes),
                Field::ActiveBytes => int(d.active_bytes),
                Field::HeadroomBytes => int(d.headroom_bytes),
                _ => return None,
            },
            V::Host(h) => match key.field()? {
                Field::MemAvailableBytes => int(h.mem_available_bytes),
                Field::MemTotalBytes => int(h.mem_total_bytes),
                Field::ReserveBytes => int(h.reserve_bytes),
                _ => return None,
            },
            V::Service(s, live) => match key.field()? {
                Field::Class => V::Str(&s.class),
                Field::Priority => V::Int(s.priority),
                Field::Running => int(live.as_ref().map_or(s.running, |now| now.running)),
                Field::Concurrency => int(s.concurrency),
                Field::BudgetBytes => int(s.budget_bytes),
                Field::MemoryBytes => match live {
                    Some(now) => V::OwnCounts(Rc::new(now.memory_bytes.clone())),
                    None => V::Counts(&s.memory_bytes),
                },
                _ => return None,
            },
            V::Model(m) => match key.field()? {
                Field::Priority => V::Int(m.priority),
                Field::Residency => V::Str(&m.residency),
                Field::Pools => V::Table(Table::ModelPools(m)),
                _ => return None,
            },
            V::ModelPool(p) => match key.field()? {
                Field::Resident => V::Bool(p.resident),
                Field::Busy => int(p.busy),
                Field::IdleMs => int(p.idle_ms),
                Field::LoadedMsAgo => int(p.loaded_ms_ago),
                Field::WeightsBytes => int(p.weights_bytes),
                Field::HostTier => V::Bool(p.host_tier),
                Field::ReloadMs => int(p.reload_ms),
                _ => return None,
            },
            // Tables and maps: any name.
            V::Counts(counts) => int(*counts.get(key.name())?),
            V::OwnCounts(counts) => int(*counts.get(key.name())?),
            V::Table(table) => match table {
                Table::Devices => V::Device(snapshot.devices.get(key.name())?),
                Table::Pools => {
                    let pool = snapshot.pools.get(key.name())?;
                    V::Pool(pool, self.live.and_then(|l| l.pool_load(key.name())).map(Rc::new))
                }
                Table::Services => {
                    let service = snapshot.services.get(key.name())?;
                    V::Service(service, self.live.and_then(|l| l.service_now(key.name())).map(Rc::new))
                }
                Table::Models => V::Model(snapshot.models.get(key.name())?),
                Table::ModelPools(model) => V::ModelPool(model.pools.get(key.name())?),
            },
            V::Map(entries) => entries.iter().find(|(k, _)| k.as_str() == key.name())?.1.clone(),
            _ => return None,
        })
    }

    /// Whether `v` is something with named entries (a map, a record or a table).
    fn has_entries(v: &V<'a>) -> bool {
        !matches!(
            v,
            V::Unit | V::Bool(_) | V::Int(_) | V::Float(_) | V::Str(_) | V::Own(_) | V::Decided(_) | V::Made(_)
        )
    }

    fn native(&self, native: Native, args: &[V<'a>]) -> R<'a, V<'a>> {
        let give_up = Err(Stop::GiveUp);
        let decision = |d: Decision| Ok(V::Made(Rc::new(d)));
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
                Ok(V::Bool(self.field(container, Key::Name(key))?.is_some()))
            }
            (Native::Get, [container, key]) if Self::has_entries(container) => {
                let key = key.str().ok_or(Stop::GiveUp)?;
                Ok(self.field(container, Key::Name(key))?.unwrap_or(V::Unit))
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

fn request_field(req: &RequestInfo, field: Field) -> Option<V<'_>> {
    Some(match field {
        Field::Id => V::Str(&req.id),
        Field::Model => V::Str(&req.model),
        Field::Pool => V::Str(&req.pool),
        Field::Service => V::Str(&req.service),
        Field::ContextTokens => int(req.context_tokens),
        Field::MaxNewTokens => int(req.max_new_tokens),
        Field::Batch => int(req.batch),
        Field::Priority => V::Int(req.priority),
        Field::Replayable => V::Bool(req.replayable),
        Field::AllowShrink => V::Bool(req.allow_shrink),
        Field::DeadlineMs => int(req.deadline_ms),
        Field::Estimate => V::Estimate(&req.estimate),
        Field::Dims => V::Counts(&req.dims),
        Field::LoadBytes => int(req.load_bytes),
        Field::EvictableBytes => int(req.evictable_bytes),
        _ => return None,
    })
}

/// A pool's field, its load read live when the server keeps it so (as `values::Table::read`).
fn pool_field<'a>(p: &'a PoolState, live: Option<&PoolLoadNow>, field: Field) -> Option<V<'a>> {
    Some(match (field, live) {
        (Field::Provider, _) => V::Str(p.provider.label()),
        (Field::Device, _) => V::Str(&p.device),
        (Field::Breaker, Some(l)) => V::Str(l.breaker.label()),
        (Field::Breaker, None) => V::Str(p.breaker.label()),
        (Field::QueueDepth, l) => int(l.map_or(p.queue_depth, |l| l.queue_depth)),
        (Field::QueueOldestAgeMs, l) => int(l.map_or(p.queue_oldest_age_ms, |l| l.queue_oldest_age_ms)),
        (Field::Inflight, l) => int(l.map_or(p.inflight, |l| l.inflight)),
        (Field::Concurrency, _) => int(p.concurrency),
        (Field::AllocFailuresRecent, l) => int(l.map_or(p.alloc_failures_recent, |l| l.alloc_failures_recent)),
        (Field::EstDelayMs, l) => int(l.map_or(p.est_delay_ms, |l| l.est_delay_ms)),
        (Field::MaxContext, _) => int(p.max_context),
        (Field::SequencesWaiting, l) => int(l.map_or(p.sequences_waiting, |l| l.sequences_waiting)),
        (Field::SequencesRunning, l) => int(l.map_or(p.sequences_running, |l| l.sequences_running)),
        (Field::KvCacheBytes, l) => int(l.map_or(p.kv_cache_bytes, |l| l.kv_cache_bytes)),
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
