//! Turning a policy [`Decision`] into what the request path does: which pool runs the request,
//! whether its context is cut first, how long to wait before asking again, or why it is refused.
//! Pure: plain data in, a [`Plan`] out, tested without pools, sockets or sleeps.

use std::time::Duration;

use crate::core::snapshot::{Decision, RequestInfo};

/// What the router knows about one pool when planning.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolView<'a> {
    /// Name.
    pub name: &'a str,
    /// Serves the request's model.
    pub serves: bool,
    /// Can take work now; otherwise why not.
    pub ready: Result<(), String>,
    /// Longest context it accepts (`pools[].max_context`), when limited.
    pub max_context: Option<u64>,
    /// Runs on an accelerator (`cuda` or `simulated`): the only pools `make_room` applies to.
    pub accelerator: bool,
}

/// How the request proceeds.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Queue it on `pool`, after cutting the context axis to `shrink_to` tokens if set.
    Run {
        /// Target pool.
        pool: String,
        /// New context length.
        shrink_to: Option<u64>,
    },
    /// Free room on `pool`'s device until `bytes` (by default what the request needs there) fit,
    /// then queue it on `pool`.
    MakeRoom {
        /// Target pool.
        pool: String,
        /// Headroom to reach, when the policy said.
        bytes: Option<u64>,
    },
    /// Wait this long without holding a worker, then decide again.
    Wait(Duration),
    /// Answer 429 + `Retry-After`: deferring longer would pass the pool's max wait.
    DeferredTooLong {
        /// Total deferral it would have reached.
        total: Duration,
        /// The bound.
        bound: Duration,
    },
    /// Answer 503 + `Retry-After` with this reason.
    Refuse(String),
    /// The decision cannot be carried out as written (unknown pool, zero tokens, a shrink the
    /// client did not allow): the configured fallback applies and it counts as a `bad_return`
    /// policy error.
    Invalid(String),
}

