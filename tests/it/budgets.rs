//! Services' budgets (`services[]`: `concurrency`, `class`, `device_memory`) as clients and
//! operators see them: a request over its service's concurrency waits without a worker and
//! runs, or gets 429 naming the service past `max_wait`, and a generation holds its place until
//! its last token; a background request gives way to
//! waiting interactive work; a request over its service's `device_memory` on the simulated
//! accelerator is refused (or sent to the CPU pool by the default policy) with a reason naming
//! the budget; `/metrics` and `/status` show each service's memory and budget.
//!
//! Concurrency, class and waiting for memory run on fake backends held on a gate, so what is
//! running is decided by the test, not by how fast the machine is; the memory refusals, metrics
//! and `/status` run on real ONNX Runtime sessions on the simulated accelerator.

use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::Value;
use vramguard::core::backend::{Backend, BackendError, Residency, RunMeta};
use vramguard::core::tensor::{Tensor, TensorData};
use vramguard::http::status_of;
use vramguard::serve::lifecycle::{self, Request, RequestError};
use vramguard::serve::metrics::Outcome;
use vramguard::serve::service::Service;
use vramguard::testing::fakes::{self, FakeFactory, encoder_request};
use vramguard::testing::{ADMIT_ALL, Scratch, config};

use crate::common::{TestServer, sample};

/// A run whose first input value is this waits for the gate.
const WAIT_FOR_GATE: f32 = -2.0;

/// Echoes its input; waits for the gate first when told to.
struct Gated(Arc<Mutex<mpsc::Receiver<()>>>);

impl Backend for Gated {
    fn run(&mut self, _: &str, inputs: Vec<Tensor>, _: &[String], _: &RunMeta) -> Result<Vec<Tensor>, BackendError> {
        let input = inputs.into_iter().next().expect("one input");
        if matches!(&input.data, TensorData::Fp32(v) if v.first() == Some(&WAIT_FOR_GATE)) {
            let _ = self.0.lock().unwrap().recv();
        }
        Ok(vec![Tensor {
            name: "pooled".into(),
            ..input
        }])
    }

    fn residency(&mut self) -> Option<&mut dyn Residency> {
        Some(self)
    }

    vramguard::testing::fakes::lacks!(generations, arenas, liveness, interrupts);
}

impl Residency for Gated {
    /// An `on_demand` model's load: nothing to build.
    fn load_model(&mut self, _: &str, _: vramguard::core::model::ModelData<'_>) -> Result<(), String> {
        Ok(())
    }

    fn unload_model(&mut self, _: &str) {}

    /// Nothing to share either.
    fn share_model(&mut self, _: &str, _: &str) -> Result<(), String> {
        Ok(())
    }

    fn release_memory(&mut self, _: &dyn Fn(&str) -> Option<Vec<Tensor>>) {}
}

struct Harness {
    service: Arc<Service>,
    release: mpsc::Sender<()>,
    _script: Scratch,
}

/// Models `chat` (service `chat`: interactive, concurrency 1) on pool `gpu` of two workers, so
/// only the budget holds a request back, and `batch` (service `batch`: background) on pool
/// `bg`, whose max wait (5 s) ends before `gpu`'s (30 s).
fn harness() -> Harness {
    harness_of(
        "services:\n\
         - {name: chat, concurrency: 1}\n\
         - {name: batch, class: background}\n\
         models:\n\
         - {name: chat, path: 'builtin:encoder', service: chat}\n\
         - {name: batch, path: 'builtin:encoder', service: batch}\n\
         pools:\n\
         - {name: gpu, provider: cpu, models: [chat], workers: 2, queue: {capacity: 8, max_wait: 30s}}\n\
         - {name: bg, provider: cpu, models: [batch], workers: 1, queue: {capacity: 8, max_wait: 5s}}\n",
    )
}

/// A service of `yaml` on fake backends, under a policy that admits everything.
fn harness_of(yaml: &str) -> Harness {
    let script = Scratch::new();
    let yaml = format!("{yaml}{}", script.policy(ADMIT_ALL));
    let (release, gate) = mpsc::channel();
    let gate = Arc::new(Mutex::new(gate));
    let factory = Arc::new(FakeFactory::new(move |_| Ok(Box::new(Gated(Arc::clone(&gate))))));
    Harness {
        service: Arc::new(fakes::service(config::validated(&yaml), factory)),
        release,
        _script: script,
    }
}

