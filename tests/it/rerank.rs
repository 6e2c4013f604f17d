//! `POST /v1/rerank` on the cross-encoder of `models/embed/` (a tiny BERT with one logit from
//! random weights, saved by `CrossEncoder.save` and exported by Optimum's
//! `text-classification`; `make.py` made it): the order and every score equal what
//! `CrossEncoder.predict` and `rank` gave on the same folder (`reference.json`), all documents
//! in one request and each alone; `top_n`, `return_documents` and documents as objects; and
//! what is refused is refused naming the field.

use std::path::Path;

use serde_json::{Value, json};

use crate::common::TestServer;

const CONFIG: &str = "
models:
  - {name: rerank, path: models/embed/bert-cross-encoder/model.onnx}
  - {name: mean, path: models/embed/bert-mean-normalize/model.onnx}
pools: [{name: cpu, provider: cpu, models: [rerank, mean]}]
";

/// The cross-encoder's reference: `cases` of `query`, `documents`, `scores` (all at once),
/// `alone`, `order` and each pair's `ids`.
fn reference() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/embed/reference.json");
    let all: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    all["rerankers"]["bert-cross-encoder"].clone()
}

/// A 200's body.
async fn rerank(server: &TestServer, body: Value) -> Value {
    let response = server.post_json("/v1/rerank", &body).await;
    let status = response.status();
    let answer: Value = response.json().await.unwrap();
    assert_eq!(status, 200, "{body} → {answer}");
    assert_eq!(answer["model"], body["model"]);
    answer
}

/// Each result's `(index, relevance_score)`, in the answer's order.
fn ranked(answer: &Value) -> Vec<(usize, f64)> {
    answer["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["index"].as_u64().unwrap() as usize,
                r["relevance_score"].as_f64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test]
async fn documents_come_back_in_the_cross_encoder_s_order_with_its_scores() {
    let reference = reference();
    assert_eq!(reference["activation"], "Sigmoid");
    let server = TestServer::start(CONFIG).await;
    for (c, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
        let documents = case["documents"].as_array().unwrap();
        let order: Vec<usize> = case["order"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as usize)
            .collect();
        let scores: Vec<f64> = case["scores"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_f64().unwrap())
            .collect();
        let answer = rerank(
            &server,
            json!({"model": "rerank", "query": case["query"], "documents": documents}),
        )
        .await;
        let got = ranked(&answer);
        assert_eq!(got.iter().map(|r| r.0).collect::<Vec<_>>(), order, "case {c}: order");
        for (index, score) in &got {
            let far = (score - scores[*index]).abs();
            assert!(
                far <= 1e-5,
                "case {c} document {index}: {score} against {}",
                scores[*index]
            );
        }
        // The documents by default, as sent; the tokens of every pair counted.
        for result in answer["results"].as_array().unwrap() {
            let index = result["index"].as_u64().unwrap() as usize;
            assert_eq!(result["document"], json!({"text": documents[index]}));
        }
        let tokens: usize = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_array().unwrap().len())
            .sum();
        assert_eq!(
            answer["usage"],
            json!({"prompt_tokens": tokens, "total_tokens": tokens})
        );
        // Each document alone scores as it did in the batch (padding changes nothing), and as
        // `CrossEncoder.predict` gave it alone.
        for (index, document) in documents.iter().enumerate() {
            let alone = rerank(
                &server,
                json!({"model": "rerank", "query": case["query"], "documents": [document]}),
            )
            .await;
            let (at, score) = ranked(&alone)[0];
            let want = case["alone"][index].as_f64().unwrap();
            assert_eq!(at, 0);
            assert!(
                (score - want).abs() <= 1e-5,
                "case {c} document {index} alone: {score} against {want}"
            );
        }
        // `top_n` keeps the best; objects with `text` are read as strings; no documents back.
        let objects: Vec<Value> = documents.iter().map(|d| json!({"text": d})).collect();
        let top = rerank(
            &server,
            json!({"model": "rerank", "query": case["query"], "documents": objects, "top_n": 2, "return_documents": false}),
        )
        .await;
        assert_eq!(ranked(&top), got[..2].to_vec());
        assert!(
            top["results"]
                .as_array()
                .unwrap()
                .iter()
                .all(|r| r.get("document").is_none())
        );
    }
    server.stop().await;
}

