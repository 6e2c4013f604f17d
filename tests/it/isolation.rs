//! Process isolation over real processes and real ONNX Runtime sessions: the simulated
//! accelerator pool runs in a worker process of its own. Its death (`kill_worker`, SIGKILL)
//! under mixed load answers every request as documented and nothing twice, the CPU pool's
//! unrelated work completes, the worker comes back and its own probe closes the breaker with
//! no accelerator traffic; a hung worker is found by its heartbeat and replaced; a driver fault
//! poisons the worker until a restore replaces it; a parent that dies takes its worker along.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::common::{TestServer, sample};

/// A simulated `gpu` pool (process isolation, the default) with two workers, falling back on
/// a `cpu` pool that also serves a CPU-only model and the decoder.
const CONFIG: &str = "\
devices: [{name: gpu0, kind: simulated, capacity: 256MiB}]
models:
- {name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}}
- {name: classifier, path: 'builtin:classifier'}
- {name: tiny, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json, chat_template: 'builtin:chatml'}
pools:
- {name: gpu, provider: simulated, device: gpu0, models: [encoder, tiny], workers: 2, fallback: cpu,
   queue: {capacity: 512}, breaker: {failures: 100, window: 60s, cooldown: 1h},
   health: {interval: 1h, timeout: 1s}}
- {name: cpu, provider: cpu, models: [encoder, classifier, tiny], workers: 2, queue: {capacity: 512}}
host: {reserve: 64MiB}
";

async fn status(server: &TestServer) -> Value {
    reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap()
}

