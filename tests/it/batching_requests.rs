//! Dynamic batching across requests (`models[].batching`) on real models: the tiny
//! sentence-transformers BERT of `models/embed/` and the bundled encoder (OIP tensors). Requests
//! that arrive together share runs (the rows histogram shows them), a batch never grows past
//! `max_batch` or past what fits on the device now, tensors of other shapes are not mixed, a
//! failed batch is retried member by member on the fallback, and every answer equals the same
//! request run alone (on a twin model of the same file without `batching`).
//!
//! Requests that must arrive together are driven through the lifecycle in one current-thread
//! runtime: every member is spawned before any runs, so all of them join before their batch's
//! own task first runs. Nothing here depends on timing.

use std::sync::Arc;

use reqwest::StatusCode;
use serde_json::{Value, json};
use vramguard::core::tensor::{Tensor, TensorData};
use vramguard::runtime::embedder::Embedder;
use vramguard::serve::lifecycle::{self, Refused, Request, RequestError, Served};
use vramguard::serve::service::Service;

use crate::common::{TestServer, sample};

const MEAN: &str = "models/embed/bert-mean-normalize/model.onnx";

/// An embeddings request for `model` of `ids` (one list of token ids per input), as the
/// endpoint makes it.
fn embedding(service: &Service, model: &str, ids: &[Vec<u32>], id: &str) -> Request {
    let entry = service.model(model).unwrap();
    let mut request = vramguard::testing::request(model, Embedder::batch(&entry.signature, ids, 0));
    request.outputs = vec![Embedder::output(&entry.signature).to_string()];
    request.pads = true;
    request.meta.request_id = id.to_string();
    request
}

/// Token ids of `len` tokens, different for each `seed`.
fn ids(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|k| 5 + (seed * 37 + k * 13) % 300).collect()
}

/// The pooled vectors of an embeddings answer.
fn vectors(service: &Service, model: &str, served: &Served, ids: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let entry = service.model(model).unwrap();
    let given = served
        .outputs
        .iter()
        .find(|t| t.name == Embedder::output(&entry.signature))
        .unwrap();
    let lengths: Vec<usize> = ids.iter().map(Vec::len).collect();
    entry.kind.embedder().unwrap().0.vectors(given, &lengths).unwrap()
}

/// The floats of an output.
fn floats(tensor: &Tensor) -> &[f32] {
    match &tensor.data {
        TensorData::Fp32(v) => v,
        other => panic!("not FP32: {other:?}"),
    }
}

fn assert_near(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(worst <= 1e-5, "{what}: differs by {worst} from the same request alone");
}

/// `served`'s first output equals that of the embeddings request of `ids` run alone on `alone`.
async fn assert_as_alone(service: &Service, served: &Served, ids: &[Vec<u32>], what: &str) {
    let alone = lifecycle::infer(service, embedding(service, "alone", ids, "alone"))
        .await
        .unwrap();
    assert_near(floats(&served.outputs[0]), floats(&alone.outputs[0]), what);
}

