//! The host tier and the optimized cache, on a CPU pool with real ONNX Runtime sessions: a
//! `host_tier: warm` model is optimized once into the cache and the tier at start, an unloaded
//! model loads again from the tier and answers as from its file, a restart loads from the cache,
//! a corrupt cache entry is built again, and the tier never holds bytes the host's reserve needs.

use reqwest::StatusCode;
use serde_json::{Value, json};
use vramguard::testing::Scratch;

use crate::common::{TestServer, assert_close, floats, reference_cases, request_from_case, sample};

fn config(cache: &Scratch, reserve: &str) -> String {
    format!(
        "
host: {{reserve: {reserve}, optimized_cache: '{}'}}
models:
  - {{name: classifier, path: 'builtin:classifier', residency: on_demand, host_tier: warm}}
pools:
  - {{name: cpu, provider: cpu, models: [classifier]}}
",
        cache.path().display()
    )
}

/// The classifier loaded at start (`resident`), with no warming: its first start optimizes it.
fn resident_config(cache: &Scratch) -> String {
    format!(
        "
host: {{reserve: 1MiB, optimized_cache: '{}'}}
models:
  - {{name: classifier, path: 'builtin:classifier'}}
pools:
  - {{name: cpu, provider: cpu, models: [classifier]}}
",
        cache.path().display()
    )
}

/// Wait until the cache holds one entry other than `not` (the model is optimized in the
/// background); its graph's bytes.
async fn entry_written(cache: &Scratch, not: &[u8]) -> Vec<u8> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        if let [entry] = entries(cache).as_slice()
            && let Ok(bytes) = std::fs::read(entry)
            && bytes != not
        {
            return bytes;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the model was never optimized into the cache"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

fn loads_from(metrics: &str, source: &str) -> f64 {
    sample(
        metrics,
        &format!("vramguard_model_session_loads_total{{model=\"classifier\",pool=\"cpu\",source=\"{source}\"}}"),
    )
}

/// Every reference case of the classifier answers as the committed outputs say.
async fn answers_as_the_reference(server: &TestServer) {
    for case in reference_cases("classifier") {
        let response = server
            .post_json("/v2/models/classifier/infer", &request_from_case(&case))
            .await;
        assert_eq!(response.status(), StatusCode::OK, "{}", case["name"]);
        let body: Value = response.json().await.unwrap();
        for out in body["outputs"].as_array().unwrap() {
            let name = out["name"].as_str().unwrap();
            assert_close(
                &floats(&out["data"]),
                &floats(&case["outputs"][name]["data"]),
                1e-4,
                name,
            );
        }
    }
}

async fn status(server: &TestServer) -> Value {
    reqwest::get(server.url("/status")).await.unwrap().json().await.unwrap()
}

/// The graphs of the cache's entries (a CPU pool's: `<key>.onnx` beside the `<key>.bin` its
/// sessions map), each an entry once its record (`<key>.sum`, written last) is there.
fn entries(cache: &Scratch) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(cache.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "onnx") && p.with_extension("sum").exists())
        .collect()
}

#[tokio::test]
async fn an_unloaded_model_loads_again_from_the_host_tier_and_answers_the_same() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let cache = Scratch::new();
    let server = TestServer::start(&config(&cache, "1MiB")).await;
    assert_eq!(entries(&cache).len(), 1, "warmed: optimized once into the cache");
    let tier = &status(&server).await["host_tier"];
    assert_eq!(tier["models"], json!(["classifier"]), "{tier}");
    assert!(tier["bytes"].as_u64().unwrap() > 0, "{tier}");

    answers_as_the_reference(&server).await;
    let metrics = server.metrics().await;
    assert_eq!(loads_from(&metrics, "host_tier"), 1.0, "{metrics}");
    assert_eq!(loads_from(&metrics, "disk"), 0.0);
    assert_eq!(sample(&metrics, "vramguard_model_host_tier{model=\"classifier\"}"), 1.0);
    assert!(sample(&metrics, "vramguard_host_tier_bytes") > 0.0, "{metrics}");

    let response = server.post_json("/admin/models/classifier/unload", &json!({})).await;
    assert_eq!(response.status(), StatusCode::OK);
    answers_as_the_reference(&server).await;
    let metrics = server.metrics().await;
    assert_eq!(
        loads_from(&metrics, "host_tier"),
        2.0,
        "loaded again from memory:\n{metrics}"
    );
    assert_eq!(
        loads_from(&metrics, "disk") + loads_from(&metrics, "optimized_cache"),
        0.0
    );
    server.stop().await;
}

