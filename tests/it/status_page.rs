//! The status page at `GET /` rendered by a real browser (headless Chromium, Debian package
//! `chromium`, installed by `make tools`) against a running server whose simulated accelerator
//! is under external pressure and then reset: the rendered DOM must show the process holding
//! the device, the degraded banner and the policy's decisions. A screenshot is saved to
//! `target/status-page.png` (the README shows a copy, `docs/status-page.png`).
//!
//! The models, services and evictions panels are rendered from the page the server serves, put
//! behind a stand-in `/status` that sends the real server's report without those keys (an older
//! server), with them empty, and with them filled as `/status` describes them.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::TestServer;
use reqwest::StatusCode;
use serde_json::{Value, json};

/// Run headless Chromium on `url` with `args`, killed after 60 s; returns its stdout.
fn chromium(url: &str, args: &[&str], profile: &Path) -> String {
    let mut child = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            // Let the page's fetch of /status finish before the DOM is read.
            "--virtual-time-budget=10000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromium is needed for this test: run `make tools` (Debian package `chromium`)");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "chromium failed: {:?}", out.status);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The DOM headless Chromium renders at `url`, in a profile of its own.
async fn dump_dom(url: &str) -> String {
    let url = url.to_string();
    tokio::task::spawn_blocking(move || chromium(&url, &["--dump-dom"], vramguard::testing::Scratch::new().path()))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_shows_who_holds_the_accelerator_and_the_degraded_banner() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(crate::common::FAILOVER_CONFIG).await;
    let page = server.url("/");

    // Another process (the simulated pressure) takes 40 MiB; a request runs on the accelerator.
    let pressure = server.post_json("/admin/sim/gpu0", &json!({"pressure": "40MiB"})).await;
    assert_eq!(pressure.status(), StatusCode::OK);
    assert_eq!(server.encoder(32).await.status(), StatusCode::OK);
    let dom = dump_dom(&page).await;
    assert!(dom.contains("Serving normally"), "{dom}");
    assert!(
        dom.contains("simulated-pressure · simulated · pid 0 · 40.0 MiB"),
        "{dom}"
    );
    assert!(dom.contains("SIMULATED"), "{dom}");
    assert!(dom.contains("admit"), "the decision is listed: {dom}");

    // A driver reset opens the breaker: the page says degraded, why, and where work goes.
    let reset = server
        .post_json("/admin/sim/gpu0", &json!({"driver_reset": true}))
        .await;
    assert_eq!(reset.status(), StatusCode::OK);
    let after = server
        .encoder_with_headers(32, &[("x-request-id", "after-reset")])
        .await;
    assert_eq!(after.status(), StatusCode::OK);
    let screenshot = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/status-page.png");
    let _ = std::fs::remove_file(&screenshot);
    let dom = {
        let page = page.clone();
        let screenshot = screenshot.clone();
        tokio::task::spawn_blocking(move || {
            let profile = vramguard::testing::Scratch::new();
            let dom = chromium(&page, &["--dump-dom"], profile.path());
            chromium(
                &page,
                &[
                    &format!("--screenshot={}", screenshot.display()),
                    "--window-size=1280,1100",
                ],
                profile.path(),
            );
            dom
        })
        .await
        .unwrap()
    };
    assert!(dom.contains("Degraded since"), "{dom}");
    assert!(
        dom.contains("gpu → cpu: position"),
        "the banner says where work moves: {dom}"
    );
    assert!(dom.contains("simulated-pressure"), "{dom}");
    assert!(dom.contains("driver"), "the breaker's reason is shown: {dom}");
    // The decision's row says who answered the request in the end, and how it ended.
    let decided = row(&dom, r#"data-request="after-reset""#);
    assert_eq!(decided[5..7], ["cpu", "ok"], "{decided:?}");
    let png = std::fs::read(&screenshot).expect("a screenshot was saved");
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "{} bytes", png.len());
    server.stop().await;
}

/// A stand-in server on loopback: `page` at `/`, and at `/status` whatever `status` holds when
/// it is asked. Aborted when dropped.
struct StandIn {
    url: String,
    status: Arc<Mutex<Value>>,
    task: tokio::task::JoinHandle<()>,
}

