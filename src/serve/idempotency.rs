//! `idempotency-key`: a request sent with a key executes at most once; duplicates get the first
//! one's response.
//!
//! Protocol-free: the HTTP layer turns the header and the request into a scope, a key and a
//! [`fingerprint`], calls [`IdempotencyCache::claim`], and acts on the [`Claim`]:
//!
//! - the first request with a key gets [`Claim::Run`] and a [`Ticket`]: it runs, then either
//!   [`Ticket::complete`]s with the response to replay or [`Ticket::abandon`]s (drops) the ticket;
//! - a duplicate that arrives while the first runs waits for it, then gets what it stored;
//! - a duplicate within the TTL of completion gets the stored response ([`Claim::Done`]);
//! - the same key with a different request is [`Claim::Conflict`] (422 in the IETF
//!   Idempotency-Key draft): a key names one request, and replaying another's response would be
//!   wrong;
//! - when every slot holds a running request there is no room for another key:
//!   [`Claim::Busy`] (503 + `Retry-After`), never unbounded growth.
//!
//! **What is stored is the caller's decision.** Complete with every response that *executed*,
//! success or not (the outputs, or a backend failure after the model ran): replaying it is what
//! keeps the work from running twice. Abandon when the request was refused before it ran (queue
//! full, no pool, deadline passed while deferred): nothing executed, so a retry with the same key
//! should get its chance to run, and storing a 503 would replay the refusal for the whole TTL.
//!
//! Bounds: at most `max_entries` keys, running or stored. Stored responses expire `ttl` after
//! completion; when a new key needs room the oldest stored response is evicted. A running entry
//! is never evicted (its waiters depend on it) and never expires (it ends when its ticket does).
//!
//! Time is tokio's, so the TTL is tested with paused time.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio::time::Instant;

/// The longest TTL the cache honours; longer ones are cut to it so an expiry instant can always
/// be computed (the config allows far less).
const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// A response as it went out, kept to answer a duplicate with exactly the same thing:
/// protocol-neutral (status code, headers, body bytes), so every endpoint can store its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// Status code.
    pub status: u16,
    /// Headers (names lower-case).
    pub headers: Vec<(String, Vec<u8>)>,
    /// Body.
    pub body: bytes::Bytes,
}

/// SHA-256 over `parts`, each prefixed with its length so that moving bytes from one part to the
/// next (`"ab", "c"` against `"a", "bc"`) changes the fingerprint.
///
/// Pass everything that gives the request its meaning: the model name, the raw body, and the
/// headers that change what runs (`x-vramguard-allow-shrink`, `x-vramguard-priority`, the binary
/// header length). Leave out what legitimately differs between retries (`x-request-id`,
/// `x-vramguard-deadline-ms`).
pub fn fingerprint(parts: &[&[u8]]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    hasher.finalize().into()
}

/// What a [`IdempotencyCache::claim`] found.
#[derive(Debug)]
pub enum Claim<T> {
    /// First with this key (or the first after an abandoned run): run the request, then
    /// [`Ticket::complete`] with its response, or [`Ticket::abandon`] if it did not execute.
    Run(Ticket<T>),
    /// The response the request with this key completed with, within the TTL; also what a
    /// duplicate that waited for a running request gets.
    Done(T),
    /// The key is running or stored for a different request (different fingerprint): 422.
    Conflict,
    /// The cache is full of running requests; no room for a new key: 503 + `Retry-After`.
    Busy,
}

/// `{reason}` of `vramguard_idempotency_evictions_total`.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum EvictionReason {
    /// Dropped early to make room for a new key (the cache was at `max_entries`).
    capacity,
    /// Its TTL passed.
    expired,
}

/// `{reason}`
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EvictionLabels {
    /// Why the stored response was dropped.
    pub reason: EvictionReason,
}

/// The cache's metric handles; the cache is their only writer. Register them with
/// [`IdempotencyMetrics::register`].
#[derive(Debug, Clone, Default)]
pub struct IdempotencyMetrics {
    /// Duplicates answered with a stored response, whether or not they waited for it first.
    hits: Counter,
    /// Duplicates that arrived while the first was running and waited for it.
    waits: Counter,
    /// Keys reused for a different request.
    conflicts: Counter,
    /// Stored responses dropped before a duplicate could use them, by reason.
    evictions: Family<EvictionLabels, Counter>,
    /// Keys held now, running and stored.
    entries: Gauge,
}