#[tokio::test]
async fn a_corrupt_cache_entry_is_built_again_never_served() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let cache = Scratch::new();
    TestServer::start(&config(&cache, "1MiB")).await.stop().await;
    let [entry] = entries(&cache).try_into().expect("one entry");
    let mut bytes = std::fs::read(&entry).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x5a;
    std::fs::write(&entry, &bytes).unwrap();

    let server = TestServer::start(&config(&cache, "1MiB")).await;
    let rebuilt = std::fs::read(&entry).unwrap();
    assert_ne!(rebuilt, bytes, "the corrupt entry was replaced");
    answers_as_the_reference(&server).await;
    let metrics = server.metrics().await;
    assert_eq!(loads_from(&metrics, "host_tier"), 1.0, "{metrics}");
    server.stop().await;
}

#[tokio::test]
async fn the_host_tier_never_takes_the_host_below_its_reserve() {
    if crate::common::ran_in_own_process() {
        return;
    }
    // A reserve no host can keep: the tier admits nothing, and the model loads from its file.
    let cache = Scratch::new();
    let server = TestServer::start(&config(&cache, "1000TiB")).await;
    let tier = &status(&server).await["host_tier"];
    assert_eq!(tier["bytes"], 0, "{tier}");
    assert_eq!(tier["models"], json!([]), "{tier}");
    server.stop().await;
}

#[tokio::test]
async fn a_restart_loads_from_the_optimized_cache_and_a_corrupt_entry_is_built_again() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let cache = Scratch::new();
    let first = TestServer::start(&resident_config(&cache)).await;
    let metrics = first.metrics().await;
    assert_eq!(
        loads_from(&metrics, "disk"),
        1.0,
        "the first start reads the file:\n{metrics}"
    );
    let written = entry_written(&cache, &[]).await;
    first.stop().await;

    // A restart: the pool's session comes from the optimized entry, and answers the same.
    let second = TestServer::start(&resident_config(&cache)).await;
    let metrics = second.metrics().await;
    assert_eq!(loads_from(&metrics, "optimized_cache"), 1.0, "{metrics}");
    assert_eq!(loads_from(&metrics, "disk"), 0.0, "{metrics}");
    answers_as_the_reference(&second).await;
    second.stop().await;

    // A corrupt entry is not served: the start reads the file and the entry is built again.
    let [entry] = entries(&cache).try_into().expect("one entry");
    let mut corrupt = written.clone();
    let middle = corrupt.len() / 2;
    corrupt[middle] ^= 0x5a;
    std::fs::write(&entry, &corrupt).unwrap();
    let third = TestServer::start(&resident_config(&cache)).await;
    let metrics = third.metrics().await;
    assert_eq!(loads_from(&metrics, "disk"), 1.0, "{metrics}");
    assert_eq!(loads_from(&metrics, "optimized_cache"), 0.0, "{metrics}");
    answers_as_the_reference(&third).await;
    entry_written(&cache, &corrupt).await;
    third.stop().await;

    // The entry built again is sound: the next start loads from it.
    let fourth = TestServer::start(&resident_config(&cache)).await;
    let metrics = fourth.metrics().await;
    assert_eq!(loads_from(&metrics, "optimized_cache"), 1.0, "{metrics}");
    answers_as_the_reference(&fourth).await;
    fourth.stop().await;
}

/// `a` (16 MiB of weights) on a simulated device of 24 MiB that only it runs on, loaded on
/// demand: from its file (`model_cache: 0`) or from the host tier (`host_tier: warm`), in this
/// process or a worker process (`isolation`).
fn simulated_config(models: &Scratch, cache: &Scratch, tier: &str, isolation: &str) -> String {
    format!(
        "
host: {{reserve: 1MiB, optimized_cache: '{}', model_cache: {}}}
devices: [{{name: sim0, kind: simulated, capacity: 24MiB}}]
models:
  - {{name: a, path: '{}', residency: on_demand{}}}
pools:
  - {{name: gpu, provider: simulated, device: sim0, models: [a], workers: 1, isolation: {}}}
policy: {{params: {{reserve_bytes: 2MiB}}}}
",
        cache.path().display(),
        if tier.is_empty() { "0" } else { "64MiB" },
        models.path().join("a.onnx").display(),
        tier,
        isolation,
    )
}

/// `a`'s answer to one input, served by the simulated pool.
async fn dense_answer(server: &TestServer) -> Vec<f64> {
    let body = json!({"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": vec![0.5f32; 64]}]});
    let response = server.post_json("/v2/models/a/infer", &body).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-vramguard-pool"], "gpu");
    let body: Value = response.json().await.unwrap();
    floats(&body["outputs"][0]["data"])
}

