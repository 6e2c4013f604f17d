//! The policy's last decisions, newest first, for `/status` and the status page: what a person
//! looking at a busy server wants to see without reading logs. Each says, once its request is
//! answered, how it ended and which pool answered it: after a retry or a move that is not the
//! pool the policy chose.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::core::snapshot::{Action, Decision};

/// How many decisions are kept.
pub const KEPT: usize = 20;

/// One decision as shown.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RecentDecision {
    /// When it was taken (milliseconds since the Unix epoch).
    pub unix_ms: u64,
    /// The request's id.
    pub request_id: String,
    /// The model asked for.
    pub model: String,
    /// `admit`, `defer`, `shrink_context`, `redirect` or `reject`.
    pub action: Action,
    /// The decision as the script wrote it, e.g. `redirect("cpu")`.
    pub decision: String,
    /// The pool it sends the request to (the routed pool for defer and reject).
    pub pool: String,
    /// Whether the configured fallback stood in for a failing or impossible decision.
    pub fallback: bool,
    /// How the request ended, as `vramguard_requests_total`'s `outcome` (`ok`, `rejected`,
    /// `failed`, …); absent while it is not answered yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
    /// The pool whose run answered it (after a retry or a move, the pool it moved to); absent
    /// while it is not answered, or when it was refused before any pool ran it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answered_by: Option<String>,
}

/// A bounded log of decisions; recording takes one short lock.
#[derive(Debug, Default)]
pub struct RecentDecisions {
    entries: Mutex<VecDeque<RecentDecision>>,
}

impl RecentDecisions {
    /// Keep `decision` for `request_id`, dropping the oldest beyond [`KEPT`].
    pub fn record(&self, request_id: &str, model: &str, decision: &Decision, pool: &str, fallback: bool) {
        let entry = RecentDecision {
            unix_ms: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            request_id: request_id.to_string(),
            model: model.to_string(),
            action: decision.action(),
            decision: decision.to_string(),
            pool: pool.to_string(),
            fallback,
            outcome: None,
            answered_by: None,
        };
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.len() == KEPT {
            entries.pop_back();
        }
        entries.push_front(entry);
    }

    /// Request `request_id` was answered with `outcome`, by `pool`'s run when one ran it: its
    /// newest decision not yet answered says so (a request older than the kept ones is not
    /// there, and nothing changes).
    pub fn answered(&self, request_id: &str, outcome: &str, pool: Option<&str>) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = entries
            .iter_mut()
            .find(|e| e.outcome.is_none() && e.request_id == request_id)
        {
            entry.outcome = Some(outcome.to_string());
            entry.answered_by = pool.map(str::to_string);
        }
    }

    /// The kept decisions, newest first.
    pub fn list(&self) -> Vec<RecentDecision> {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest_decisions_first_and_no_more_than_kept() {
        let recent = RecentDecisions::default();
        for i in 0..KEPT + 5 {
            recent.record(
                &format!("r{i}"),
                "encoder",
                &Decision::Admit { pool: None },
                "gpu",
                false,
            );
        }
        recent.record(
            "last",
            "encoder",
            &Decision::Redirect { pool: "cpu".into() },
            "cpu",
            true,
        );
        let list = recent.list();
        assert_eq!(list.len(), KEPT);
        assert_eq!(list[0].request_id, "last");
        assert_eq!(list[0].action, Action::Redirect);
        assert_eq!(list[0].decision, "redirect(\"cpu\")");
        assert!(list[0].fallback);
        assert_eq!(list[1].request_id, format!("r{}", KEPT + 4));
        assert_eq!(list[KEPT - 1].request_id, "r6");
    }

    /// A request the policy admitted to the accelerator and that was retried on the CPU shows
    /// both: the decision and pool chosen, and the pool that answered and how.
    #[test]
    fn an_answer_says_how_its_request_ended_and_which_pool_answered() {
        let recent = RecentDecisions::default();
        recent.record("moved", "encoder", &Decision::Admit { pool: None }, "gpu", false);
        recent.record("refused", "encoder", &Decision::Admit { pool: None }, "gpu", false);
        recent.record("running", "encoder", &Decision::Admit { pool: None }, "gpu", false);
        recent.answered("moved", "ok", Some("cpu"));
        recent.answered("refused", "rejected", None);
        recent.answered("never-decided", "client_error", None);
        let list = recent.list();
        let of = |id: &str| list.iter().find(|d| d.request_id == id).unwrap();
        assert_eq!(
            (of("moved").pool.as_str(), of("moved").answered_by.as_deref()),
            ("gpu", Some("cpu"))
        );
        assert_eq!(of("moved").outcome.as_deref(), Some("ok"));
        assert_eq!(of("refused").outcome.as_deref(), Some("rejected"));
        assert_eq!(of("refused").answered_by, None);
        assert_eq!(
            (of("running").outcome.as_deref(), of("running").answered_by.as_deref()),
            (None, None)
        );
        // Answered once: a later answer under the same id is a new request's.
        recent.answered("moved", "failed", Some("gpu"));
        assert_eq!(recent.list()[2].outcome.as_deref(), Some("ok"));
    }
}