impl IdempotencyMetrics {
    /// Register the handles (clones of them: they keep counting into the same values) in
    /// `registry`, whose prefix (`vramguard`) makes `vramguard_idempotency_*`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "idempotency_hits",
            "Requests with an idempotency key answered with the stored response of the first",
            self.hits.clone(),
        );
        registry.register(
            "idempotency_waits",
            "Requests with an idempotency key that waited for the first with that key to finish",
            self.waits.clone(),
        );
        registry.register(
            "idempotency_conflicts",
            "Requests refused because their idempotency key belongs to a different request",
            self.conflicts.clone(),
        );
        registry.register(
            "idempotency_evictions",
            "Stored idempotent responses dropped, by reason (capacity, expired)",
            self.evictions.clone(),
        );
        registry.register(
            "idempotency_entries",
            "Idempotency keys held now, running and stored",
            self.entries.clone(),
        );
        for reason in [EvictionReason::capacity, EvictionReason::expired] {
            self.evictions.get_or_create_owned(&EvictionLabels { reason });
        }
    }

    fn evicted(&self, reason: EvictionReason) {
        self.evictions.get_or_create(&EvictionLabels { reason }).inc();
    }
}

/// Responses by idempotency key, bounded in entries and time. Cloning shares the cache.
pub struct IdempotencyCache<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Clone for IdempotencyCache<T> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<T> std::fmt::Debug for IdempotencyCache<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyCache")
            .field("max_entries", &self.shared.max_entries)
            .field("ttl", &self.shared.ttl)
            .field("entries", &self.shared.lock().entries.len())
            .finish()
    }
}

struct Shared<T> {
    // A std mutex: every critical section is a few map operations and none spans an `.await`.
    inner: Mutex<Inner<T>>,
    max_entries: usize,
    ttl: Duration,
    metrics: IdempotencyMetrics,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    scope: String,
    key: String,
}

struct Inner<T> {
    entries: HashMap<Key, Entry<T>>,
    /// Stored entries with their expiry, in completion order. One TTL for all makes this expiry
    /// order too, so the front is both the next to expire and the first to evict. Exactly the
    /// stored entries are here: an entry leaves the map only by being popped from this queue or,
    /// while running, by its ticket ending.
    stored: VecDeque<(Instant, Key)>,
}

struct Entry<T> {
    fingerprint: [u8; 32],
    state: State<T>,
}

enum State<T> {
    /// The first request runs. Its ticket holds the sender and never sends: the channel closing
    /// (ticket completed or dropped) is the signal to look again.
    Running(watch::Receiver<()>),
    Stored(T),
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, Inner<T>> {
        // A panic elsewhere cannot leave the map half-updated in a way that matters more than
        // refusing every idempotent request would.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn count_entries(&self, inner: &Inner<T>) {
        self.metrics.entries.set(inner.entries.len() as i64);
    }
}

impl<T> Inner<T> {
    /// Drop stored responses whose TTL has passed.
    fn expire(&mut self, now: Instant, metrics: &IdempotencyMetrics) {
        while self.stored.front().is_some_and(|(expires, _)| *expires <= now) {
            if let Some((_, key)) = self.stored.pop_front() {
                self.entries.remove(&key);
                metrics.evicted(EvictionReason::expired);
            }
        }
    }

    /// Evict the oldest stored responses until a new key fits; false when only running entries
    /// are left and it still does not.
    fn make_room(&mut self, max_entries: usize, metrics: &IdempotencyMetrics) -> bool {
        while self.entries.len() >= max_entries {
            let Some((_, key)) = self.stored.pop_front() else {
                return false;
            };
            self.entries.remove(&key);
            metrics.evicted(EvictionReason::capacity);
        }
        true
    }
}

