//! Never fits or not now. A request whose estimate is more than any pool serving its model could
//! ever give it (a device's whole capacity less the weights of the other models resident on it,
//! the host's memory less its reserve, a pool's `max_context`) can never run here, however long
//! it waits: it is the client's to make smaller, so it is answered at once as a client error
//! that says how much it asked, the most that fits and the axis to cut, with no `Retry-After`.
//! Only what may pass (headroom taken by others, queues, an open breaker) is "not now".
//!
//! A request the client allows to be shrunk is left to the policy, which may cut it to fit.

use std::fmt;

use crate::core::human::human_bytes;
use crate::core::snapshot::{Estimate, Snapshot};
use crate::pool::Pool;
use crate::runtime::estimate::{AxisRole, Dims};
use crate::serve::service::{Memory, ModelEntry, Service, memory_of};

use super::Request;

/// Why a request can never run on any pool serving its model.
#[derive(Debug, Clone, PartialEq)]
pub struct NeverFits {
    /// The model.
    pub model: String,
    /// The request's estimated need in bytes.
    pub need_bytes: u64,
    /// Its context length (tokens along the context axis; for a generation, the prompt plus
    /// the tokens it may add).
    pub tokens: u64,
    /// The most any serving pool could ever give a run of this model, with the pool and how
    /// that figure is made; `None` when no pool takes a context this long at all.
    pub largest: Option<Ceiling>,
    /// The longest context that would fit (with the same batch), when the model has a context.
    pub max_tokens: Option<u64>,
    /// What to cut, as the client sends it (`input` axis 1, or the prompt and max_tokens).
    pub axis: Option<String>,
    /// The input's size along each dynamic axis, as the estimate read it.
    pub dims: Vec<(String, u64)>,
    /// Why the model's `fallback_model` did not answer instead, when it was asked.
    pub substitute: Option<String>,
}

/// The most one pool could ever give one run.
#[derive(Debug, Clone, PartialEq)]
pub struct Ceiling {
    /// The pool.
    pub pool: String,
    /// Bytes.
    pub bytes: u64,
    /// How the figure is made, for the message (`device gpu0 of 128 MiB`).
    pub what: String,
    /// The longest context the pool takes (`pools[].max_context`).
    pub max_context: Option<u64>,
}

