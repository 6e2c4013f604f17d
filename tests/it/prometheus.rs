//! The shipped alerts and dashboards against a real Prometheus (Debian package `prometheus`,
//! installed by `make tools`) scraping a real vramguard on loopback:
//! - every PromQL expression in `alerts/` and `dashboards/` is accepted by Prometheus's query API;
//! - every metric they reference is in what Prometheus scraped from vramguard;
//! - every alert has a severity, a summary, a description and a runbook section that exists;
//! - a driver reset injected through `/admin/sim` makes `VramguardDegraded` fire, a restore
//!   resolves it, and a stopped vramguard makes `VramguardDown` fire.
//!
//! The rules are loaded as shipped except for their `for` durations, shortened so the test ends
//! in seconds. Prometheus is stopped and its folder removed however the test ends.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::TestServer;
use reqwest::StatusCode;
use serde_json::{Value, json};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// A Prometheus server in its own folder; killed and cleaned up when dropped.
struct Prometheus {
    child: Child,
    url: String,
    /// Config, rules, data and log; removed after the process is gone (fields drop in order).
    _dir: vramguard::testing::Scratch,
}

impl Prometheus {
    /// Start Prometheus scraping `target` every second as job `vramguard`, with `rules` loaded
    /// and evaluated every second; waits until it is ready.
    async fn start(target: &str, rules: &str) -> Prometheus {
        let dir = vramguard::testing::Scratch::new();
        let at = |name: &str| dir.path().join(name);
        std::fs::create_dir_all(at("data")).unwrap();
        std::fs::write(at("rules.yaml"), rules).unwrap();
        std::fs::write(
            at("prometheus.yml"),
            format!(
                "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
                 rule_files: [rules.yaml]\n\
                 scrape_configs:\n\
                 - job_name: vramguard\n\
                 \x20 static_configs: [{{targets: ['{target}']}}]\n"
            ),
        )
        .unwrap();
        // The port is found free, then handed over; another process taking it in between makes
        // Prometheus exit, which is retried.
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let mut child = Command::new("prometheus")
                .arg(format!("--config.file={}", at("prometheus.yml").display()))
                .arg(format!("--storage.tsdb.path={}", at("data").display()))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .arg("--log.level=warn")
                .stdout(Stdio::null())
                .stderr(Stdio::from(std::fs::File::create(at("log")).unwrap()))
                .spawn()
                .expect("prometheus is needed for this test: run `make tools` (Debian package `prometheus`)");
            let url = format!("http://127.0.0.1:{port}");
            if ready(&mut child, &url).await {
                return Prometheus { child, url, _dir: dir };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let log = std::fs::read_to_string(at("log")).unwrap_or_default();
        panic!("prometheus did not start:\n{log}");
    }

    async fn api(&self, path: &str, query: &[(&str, &str)]) -> Value {
        let response = reqwest::Client::new()
            .get(format!("{}{path}", self.url))
            .query(query)
            .send()
            .await
            .unwrap();
        response.json().await.unwrap()
    }

    /// The state of `alert` in `/api/v1/alerts` (`pending`, `firing`), or None when inactive.
    async fn alert_state(&self, alert: &str) -> Option<String> {
        let alerts = self.api("/api/v1/alerts", &[]).await;
        alerts["data"]["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["labels"]["alertname"] == alert)
            .map(|a| a["state"].as_str().unwrap().to_string())
    }

    /// Wait (at most 60 s) until `alert` is in `state` (None: inactive).
    async fn wait_for(&self, alert: &str, state: Option<&str>) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let now = self.alert_state(alert).await;
            if now.as_deref() == state {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{alert} is {now:?}, expected {state:?}; alerts: {}",
                self.api("/api/v1/alerts", &[]).await
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether the Prometheus `child` answers ready at `url` within 30 s (false once it exits).
async fn ready(child: &mut Child, url: &str) -> bool {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        if let Ok(r) = reqwest::get(format!("{url}/-/ready")).await
            && r.status() == StatusCode::OK
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// The shipped rules, as parsed YAML.
fn rules() -> Value {
    let text = std::fs::read_to_string(Path::new(ROOT).join("alerts/vramguard.rules.yaml")).unwrap();
    vramguard::config::parse_yaml(&text, "alerts/vramguard.rules.yaml").unwrap()
}

/// Every alerting rule in the shipped rules.
fn alert_rules() -> Vec<Value> {
    rules()["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().clone())
        .filter(|r| r["alert"].is_string())
        .collect()
}

/// The shipped rules with every `for` shortened to 2 s.
fn fast_rules() -> String {
    let mut rules = rules();
    for group in rules["groups"].as_array_mut().unwrap() {
        for rule in group["rules"].as_array_mut().unwrap() {
            if rule.get("for").is_some() {
                rule["for"] = json!("2s");
            }
        }
    }
    // JSON is YAML.
    rules.to_string()
}

/// Every dashboard under `dashboards/` (not the provisioning or schema folders).
fn dashboards() -> Vec<(PathBuf, Value)> {
    let dir = Path::new(ROOT).join("dashboards");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut found: Vec<_> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, value)
        })
        .collect();
    found.sort_by(|a, b| a.0.cmp(&b.0));
    found
}

/// Every PromQL expression a dashboard runs: panel targets (rows nest panels), and query
/// variables, whose `label_values(expr, label)` form is Grafana's and reduced to `expr`.
fn dashboard_exprs(dashboard: &Value) -> Vec<String> {
    fn panels(list: &Value, out: &mut Vec<String>) {
        for panel in list.as_array().into_iter().flatten() {
            for target in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = target["expr"].as_str() {
                    out.push(expr.to_string());
                }
            }
            panels(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    panels(&dashboard["panels"], &mut out);
    let label_values = regex::Regex::new(r"^label_values\((.*),\s*\w+\)$").unwrap();
    for variable in dashboard["templating"]["list"].as_array().into_iter().flatten() {
        if variable["type"] != "query" {
            continue;
        }
        let query = match &variable["query"] {
            Value::String(q) => q.clone(),
            q => q["query"].as_str().unwrap_or_default().to_string(),
        };
        if let Some(inner) = label_values.captures(query.trim()) {
            out.push(inner[1].to_string());
        } else if !query.starts_with("label_values(") && !query.is_empty() {
            out.push(query);
        }
    }
    out
}

/// Grafana's variables replaced by what Prometheus accepts: intervals by `1m`, template
/// variables by a match-anything regex.
fn substitute(expr: &str) -> String {
    let intervals =
        regex::Regex::new(r"\$__(rate_interval|interval|range)|\$\{__(rate_interval|interval|range)\}").unwrap();
    let variables = regex::Regex::new(r"\$\{?\w+(:\w+)?\}?").unwrap();
    let expr = intervals.replace_all(expr, "1m");
    variables.replace_all(&expr, ".*").into_owned()
}

/// `vramguard_*` names in an expression.
fn metric_names(expr: &str) -> Vec<String> {
    let name = regex::Regex::new(r"vramguard_[a-z0-9_]+").unwrap();
    name.find_iter(expr).map(|m| m.as_str().to_string()).collect()
}

#[test]
fn every_alert_says_how_bad_what_and_where_the_runbook_is() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let runbook = std::fs::read_to_string(Path::new(ROOT).join("docs/runbook.md")).unwrap();
    let sections: BTreeSet<String> = runbook
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(|h| h.trim().to_lowercase())
        .collect();
    let alerts = alert_rules();
    assert!(alerts.len() >= 11, "{} alerts", alerts.len());
    for rule in &alerts {
        let name = rule["alert"].as_str().unwrap();
        let severity = rule["labels"]["severity"].as_str().unwrap_or_default();
        assert!(
            ["critical", "warning", "info"].contains(&severity),
            "{name}: severity `{severity}`"
        );
        for key in ["summary", "description"] {
            let text = rule["annotations"][key].as_str().unwrap_or_default();
            assert!(!text.trim().is_empty(), "{name}: no {key}");
        }
        let url = rule["annotations"]["runbook_url"].as_str().unwrap_or_default();
        let (file, anchor) = url
            .split_once('#')
            .unwrap_or_else(|| panic!("{name}: runbook_url `{url}`"));
        assert_eq!(file, "docs/runbook.md", "{name}");
        assert!(
            sections.contains(anchor),
            "{name}: no `## {anchor}` section in docs/runbook.md"
        );
    }
    // A section per alert, and no section for an alert that no longer exists.
    let names: BTreeSet<String> = alerts
        .iter()
        .map(|r| r["alert"].as_str().unwrap().to_lowercase())
        .collect();
    assert_eq!(names, sections, "runbook sections and alerts differ");
}

#[test]
fn grafana_variables_are_substituted_into_valid_promql_shapes() {
    if crate::common::ran_in_own_process() {
        return;
    }
    assert_eq!(
        substitute(r#"sum(rate(x{pool=~"$pool", device=~"${device}"}[$__rate_interval]))"#),
        r#"sum(rate(x{pool=~".*", device=~".*"}[1m]))"#
    );
    let dashboard = json!({
        "panels": [{"type": "row", "panels": [{"targets": [{"expr": "a"}]}]}, {"targets": [{"expr": "b"}]}],
        "templating": {"list": [
            {"type": "query", "query": {"query": "label_values(vramguard_queue_depth, pool)"}},
            {"type": "datasource", "query": "prometheus"}
        ]}
    });
    assert_eq!(dashboard_exprs(&dashboard), ["a", "b", "vramguard_queue_depth"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_and_dashboards_work_in_a_real_prometheus() {
    if crate::common::ran_in_own_process() {
        return;
    }
    tokio::time::timeout(Duration::from_secs(240), run())
        .await
        .expect("bounded in time");
}

async fn run() {
    // A budget the 68 KB encoder never reaches, so the service budget family exists.
    let yaml = format!(
        "{}services: [{{name: encoder, device_memory: 64MiB}}]\n",
        crate::common::FAILOVER_CONFIG
    );
    let server = TestServer::start(&yaml).await;
    let prometheus = Prometheus::start(&server.addr.to_string(), &fast_rules()).await;

    // Traffic that makes every family exist: requests on both pools, an allocator failure
    // retried on the CPU pool, a client error.
    for _ in 0..3 {
        assert_eq!(server.encoder(32).await.status(), StatusCode::OK);
    }
    let injected = server.post_json("/admin/sim/gpu0", &json!({"fail_next": 1})).await;
    assert_eq!(injected.status(), StatusCode::OK);
    assert_eq!(server.encoder(32).await.status(), StatusCode::OK);

    // Every expression is valid PromQL to Prometheus itself.
    let mut exprs: Vec<(String, String)> = alert_rules()
        .iter()
        .map(|r| {
            (
                format!("alert {}", r["alert"].as_str().unwrap()),
                r["expr"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let shipped = dashboards();
    assert!(!shipped.is_empty(), "no dashboard under dashboards/");
    for (path, dashboard) in shipped {
        let found = dashboard_exprs(&dashboard);
        assert!(
            found.len() >= 20,
            "{}: only {} expressions found",
            path.display(),
            found.len()
        );
        for expr in found {
            exprs.push((path.display().to_string(), expr));
        }
    }
    for (origin, expr) in &exprs {
        let query = substitute(expr);
        let answer = prometheus.api("/api/v1/query", &[("query", &query)]).await;
        assert_eq!(answer["status"], "success", "{origin}: `{query}`: {answer}");
    }

    // A driver reset opens the breaker: degraded mode, and the page fires.
    let reset = server
        .post_json("/admin/sim/gpu0", &json!({"driver_reset": true}))
        .await;
    assert_eq!(reset.status(), StatusCode::OK);
    assert_eq!(
        server.encoder(32).await.status(),
        StatusCode::OK,
        "served by the CPU pool"
    );
    prometheus.wait_for("VramguardDegraded", Some("firing")).await;
    prometheus.wait_for("VramguardBreakerOpen", Some("firing")).await;
    let alerts = prometheus.api("/api/v1/alerts", &[]).await;
    let degraded: Vec<&Value> = alerts["data"]["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["labels"]["alertname"] == "VramguardDegraded")
        .collect();
    assert!(
        degraded.iter().all(|a| a["labels"]["reason"] == "driver_fault"),
        "a driver reset pages as a driver fault: {alerts}"
    );

    // Every metric the alerts and dashboards use was scraped from vramguard.
    let scraped = prometheus.api("/api/v1/label/__name__/values", &[]).await;
    let scraped: BTreeSet<&str> = scraped["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for (origin, expr) in &exprs {
        for name in metric_names(expr) {
            assert!(
                scraped.contains(name.as_str()),
                "{origin} uses {name}, which vramguard does not export (scraped: {scraped:?})"
            );
        }
    }

    // After a restore the server's own health check closes the breaker; the page resolves.
    let restored = server.post_json("/admin/pools/gpu/restore", &json!({})).await;
    assert_eq!(restored.status(), StatusCode::OK);
    let (closed, metrics) = crate::common::breaker_closes(&server, "gpu", std::time::Duration::from_secs(5)).await;
    assert!(closed, "{metrics}");
    let served = server.encoder(32).await;
    assert_eq!(served.status(), StatusCode::OK);
    assert_eq!(served.headers()["x-vramguard-pool"], "gpu");
    // A driver fault holds nothing over: degraded mode ends with the breaker.
    prometheus.wait_for("VramguardDegraded", None).await;
    prometheus.wait_for("VramguardBreakerOpen", None).await;

    // A vramguard that stops answering scrapes pages as down.
    server.stop().await;
    prometheus.wait_for("VramguardDown", Some("firing")).await;
}