impl<T: Clone + Send + Sync + 'static> IdempotencyCache<T> {
    /// A cache holding at most `max_entries` keys (running or stored; 0 makes every new key
    /// [`Claim::Busy`]) whose stored responses are replayed for `ttl` after completion (cut to a
    /// year). Its metrics count from zero; register them with `cache.metrics().register(..)`.
    pub fn new(max_entries: usize, ttl: Duration) -> Self {
        Self {
            shared: Arc::new(Shared {
                inner: Mutex::new(Inner {
                    entries: HashMap::new(),
                    stored: VecDeque::new(),
                }),
                max_entries,
                ttl: ttl.min(MAX_TTL),
                metrics: IdempotencyMetrics::default(),
            }),
        }
    }

    /// The handles this cache counts into.
    pub fn metrics(&self) -> &IdempotencyMetrics {
        &self.shared.metrics
    }

    /// Claim `key` within `scope` (the model name, so two models never share a key) for the
    /// request whose [`fingerprint`] is `fingerprint`.
    ///
    /// While the first request with the key runs, this waits for it to end: it then returns
    /// what that request stored, or, when its ticket was abandoned, claims again, so of the
    /// waiters exactly one gets [`Claim::Run`] and the rest wait for that one. Cancel-safe:
    /// dropping the future while it waits leaves the cache as it was.
    pub async fn claim(&self, scope: &str, key: &str, fingerprint: [u8; 32]) -> Claim<T> {
        let shared = &self.shared;
        let key = Key {
            scope: scope.to_string(),
            key: key.to_string(),
        };
        let mut waited = false;
        loop {
            let mut running = {
                let mut inner = shared.lock();
                inner.expire(Instant::now(), &shared.metrics);
                match inner.entries.get(&key) {
                    Some(entry) if entry.fingerprint != fingerprint => {
                        shared.count_entries(&inner);
                        shared.metrics.conflicts.inc();
                        return Claim::Conflict;
                    }
                    Some(Entry {
                        state: State::Stored(value),
                        ..
                    }) => {
                        let value = value.clone();
                        shared.count_entries(&inner);
                        shared.metrics.hits.inc();
                        return Claim::Done(value);
                    }
                    Some(Entry {
                        state: State::Running(done),
                        ..
                    }) => done.clone(),
                    None => {
                        let claim = if inner.make_room(shared.max_entries, &shared.metrics) {
                            let (sender, receiver) = watch::channel(());
                            inner.entries.insert(
                                key.clone(),
                                Entry {
                                    fingerprint,
                                    state: State::Running(receiver),
                                },
                            );
                            Claim::Run(Ticket {
                                shared: Arc::clone(shared),
                                key: Some(key),
                                _done: sender,
                            })
                        } else {
                            Claim::Busy
                        };
                        shared.count_entries(&inner);
                        return claim;
                    }
                }
            };
            if !waited {
                waited = true;
                shared.metrics.waits.inc();
            }
            // Nothing is ever sent: this returns (with an error) once the running ticket ends.
            let _ = running.changed().await;
        }
    }
}

/// The right, and the duty, to run the request for a key: end it with [`Ticket::complete`] or
/// [`Ticket::abandon`]. Dropping it (a panic, a cancelled handler) abandons it.
///
/// Hold it for as long as the request may still execute: if the work goes on after the client
/// has gone (a job already handed to a pool), keep the ticket with the work and complete it,
/// or a retry with the same key would run the request a second time.
pub struct Ticket<T> {
    shared: Arc<Shared<T>>,
    /// `None` once completed; `Drop` abandons a ticket that still has its key.
    key: Option<Key>,
    /// Closed when the ticket ends (after the map is updated), waking the waiters.
    _done: watch::Sender<()>,
}

impl<T> std::fmt::Debug for Ticket<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket").field("key", &self.key).finish()
    }
}

impl<T> Ticket<T> {
    /// The request executed: store `value` as the response for its key, for the TTL, and hand
    /// it to every duplicate waiting.
    pub fn complete(mut self, value: T) {
        let Some(key) = self.key.take() else {
            return;
        };
        let shared = &self.shared;
        let mut inner = shared.lock();
        // Running entries are never evicted or expired, so the ticket's entry is still there.
        if let Some(entry) = inner.entries.get_mut(&key) {
            entry.state = State::Stored(value);
            let expires = Instant::now() + shared.ttl;
            inner.stored.push_back((expires, key));
        }
    }

    /// The request did not execute (refused before running): forget the key, so the next
    /// request with it (a waiting duplicate or a later retry) runs.
    pub fn abandon(self) {}
}

