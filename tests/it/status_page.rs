//! The status page at `GET /` rendered by a real browser (headless Chromium, Debian package
//! `chromium`, installed by `make tools`) against a running server whose simulated accelerator
//! is under external pressure and then reset: the rendered DOM must show the process holding
//! the device, the degraded banner and the policy's decisions. A screenshot is saved to
//! `target/status-page.png` (the README shows a copy, `docs/status-page.png`).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::TestServer;
use reqwest::StatusCode;
use serde_json::json;

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
    let dom = {
        let page = page.clone();
        tokio::task::spawn_blocking(move || chromium(&page, &["--dump-dom"], vramguard::testing::Scratch::new().path()))
            .await
            .unwrap()
    };
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
    assert_eq!(server.encoder(32).await.status(), StatusCode::OK);
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
    let png = std::fs::read(&screenshot).expect("a screenshot was saved");
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "{} bytes", png.len());
    server.stop().await;
}