/// Plan `decision` for `req`. `deferred` is how long this request already waited on `defer`
/// decisions; `max_defer` bounds the total.
pub fn plan(
    decision: &Decision,
    req: &RequestInfo,
    has_context_axis: bool,
    pools: &[PoolView<'_>],
    deferred: Duration,
    max_defer: Duration,
) -> Plan {
    let target = |name: &str| -> Plan {
        match pools.iter().find(|p| p.name == name) {
            None => Plan::Invalid(format!("the policy chose pool `{name}`, which does not exist")),
            Some(p) if !p.serves => Plan::Invalid(format!(
                "the policy chose pool `{name}`, which does not serve model `{}`",
                req.model
            )),
            Some(p) => match &p.ready {
                Ok(()) => Plan::Run {
                    pool: name.to_string(),
                    shrink_to: None,
                },
                Err(why) => Plan::Refuse(format!("pool `{name}` cannot take work: {why}")),
            },
        }
    };
    // A pool's context limit holds whatever the policy decided: a request over it is refused
    // there, never run and never cut without the policy saying so.
    let within_limit = |plan: Plan| -> Plan {
        if let Plan::Run { pool, shrink_to } = &plan {
            let tokens = shrink_to.unwrap_or(req.context_tokens);
            if let Some(limit) = pools.iter().find(|p| p.name == pool).and_then(|p| p.max_context)
                && tokens > limit
            {
                return Plan::Refuse(format!(
                    "pool `{pool}` accepts at most {limit} tokens of context (pools[].max_context); this request has {tokens}"
                ));
            }
        }
        plan
    };
    let plan = match decision {
        Decision::Admit { pool: None } => target(&req.pool),
        Decision::Admit { pool: Some(pool) } | Decision::Redirect { pool } => target(pool),
        Decision::ShrinkContext { tokens } => {
            // Cutting a context changes the answer: only the client may allow it, whatever the
            // script says, so a custom script can never cut one silently.
            if !req.allow_shrink {
                return Plan::Invalid(
                    "the policy asked to shrink the context, but the client did not allow it (x-vramguard-allow-shrink)"
                        .into(),
                );
            }
            if !has_context_axis {
                return Plan::Refuse(format!(
                    "the policy asked to shrink the context, but model `{}` has no context axis",
                    req.model
                ));
            }
            if *tokens == 0 {
                return Plan::Invalid("shrink_context(0) would leave no context".into());
            }
            match target(&req.pool) {
                Plan::Run { pool, .. } => Plan::Run {
                    pool,
                    shrink_to: (*tokens < req.context_tokens).then_some(*tokens),
                },
                other => other,
            }
        }
        Decision::Defer { ms } => {
            let total = deferred + Duration::from_millis(*ms);
            if total > max_defer {
                Plan::DeferredTooLong {
                    total,
                    bound: max_defer,
                }
            } else {
                Plan::Wait(Duration::from_millis((*ms).max(1)))
            }
        }
        Decision::MakeRoom { pool, bytes } => match (target(pool), pools.iter().find(|p| p.name == pool)) {
            (Plan::Run { pool, .. }, Some(view)) if view.accelerator => Plan::MakeRoom { pool, bytes: *bytes },
            (Plan::Run { pool, .. }, _) => Plan::Invalid(format!(
                "make_room(`{pool}`): only an accelerator pool's device has models to evict"
            )),
            (other, _) => other,
        },
        Decision::Reject { reason } => Plan::Refuse(format!("rejected by policy: {reason}")),
    };
    within_limit(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> RequestInfo {
        RequestInfo {
            model: "encoder".into(),
            pool: "gpu".into(),
            context_tokens: 1000,
            ..RequestInfo::default()
        }
    }

    fn pools() -> Vec<PoolView<'static>> {
        vec![
            PoolView {
                accelerator: true,
                name: "gpu",
                serves: true,
                ready: Ok(()),
                max_context: None,
            },
            PoolView {
                accelerator: false,
                name: "cpu",
                serves: true,
                ready: Ok(()),
                max_context: Some(512),
            },
            PoolView {
                accelerator: false,
                name: "other",
                serves: false,
                ready: Ok(()),
                max_context: None,
            },
            PoolView {
                accelerator: false,
                name: "down",
                serves: true,
                ready: Err("no NVIDIA driver".into()),
                max_context: None,
            },
        ]
    }

    fn run(pool: &str, shrink_to: Option<u64>) -> Plan {
        Plan::Run {
            pool: pool.into(),
            shrink_to,
        }
    }

    /// `req()` from a client that allows its context to be cut.
    fn shrinkable() -> RequestInfo {
        RequestInfo {
            allow_shrink: true,
            ..req()
        }
    }

    fn p(decision: Decision) -> Plan {
        p_for(&req(), decision)
    }

    fn p_for(req: &RequestInfo, decision: Decision) -> Plan {
        plan(&decision, req, true, &pools(), Duration::ZERO, Duration::from_secs(1))
    }

    #[test]
    fn a_pools_context_limit_refuses_longer_requests() {
        // req() has 1000 tokens; `cpu` accepts 512.
        assert_eq!(
            p(Decision::Redirect { pool: "cpu".into() }),
            Plan::Refuse(
                "pool `cpu` accepts at most 512 tokens of context (pools[].max_context); this request has 1000".into()
            )
        );
        let short = RequestInfo {
            context_tokens: 512,
            ..req()
        };
        let fits = plan(
            &Decision::Redirect { pool: "cpu".into() },
            &short,
            true,
            &pools(),
            Duration::ZERO,
            Duration::from_secs(1),
        );
        assert_eq!(fits, run("cpu", None));
    }

    #[test]
    fn admit_and_redirect_pick_their_pool() {
        assert_eq!(p(Decision::Admit { pool: None }), run("gpu", None));
        assert_eq!(p(Decision::Redirect { pool: "gpu".into() }), run("gpu", None));
    }

    #[test]
    fn impossible_targets_are_invalid_and_unready_ones_refused() {
        assert!(
            matches!(p(Decision::Redirect { pool: "nope".into() }), Plan::Invalid(m) if m.contains("does not exist"))
        );
        assert!(
            matches!(p(Decision::Redirect { pool: "other".into() }), Plan::Invalid(m) if m.contains("does not serve"))
        );
        assert_eq!(
            p(Decision::Redirect { pool: "down".into() }),
            Plan::Refuse("pool `down` cannot take work: no NVIDIA driver".into())
        );
    }

    #[test]
    fn shrink_cuts_only_when_shorter_and_only_with_a_context_axis() {
        let shrink = |tokens| p_for(&shrinkable(), Decision::ShrinkContext { tokens });
        assert_eq!(shrink(512), run("gpu", Some(512)));
        assert_eq!(shrink(4096), run("gpu", None));
        assert!(matches!(shrink(0), Plan::Invalid(_)));
        let no_axis = plan(
            &Decision::ShrinkContext { tokens: 10 },
            &shrinkable(),
            false,
            &pools(),
            Duration::ZERO,
            Duration::from_secs(1),
        );
        assert!(matches!(no_axis, Plan::Refuse(m) if m.contains("has no context axis")));
    }

    #[test]
    fn a_shrink_the_client_did_not_allow_is_invalid_whatever_the_script_says() {
        let invalid = Plan::Invalid(
            "the policy asked to shrink the context, but the client did not allow it (x-vramguard-allow-shrink)".into(),
        );
        // Even a shrink that would not cut anything, or one on a model without a context axis:
        // the script asked for something the client never agreed to.
        assert_eq!(p(Decision::ShrinkContext { tokens: 512 }), invalid);
        assert_eq!(p(Decision::ShrinkContext { tokens: 4096 }), invalid);
        let no_axis = plan(
            &Decision::ShrinkContext { tokens: 10 },
            &req(),
            false,
            &pools(),
            Duration::ZERO,
            Duration::from_secs(1),
        );
        assert_eq!(no_axis, invalid);
        // Other decisions do not need the client's consent.
        assert_eq!(p(Decision::Admit { pool: None }), run("gpu", None));
    }

    #[test]
    fn deferral_is_bounded_in_total() {
        assert_eq!(p(Decision::Defer { ms: 250 }), Plan::Wait(Duration::from_millis(250)));
        let later = plan(
            &Decision::Defer { ms: 250 },
            &req(),
            true,
            &pools(),
            Duration::from_millis(900),
            Duration::from_secs(1),
        );
        assert_eq!(
            later,
            Plan::DeferredTooLong {
                total: Duration::from_millis(1150),
                bound: Duration::from_secs(1)
            }
        );
    }

    #[test]
    fn reject_carries_the_reason() {
        assert_eq!(
            p(Decision::Reject {
                reason: "host memory low".into()
            }),
            Plan::Refuse("rejected by policy: host memory low".into())
        );
    }

    #[test]
    fn make_room_applies_to_a_ready_accelerator_pool_serving_the_model() {
        let room = |pool: &str, bytes| {
            p(Decision::MakeRoom {
                pool: pool.into(),
                bytes,
            })
        };
        assert_eq!(
            room("gpu", Some(7)),
            Plan::MakeRoom {
                pool: "gpu".into(),
                bytes: Some(7)
            }
        );
        assert_eq!(
            room("cpu", None),
            Plan::Invalid("make_room(`cpu`): only an accelerator pool's device has models to evict".into())
        );
        assert!(matches!(room("other", None), Plan::Invalid(_)));
        assert!(matches!(room("down", None), Plan::Refuse(_)));
    }
}