impl<T> Drop for Ticket<T> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            let mut inner = self.shared.lock();
            inner.entries.remove(&key);
            self.shared.count_entries(&inner);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::time::{advance, sleep};

    const TTL: Duration = Duration::from_secs(600);

    fn fp(body: &str) -> [u8; 32] {
        fingerprint(&[b"encoder", body.as_bytes()])
    }

    fn cache(max_entries: usize) -> IdempotencyCache<String> {
        IdempotencyCache::new(max_entries, TTL)
    }

    async fn run(cache: &IdempotencyCache<String>, key: &str, value: &str) {
        match cache.claim("encoder", key, fp(key)).await {
            Claim::Run(ticket) => ticket.complete(value.to_string()),
            other => panic!("expected Run for `{key}`, got {other:?}"),
        }
    }

    async fn stored(cache: &IdempotencyCache<String>, key: &str) -> Option<String> {
        match cache.claim("encoder", key, fp(key)).await {
            Claim::Done(value) => Some(value),
            Claim::Run(_) => None,
            other => panic!("expected Done or Run for `{key}`, got {other:?}"),
        }
    }

    fn exposition(cache: &IdempotencyCache<String>) -> String {
        let mut registry = Registry::with_prefix("vramguard");
        cache.metrics().register(&mut registry);
        crate::telemetry::metrics::encode(&registry)
    }

    /// Claim, count a run, take `work` of (paused) time, complete with `value`; what came back.
    async fn run_once(cache: IdempotencyCache<String>, runs: Arc<AtomicUsize>, value: String) -> String {
        match cache.claim("encoder", "k", fp("body")).await {
            Claim::Run(ticket) => {
                runs.fetch_add(1, Ordering::SeqCst);
                sleep(Duration::from_millis(100)).await;
                ticket.complete(value.clone());
                value
            }
            Claim::Done(value) => value,
            other => panic!("expected Run or Done, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_request_runs_and_a_later_duplicate_gets_its_response() {
        let cache = cache(10);
        run(&cache, "k", "outputs").await;
        assert_eq!(stored(&cache, "k").await.as_deref(), Some("outputs"));
        assert_eq!(stored(&cache, "k").await.as_deref(), Some("outputs"));
        assert_eq!(cache.metrics().hits.get(), 2);
        assert_eq!(cache.metrics().waits.get(), 0);
        assert_eq!(cache.metrics().entries.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_duplicates_wait_for_the_first_and_the_work_runs_once() {
        let cache = cache(10);
        let runs = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..5)
            .map(|i| tokio::spawn(run_once(cache.clone(), runs.clone(), format!("from {i}"))))
            .collect();
        let mut answers = Vec::new();
        for task in tasks {
            answers.push(task.await.unwrap());
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(answers.iter().all(|a| *a == answers[0]), "{answers:?}");
        assert_eq!(cache.metrics().waits.get(), 4);
        assert_eq!(cache.metrics().hits.get(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn the_same_key_for_another_request_is_a_conflict_running_or_stored() {
        let cache = cache(10);
        let Claim::Run(ticket) = cache.claim("encoder", "k", fp("a")).await else {
            panic!("first claim runs");
        };
        assert!(matches!(cache.claim("encoder", "k", fp("b")).await, Claim::Conflict));
        ticket.complete("a".into());
        assert!(matches!(cache.claim("encoder", "k", fp("b")).await, Claim::Conflict));
        assert!(matches!(cache.claim("encoder", "k", fp("a")).await, Claim::Done(v) if v == "a"));
        assert_eq!(cache.metrics().conflicts.get(), 2);
        assert_eq!(cache.metrics().waits.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_is_scoped_by_model() {
        let cache = cache(10);
        run(&cache, "k", "encoder's").await;
        assert!(matches!(
            cache
                .claim("classifier", "k", fingerprint(&[b"classifier", b"k"]))
                .await,
            Claim::Run(_)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn an_abandoned_ticket_lets_exactly_one_waiter_run() {
        let cache = cache(10);
        let Claim::Run(first) = cache.claim("encoder", "k", fp("body")).await else {
            panic!("first claim runs");
        };
        let runs = Arc::new(AtomicUsize::new(0));
        let waiters: Vec<_> = (0..4)
            .map(|i| tokio::spawn(run_once(cache.clone(), runs.clone(), format!("retry {i}"))))
            .collect();
        sleep(Duration::from_millis(10)).await;
        assert_eq!(cache.metrics().waits.get(), 4, "all four wait for the first");
        first.abandon();
        let mut answers = Vec::new();
        for waiter in waiters {
            answers.push(waiter.await.unwrap());
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(answers.iter().all(|a| *a == answers[0]), "{answers:?}");
        assert_eq!(cache.metrics().hits.get(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_ticket_forgets_the_key_so_a_retry_runs() {
        let cache = cache(10);
        drop(cache.claim("encoder", "k", fp("k")).await);
        assert_eq!(cache.metrics().entries.get(), 0);
        assert!(stored(&cache, "k").await.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_gives_up_leaves_the_cache_as_it_was() {
        let cache = cache(10);
        let Claim::Run(first) = cache.claim("encoder", "k", fp("k")).await else {
            panic!("first claim runs");
        };
        let gave_up = tokio::time::timeout(Duration::from_secs(1), cache.claim("encoder", "k", fp("k"))).await;
        assert!(gave_up.is_err());
        first.complete("done".into());
        assert_eq!(stored(&cache, "k").await.as_deref(), Some("done"));
        assert_eq!(cache.metrics().entries.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stored_response_expires_after_the_ttl() {
        let cache = cache(10);
        run(&cache, "k", "old").await;
        advance(TTL - Duration::from_millis(1)).await;
        assert_eq!(stored(&cache, "k").await.as_deref(), Some("old"));
        advance(Duration::from_millis(1)).await;
        let Claim::Run(ticket) = cache.claim("encoder", "k", fp("k")).await else {
            panic!("an expired key runs again");
        };
        ticket.complete("new".into());
        assert_eq!(stored(&cache, "k").await.as_deref(), Some("new"));
        assert_eq!(
            cache
                .metrics()
                .evictions
                .get_or_create(&EvictionLabels {
                    reason: EvictionReason::expired
                })
                .get(),
            1
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_running_request_never_expires() {
        let cache = cache(10);
        let Claim::Run(ticket) = cache.claim("encoder", "k", fp("k")).await else {
            panic!("first claim runs");
        };
        advance(TTL * 2).await;
        run(&cache, "other", "x").await;
        ticket.complete("slow".into());
        assert_eq!(stored(&cache, "k").await.as_deref(), Some("slow"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_cache_evicts_the_oldest_stored_response_first() {
        let cache = cache(2);
        run(&cache, "a", "A").await;
        advance(Duration::from_secs(1)).await;
        run(&cache, "b", "B").await;
        run(&cache, "c", "C").await; // evicts a, the oldest
        assert_eq!(stored(&cache, "b").await.as_deref(), Some("B"));
        assert_eq!(stored(&cache, "c").await.as_deref(), Some("C"));
        // `a` runs again and evicts b, stored before c: reading b did not make it younger.
        run(&cache, "a", "A again").await;
        assert_eq!(stored(&cache, "c").await.as_deref(), Some("C"));
        assert_eq!(stored(&cache, "a").await.as_deref(), Some("A again"));
        let capacity = EvictionLabels {
            reason: EvictionReason::capacity,
        };
        assert_eq!(cache.metrics().evictions.get_or_create(&capacity).get(), 2);
        assert_eq!(cache.metrics().entries.get(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn running_entries_are_never_evicted_and_a_cache_full_of_them_is_busy() {
        let cache = cache(2);
        let Claim::Run(a) = cache.claim("encoder", "a", fp("a")).await else {
            panic!("a runs");
        };
        run(&cache, "b", "B").await;
        // c evicts b, the only stored entry; d finds only running entries.
        let Claim::Run(c) = cache.claim("encoder", "c", fp("c")).await else {
            panic!("c runs");
        };
        assert!(matches!(cache.claim("encoder", "d", fp("d")).await, Claim::Busy));
        assert_eq!(cache.metrics().entries.get(), 2);
        // A duplicate of a running key needs no room: it waits, and is not Busy.
        let duplicate = tokio::spawn({
            let cache = cache.clone();
            async move { stored(&cache, "a").await }
        });
        sleep(Duration::from_millis(10)).await;
        c.complete("C".into());
        a.complete("A".into());
        assert_eq!(duplicate.await.unwrap().as_deref(), Some("A"));
        // Now c's stored response makes room for d.
        run(&cache, "d", "D").await;
        assert_eq!(stored(&cache, "a").await.as_deref(), Some("A"));
        assert!(stored(&cache, "c").await.is_none(), "c was the oldest stored");
    }

    #[tokio::test(start_paused = true)]
    async fn metrics_are_exported_under_the_contract_names() {
        let cache = cache(1);
        run(&cache, "a", "A").await;
        stored(&cache, "a").await;
        assert!(matches!(
            cache.claim("encoder", "a", fp("other")).await,
            Claim::Conflict
        ));
        run(&cache, "b", "B").await;
        advance(TTL).await;
        // b expired: this claim runs it again (and drops the ticket, forgetting the key).
        assert!(stored(&cache, "b").await.is_none());
        let text = exposition(&cache);
        for line in [
            "# TYPE vramguard_idempotency_hits counter\nvramguard_idempotency_hits_total 1\n",
            "vramguard_idempotency_waits_total 0\n",
            "vramguard_idempotency_conflicts_total 1\n",
            "vramguard_idempotency_evictions_total{reason=\"capacity\"} 1\n",
            "vramguard_idempotency_evictions_total{reason=\"expired\"} 1\n",
            "# TYPE vramguard_idempotency_entries gauge\nvramguard_idempotency_entries 0\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }

    #[test]
    fn the_fingerprint_separates_its_parts() {
        assert_ne!(fingerprint(&[b"ab", b"c"]), fingerprint(&[b"a", b"bc"]));
        assert_eq!(fingerprint(&[b"a", b"bc"]), fingerprint(&[b"a", b"bc"]));
    }
}