#[tokio::test]
async fn a_simulated_pool_loads_from_the_host_tier_holding_the_weights_once() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let (models, cache) = (Scratch::new(), Scratch::new());
    models.write(
        "a.onnx",
        vramguard::runtime::onnx::dense::Dense::of_mib(41, 16).to_onnx(),
    );
    let from_file = TestServer::start(&simulated_config(&models, &cache, "", "thread")).await;
    let expected = dense_answer(&from_file).await;
    from_file.stop().await;

    // Built from the ORT-format bytes, the device holds the weights once: twice (32 MiB) would
    // not fit its 24 MiB. A worker process owns the bytes it is sent, so it does the same.
    for isolation in ["thread", "process"] {
        let config = simulated_config(&models, &cache, ", host_tier: warm", isolation);
        let server = TestServer::start(&config).await;
        assert_close(&dense_answer(&server).await, &expected, 1e-5, isolation);
        let metrics = server.metrics().await;
        let series = |source: &str| {
            format!("vramguard_model_session_loads_total{{model=\"a\",pool=\"gpu\",source=\"{source}\"}}")
        };
        assert!(sample(&metrics, &series("host_tier")) > 0.0, "{isolation}: {metrics}");
        assert_eq!(sample(&metrics, &series("disk")), 0.0, "{isolation}: {metrics}");
        let status = status(&server).await;
        let arena = &status["pools"][0]["arena"];
        assert!(
            arena["peak_active_bytes"].as_u64().unwrap() < 20 << 20,
            "{isolation}: {arena}"
        );
        server.stop().await;
    }
}

#[tokio::test]
async fn without_the_host_tier_a_start_loads_from_the_file_and_optimizes_nothing() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let cache = Scratch::new();
    let config = resident_config(&cache).replace("reserve: 1MiB,", "reserve: 1MiB, model_cache: 0,");
    let server = TestServer::start(&config).await;
    let metrics = server.metrics().await;
    assert_eq!(loads_from(&metrics, "disk"), 1.0, "{metrics}");
    answers_as_the_reference(&server).await;
    server.stop().await;
    assert!(entries(&cache).is_empty(), "no tier: nothing optimized");
}

/// The processes that map `file`, and the proportional set size of its pages in all of them
/// (a page mapped by n processes counts 1/n in each), in bytes.
fn mapped_by(file: &std::path::Path) -> (Vec<u32>, u64) {
    let name = file.to_str().unwrap();
    let (mut pids, mut pss) = (Vec::new(), 0);
    for pid in std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
    {
        let Ok(smaps) = std::fs::read_to_string(format!("/proc/{pid}/smaps")) else {
            continue;
        };
        let mut ours = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if first.contains('-') && !first.ends_with(':') {
                ours = line.ends_with(name);
                if ours && !pids.contains(&pid) {
                    pids.push(pid);
                }
            } else if ours && first == "Pss:" {
                pss += line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024;
            }
        }
    }
    (pids, pss)
}

/// The worker processes of two CPU pools (a pool's sessions share one worker process), started
/// from the optimized cache, map the same weights file: the machine holds one copy of the
/// model's weights (and of their pre-packed form), whatever the number of processes.
#[tokio::test]
async fn worker_processes_of_cpu_pools_map_one_copy_of_the_weights() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let (models, cache) = (Scratch::new(), Scratch::new());
    models.write(
        "a.onnx",
        vramguard::runtime::onnx::dense::Dense::of_mib(43, 4).to_onnx(),
    );
    let config = format!(
        "
host: {{reserve: 1MiB, optimized_cache: '{}'}}
models:
  - {{name: a, path: '{}'}}
pools:
  - {{name: one, provider: cpu, models: [a], workers: 2, isolation: process}}
  - {{name: two, provider: cpu, models: [a], isolation: process}}
",
        cache.path().display(),
        models.path().join("a.onnx").display(),
    );
    let first = TestServer::start(&config).await;
    entry_written(&cache, &[]).await;
    first.stop().await;

    let server = TestServer::start(&config).await;
    let metrics = server.metrics().await;
    for pool in ["one", "two"] {
        let loads =
            format!("vramguard_model_session_loads_total{{model=\"a\",pool=\"{pool}\",source=\"optimized_cache\"}}");
        assert!(sample(&metrics, &loads) > 0.0, "{pool}: {metrics}");
    }
    let [graph] = entries(&cache).try_into().expect("one entry");
    let weights = graph.with_extension("bin");
    let size = std::fs::metadata(&weights).unwrap().len();
    assert!(size >= 4 << 20, "the weights lie in the file: {size} bytes");
    let (pids, pss) = mapped_by(&weights);
    let workers: Vec<_> = pids.iter().filter(|&&p| p != std::process::id()).collect();
    assert!(
        workers.len() >= 2,
        "each pool's worker process maps the weights: {pids:?}"
    );
    assert!(
        pss <= size + (64 << 10) * pids.len() as u64,
        "{pss} bytes of the weights' pages held by {pids:?} for a {size}-byte file"
    );
    server.stop().await;
}