fn request(model: &str, value: f32) -> Request {
    request_of(model, 4, value)
}

/// A request for `model` of `seq` tokens, all `value`.
fn request_of(model: &str, seq: usize, value: f32) -> Request {
    Request {
        model: model.into(),
        ..encoder_request(seq, value)
    }
}

/// Start `request` on its own task.
fn spawn(h: &Harness, request: Request) -> tokio::task::JoinHandle<Result<lifecycle::Served, lifecycle::Refused>> {
    let service = Arc::clone(&h.service);
    tokio::spawn(async move { lifecycle::infer(&service, request).await })
}

/// Wait (at most 10 s) until `done` holds, letting the other tasks run. The clock is not moved:
/// under paused time a sleep here would advance it and end other requests' waits early.
async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(1));
        tokio::task::yield_now().await;
    }
}

fn counter(h: &Harness, series: &str) -> f64 {
    sample(&vramguard::telemetry::metrics::encode(&h.service.registry), series)
}

#[tokio::test]
async fn a_request_over_its_services_concurrency_waits_without_a_worker_and_then_runs() {
    let h = harness();
    let first = spawn(&h, request("chat", WAIT_FOR_GATE));
    until("the first runs on its worker", || h.service.activity.running() == 1).await;
    let second = spawn(&h, request("chat", 0.5));
    // It waits for its service, not for a worker: the pool's second worker stays idle.
    until("the second waits", || h.service.activity.waiting() == 1).await;
    assert_eq!(h.service.pool("gpu").unwrap().load().queue_depth, 0);
    assert_eq!(h.service.services.running("chat"), 1, "the limit holds");
    assert!(!second.is_finished());

    h.release.send(()).unwrap();
    let first = first.await.unwrap().expect("the first is served");
    let second = second
        .await
        .unwrap()
        .expect("the second runs once the first is answered");
    assert_eq!((first.pool.name(), second.pool.name()), ("gpu", "gpu"));
    assert_eq!(h.service.services.running("chat"), 0, "both gave their places back");
    assert_eq!(
        counter(
            &h,
            "vramguard_requests_total{model=\"chat\",pool=\"gpu\",outcome=\"ok\"}"
        ),
        2.0
    );
}

#[tokio::test(start_paused = true)]
async fn past_max_wait_a_request_over_its_services_concurrency_gets_429_naming_the_service() {
    let h = harness();
    let first = spawn(&h, request("chat", WAIT_FOR_GATE));
    until("the first runs on its worker", || h.service.activity.running() == 1).await;
    let started = tokio::time::Instant::now();
    let refused = lifecycle::infer(&h.service, request("chat", 0.5))
        .await
        .expect_err("the first never finishes within max_wait");
    assert!(started.elapsed() >= Duration::from_secs(30), "{:?}", started.elapsed());
    assert!(
        matches!(refused.error, RequestError::OverBudget { .. }),
        "{:?}",
        refused.error
    );
    assert_eq!(status_of(&refused.error), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.error.outcome(), Outcome::deferred_timeout);
    assert!(refused.error.retry_after_secs().is_some_and(|s| s >= 30));
    let message = refused.error.to_string();
    assert!(
        message.starts_with("service `chat` has 1 requests running, at its concurrency of 1; waited 30"),
        "{message}"
    );
    assert_eq!(
        counter(
            &h,
            "vramguard_requests_total{model=\"chat\",pool=\"gpu\",outcome=\"deferred_timeout\"}"
        ),
        1.0
    );
    h.release.send(()).unwrap();
    first.await.unwrap().expect("the first is served");
}

