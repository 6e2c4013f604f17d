//! The policy's last decisions, newest first, for `/status` and the status page: what a person
//! looking at a busy server wants to see without reading logs.

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
        };
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.len() == KEPT {
            entries.pop_back();
        }
        entries.push_front(entry);
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
}
