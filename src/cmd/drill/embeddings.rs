//! The embeddings phase: `POST /v1/embeddings` beside the accelerator's faults. First a
//! reference at rest: every sentence of [`SENTENCES`] in one request, on the accelerator. Then
//! requests of one sentence each, concurrently, while an external workload holds most of the
//! device; then each after an allocator failure injected before its run (retried once on the
//! CPU pool); then while a driver reset fails every accelerator run (served on the CPU pool).
//! Wherever it ran and however it was batched, every answer must give the reference's vector
//! for its sentence: both pools run the same graph, so within [`TOLERANCE`].

use std::sync::Arc;

use serde_json::{Value, json};

use super::client::{Drill, refusal};
use super::phase::Phase;
use super::record::{Judged, Record};
use super::{CPU, DEVICE, EMBEDDER, GPU};

/// The sentences embedded, of different lengths so that a batch of them is padded.
const SENTENCES: [&str; 4] = [
    "The GPU is shared",
    "by chat, embeddings and speech, each in the API its clients already speak",
    "memory",
    "an embedding request that meets an allocator failure is retried on the CPU",
];
/// The most any component of a vector may differ from the reference's.
const TOLERANCE: f32 = 1e-5;
/// The share of the device the external workload holds while the concurrent requests run.
const PRESSURE: f64 = 0.85;

/// Run the phase; its records are judged as they come.
pub(super) async fn run(drill: &Arc<Drill>) -> Result<(), String> {
    let (concurrent, failures, reset) = (drill.n(8, 24), drill.n(2, 3), drill.n(2, 6));
    drill.begin(Phase::Embeddings, 1 + concurrent + failures + reset);
    let (record, reference) = embed(drill, "embed-reference", &SENTENCES, "ok on gpu").await;
    let Some(reference) = reference.map(Arc::new) else {
        record.judge(|_| false).keep(drill);
        return Ok(());
    };
    record.judge(|r| r.served_on(GPU)).keep(drill);

    let capacity = drill
        .status()
        .await?
        .devices
        .get(DEVICE)
        .map_or(96 << 20, |d| d.memory.total_bytes);
    drill.squeeze((capacity as f64 * PRESSURE) as u64).await?;
    let shared = Arc::clone(&reference);
    drill
        .concurrently(concurrent, 8, move |d, i| {
            let reference = Arc::clone(&shared);
            async move {
                let id = format!("embed-pressure-{i}");
                one(&d, &id, i, &reference, "the reference's vector, any pool").await
            }
        })
        .await;
    drill.admin(json!({"pressure": 0})).await?;

    for i in 0..failures {
        drill.admin(json!({"fail_next": 1})).await?;
        let id = format!("embed-alloc-{i}");
        let (record, same) = compared(drill, &id, i, &reference, "retried on cpu, the reference's vector").await;
        record.judge(|r| same && r.served_on(CPU)).keep(drill);
    }

    drill.admin(json!({"driver_reset": true})).await?;
    for i in 0..reset {
        let id = format!("embed-reset-{i}");
        let (record, same) = compared(drill, &id, i, &reference, "on cpu, the reference's vector").await;
        record.judge(|r| same && r.served_on(CPU)).keep(drill);
    }
    drill.restore_gpu().await
}

/// One sentence's request, judged: answered 200 on either pool with the reference's vector.
async fn one(drill: &Drill, id: &str, i: usize, reference: &[Vec<f32>], expect: &'static str) -> Judged {
    let (record, same) = compared(drill, id, i, reference, expect).await;
    record.judge(|r| same && r.status == Some(200))
}

/// Embed sentence `i % 4` alone; whether its vector is the reference's.
async fn compared(drill: &Drill, id: &str, i: usize, reference: &[Vec<f32>], expect: &'static str) -> (Record, bool) {
    let k = i % SENTENCES.len();
    let (record, vectors) = embed(drill, id, &[SENTENCES[k]], expect).await;
    let same = vectors.is_some_and(|v| v.len() == 1 && close(&v[0], &reference[k]));
    (record, same)
}

/// Whether two vectors agree component by component within [`TOLERANCE`].
fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= TOLERANCE)
}

/// `POST /v1/embeddings` of `inputs` to the drill's embedder: the record, and the vectors when
/// it was answered with one per input.
async fn embed(drill: &Drill, id: &str, inputs: &[&str], expect: &'static str) -> (Record, Option<Vec<Vec<f32>>>) {
    let kind = format!("{EMBEDDER} embeddings ×{}", inputs.len());
    let mut record = Record::new(Phase::Embeddings, id, kind, expect, drill.elapsed_ms());
    let body = json!({"model": EMBEDDER, "input": inputs});
    let mut vectors = None;
    if let Some(answer) = drill.post_json(&mut record, "/v1/embeddings", &body).await {
        if record.status == Some(200) {
            vectors = read_vectors(&answer).filter(|v| v.len() == inputs.len());
        } else {
            record.first_failure = refusal(&answer);
        }
    }
    (record, vectors)
}

/// An OpenAI embeddings answer's vectors, in its `index` order.
fn read_vectors(answer: &Value) -> Option<Vec<Vec<f32>>> {
    let mut items: Vec<&Value> = answer["data"].as_array()?.iter().collect();
    items.sort_by_key(|item| item["index"].as_u64());
    items
        .into_iter()
        .map(|item| {
            item["embedding"]
                .as_array()?
                .iter()
                .map(|v| v.as_f64().map(|x| x as f32))
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors_are_read_in_index_order_and_compared_within_the_tolerance() {
        let answer = json!({"data": [{"index": 1, "embedding": [0.5, 0.25]}, {"index": 0, "embedding": [1.0, 0.0]}]});
        let vectors = read_vectors(&answer).unwrap();
        assert_eq!(vectors, [vec![1.0, 0.0], vec![0.5, 0.25]]);
        assert!(close(&vectors[1], &[0.5 + TOLERANCE / 2.0, 0.25]));
        assert!(!close(&vectors[1], &[0.5 + TOLERANCE * 2.0, 0.25]));
        assert!(!close(&vectors[1], &[0.5]));
        assert!(read_vectors(&json!({"data": [{"index": 0, "embedding": "AAAA"}]})).is_none());
    }
}