#[tokio::test]
async fn a_background_request_waits_while_interactive_requests_wait_and_then_runs() {
    let h = harness();
    let chat = spawn(&h, request("chat", WAIT_FOR_GATE));
    // Started on its worker: no longer waiting.
    until("chat runs", || h.service.activity.running() == 1).await;
    // A second chat request waits for its service's concurrency: interactive work is waiting.
    let waiting_chat = spawn(&h, request("chat", 0.5));
    until("chat waits", || h.service.services.interactive_waiting() == 1).await;
    let batch = spawn(&h, request("batch", 0.5));
    let decided = "vramguard_policy_decisions_total{action=\"admit\",pool=\"bg\"}";
    until("the policy admitted it", || counter(&h, decided) == 1.0).await;
    // Admitted by the policy, but held back by its class with a worker free: give it time to
    // run if it were going to.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !batch.is_finished(),
        "a background request gave no way to waiting interactive work"
    );
    assert_eq!(h.service.services.running("batch"), 0);

    h.release.send(()).unwrap();
    chat.await.unwrap().expect("chat is served");
    waiting_chat.await.unwrap().expect("the waiting chat request runs");
    let batch = batch
        .await
        .unwrap()
        .expect("the background request runs once no interactive one waits");
    assert_eq!(batch.pool.name(), "bg");
    // Each request held back is counted once, under what it waited for.
    let waits = |service: &str, reason: &str| {
        counter(
            &h,
            &format!("vramguard_service_waits_total{{service=\"{service}\",reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(waits("batch", "background"), 1.0);
    assert_eq!(waits("chat", "concurrency"), 1.0);
    assert_eq!((waits("batch", "concurrency"), waits("chat", "background")), (0.0, 0.0));
}

#[tokio::test(start_paused = true)]
async fn a_background_request_behind_interactive_work_past_max_wait_gets_429_naming_its_class() {
    let h = harness();
    let chat = spawn(&h, request("chat", WAIT_FOR_GATE));
    // Started on its worker: no longer waiting.
    until("chat runs", || h.service.activity.running() == 1).await;
    let waiting_chat = spawn(&h, request("chat", 0.5));
    until("chat waits", || h.service.services.interactive_waiting() == 1).await;
    let started = tokio::time::Instant::now();
    let refused = lifecycle::infer(&h.service, request("batch", 0.5))
        .await
        .expect_err("interactive work waits the whole time");
    assert!(started.elapsed() >= Duration::from_secs(5), "{:?}", started.elapsed());
    assert_eq!(status_of(&refused.error), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        counter(
            &h,
            "vramguard_requests_total{model=\"batch\",pool=\"bg\",outcome=\"deferred_timeout\"}"
        ),
        1.0
    );
    let message = refused.error.to_string();
    assert!(
        message.starts_with("background service `batch` gives way to 1 waiting interactive requests"),
        "{message}"
    );
    h.release.send(()).unwrap();
    chat.await.unwrap().expect("chat is served");
    waiting_chat.await.unwrap().expect("the waiting chat request runs");
}

/// Model `chat` of service `chat` on a CUDA pool of fake backends, with a `device_memory` budget
/// of its weights (the fake's: the model file's size, once per worker) plus `room` bytes. The
/// fake estimates 1 KiB a token of its context axis and 1 KiB of workspace.
fn on_device(room: u64) -> Harness {
    let yaml = |budget: u64| {
        format!(
            "devices: [{{name: gpu0, kind: nvidia, index: 0}}]\n\
             services: [{{name: chat, device_memory: {budget}}}]\n\
             models: [{{name: chat, path: 'builtin:encoder', service: chat, context: {{input: input, axis: 1}}}}]\n\
             pools: [{{name: gpu, provider: cuda, device: gpu0, models: [chat], workers: 2, queue: {{capacity: 8, max_wait: 30s}}}}]\n"
        )
    };
    let h = harness_of(&yaml(u64::MAX >> 2));
    let weights = h.service.model("chat").unwrap().profile.weights_bytes * 2;
    harness_of(&yaml(weights + room))
}

#[tokio::test]
async fn over_its_device_memory_a_request_waits_for_its_services_own_running_request_and_then_runs() {
    // Room for one request of 60 tokens (61 KiB), not two.
    let h = on_device(100 << 10);
    let first = spawn(&h, request_of("chat", 60, WAIT_FOR_GATE));
    until("the first runs on its worker", || h.service.activity.running() == 1).await;
    let second = spawn(&h, request_of("chat", 60, 0.5));
    until("the second waits", || h.service.activity.waiting() == 1).await;
    assert_eq!(h.service.pool("gpu").unwrap().load().queue_depth, 0, "a worker is free");
    // One that would not fit even alone is refused at once, naming the budget.
    let refused = lifecycle::infer(&h.service, request_of("chat", 200, 0.5))
        .await
        .expect_err("over the budget whatever finishes");
    assert_eq!(status_of(&refused.error), StatusCode::SERVICE_UNAVAILABLE);
    let message = refused.error.to_string();
    assert!(message.starts_with("service `chat` would use "), "{message}");
    assert!(
        message.contains(" on gpu0, over its device_memory budget of "),
        "{message}"
    );
    assert!(!second.is_finished());

    h.release.send(()).unwrap();
    first.await.unwrap().expect("the first is served");
    second
        .await
        .unwrap()
        .expect("the second runs once the first gave its memory back");
}

#[tokio::test]
async fn a_request_waiting_for_its_services_budget_does_not_hold_up_another_services_cold_start() {
    let h = harness_of(
        "devices: [{name: gpu0, kind: nvidia, index: 0}]\n\
         services: [{name: chat, concurrency: 1}]\n\
         models:\n\
         - {name: chat, path: 'builtin:encoder', service: chat}\n\
         - {name: chat-cold, path: 'builtin:encoder', service: chat, residency: on_demand}\n\
         - {name: other-cold, path: 'builtin:encoder', residency: on_demand}\n\
         pools: [{name: gpu, provider: cuda, device: gpu0, models: [chat, chat-cold, other-cold], workers: 2, queue: {capacity: 8, max_wait: 30s}}]\n",
    );
    let first = spawn(&h, request("chat", WAIT_FOR_GATE));
    until("the first runs on its worker", || h.service.activity.running() == 1).await;
    // A cold start of the same service: it takes the device's hold for its load, then waits
    // for its service's concurrency.
    let cold = spawn(&h, request("chat-cold", 0.5));
    until("the cold start waits for its service", || {
        h.service.services.running("chat") == 1 && h.service.activity.waiting() == 1
    })
    .await;
    // Another service's cold start on the device goes ahead (it would wait for the hold up to
    // its pool's 30 s max wait otherwise).
    let other = tokio::time::timeout(
        Duration::from_secs(10),
        lifecycle::infer(&h.service, request("other-cold", 0.5)),
    )
    .await
    .expect("not held up by the waiting request")
    .expect("served");
    assert_eq!(other.pool.name(), "gpu");
    assert!(!cold.is_finished());
    h.release.send(()).unwrap();
    first.await.unwrap().expect("the first is served");
    cold.await
        .unwrap()
        .expect("the cold start runs once the first is answered");
}

// ─── device_memory, on the simulated accelerator ─────────────────────────────────────────────

/// The encoder (68 KB of weights) belongs to service `search`, whose `device_memory` budget of
/// 2 MiB holds a short request but not a 512-token one (4 MiB of attention scores alone).
const MEMORY: &str = "
devices: [{name: gpu0, kind: simulated, capacity: 128MiB}]
services: [{name: search, device_memory: 2MiB, priority: 3}]
models: [{name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}, service: search}]
";

async fn status(server: &TestServer) -> Value {
    reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap()
}

#[tokio::test]
async fn a_request_over_its_services_device_memory_is_refused_naming_the_budget() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let yaml = format!("{MEMORY}pools: [{{name: gpu, provider: simulated, device: gpu0, models: [encoder]}}]\n");
    let server = TestServer::with_policy(&yaml, ADMIT_ALL).await;

    // The metrics and /status show what the service holds from the first scrape: its weights.
    let metrics = server.metrics().await;
    let weights = sample(
        &metrics,
        "vramguard_model_memory_bytes{model=\"encoder\",pool=\"gpu\",kind=\"weights\"}",
    );
    assert!(weights > 0.0, "{metrics}");
    let held = "vramguard_service_memory_bytes{service=\"search\",device=\"gpu0\"}";
    assert_eq!(sample(&metrics, held), weights, "{metrics}");
    assert_eq!(
        sample(
            &metrics,
            "vramguard_service_memory_budget_bytes{service=\"search\",device=\"gpu0\"}"
        ),
        (2u64 << 20) as f64
    );
    let service = &status(&server).await["services"][0];
    assert_eq!(
        service,
        &serde_json::json!({"name": "search", "class": "interactive", "priority": 3, "configured": true,
            "device_memory_budget_bytes": 2u64 << 20, "concurrency": null, "running": 0,
            "memory": {"gpu0": weights as u64}})
    );

    assert_eq!(
        server.encoder(16).await.status(),
        StatusCode::OK,
        "a short request fits"
    );
    let over = server.encoder(512).await;
    assert_eq!(over.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(over.headers().contains_key("retry-after"));
    let error: Value = over.json().await.unwrap();
    let message = error["error"].as_str().unwrap();
    assert!(message.starts_with("service `search` would use "), "{message}");
    assert!(
        message.ends_with(" on gpu0, over its device_memory budget of 2 MiB"),
        "{message}"
    );
    let metrics = server.metrics().await;
    assert_eq!(
        sample(
            &metrics,
            "vramguard_requests_total{model=\"encoder\",pool=\"gpu\",outcome=\"rejected\"}"
        ),
        1.0
    );
    // Nothing of the refused request stays counted against the service.
    assert_eq!(sample(&metrics, held), weights);
    server.stop().await;
}

#[tokio::test]
async fn the_default_policy_sends_a_request_over_its_services_budget_to_the_cpu_pool() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let yaml = format!(
        "{MEMORY}pools:\n\
         - {{name: gpu, provider: simulated, device: gpu0, models: [encoder]}}\n\
         - {{name: cpu, provider: cpu, models: [encoder]}}\n\
         policy: {{params: {{cpu_pool: cpu, reserve_bytes: 32MiB, min_context_tokens: 16, defer_ms: 25, defer_max_queue: 4}}}}\n"
    );
    let server = TestServer::start(&yaml).await;
    let short = server.encoder(16).await;
    assert_eq!(short.status(), StatusCode::OK);
    assert_eq!(short.headers()["x-vramguard-pool"], "gpu");
    let over = server.encoder(512).await;
    assert_eq!(over.status(), StatusCode::OK, "the CPU pool takes it whole");
    assert_eq!(over.headers()["x-vramguard-pool"], "cpu");
    assert_eq!(over.headers()["x-vramguard-decision"], "redirect");
    let status = status(&server).await;
    // The CPU pool's memory is the host's: no device budget, nothing counted on gpu0 for it.
    let search = &status["services"][0];
    assert_eq!(search["running"], 0);
    assert!(search["memory"]["gpu0"].as_u64().unwrap() < 2 << 20, "{search}");
    server.stop().await;
}