fn gpu(status: &Value) -> &Value {
    status["pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "gpu")
        .unwrap()
}

async fn sim(server: &TestServer, body: Value) -> (StatusCode, Value) {
    let response = server.post_json("/admin/sim/gpu0", &body).await;
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// Poll `/status` (no inference traffic) until the gpu pool has a worker other than `old`
/// and a closed breaker, for at most `within`: the new pid, and how long it took.
async fn replaced(server: &TestServer, old: u64, within: Duration) -> (Option<u64>, Duration) {
    let since = Instant::now();
    while since.elapsed() < within {
        let status = status(server).await;
        let pool = gpu(&status);
        if let Some(pid) = pool["worker_pid"].as_u64()
            && pid != old
            && pool["breaker"] == "closed"
        {
            return (Some(pid), since.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (None, since.elapsed())
}

fn alive(pid: u64) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
}

/// What one client request ended with.
#[derive(Debug)]
struct Seen {
    kind: &'static str,
    status: u16,
    pool: String,
    body: String,
}

async fn encoder(url: String, id: String, headers: Vec<(&'static str, String)>, kind: &'static str) -> Seen {
    encoder_of(url, id, headers, kind, crate::common::encoder_binary_request(1024)).await
}

/// An encoder request whose body (and its JSON header's length) was made beforehand.
async fn encoder_of(
    url: String,
    id: String,
    headers: Vec<(&'static str, String)>,
    kind: &'static str,
    (header, body): (String, Vec<u8>),
) -> Seen {
    let mut request = reqwest::Client::new()
        .post(url)
        .header("Inference-Header-Content-Length", header.len())
        .header("x-request-id", id);
    for (name, value) in headers {
        request = request.header(name, value);
    }
    seen(kind, request.body(body).send().await.unwrap()).await
}

/// What `response` to a request of `kind` said: its status, pool and body.
async fn seen(kind: &'static str, response: reqwest::Response) -> Seen {
    let status = response.status().as_u16();
    let pool = response
        .headers()
        .get("x-vramguard-pool")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let body = String::from_utf8_lossy(&response.bytes().await.unwrap_or_default()).into_owned();
    Seen {
        kind,
        status,
        pool,
        body,
    }
}

async fn stream(url: String, id: String) -> Seen {
    let request = json!({"model": "tiny", "messages": [{"role": "user", "content": "Tell me about memory."}],
                         "max_tokens": 48, "temperature": 0, "stream": true});
    let client = reqwest::Client::new();
    seen(
        "stream",
        client
            .post(url)
            .header("x-request-id", id)
            .json(&request)
            .send()
            .await
            .unwrap(),
    )
    .await
}

async fn classifier(url: String, id: String) -> Seen {
    let data: Vec<f32> = (0..64 * 16).map(|i| (i % 11) as f32 * 0.1).collect();
    let body = json!({"inputs": [{"name": "features", "shape": [64, 16], "datatype": "FP32", "data": data}]});
    let client = reqwest::Client::new();
    seen(
        "cpu",
        client
            .post(url)
            .header("x-request-id", id)
            .json(&body)
            .send()
            .await
            .unwrap(),
    )
    .await
}

// Threads of their own for the clients, so the burst arrives faster than the worker drains it
// and the kill below finds runs going and more queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_worker_under_mixed_load_loses_nothing_runs_nothing_twice_and_comes_back_by_its_own_probe() {
    let server = TestServer::start(CONFIG).await;
    let first = gpu(&status(&server).await)["worker_pid"]
        .as_u64()
        .expect("a worker runs");
    assert!(alive(first));
    let before = server.metrics().await;
    let infer = server.url("/v2/models/encoder/infer");
    let mut tasks = Vec::new();
    // The first dozen cannot be replayed and run longest: they are what the worker holds
    // when it dies. Their bodies are made first, so that they arrive together.
    let long: Vec<(String, Vec<u8>)> = (0..12).map(|_| crate::common::encoder_binary_request(2048)).collect();
    let mut bodies: Vec<(String, Vec<u8>)> = (0..108).map(|_| crate::common::encoder_binary_request(1024)).collect();
    for (i, body) in long.into_iter().enumerate() {
        let not = vec![("x-vramguard-replayable", "false".into())];
        tasks.push(tokio::spawn(encoder_of(
            infer.clone(),
            format!("held-{i}"),
            not,
            "non_replayable",
            body,
        )));
    }
    for i in 0..108 {
        let id = format!("mixed-{i}");
        let body = bodies.pop().unwrap();
        tasks.push(match i % 6 {
            0 | 1 => tokio::spawn(encoder_of(infer.clone(), id, vec![], "replayable", body)),
            2 => tokio::spawn(encoder_of(
                infer.clone(),
                id,
                vec![("x-vramguard-replayable", "false".into())],
                "non_replayable",
                body,
            )),
            3 => tokio::spawn(encoder_of(
                infer.clone(),
                id.clone(),
                vec![("idempotency-key", id)],
                "keyed",
                body,
            )),
            4 => tokio::spawn(stream(server.url("/v1/chat/completions"), id)),
            _ => tokio::spawn(classifier(server.url("/v2/models/classifier/infer"), id)),
        });
    }
    // Kill it while the burst is in flight there: runs going, more queued.
    let since = Instant::now();
    loop {
        let status = status(&server).await;
        let pool = gpu(&status);
        if pool["inflight"].as_u64() >= Some(2) && pool["queue_depth"].as_u64() >= Some(8) {
            break;
        }
        assert!(
            since.elapsed() < Duration::from_secs(20),
            "the burst never queued on the gpu: {pool}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let (code, killed) = sim(&server, json!({"kill_worker": true})).await;
    assert_eq!(code, StatusCode::OK, "{killed}");
    assert_eq!(killed["killed_worker_pid"].as_u64(), Some(first));
    let mut seen = Vec::new();
    for task in tasks {
        seen.push(task.await.unwrap());
    }
    // No accelerator traffic from here on: the worker comes back and its probe closes the
    // breaker by itself.
    let (second, took) = replaced(&server, first, Duration::from_secs(15)).await;
    let second = second.unwrap_or_else(|| panic!("no new worker with a closed breaker after {took:?}"));
    assert!(!alive(first), "the killed worker {first} is gone (and reaped)");
    assert!(alive(second));

    let mut by_kind: BTreeMap<(&str, u16), usize> = BTreeMap::new();
    for s in &seen {
        *by_kind.entry((s.kind, s.status)).or_default() += 1;
        match s.kind {
            // Replayable work is answered, on the gpu or (retried once) on the cpu.
            "replayable" | "keyed" => assert_eq!(s.status, 200, "{s:?}"),
            // Non-replayable work that the lost worker held is not run again elsewhere: a
            // resumable 503 naming the reason; what it did not hold ran once.
            "non_replayable" => match s.status {
                // Run once where it was first placed: never a retry's answer.
                200 => {
                    let answer: Value = serde_json::from_str(&s.body).unwrap();
                    assert!(
                        answer["parameters"]["reason"].is_null(),
                        "a non-replayable request ran again: {s:?}"
                    );
                }
                503 => {
                    assert!(s.body.contains("worker_lost") || s.body.contains("breaker"), "{s:?}");
                    assert_ne!(s.pool, "cpu", "a non-replayable request never moves: {s:?}");
                }
                _ => panic!("{s:?}"),
            },
            // A stream either completes or ends with a resumable error event.
            "stream" => {
                assert_eq!(s.status, 200, "{s:?}");
                assert!(s.body.contains("[DONE]") || s.body.contains("\"error\""), "{s:?}");
            }
            // The CPU pool's unrelated work completes.
            _ => assert_eq!((s.status, s.pool.as_str()), (200, "cpu"), "{s:?}"),
        }
    }
    let after = server.metrics().await;
    let delta = |series: &str| sample(&after, series) - sample(&before, series);
    assert_eq!(
        delta("vramguard_worker_restarts_total{pool=\"gpu\",reason=\"exited\"}"),
        1.0
    );
    assert_eq!(sample(&after, "vramguard_worker_up{pool=\"gpu\"}"), 1.0);
    assert!(delta("vramguard_health_checks_total{pool=\"gpu\",result=\"ok\"}") >= 1.0);
    // The worker held work when it died (runs going, frames waiting, a queue of 8 behind):
    // retried on the cpu, or answered with the resumable error.
    let lost = seen
        .iter()
        .filter(|s| s.kind == "non_replayable" && s.status == 503 && s.body.contains("worker_lost"))
        .count();
    let moved = delta("vramguard_failovers_total{from=\"gpu\",to=\"cpu\",reason=\"worker_lost\"}");
    assert!(
        moved + lost as f64 >= 1.0,
        "nothing was held by the killed worker: {by_kind:?}"
    );
    // The server counted what the clients saw, outcome by outcome.
    let counted = |outcome: &str| {
        crate::common::requests_with(&after, |o| o == outcome) - crate::common::requests_with(&before, |o| o == outcome)
    };
    let ok = seen
        .iter()
        .filter(|s| s.status == 200 && !s.body.contains("\"error\""))
        .count();
    let stream_errors = seen
        .iter()
        .filter(|s| s.status == 200 && s.body.contains("\"error\""))
        .count();
    let refused = seen.iter().filter(|s| s.status == 503).count();
    assert_eq!(counted("ok") as usize, ok, "{by_kind:?}");
    assert_eq!(
        (counted("failed") + counted("rejected")) as usize,
        refused + stream_errors,
        "{by_kind:?}"
    );
    for outcome in ["client_error", "deferred_timeout", "cancelled"] {
        assert_eq!(counted(outcome), 0.0, "{outcome}: {by_kind:?}");
    }
    // A keyed request ran once: asking again replays the stored answer.
    let again = encoder(
        infer.clone(),
        "mixed-3-again".into(),
        vec![("idempotency-key", "mixed-3".into())],
        "keyed",
    )
    .await;
    assert_eq!(again.status, 200);
    server.stop().await;
}

#[tokio::test]
async fn a_hung_worker_is_found_by_its_heartbeat_replaced_and_its_job_answered() {
    let server = TestServer::start(CONFIG).await;
    let first = gpu(&status(&server).await)["worker_pid"].as_u64().unwrap();
    let (code, body) = sim(&server, json!({"hang_worker": true})).await;
    assert_eq!(code, StatusCode::OK, "{body}");
    let since = Instant::now();
    // Sent to the hung worker, which holds them: answered once it is found hung and killed,
    // the replayable one retried on the cpu, the other one not run again anywhere.
    let infer = server.url("/v2/models/encoder/infer");
    let replayable = tokio::spawn(encoder(infer.clone(), "to-a-hung-worker".into(), vec![], "replayable"));
    let not = vec![("x-vramguard-replayable", "false".into())];
    let held = encoder(infer, "held-by-a-hung-worker".into(), not, "non_replayable").await;
    let replayable = replayable.await.unwrap();
    assert_eq!(
        (replayable.status, replayable.pool.as_str()),
        (200, "cpu"),
        "{replayable:?}"
    );
    assert!(replayable.body.contains("worker_lost"), "{replayable:?}");
    assert_eq!(held.status, 503, "{held:?}");
    let error: Value = serde_json::from_str(&held.body).unwrap();
    assert_eq!(error["reason"], "worker_lost", "{error}");
    assert_eq!(error["retried"], false, "{error}");
    assert_eq!(error["request_id"], "held-by-a-hung-worker", "{error}");
    let (second, _) = replaced(&server, first, Duration::from_secs(15)).await;
    assert!(second.is_some(), "the hung worker was not replaced");
    // Found within the heartbeat timeout (1 s), and a little for the heartbeat's period.
    assert!(since.elapsed() < Duration::from_secs(10), "{:?}", since.elapsed());
    let metrics = server.metrics().await;
    assert_eq!(
        sample(
            &metrics,
            "vramguard_worker_restarts_total{pool=\"gpu\",reason=\"hung\"}"
        ),
        1.0
    );
    assert!(!alive(first), "the hung worker {first} was killed");
    server.stop().await;
}

#[tokio::test]
async fn a_driver_fault_poisons_the_worker_until_a_restore_replaces_it() {
    let server = TestServer::start(CONFIG).await;
    let first = gpu(&status(&server).await)["worker_pid"].as_u64().unwrap();
    let (code, body) = sim(&server, json!({"driver_reset": true})).await;
    assert_eq!(code, StatusCode::OK, "{body}");
    // The worker process is poisoned: clearing the fault there is refused, and no request
    // runs on the gpu pool (they are retried on, then sent to, the cpu pool).
    let (code, body) = sim(&server, json!({"driver_reset": false})).await;
    assert_eq!(code, StatusCode::CONFLICT, "{body}");
    assert!(body["error"].as_str().unwrap().contains("sticky"), "{body}");
    for i in 0..3 {
        let seen = encoder(
            server.url("/v2/models/encoder/infer"),
            format!("poisoned-{i}"),
            vec![],
            "replayable",
        )
        .await;
        assert_eq!((seen.status, seen.pool.as_str()), (200, "cpu"), "{seen:?}");
    }
    assert_ne!(gpu(&status(&server).await)["breaker"], "closed");
    // A restore replaces the worker; the new one's probe closes the breaker.
    let restored = server.post_json("/admin/pools/gpu/restore", &json!({})).await;
    assert_eq!(restored.status(), StatusCode::OK);
    let (second, took) = replaced(&server, first, Duration::from_secs(15)).await;
    assert!(second.is_some(), "not replaced after {took:?}");
    let seen = encoder(
        server.url("/v2/models/encoder/infer"),
        "healed".into(),
        vec![],
        "replayable",
    )
    .await;
    assert_eq!((seen.status, seen.pool.as_str()), (200, "gpu"), "{seen:?}");
    let metrics = server.metrics().await;
    assert_eq!(
        sample(
            &metrics,
            "vramguard_worker_restarts_total{pool=\"gpu\",reason=\"restore\"}"
        ),
        1.0
    );
    server.stop().await;
}

/// A restore whose new worker cannot start (here its binary is gone for a moment) answers 503
/// and leaves no worker; the supervisor then keeps starting one in the background, and once
/// one starts, its probe closes the breaker without any request.
#[tokio::test]
async fn a_restore_whose_worker_cannot_start_is_retried_in_the_background() {
    let scratch = vramguard::testing::Scratch::new();
    let exe = scratch.path().join("vramguard");
    std::os::unix::fs::symlink(crate::common::BIN, &exe).unwrap();
    let mut config = vramguard::testing::config::validated(CONFIG);
    config.worker_exe = Some(exe.clone());
    let server = TestServer::start_with(config).await;
    let first = gpu(&status(&server).await)["worker_pid"].as_u64().unwrap();
    std::fs::remove_file(&exe).unwrap();
    let restored = server.post_json("/admin/pools/gpu/restore", &json!({})).await;
    assert_eq!(restored.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = restored.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("in the background"), "{body}");
    let now = status(&server).await;
    assert!(gpu(&now)["worker_pid"].is_null(), "{now}");
    assert_ne!(gpu(&now)["breaker"], "closed");
    assert!(!alive(first), "the replaced worker {first} was killed");
    std::os::unix::fs::symlink(crate::common::BIN, &exe).unwrap();
    let (second, took) = replaced(&server, first, Duration::from_secs(20)).await;
    assert!(second.is_some(), "no worker {took:?} after the binary came back");
    let metrics = server.metrics().await;
    assert_eq!(sample(&metrics, "vramguard_worker_up{pool=\"gpu\"}"), 1.0);
    server.stop().await;
}

#[tokio::test]
async fn a_fresh_server_shows_its_worker_up_and_no_restarts() {
    let server = TestServer::start(CONFIG).await;
    let metrics = server.metrics().await;
    assert_eq!(sample(&metrics, "vramguard_worker_up{pool=\"gpu\"}"), 1.0, "{metrics}");
    for reason in ["exited", "hung", "restore"] {
        let series = format!("vramguard_worker_restarts_total{{pool=\"gpu\",reason=\"{reason}\"}} 0");
        assert!(metrics.contains(&series), "{series} missing");
    }
    // Thread-isolated pools have no worker process, and no series.
    assert!(!metrics.contains("vramguard_worker_up{pool=\"cpu\"}"));
    let status = status(&server).await;
    assert_eq!(gpu(&status)["isolation"], "process");
    // The worker's memory is listed as vramguard's, with the pool named.
    let pid = gpu(&status)["worker_pid"].as_u64().unwrap();
    let processes = status["processes"].as_array().cloned().unwrap_or_default();
    let listed = format!("{metrics}{}", Value::Array(processes));
    assert!(
        listed.contains(&format!("pid=\"{pid}\"")) || listed.contains(&pid.to_string()),
        "{listed}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_tensors_cross_in_shared_memory_and_answer_as_through_the_socket() {
    let server = TestServer::start(CONFIG).await;
    let url = server.url("/v2/models/encoder/infer");
    // The first seq-1024 run's 256 KiB input crosses in the frame on each of the pool's two
    // connections; the runs after it find shared memory made for it.
    let mut answers = Vec::new();
    for i in 0..6 {
        let seen = encoder(url.clone(), format!("shm-{i}"), vec![], "replayable").await;
        assert_eq!((seen.status, seen.pool.as_str()), (200, "gpu"), "{}", seen.body);
        let pooled: Value = serde_json::from_str(&seen.body).unwrap();
        answers.push(pooled["outputs"][0]["data"].clone());
    }
    assert!(answers.windows(2).all(|w| w[0] == w[1]), "{answers:?}");
    // A smaller input, in the same region, is read as its own length.
    let small = encoder_of(
        url.clone(),
        "shm-small".into(),
        vec![],
        "replayable",
        crate::common::encoder_binary_request(300),
    )
    .await;
    assert_eq!(small.status, 200, "{}", small.body);
    assert_ne!(
        serde_json::from_str::<Value>(&small.body).unwrap()["outputs"][0]["data"],
        answers[0]
    );
    let pid = gpu(&status(&server).await)["worker_pid"].as_u64().unwrap();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    assert!(
        maps.contains("memfd:vramguard-tensors"),
        "the worker maps no shared memory:\n{maps}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_s_two_lanes_share_its_sessions_and_run_concurrent_work_in_turn() {
    // The same simulated pool, one worker, in a process and on a thread: the weights are on
    // the device once either way (the process pool's two lanes share one worker's sessions).
    let one = |isolation: &str| {
        format!(
            "devices: [{{name: gpu0, kind: simulated, capacity: 256MiB}}]
models: [{{name: encoder, path: 'builtin:encoder', context: {{input: input, axis: 1}}}}]
pools: [{{name: gpu, provider: simulated, device: gpu0, models: [encoder], workers: 1, isolation: {isolation}}}]
"
        )
    };
    let mut reserved = Vec::new();
    for isolation in ["thread", "process"] {
        let server = TestServer::start(&one(isolation)).await;
        let metrics = server.metrics().await;
        reserved.push(sample(
            &metrics,
            "vramguard_allocator_reserved_bytes{pool=\"gpu\",device=\"gpu0\"}",
        ));
        // Concurrent requests all run, one after another, on the one worker.
        let url = server.url("/v2/models/encoder/infer");
        let tasks: Vec<_> = (0..8)
            .map(|i| tokio::spawn(encoder(url.clone(), format!("{isolation}-{i}"), vec![], "replayable")))
            .collect();
        let mut answers = Vec::new();
        for task in tasks {
            answers.push(task.await.unwrap());
        }
        for seen in &answers {
            assert_eq!(
                (seen.status, seen.pool.as_str()),
                (200, "gpu"),
                "{isolation}: {}",
                seen.body
            );
        }
        let data = |seen: &Seen| serde_json::from_str::<Value>(&seen.body).unwrap()["outputs"][0]["data"].clone();
        assert!(
            answers.windows(2).all(|w| data(&w[0]) == data(&w[1])),
            "{isolation}: answers differ"
        );
        server.stop().await;
    }
    assert!(reserved[0] > 0.0, "{reserved:?}");
    assert_eq!(
        reserved[0], reserved[1],
        "weights held once per worker: thread, process"
    );
}

#[test]
fn a_parent_that_dies_takes_its_worker_with_it() {
    let dir = vramguard::testing::Scratch::new();
    let config = dir.path().join("vramguard.yaml");
    std::fs::write(
        &config,
        format!(
            "server: {{listen: '127.0.0.1:0', admin_socket: 'off'}}\n{}",
            CONFIG.replace(
                "models/decoder",
                &format!("{}/models/decoder", env!("CARGO_MANIFEST_DIR"))
            )
        ),
    )
    .unwrap();
    let serving = crate::common::spawn_serving(
        &["serve", "--config", config.to_str().unwrap()],
        &[],
        "vramguard serving",
    );
    let url = format!("http://{}/status", serving.addr);
    let status: Value = reqwest::blocking::get(url).unwrap().json().unwrap();
    let worker = gpu(&status)["worker_pid"].as_u64().unwrap();
    assert!(alive(worker));
    let mut serving = serving;
    serving.child.kill().unwrap();
    serving.child.wait().unwrap();
    let since = Instant::now();
    while alive(worker) && since.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!alive(worker), "worker {worker} outlived its parent");
}

/// Linux sends a worker its parent-death signal when the *thread* that started it exits, not
/// the process. A restore starts its worker on one of tokio's blocking threads, which exit
/// after 10 s idle: that worker, and every later one, must live on after its starter is gone.
#[test]
fn a_worker_outlives_the_thread_that_started_it() {
    use vramguard::pool::process::WorkerHost;
    let rt = vramguard::runtime::onnx::runtime(None).expect("ONNX Runtime");
    let spec = vramguard::testing::config::cpu_worker("gpu", &rt.library);
    let host = WorkerHost::new(spec, crate::common::BIN.into(), Duration::from_secs(5)).unwrap();
    for _ in 0..2 {
        let starter = std::sync::Arc::clone(&host);
        let pid = std::thread::spawn(move || starter.start().map(|w| w.pid))
            .join()
            .unwrap()
            .unwrap();
        // The signal would come as the thread ends, a little after `join` returns: look for a
        // while, asking the worker each time.
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(30));
            let worker = host.current().unwrap();
            assert_eq!(
                worker.ended(),
                None,
                "worker {pid} died with the thread that started it"
            );
            host.ping().unwrap();
        }
        host.take().unwrap().kill();
    }
}

/// A worker process with two models holds two arenas (a CPU session has its own): the pool's
/// reserved bytes are both, read through the worker, not those of the model that ran last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_s_arena_statistics_cover_every_session_it_holds() {
    let server = TestServer::start(
        "models:\n\
         - {name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}}\n\
         - {name: classifier, path: 'builtin:classifier'}\n\
         pools:\n\
         - {name: cpu, provider: cpu, models: [encoder, classifier], workers: 1, isolation: process,\n\
            memory: {idle_release: 0s}}\n",
    )
    .await;
    let long = encoder_of(
        server.url("/v2/models/encoder/infer"),
        "long".into(),
        vec![],
        "replayable",
        crate::common::encoder_binary_request(512),
    )
    .await;
    assert_eq!(long.status, 200, "{}", long.body);
    // Only classifier runs from here on, for longer than two of the sampler's intervals: the
    // statistics are read after one of them.
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(2500) {
        let seen = classifier(server.url("/v2/models/classifier/infer"), "short".into()).await;
        assert_eq!(seen.status, 200, "{}", seen.body);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = status(&server).await;
    let cpu = status["pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "cpu")
        .unwrap();
    let reserved = cpu["arena"]["reserved_bytes"].as_u64().unwrap();
    // The encoder's arena keeps the blocks of its seq-512 run (16·n² bytes of attention
    // scores, 4 MiB), since nothing gives them back.
    assert!(reserved >= 4 << 20, "reserved {reserved} bytes: {cpu}");
    server.stop().await;
}