impl StandIn {
    async fn start(page: String, status: Value) -> StandIn {
        let status = Arc::new(Mutex::new(status));
        let report = Arc::clone(&status);
        let app = axum::Router::new()
            .route(
                "/",
                axum::routing::get(move || std::future::ready(axum::response::Html(page.clone()))),
            )
            .route(
                "/status",
                axum::routing::get(move || std::future::ready(axum::Json(report.lock().unwrap().clone()))),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        StandIn { url, status, task }
    }

    fn set(&self, status: Value) {
        *self.status.lock().unwrap() = status;
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The text of each cell of the table row that opens with `<tr {attributes}>`, tags removed.
fn row(dom: &str, attributes: &str) -> Vec<String> {
    let start = dom
        .find(&format!("<tr {attributes}>"))
        .unwrap_or_else(|| panic!("no row <tr {attributes}>: {dom}"));
    let html = &dom[start..start + dom[start..].find("</tr>").unwrap()];
    let cell = regex::Regex::new(r"(?s)<td[^>]*>(.*?)</td>").unwrap();
    let tag = regex::Regex::new(r"<[^>]+>").unwrap();
    cell.captures_iter(html)
        .map(|c| {
            tag.replace_all(&c[1], " ")
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

/// `models`, `services` and `evictions` as `/status` describes them: a pinned model held on the
/// accelerator and not on the CPU pool, an on-demand one unloaded, one no pool serves; a service
/// over its budget, one exactly at it, one with no budget and not declared; two evictions, the
/// older one first.
fn residency_report() -> Value {
    json!({
        "models": [
            {"name": "chat", "service": "chat", "priority": 10, "residency": "pinned", "fallback_model": "chat-small",
             "pools": [
                {"pool": "gpu", "resident": true, "loaded_unix": 1764590000, "idle_ms": 754000,
                 "running": 1, "queued": 2, "weights_bytes": 123456789},
                {"pool": "cpu", "resident": false, "loaded_unix": null, "idle_ms": null,
                 "running": 0, "queued": 0, "weights_bytes": 0}]},
            {"name": "speech", "service": "speech", "priority": 1, "residency": "on_demand", "fallback_model": null,
             "pools": [{"pool": "gpu", "resident": false, "loaded_unix": null, "idle_ms": null,
                        "running": 0, "queued": 3, "weights_bytes": 1048576}]},
            {"name": "orphan", "service": "orphan", "priority": 0, "residency": "resident", "fallback_model": null,
             "pools": []}
        ],
        "services": [
            {"name": "chat", "class": "interactive", "priority": 10, "configured": true,
             "device_memory_budget_bytes": 6442450944_u64, "concurrency": 4, "running": 1,
             "memory": {"gpu0": 6979321856_u64}},
            {"name": "speech", "class": "background", "priority": 1, "configured": true,
             "device_memory_budget_bytes": 2147483648_u64, "concurrency": null, "running": 0,
             "memory": {"gpu0": 2147483648_u64}},
            {"name": "orphan", "class": "interactive", "priority": 0, "configured": false,
             "device_memory_budget_bytes": null, "concurrency": null, "running": 0,
             "memory": {"gpu0": 1048576}}
        ],
        "evictions": [
            {"at_unix": 1764590000, "pool": "gpu", "device": "gpu0", "model": "speech", "freed_bytes": 1234567,
             "for_model": "chat", "for_request": "req-42"},
            {"at_unix": 1764590100, "pool": "gpu", "device": "gpu0", "model": "image", "freed_bytes": 2048,
             "for_model": "chat", "for_request": null}
        ],
        "speech": [
            {"model": "whisper", "pool": "gpu", "transcriptions": 3, "audio_seconds": 225.0, "real_time_factor": 0.0213},
            {"model": "whisper", "pool": "cpu", "transcriptions": 1, "audio_seconds": 75.0, "real_time_factor": 1.25},
            {"model": "whisper-large", "pool": "gpu", "transcriptions": 0, "audio_seconds": 0.0, "real_time_factor": null}
        ]
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_models_services_and_evictions_panels_render_what_status_says_or_that_it_says_nothing() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::start(crate::common::FAILOVER_CONFIG).await;
    let page = reqwest::get(server.url("/")).await.unwrap().text().await.unwrap();
    let mut report: Value = reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap();
    server.stop().await;
    let keys = ["models", "services", "evictions", "speech"];

    // An older server sends none of the keys: each panel says so, and the rest renders.
    for key in keys {
        report.as_object_mut().unwrap().remove(key);
    }
    let stand_in = StandIn::start(page, report.clone()).await;
    let dom = dump_dom(&stand_in.url).await;
    assert!(dom.contains("Serving normally"), "the page rendered to its end: {dom}");
    for (key, list) in [
        ("models", "table"),
        ("services", "table"),
        ("evictions", "ul"),
        ("speech", "table"),
    ] {
        assert!(
            dom.contains(&format!(
                r#"<div id="{key}-note" class="muted">Not reported by this vramguard.</div>"#
            )),
            "{key}: {dom}"
        );
        assert!(
            dom.contains(&format!(r#"<{list} id="{key}" hidden="">"#)),
            "{key}: {dom}"
        );
    }

    // Empty lists: said, not drawn.
    for key in keys {
        report[key] = json!([]);
    }
    stand_in.set(report.clone());
    let dom = dump_dom(&stand_in.url).await;
    assert!(dom.contains("Serving normally"), "{dom}");
    for (key, note) in [
        ("models", "No models configured."),
        ("services", "No services."),
        ("evictions", "No evictions recorded."),
        ("speech", "No speech models configured."),
    ] {
        assert!(
            dom.contains(&format!(r#"<div id="{key}-note" class="muted">{note}</div>"#)),
            "{key}: {dom}"
        );
    }
    assert!(dom.contains(r#"<table id="models" hidden="">"#), "{dom}");

    for (key, value) in residency_report().as_object().unwrap() {
        report[key] = value.clone();
    }
    stand_in.set(report);
    let dom = dump_dom(&stand_in.url).await;
    assert!(dom.contains("Serving normally"), "{dom}");
    assert!(
        dom.contains(r#"<table id="models">"#),
        "shown once there are models: {dom}"
    );
    assert!(dom.contains(r#"<div id="models-note" class="muted"></div>"#), "{dom}");

    // A row per pool serving a model, the model's own cells spanning them.
    let chat_gpu = row(&dom, r#"data-model="chat" data-pool="gpu""#);
    assert_eq!(chat_gpu.len(), 11, "{chat_gpu:?}");
    assert_eq!(
        chat_gpu[..7],
        ["chat", "chat", "10", "pinned", "chat-small", "gpu", "yes"],
        "{chat_gpu:?}"
    );
    assert_ne!(chat_gpu[7], "–", "the load time is shown: {chat_gpu:?}");
    assert_eq!(chat_gpu[8..], ["12m 34s", "1 / 2", "117.7 MiB"], "{chat_gpu:?}");
    assert!(
        dom.contains(r#"<td class="model" rowspan="2">chat-small</td>"#),
        "{dom}"
    );
    assert_eq!(
        row(&dom, r#"data-model="chat" data-pool="cpu""#),
        ["cpu", "no", "–", "–", "0 / 0", "0 B"]
    );
    assert_eq!(
        row(&dom, r#"data-model="speech" data-pool="gpu""#),
        [
            "speech",
            "speech",
            "1",
            "on_demand",
            "–",
            "gpu",
            "no",
            "–",
            "–",
            "0 / 3",
            "1.0 MiB"
        ]
    );
    assert_eq!(
        row(&dom, r#"data-model="orphan""#),
        [
            "orphan",
            "orphan",
            "0",
            "resident",
            "–",
            "no pool serves it",
            "–",
            "–",
            "–",
            "–",
            "–"
        ]
    );

    // Speech: per model and pool, the transcriptions, their audio and their mean pace.
    assert_eq!(
        row(&dom, r#"data-speech="whisper" data-pool="gpu""#),
        ["whisper", "gpu", "3", "3m 45s", "0.021 · 47× faster than spoken"]
    );
    assert_eq!(
        row(&dom, r#"data-speech="whisper" data-pool="cpu""#),
        ["whisper", "cpu", "1", "1m 15s", "1.250 · slower than spoken"]
    );
    assert_eq!(
        row(&dom, r#"data-speech="whisper-large" data-pool="gpu""#),
        ["whisper-large", "gpu", "0", "0 s", "–"]
    );
    assert!(dom.contains(r#"<div id="speech-note" class="muted"></div>"#), "{dom}");

    // Evictions, newest first: what, where, what it freed, for whom.
    let image = dom
        .find(" · image evicted from gpu (gpu0), freed 2.0 KiB for chat</li>")
        .unwrap_or_else(|| panic!("{dom}"));
    let speech = dom
        .find(" · speech evicted from gpu (gpu0), freed 1.2 MiB for chat (request req-42)</li>")
        .unwrap_or_else(|| panic!("{dom}"));
    assert!(image < speech, "newest first: {dom}");

    // Services: over the budget is marked, exactly at it is not, no budget says so.
    assert_eq!(
        row(&dom, r#"data-service="chat""#),
        [
            "chat",
            "interactive",
            "10",
            "1 / 4",
            "gpu0: 6.5 GiB of 6.0 GiB · over budget"
        ]
    );
    assert!(
        dom.contains(r#"<div class="over">gpu0: 6.5 GiB of 6.0 GiB · over budget</div>"#),
        "{dom}"
    );
    assert!(
        dom.contains("<div>gpu0: 2.0 GiB of 2.0 GiB</div>"),
        "at the budget, not over: {dom}"
    );
    assert_eq!(
        row(&dom, r#"data-service="orphan""#),
        [
            "orphan *",
            "interactive",
            "0",
            "0 / no limit",
            "gpu0: 1.0 MiB (no budget)"
        ]
    );
    // Said once, for every service marked so, not on each row (the page's script holds the
    // text too, after a quote).
    assert_eq!(dom.matches(">* not configured under services").count(), 1, "{dom}");
}