#[tokio::test]
async fn a_background_request_waits_while_its_device_is_under_the_reserve_but_not_on_the_cpu_pool() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let scratch = Scratch::new();
    let policy = scratch.write("policy.rhai", ADMIT_ALL);
    let yaml = format!(
        "devices: [{{name: gpu0, kind: simulated, capacity: 128MiB}}]\n\
         services: [{{name: batch, class: background}}]\n\
         models:\n\
         - {{name: encoder, path: 'builtin:encoder', context: {{input: input, axis: 1}}, service: batch}}\n\
         - {{name: classifier, path: 'builtin:classifier', service: batch}}\n\
         pools:\n\
         - {{name: gpu, provider: simulated, device: gpu0, models: [encoder], queue: {{capacity: 8, max_wait: 20s}}}}\n\
         - {{name: cpu, provider: cpu, models: [classifier]}}\n\
         policy: {{path: '{}', watch_interval: 0s, params: {{reserve_bytes: 64MiB}}}}\n",
        policy.display()
    );
    let server = TestServer::start(&yaml).await;
    // 100 MiB held by someone else: the device's headroom drops under the 64 MiB reserve.
    let set = server
        .post_json("/admin/sim/gpu0", &serde_json::json!({"pressure": "100MiB"}))
        .await;
    assert_eq!(set.status(), StatusCode::OK);
    let waiting = crate::common::spawn_binary_encoder(&server, 16);
    crate::common::until_waiting(&server, 1.0, "the background request").await;
    // The same service on the CPU pool is not held back by the device's headroom.
    let case = &crate::common::reference_cases("classifier")[0];
    let on_cpu = server
        .post_json("/v2/models/classifier/infer", &crate::common::request_from_case(case))
        .await;
    assert_eq!(on_cpu.status(), StatusCode::OK);
    assert!(!waiting.is_finished(), "the device is still under its reserve");

    let released = server
        .post_json("/admin/sim/gpu0", &serde_json::json!({"pressure": "0"}))
        .await;
    assert_eq!(released.status(), StatusCode::OK);
    assert_eq!(
        waiting.await.unwrap(),
        StatusCode::OK,
        "served once the headroom is back"
    );
    server.stop().await;
}

