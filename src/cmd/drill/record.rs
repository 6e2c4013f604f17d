//! What the drill keeps of every request: a [`Record`], the [`Failure`] it met, and the verdict
//! on it ([`Record::judge`]).

use serde::{Serialize, Serializer};

use super::phase::Phase;
use crate::core::snapshot::Action;
use crate::protocol::headers::{DECISION_HEADER, DEGRADED_HEADER, IDEMPOTENT_REPLAYED, POOL_HEADER, REQUEST_ID};

/// One request as the drill saw it.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// Phase it belongs to.
    pub phase: Phase,
    /// Its request id.
    pub id: String,
    /// What was sent (`encoder seq 32`, `chat stream`, …).
    pub kind: String,
    /// What the phase expected of it.
    pub expect: &'static str,
    /// Milliseconds from the drill's start to sending it.
    pub sent_ms: f64,
    /// Milliseconds until its answer ended (or the client gave up).
    pub latency_ms: f64,
    /// HTTP status; none when no answer came.
    pub status: Option<u16>,
    /// The pool that served it (`x-vramguard-pool`).
    pub pool: Option<String>,
    /// The admission decision (`x-vramguard-decision`).
    pub decision: Option<Action>,
    /// Why it was retried on the fallback (`parameters.reason`), if it was.
    pub retry: Option<String>,
    /// When the retry's run started on the CPU pool, ms after the server received the request
    /// (`parameters.retry_started_ms`).
    pub cpu_started_ms: Option<f64>,
    /// The first failure it met.
    pub first_failure: Option<Failure>,
    /// `x-vramguard-degraded`, when it was served degraded.
    pub degraded: Option<String>,
    /// The answer was the stored one of an earlier request with its idempotency key.
    pub replayed: bool,
    /// The answer carried the request id it was sent with (`x-request-id`).
    pub id_kept: bool,
    /// The client kept its connection until the answer ended (false: it hung up on purpose).
    pub connection_held: bool,
    /// A generation's text, for token equivalence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// A stream's end: whether its last event was `[DONE]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub done: Option<bool>,
    /// An error answer's `reason`, `retried` and `request_id`, when it gave them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorFields>,
    /// Whether it met the phase's expectation.
    pub as_expected: bool,
}

/// The first thing that went wrong with a request. In the JSON record it is the text people
/// read (its `Display`); the drill's verdicts match on the variant.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// No answer came: the connection failed or the client's timeout ran out.
    NoAnswer(String),
    /// An error answer: its message (`error` of the Open Inference Protocol, `error.message`
    /// of OpenAI's shape).
    Refused(String),
    /// A stream's error event, after its tokens: the event's `error` object as sent.
    StreamError {
        /// The `error` object, as JSON text.
        event: String,
        /// Its `tokens_sent`: how many tokens reached the client before the failure.
        tokens_sent: Option<u64>,
    },
}

/// What an Open Inference Protocol error answer says beside its message: why it failed, whether
/// it was retried, and the request it names.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ErrorFields {
    /// `reason` (`worker_lost`, `allocator_failure_oom`, …).
    pub reason: Option<String>,
    /// `retried`.
    pub retried: Option<bool>,
    /// `request_id`.
    pub request_id: Option<String>,
}

impl Failure {
    /// The error message the server gave, when it gave one.
    pub fn refusal(&self) -> Option<&str> {
        match self {
            Failure::Refused(message) => Some(message),
            Failure::NoAnswer(_) | Failure::StreamError { .. } => None,
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::NoAnswer(e) => write!(f, "no answer: {e}"),
            Failure::Refused(message) => f.write_str(message),
            Failure::StreamError { event, .. } => f.write_str(event),
        }
    }
}

impl Serialize for Failure {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl Record {
    /// A request about to be sent, nothing known of its answer yet.
    pub(super) fn new(phase: Phase, id: &str, kind: String, expect: &'static str, sent_ms: f64) -> Record {
        Record {
            phase,
            id: id.to_string(),
            kind,
            expect,
            sent_ms,
            latency_ms: 0.0,
            status: None,
            pool: None,
            decision: None,
            retry: None,
            cpu_started_ms: None,
            first_failure: None,
            degraded: None,
            replayed: false,
            id_kept: false,
            connection_held: true,
            text: None,
            done: None,
            error: None,
            as_expected: false,
        }
    }

    /// What the answer's headers say: its id, pool, decision, degradation and replay.
    pub(super) fn read_headers(&mut self, headers: &reqwest::header::HeaderMap) {
        let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
        self.id_kept = get(REQUEST_ID).as_deref() == Some(self.id.as_str());
        self.pool = get(POOL_HEADER);
        self.decision = get(DECISION_HEADER).and_then(|d| Action::from_label(&d));
        self.degraded = get(DEGRADED_HEADER);
        self.replayed = headers.contains_key(IDEMPOTENT_REPLAYED);
    }

    /// Served with 200 by `pool`.
    pub(super) fn served_on(&self, pool: &str) -> bool {
        self.status == Some(200) && self.pool.as_deref() == Some(pool)
    }

    /// Set its verdict: whether it met the phase's expectation.
    pub(super) fn judge(mut self, expected: impl Fn(&Record) -> bool) -> Judged {
        self.as_expected = expected(&self);
        Judged(self)
    }
}

/// A record with its verdict, waiting to be kept.
pub(super) struct Judged(pub(super) Record);

/// Live samples of `/status` in one phase.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Samples {
    /// Largest queue age seen in any pool.
    pub max_queue_age_ms: u64,
    /// Lowest `MemAvailable` seen.
    pub min_host_available: Option<u64>,
    /// The simulated device's highest used memory seen, and its capacity then.
    pub max_device_used: Option<(u64, u64)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decision_headers_name_actions_and_failures_read_as_text() {
        assert_eq!(Action::from_label("shrink_context"), Some(Action::ShrinkContext));
        assert_eq!(Action::from_label("redirect"), Some(Action::Redirect));
        assert_eq!(Action::from_label("maybe"), None);
        let event = Failure::StreamError {
            event: r#"{"tokens_sent":4}"#.into(),
            tokens_sent: Some(4),
        };
        assert_eq!(serde_json::to_value(&event).unwrap(), r#"{"tokens_sent":4}"#);
        assert_eq!(
            Failure::NoAnswer("timed out".into()).to_string(),
            "no answer: timed out"
        );
    }
}