/// A 400 in OpenAI's shape naming `param`, its message containing `says`.
async fn refused(server: &TestServer, body: Value, param: &str, says: &str) {
    let response = server.post_json("/v1/rerank", &body).await;
    let status = response.status();
    let answer: Value = response.json().await.unwrap();
    assert_eq!(status, 400, "{body} → {answer}");
    assert_eq!(answer["error"]["param"], param, "{body} → {answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains(says), "{body} → {message}");
}

#[tokio::test]
async fn what_is_not_a_rerank_request_is_refused_naming_the_field() {
    let server = TestServer::start(CONFIG).await;
    let query = "Which model shares the GPU?";
    refused(
        &server,
        json!({"model": "rerank", "query": query, "documents": []}),
        "documents",
        "empty list",
    )
    .await;
    refused(
        &server,
        json!({"model": "rerank", "query": query, "documents": "a"}),
        "documents",
        "not a list",
    )
    .await;
    refused(
        &server,
        json!({"model": "rerank", "query": query}),
        "documents",
        "missing",
    )
    .await;
    refused(
        &server,
        json!({"model": "rerank", "query": query, "documents": ["a", ""]}),
        "documents",
        "`documents[1]` is an empty string",
    )
    .await;
    refused(
        &server,
        json!({"model": "rerank", "query": query, "documents": [{"title": "a"}]}),
        "documents",
        "`documents[0]` has no string `text`",
    )
    .await;
    refused(
        &server,
        json!({"model": "rerank", "documents": ["a"]}),
        "query",
        "missing",
    )
    .await;
    refused(
        &server,
        json!({"model": "rerank", "query": "", "documents": ["a"]}),
        "query",
        "empty",
    )
    .await;
    refused(
        &server,
        json!({"model": "rerank", "query": query, "documents": ["a"], "top_n": -1}),
        "top_n",
        "not a number",
    )
    .await;
    refused(
        &server,
        json!({"model": "rerank", "query": query, "documents": ["a"], "return_documents": "no"}),
        "return_documents",
        "true or false",
    )
    .await;
    refused(&server, json!({"query": query, "documents": ["a"]}), "model", "missing").await;
    refused(
        &server,
        json!({"model": "mean", "query": query, "documents": ["a"]}),
        "model",
        "does not rerank",
    )
    .await;
    // An embedder is not asked to rerank, nor a cross-encoder to embed.
    let response = server
        .post_json("/v1/embeddings", &json!({"model": "rerank", "input": "a"}))
        .await;
    assert_eq!(response.status(), 400);
    let response = server
        .post_json(
            "/v1/rerank",
            &json!({"model": "nope", "query": query, "documents": ["a"]}),
        )
        .await;
    assert_eq!(response.status(), 404);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["error"]["code"], "model_not_found");
    // A pair longer than the model's positions: refused naming the limit, unless cut, then
    // scored as `CrossEncoder.predict` scores it cut.
    let long = &reference()["truncated"];
    refused(
        &server,
        json!({"model": "rerank", "query": long["query"], "documents": ["short", long["document"]]}),
        "documents",
        "`documents[1]` with `query` is longer than the model's max_position_embeddings of 128 tokens",
    )
    .await;
    let cut = rerank(
        &server,
        json!({"model": "rerank", "query": long["query"], "documents": [long["document"]], "truncate": true}),
    )
    .await;
    let tokens = long["ids"].as_array().unwrap().len();
    assert_eq!(cut["usage"]["total_tokens"], tokens, "cut to max_position_embeddings");
    let (score, want) = (ranked(&cut)[0].1, long["score"].as_f64().unwrap());
    assert!((score - want).abs() <= 1e-5, "cut: {score} against {want}");
    // Listed among the models clients pick from.
    let models: Value = reqwest::get(server.url("/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(crate::common::model_ids(&models), vec!["rerank", "mean"]);
    let metrics = server.metrics().await;
    let refused = crate::common::sum_samples(&metrics, |l| {
        l.starts_with("vramguard_requests_total{")
            && l.contains("model=\"rerank\"")
            && l.contains("outcome=\"client_error\"")
    });
    assert!(refused >= 8.0, "refusals are counted under their model: {refused}");
    server.stop().await;
}

/// A query of 1 MB with `truncate` (issue 63: 3 documents took 5.5–8.6 s and +360 MiB, 30
/// took 60 s, the query tokenized again with each document) is tokenized once and only as far
/// as the model reads: 30 documents answer within a bound generous for a loaded machine and a
/// debug build, cut as the pair's tokenizer cuts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_of_a_megabyte_is_read_once_and_only_as_far_as_the_model_takes() {
    let server = TestServer::start(CONFIG).await;
    let query = "which model shares the gpu ".repeat(1_000_000 / 27);
    let documents = vec!["The GPU is shared by a chat model and an embedding model."; 30];
    let before = crate::memory::resident(std::process::id());
    let started = std::time::Instant::now();
    let answer = rerank(
        &server,
        json!({"model": "rerank", "query": query, "documents": documents, "truncate": true}),
    )
    .await;
    let took = started.elapsed();
    let grew = crate::memory::resident(std::process::id()).saturating_sub(before) >> 20;
    eprintln!("1 MB query, 30 documents: {took:?}, resident memory +{grew} MiB after");
    assert!(took < std::time::Duration::from_secs(20), "{took:?}");
    assert!(grew < 200, "+{grew} MiB");
    // Every pair cut to the model's 128 positions, the short document kept whole.
    let tokenizer = tokenizers::Tokenizer::from_file("models/embed/bert-cross-encoder/tokenizer.json").unwrap();
    let document = tokenizer.encode(documents[0], false).unwrap().len();
    assert_eq!(
        answer["usage"]["total_tokens"],
        30 * 128,
        "{document} tokens a document"
    );
    server.stop().await;
}