/// The tiny decoder fixture on a CPU pool of two workers, its service limited to one request
/// at a time, under a policy that admits everything.
fn decoder_service(script: &Scratch) -> vramguard::config::Config {
    config::validated(&format!(
        "services: [{{name: tiny, concurrency: 1}}]\n\
         models: [{{name: tiny, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json}}]\n\
         pools: [{{name: cpu, provider: cpu, models: [tiny], workers: 2, queue: {{capacity: 8, max_wait: 30s}}}}]\n{}",
        script.policy(ADMIT_ALL)
    ))
}

#[tokio::test]
async fn a_generation_holds_its_services_concurrency_until_its_last_token() {
    use vramguard::serve::generation::{self, Params, Penalties, Prompt};
    let script = Scratch::new();
    let config = decoder_service(&script);
    let service = Arc::new(
        tokio::task::spawn_blocking(move || Service::start(config))
            .await
            .unwrap()
            .expect("service starts"),
    );
    // The fixture's "short" case: 16 greedy tokens, no end token among them.
    let params = Params {
        max_tokens: Some(16),
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        seed: 1,
        stop: Vec::new(),
        tools: false,
        grammar: None,
        penalties: Penalties::NONE,
        logprobs: None,
    };
    let generation = |sink| {
        let (service, params) = (Arc::clone(&service), params.clone());
        tokio::spawn(async move {
            let entry = service.model("tiny").unwrap();
            let request = vramguard::testing::request("tiny", Vec::new());
            generation::generate(&service, entry, Prompt::from(vec![301, 355]), &params, request, sink)
                .await
                .map(|g| g.tokens.len())
        })
    };
    // A reader that reads nothing yet: the generation stops at its second token, between runs.
    let (sink, mut tokens) = tokio::sync::mpsc::channel(1);
    let streaming = generation(Some(sink));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while tokens.capacity() > 0 || service.activity.running() != 1 {
        assert!(std::time::Instant::now() < deadline, "the generation never started");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(service.services.running("tiny"), 1, "between its runs it still counts");
    let second = generation(None);
    until("the second generation waits", || service.activity.waiting() == 1).await;
    // The first one's step in flight when its token was sent ends, and then nothing runs: its
    // generation waits for its reader with no worker held.
    until("no worker is held meanwhile", || {
        service.pool("cpu").unwrap().load().inflight == 0
    })
    .await;
    assert_eq!(service.activity.waiting(), 1, "the second still waits");

    let mut read = 0;
    while tokens.recv().await.is_some() {
        read += 1;
    }
    assert_eq!((read, streaming.await.unwrap().expect("the stream ends")), (16, 16));
    assert_eq!(
        second
            .await
            .unwrap()
            .expect("the second runs after the first's last token"),
        16
    );
    assert_eq!(service.services.running("tiny"), 0);
}

/// A service's memory in `/status` is listed for the devices its models' pools use, not for
/// every device at 0: a model only the CPU pool serves shows none.
#[tokio::test]
async fn a_service_shows_memory_only_on_the_devices_that_serve_it() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(
        "devices: [{name: gpu0, kind: simulated, capacity: 128MiB}]
models:
- {name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}}
- {name: classifier, path: 'builtin:classifier'}
pools:
- {name: gpu, provider: simulated, device: gpu0, models: [encoder], fallback: cpu}
- {name: cpu, provider: cpu, models: [encoder, classifier]}
",
    )
    .await;
    let status = status(&server).await;
    let memory = |name: &str| {
        let services = status["services"].as_array().unwrap();
        let service = services
            .iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("{status}"));
        service["memory"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(memory("encoder"), ["gpu0"], "{status}");
    assert!(memory("classifier").is_empty(), "{status}");
    server.stop().await;
}