/// Run `requests` so that they arrive together: all spawned before any of them runs, each
/// placed as the HTTP handlers place it (through the batchers).
async fn together(server: &TestServer, requests: Vec<Request>) -> Vec<Result<Served, Refused>> {
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|request| {
            let state = Arc::clone(&server.state);
            tokio::spawn(async move { state.batching.infer(request).await })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    answers
}

fn metrics(service: &Service) -> String {
    vramguard::telemetry::metrics::encode(&service.registry)
}

/// `vramguard_batch_rows`' count (runs) and sum (rows) for `model` on `pool`.
fn runs_and_rows(service: &Service, model: &str, pool: &str) -> (f64, f64) {
    let text = metrics(service);
    let labels = format!("{{model=\"{model}\",pool=\"{pool}\"}}");
    (
        sample(&text, &format!("vramguard_batch_rows_count{labels}")),
        sample(&text, &format!("vramguard_batch_rows_sum{labels}")),
    )
}

/// Runs of `model` on `pool` that took at most `rows` rows.
fn runs_within(service: &Service, model: &str, pool: &str, rows: u32) -> f64 {
    let text = metrics(service);
    let line = format!("vramguard_batch_rows_bucket{{le=\"{rows}.0\",model=\"{model}\",pool=\"{pool}\"}}");
    sample(&text, &line)
}

#[tokio::test]
async fn requests_that_arrive_together_share_runs_of_at_most_max_batch_and_each_answer_equals_it_alone() {
    let server = TestServer::start(&format!(
        "models:\n\
         - {{name: mean, path: {MEAN}, batching: {{max_batch: 4, max_delay: 10s}}}}\n\
         - {{name: alone, path: {MEAN}}}\n\
         pools: [{{name: cpu, provider: cpu, models: [mean, alone], workers: 1}}]\n"
    ))
    .await;
    let service = &server.state.service;
    assert_eq!(
        runs_and_rows(service, "mean", "cpu"),
        (0.0, 0.0),
        "exposed at 0 from the start"
    );
    // Six requests of different lengths: one run of four rows (full), then one of two.
    let inputs: Vec<Vec<Vec<u32>>> = (0..6).map(|i| vec![ids(i, 3 + 5 * i)]).collect();
    let requests = (inputs.iter().enumerate())
        .map(|(i, ids)| embedding(service, "mean", ids, &format!("member-{i}")))
        .collect();
    let answers = together(&server, requests).await;
    assert_eq!(runs_and_rows(service, "mean", "cpu"), (2.0, 6.0));
    assert_eq!(
        runs_within(service, "mean", "cpu", 2),
        1.0,
        "the second run took the last two"
    );
    for (i, (answer, ids)) in answers.iter().zip(&inputs).enumerate() {
        let served = answer.as_ref().unwrap_or_else(|r| panic!("member {i}: {}", r.error));
        let alone = lifecycle::infer(service, embedding(service, "alone", ids, "alone"))
            .await
            .unwrap();
        let hidden = |s: &Served| s.outputs[0].clone();
        // Its rows, its own length: the batch's padding is cut away.
        assert_eq!(hidden(served).shape, hidden(&alone).shape, "member {i}");
        assert_near(floats(&hidden(served)), floats(&hidden(&alone)), &format!("member {i}"));
        let got = vectors(service, "mean", served, ids);
        assert_near(
            &got[0],
            &vectors(service, "alone", &alone, ids)[0],
            &format!("member {i} pooled"),
        );
    }
    // Each member is counted once, as its own request.
    let ok = r#"vramguard_requests_total{model="mean",pool="cpu",outcome="ok"}"#;
    assert_eq!(sample(&metrics(service), ok), 6.0);
    server.stop().await;
}

#[tokio::test]
async fn tensors_of_other_shapes_never_share_a_run_and_each_answer_equals_it_alone() {
    let server = TestServer::start(
        "models:\n\
         - {name: encoder, path: 'builtin:encoder', context: {input: input, axis: 1}, batching: {max_batch: 8, max_delay: 10s}}\n\
         - {name: alone, path: 'builtin:encoder', context: {input: input, axis: 1}}\n\
         pools: [{name: cpu, provider: cpu, models: [encoder, alone], workers: 1}]\n",
    )
    .await;
    let service = &server.state.service;
    let tensor = |seq: usize, seed: usize| Tensor {
        name: "input".into(),
        shape: vec![1, seq as i64, 64],
        data: TensorData::Fp32(
            (0..seq * 64)
                .map(|k| ((k * 7 + seed * 31) % 97) as f32 / 97.0)
                .collect(),
        ),
    };
    // Three of 8 positions and two of 12: an encoder's input has no mask, so padding would
    // change its answers; they run as two batches.
    let shapes = [8, 12, 8, 12, 8];
    let requests = (shapes.iter().enumerate())
        .map(|(i, &seq)| vramguard::testing::request("encoder", vec![tensor(seq, i)]))
        .collect();
    let answers = together(&server, requests).await;
    assert_eq!(runs_and_rows(service, "encoder", "cpu"), (2.0, 5.0));
    for (i, answer) in answers.iter().enumerate() {
        let served = answer.as_ref().unwrap_or_else(|r| panic!("member {i}: {}", r.error));
        let alone = lifecycle::infer(
            service,
            vramguard::testing::request("alone", vec![tensor(shapes[i], i)]),
        )
        .await
        .unwrap();
        assert_eq!(served.outputs.len(), alone.outputs.len());
        for (got, want) in served.outputs.iter().zip(&alone.outputs) {
            assert_eq!(got.shape, want.shape, "member {i}: {}", got.name);
            assert_near(floats(got), floats(want), &format!("member {i}: {}", got.name));
        }
    }
    server.stop().await;
}

#[tokio::test]
async fn concurrent_embeddings_requests_over_http_each_equal_the_same_request_alone() {
    let server = TestServer::start(&format!(
        "models:\n\
         - {{name: mean, path: {MEAN}, batching: {{max_batch: 8, max_delay: 20ms}}}}\n\
         - {{name: alone, path: {MEAN}}}\n\
         pools: [{{name: cpu, provider: cpu, models: [mean, alone]}}]\n"
    ))
    .await;
    let texts: Vec<String> = (0..16)
        .map(|i| format!("sentence number {i} {}", "and more words ".repeat(i % 5)))
        .collect();
    let post = |model: &'static str, text: String| {
        let url = server.url("/v1/embeddings");
        async move {
            let response = reqwest::Client::new()
                .post(url)
                .json(&json!({"model": model, "input": text}))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            let body: Value = response.json().await.unwrap();
            let vector: Vec<f32> = body["data"][0]["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            vector
        }
    };
    let batched: Vec<_> = texts.iter().map(|t| tokio::spawn(post("mean", t.clone()))).collect();
    let mut got = Vec::new();
    for task in batched {
        got.push(task.await.unwrap());
    }
    for (i, text) in texts.iter().enumerate() {
        let want = post("alone", text.clone()).await;
        assert_near(&got[i], &want, &format!("request {i}"));
    }
    // Every request's row ran exactly once, however they were grouped.
    assert_eq!(runs_and_rows(&server.state.service, "mean", "cpu").1, 16.0);
    server.stop().await;
}

#[tokio::test]
async fn a_batch_grows_only_while_its_estimate_fits_the_device_now() {
    if crate::common::ran_in_own_process() {
        return;
    }
    // 2 MiB a token and row by the configured profile: one member of 25 tokens is 50 MiB, two
    // are 100 MiB and fit the 128 MiB device, three would not.
    let scratch = vramguard::testing::Scratch::new();
    let server = TestServer::start(&format!(
        "devices: [{{name: gpu0, kind: simulated, capacity: 128MiB}}]\n\
         models:\n\
         - {{name: mean, path: {MEAN}, context: {{input: input_ids, axis: 1}}, batching: {{max_batch: 8, max_delay: 10s}},\n\
            memory_profile: {{workspace: 0, per_token_bytes: 2097152}}}}\n\
         - {{name: alone, path: {MEAN}}}\n\
         pools:\n\
         - {{name: gpu, provider: simulated, device: gpu0, models: [mean]}}\n\
         - {{name: cpu, provider: cpu, models: [alone]}}\n\
         policy: {{path: '{}', watch_interval: 0s, params: {{reserve_bytes: 0}}}}\n",
        scratch.write("policy.rhai", vramguard::testing::ADMIT_ALL).display()
    ))
    .await;
    let service = &server.state.service;
    let inputs: Vec<Vec<Vec<u32>>> = (0..6).map(|i| vec![ids(i, 25)]).collect();
    let requests = (inputs.iter().enumerate())
        .map(|(i, ids)| embedding(service, "mean", ids, &format!("member-{i}")))
        .collect();
    let answers = together(&server, requests).await;
    assert_eq!(runs_and_rows(service, "mean", "gpu"), (3.0, 6.0), "three runs of two");
    assert_eq!(runs_within(service, "mean", "gpu", 2), 3.0);
    let failures = crate::common::sum_samples(&metrics(service), |l| {
        l.starts_with("vramguard_allocator_failures_total{")
    });
    assert_eq!(failures, 0.0);
    for (i, (answer, ids)) in answers.iter().zip(&inputs).enumerate() {
        let served = answer.as_ref().unwrap_or_else(|r| panic!("member {i}: {}", r.error));
        assert_eq!(served.pool.name(), "gpu");
        assert_as_alone(service, served, ids, &format!("member {i}")).await;
    }
    server.stop().await;
}

#[tokio::test]
async fn a_batch_failing_on_the_device_is_retried_member_by_member_on_the_fallback() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let server = TestServer::with_policy(
        &format!(
            "devices: [{{name: gpu0, kind: simulated, capacity: 256MiB}}]\n\
             models:\n\
             - {{name: mean, path: {MEAN}, batching: {{max_batch: 8, max_delay: 10s}}}}\n\
             - {{name: alone, path: {MEAN}}}\n\
             pools:\n\
             - {{name: gpu, provider: simulated, device: gpu0, models: [mean], fallback: cpu}}\n\
             - {{name: cpu, provider: cpu, models: [mean, alone]}}\n"
        ),
        vramguard::testing::ADMIT_ALL,
    )
    .await;
    let response = server.post_json("/admin/sim/gpu0", &json!({"fail_next": 1})).await;
    assert_eq!(response.status(), StatusCode::OK);
    let service = &server.state.service;
    let inputs: Vec<Vec<Vec<u32>>> = (0..4).map(|i| vec![ids(i, 4 + 3 * i)]).collect();
    let requests = (inputs.iter().enumerate())
        .map(|(i, ids)| {
            let mut request = embedding(service, "mean", ids, &format!("member-{i}"));
            // The client said it must never be run twice.
            request.meta.replayable = i != 2;
            request
        })
        .collect();
    let answers = together(&server, requests).await;
    for (i, (answer, ids)) in answers.iter().zip(&inputs).enumerate() {
        if i == 2 {
            let refused = answer.as_ref().expect_err("not replayable, not retried");
            assert!(
                matches!(refused.error, RequestError::Allocation { .. }),
                "{}",
                refused.error
            );
            assert!(refused.error.to_string().contains("replay"), "{}", refused.error);
            continue;
        }
        let served = answer.as_ref().unwrap_or_else(|r| panic!("member {i}: {}", r.error));
        assert_eq!(served.pool.name(), "cpu", "member {i} ran alone on the fallback");
        assert!(served.retried.is_some());
        assert_eq!(served.outputs[0].shape[0], 1, "its own rows only");
        assert_as_alone(service, served, ids, &format!("member {i}")).await;
    }
    let text = metrics(service);
    let retries = |result: &str| {
        sample(
            &text,
            &format!("vramguard_retries_total{{pool=\"gpu\",result=\"{result}\"}}"),
        )
    };
    assert_eq!((retries("ok"), retries("not_replayable")), (3.0, 1.0));
    // The one batch that failed: no run of it is counted as a batch that ran.
    assert_eq!(runs_and_rows(service, "mean", "gpu"), (0.0, 0.0));
    server.stop().await;
}

#[tokio::test]
async fn batching_is_refused_at_start_for_a_decoder() {
    let yaml = "models: [{name: tiny, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json, \
         batching: {max_batch: 4, max_delay: 5ms}}]\n\
         pools: [{name: cpu, provider: cpu, models: [tiny]}]\n";
    let decoder = match TestServer::try_start(yaml).await {
        Ok(server) => {
            server.stop().await;
            panic!("started: {yaml}")
        }
        Err(why) => why,
    };
    assert!(decoder.contains("models[0].batching"), "{decoder}");
    assert!(decoder.contains("continuous batching"), "{decoder}");
}