impl fmt::Display for NeverFits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` can never fit here: it needs an estimated {}",
            self.model,
            human_bytes(self.need_bytes)
        )?;
        if self.tokens > 0 {
            write!(f, " for {} tokens", self.tokens)?;
        } else if !self.dims.is_empty() {
            let sizes: Vec<String> = self.dims.iter().map(|(name, v)| format!("{name}={v}")).collect();
            write!(f, " for an input of {}", sizes.join(", "))?;
        }
        match &self.largest {
            Some(c) => write!(
                f,
                ", and the most any pool serving it can ever give is {} (pool `{}`: {})",
                human_bytes(c.bytes),
                c.pool,
                c.what
            )?,
            None => write!(f, ", longer than any pool serving it takes (pools[].max_context)")?,
        }
        if let (Some(max), Some(axis)) = (self.max_tokens, &self.axis) {
            write!(f, "; send at most {max} tokens ({axis})")?;
        }
        if self.axis.is_some() {
            write!(f, ", or allow the context to be cut (x-vramguard-allow-shrink: true)")?;
        }
        if let Some(note) = &self.substitute {
            write!(f, "; {note}")?;
        }
        Ok(())
    }
}

/// Whether `request`, estimated at `estimate` for a run of `dims`, can never run on a pool
/// serving `entry`'s model; `None` when some pool could take it some day, when one cannot be
/// judged (a remote pool, no memory reading yet), or when the client lets its context be cut
/// (the policy may shrink it to fit).
pub(super) fn never_fits(
    service: &Service,
    entry: &ModelEntry,
    request: &Request,
    estimate: &Estimate,
    dims: &Dims,
) -> Option<NeverFits> {
    // A context axis, or a decoder's prompt: what a client could send less of.
    let can_shrink = entry.config.context.is_some() || entry.kind.decoder().is_some();
    if request.meta.allow_shrink && can_shrink {
        return None;
    }
    let model = entry.config.name.as_str();
    let (tokens, _) = entry.tokens_and_batch(dims);
    let snapshot = &service.store.latest().snapshot;
    let serving = || service.pools.iter().filter(|p| p.serves(model));
    // Every request passes here: the numbers first, and words only for a request refused.
    for pool in serving() {
        let room = room(service, pool, model, snapshot)?;
        if fits_under(room.bytes, room.max_context, estimate.total_bytes, tokens) {
            return None;
        }
    }
    let ceilings: Vec<Ceiling> = serving()
        .filter_map(|pool| Some(room(service, pool, model, snapshot)?.ceiling(pool)))
        .collect();
    let axis = can_shrink.then(|| match &entry.config.context {
        Some(ctx) => format!("input `{}` axis {}", ctx.input, ctx.axis),
        None => "the prompt and max_tokens together".to_string(),
    });
    // The same request with another context length (every other dimension as sent).
    let context = entry.profile.axis_with(AxisRole::Context);
    let need_at = |t: u64| match context {
        Some(i) => entry.estimate(&dims.with(i, t)).total_bytes,
        None => estimate.total_bytes,
    };
    let mut never = judge(
        model,
        estimate,
        (tokens, request.max_new_tokens),
        &ceilings,
        axis,
        &need_at,
    )?;
    let sent = entry.dims_of(&request.inputs);
    never.dims = (entry.profile.axes.iter().enumerate())
        .map(|(i, a)| (a.name.clone(), sent.get(i)))
        .collect();
    Some(never)
}

/// Whether a run of `entry`'s model estimated at `estimate` is one admission lets run on `pool`
/// now, in the numbers it reads: under what the pool could ever give it; on the host, with
/// the host keeping its reserve after it (the host-RAM guard); on a device, its working memory
/// (and its weights, when they are not loaded there) within the device's headroom less the
/// policy's `reserve_bytes`. A pool whose memory cannot be read (a remote one, no sample yet)
/// is not judged here. The batcher grows a batch only while this holds.
pub fn fits_now(service: &Service, entry: &ModelEntry, pool: &Pool, estimate: &Estimate) -> bool {
    let model = entry.config.name.as_str();
    let snapshot = &service.store.latest().snapshot;
    let run = estimate.context_bytes.saturating_add(estimate.workspace_bytes);
    let need = match pool.residency().holds_weights_of(model) {
        true => run,
        false => run.saturating_add(service.weights_on(pool, entry)),
    };
    if let Some(room) = room(service, pool, model, snapshot)
        && need > room.bytes
    {
        return false;
    }
    match memory_of(pool) {
        Some(Memory::Host) => super::run::host_keeps_reserve(service, pool, need).is_ok(),
        Some(Memory::Device(device)) => snapshot.devices.get(device).is_none_or(|d| {
            let reserve = reserve_bytes(service).unwrap_or(0);
            need <= d.headroom_bytes.saturating_sub(reserve)
        }),
        None => true,
    }
}

/// The most tokens, of at most `want`, that `generations` generations of `entry`'s model may
/// add to a prompt of `prompt` tokens and still fit what some pool serving it could ever give
/// (its memory's and `max_context`'s ceiling, as [`never_fits`] judges): what a request that
/// leaves `max_tokens` out is given. `want` when a pool's ceiling cannot be known (a remote
/// pool, no memory reading yet); 0 when not even the prompt fits.
pub fn longest_generation(service: &Service, entry: &ModelEntry, prompt: u64, generations: u64, want: u64) -> u64 {
    let model = entry.config.name.as_str();
    let snapshot = &service.store.latest().snapshot;
    let need_at = |tokens: u64| entry.estimate_tokens(tokens, generations.max(1)).total_bytes;
    let mut longest = 0;
    for pool in service.pools.iter().filter(|p| p.serves(model)) {
        let Some(room) = room(service, pool, model, snapshot) else {
            return want;
        };
        let cap = room.max_context.unwrap_or(u64::MAX).min(prompt.saturating_add(want));
        longest = longest.max(longest_within(&need_at, 0, cap, room.bytes).saturating_sub(prompt));
    }
    longest
}

/// `policy.params.reserve_bytes`: a number of bytes or a size (`512MiB`).
pub(super) fn reserve_bytes(service: &Service) -> Option<u64> {
    match service.config.policy.params.get("reserve_bytes")? {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::String(text) => crate::config::parse_size(text).ok(),
        _ => None,
    }
}

/// The pure part: with every serving pool's ceiling known, whether the request fits under one.
/// `need_at(t)` is the request's estimate with `t` tokens of context in all.
fn judge(
    model: &str,
    estimate: &Estimate,
    (tokens, new_tokens): (u64, u64),
    ceilings: &[Ceiling],
    axis: Option<String>,
    need_at: &dyn Fn(u64) -> u64,
) -> Option<NeverFits> {
    let takes = |c: &Ceiling| c.max_context.is_none_or(|max| tokens <= max);
    let fits = |c: &Ceiling| fits_under(c.bytes, c.max_context, estimate.total_bytes, tokens);
    if ceilings.iter().any(fits) {
        return None;
    }
    let largest = ceilings.iter().filter(|c| takes(c)).max_by_key(|c| c.bytes).cloned();
    // The longest context one of the pools would take, each under its own ceiling.
    let max_tokens = (tokens > 0 && axis.is_some()).then(|| {
        ceilings
            .iter()
            .map(|c| {
                let cap = c.max_context.unwrap_or(u64::MAX).min(tokens);
                longest_within(need_at, new_tokens, cap, c.bytes)
            })
            .max()
            .unwrap_or(0)
    });
    Some(NeverFits {
        model: model.to_string(),
        need_bytes: estimate.total_bytes,
        tokens: tokens.saturating_add(new_tokens),
        largest,
        max_tokens,
        axis,
        dims: Vec::new(),
        substitute: None,
    })
}

/// Whether a run needing `need` bytes for `tokens` of context fits a pool that could ever give
/// `bytes` and takes at most `max_context` tokens.
fn fits_under(bytes: u64, max_context: Option<u64>, need: u64, tokens: u64) -> bool {
    max_context.is_none_or(|max| tokens <= max) && need <= bytes
}

/// The longest context of at most `cap` tokens (plus `new_tokens` a generation may add) whose
/// estimate stays within `bytes`; 0 when not even an empty one does. The estimate grows with
/// the context, so a bisection finds it.
fn longest_within(need_at: &dyn Fn(u64) -> u64, new_tokens: u64, cap: u64, bytes: u64) -> u64 {
    let fits = |t: u64| need_at(t.saturating_add(new_tokens)) <= bytes;
    if !fits(0) {
        return 0;
    }
    let (mut lo, mut hi) = (0, cap);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) { lo = mid } else { hi = mid - 1 }
    }
    lo
}

/// What one pool could ever give a run, in numbers (a request that fits reads no more).
#[derive(Debug, Clone, Copy)]
struct Room {
    bytes: u64,
    max_context: Option<u64>,
    /// What the bytes are made of: the memory's total, what is held back from it, and the
    /// weights of the other models loaded there.
    total: u64,
    reserve: u64,
    others: u64,
}

impl Room {
    /// The same, in words, for the refusal.
    fn ceiling(self, pool: &Pool) -> Ceiling {
        let mut what = match memory_of(pool) {
            Some(Memory::Device(device)) => format!("device `{device}` of {}", human_bytes(self.total)),
            _ => format!(
                "host memory of {} less its {} reserve",
                human_bytes(self.total),
                human_bytes(self.reserve)
            ),
        };
        if self.others > 0 {
            what.push_str(&format!(", less {} of other models' weights", human_bytes(self.others)));
        }
        Ceiling {
            pool: pool.name().to_string(),
            bytes: self.bytes,
            what,
            max_context: self.max_context,
        }
    }
}

/// The most `pool` could ever give a run of `model`, or `None` when that cannot be known: a
/// remote pool (its memory is another server's), or a device or host not read yet.
fn room(service: &Service, pool: &Pool, model: &str, snapshot: &Snapshot) -> Option<Room> {
    let (total, reserve) = match memory_of(pool)? {
        Memory::Host => (snapshot.host.mem_total_bytes, snapshot.host.reserve_bytes),
        Memory::Device(device) => (snapshot.devices.get(device)?.total_bytes, 0),
    };
    if total == 0 {
        return None;
    }
    // The weights of every other model loaded beside this one on the same memory stay there.
    let others = service.weights_beside(pool, model)?;
    Some(Room {
        bytes: total.saturating_sub(reserve).saturating_sub(others),
        max_context: pool.config.max_context,
        total,
        reserve,
        others,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::estimate::MemoryProfile;

    /// The bundled encoder's shape: 16·n² bytes of attention scores a token squared.
    fn encoder() -> MemoryProfile {
        let configured = crate::config::ConfiguredProfile {
            weights_bytes: Some(1 << 20),
            workspace_bytes: 4096,
            per_token_bytes: 1024.0,
            per_token_squared_bytes: 16.0,
        };
        let context = crate::config::ContextAxis {
            input: "input".into(),
            axis: 1,
            keep: crate::config::Keep::End,
        };
        let signature = crate::runtime::onnx::ModelSignature {
            inputs: vec![crate::runtime::onnx::TensorSpec {
                name: "input".into(),
                datatype: crate::core::tensor::DataType::Fp32,
                shape: vec![-1, -1, 64],
                symbols: vec!["batch".into(), "seq".into(), String::new()],
            }],
            outputs: vec![],
        };
        MemoryProfile::configured(&configured, 0, Some(&context), &signature)
    }

    fn need(profile: &MemoryProfile) -> impl Fn(u64) -> u64 + '_ {
        |t| profile.estimate_tokens(t, 1).total_bytes
    }

    fn pool(name: &str, bytes: u64, max_context: Option<u64>) -> Ceiling {
        Ceiling {
            pool: name.into(),
            bytes,
            what: "test".into(),
            max_context,
        }
    }

    const AXIS: fn() -> Option<String> = || Some("input `input` axis 1".into());

    #[test]
    fn a_request_that_fits_one_pool_is_not_judged() {
        let profile = encoder();
        let estimate = profile.estimate_tokens(4096, 1);
        let pools = [pool("gpu", 128 << 20, None), pool("cpu", 8 << 30, None)];
        assert_eq!(
            judge("encoder", &estimate, (4096, 0), &pools, AXIS(), &need(&profile)),
            None
        );
    }

    #[test]
    fn a_request_over_every_ceiling_names_its_need_the_largest_pool_and_what_fits() {
        let profile = encoder();
        let estimate = profile.estimate_tokens(100_000, 1);
        let pools = [pool("gpu", 128 << 20, None), pool("cpu", 1 << 30, None)];
        let never = judge("encoder", &estimate, (100_000, 0), &pools, AXIS(), &need(&profile)).expect("never fits");
        assert_eq!(never.need_bytes, estimate.total_bytes);
        assert_eq!(never.largest.as_ref().map(|c| c.pool.as_str()), Some("cpu"));
        let max = never.max_tokens.expect("a longest context");
        // The longest context is exact: one more token would not fit under 1 GiB.
        assert!(profile.estimate_tokens(max, 1).total_bytes <= 1 << 30);
        assert!(profile.estimate_tokens(max + 1, 1).total_bytes > 1 << 30);
        let message = never.to_string();
        assert!(
            message.starts_with("`encoder` can never fit here: it needs an estimated "),
            "{message}"
        );
        assert!(message.contains("for 100000 tokens"), "{message}");
        assert!(message.contains("pool `cpu`"), "{message}");
        assert!(
            message.contains(&format!("send at most {max} tokens (input `input` axis 1)")),
            "{message}"
        );
        assert!(message.contains("x-vramguard-allow-shrink: true"), "{message}");
    }

    #[test]
    fn a_context_longer_than_every_pools_max_context_never_fits_either() {
        let profile = encoder();
        let estimate = profile.estimate_tokens(2048, 1);
        let pools = [pool("gpu", 8 << 30, Some(1024)), pool("cpu", 8 << 30, Some(512))];
        let never = judge("encoder", &estimate, (2048, 0), &pools, AXIS(), &need(&profile)).expect("never fits");
        assert_eq!(never.largest, None);
        assert_eq!(never.max_tokens, Some(1024));
        assert!(
            never.to_string().contains("longer than any pool serving it takes"),
            "{never}"
        );
    }

    #[test]
    fn a_generation_counts_the_tokens_it_may_add() {
        let profile = encoder();
        let ceiling = profile.estimate_tokens(1000, 1).total_bytes;
        let pools = [pool("gpu", ceiling, None)];
        // 900 prompt tokens fit alone, not with 200 more to come.
        let estimate = profile.estimate_tokens(1100, 1);
        let never = judge("tiny", &estimate, (900, 200), &pools, AXIS(), &need(&profile)).expect("never fits");
        assert_eq!(never.tokens, 1100);
        assert_eq!(never.max_tokens, Some(800));
    }

    #[test]
    fn a_model_without_a_context_names_no_axis() {
        let profile = encoder();
        // A batch far too large for a model with no context axis.
        let estimate = Estimate {
            total_bytes: 1 << 41,
            ..Estimate::default()
        };
        let pools = [pool("cpu", 1 << 30, None)];
        let mut never = judge("classifier", &estimate, (0, 0), &pools, None, &need(&profile)).expect("never fits");
        assert_eq!((never.max_tokens, never.axis.as_deref()), (None, None));
        assert!(!never.to_string().contains("allow-shrink"), "{never}");
        // An image model's message names the size it was sent.
        never.dims = vec![("height".into(), 40_000), ("width".into(), 30_000)];
        assert!(
            never.to_string().contains("for an input of height=40000, width=30000"),
            "{never}"
        );
    }
}
