//! The stepper of each batch ([`crate::pool::batch`]): one tokio task per model and pool that
//! gathers its members' tokens, runs them as one decode job, and answers each row.

use std::collections::HashSet;
use std::sync::Weak;

use tokio::sync::mpsc;

use super::sequences::Padding;
use super::{GRACE, Message, Reply, StepPool};
use crate::core::backend::{BackendError, DecodeRow, DecodeStep, Fork, RunMeta};
use crate::core::tensor::TensorData;
use crate::pool::job::{InferJob, Inputs, PoolError, RunCancel, RunMemory, RunOp};

/// What the stepper knows between steps.
#[derive(Default)]
struct Steps {
    members: HashSet<u64>,
    /// Members that missed a step's grace: not waited for until their next token comes, so
    /// a stalled reader costs the others one grace, not one a step.
    late: HashSet<u64>,
    pending: Vec<(DecodeRow, Reply)>,
    ended: Vec<u64>,
    forks: Vec<Fork>,
}

impl Steps {
    fn take(&mut self, message: Message) {
        match message {
            Message::Join(seq) => {
                self.members.insert(seq);
            }
            Message::Step(row, reply) => {
                self.members.insert(row.seq);
                self.late.remove(&row.seq);
                self.pending.push((row, reply));
            }
            Message::Fork(fork) => self.forks.push(fork),
            Message::Leave(seq) => {
                self.members.remove(&seq);
                self.late.remove(&seq);
                self.pending.retain(|(row, _)| row.seq != seq);
                self.ended.push(seq);
            }
        }
    }

    /// Whether a member the step waits for has not sent its token yet. A member's rows are
    /// pending or it is late, never both, and every pending row is a member's.
    fn awaits_more(&self) -> bool {
        self.pending.len() + self.late.len() < self.members.len()
    }

    /// Take the next step's messages from `inbox`: wait for a first token (unless caches of a
    /// batch left empty are still to be dropped), then for the members not late, up to
    /// [`GRACE`] after it; those still missing then are late. False once every sender is gone.
    async fn gather(&mut self, inbox: &mut mpsc::UnboundedReceiver<Message>) -> bool {
        let only_ends = self.members.is_empty() && !self.ended.is_empty();
        if self.pending.is_empty() && !only_ends {
            match inbox.recv().await {
                Some(message) => self.take(message),
                None => return false,
            }
        }
        while let Ok(message) = inbox.try_recv() {
            self.take(message);
        }
        if self.pending.is_empty() {
            return true;
        }
        let until = tokio::time::Instant::now() + GRACE;
        while self.awaits_more() {
            match tokio::time::timeout_at(until, inbox.recv()).await {
                Ok(Some(message)) => self.take(message),
                Ok(None) => return false,
                Err(_) => {
                    let sent: HashSet<u64> = self.pending.iter().map(|(row, _)| row.seq).collect();
                    self.late.extend(self.members.difference(&sent).copied());
                    break;
                }
            }
        }
        true
    }
}

/// The stepper of `model`'s batch on `pool`, until the pool is gone.
pub(super) async fn step_batch<P: StepPool>(pool: Weak<P>, model: String, mut inbox: mpsc::UnboundedReceiver<Message>) {
    let mut steps = Steps::default();
    // What the batch's masked slots hold, in the pool's KV bytes beside its generations' own.
    let mut padding = match pool.upgrade() {
        Some(pool) => Padding::on(pool.sequences(), &model),
        None => return,
    };
    loop {
        if !steps.gather(&mut inbox).await {
            return;
        }
        let Some(pool) = pool.upgrade() else { return };
        let pending = std::mem::take(&mut steps.pending);
        let step = DecodeStep {
            rows: pending.iter().map(|(row, _)| *row).collect(),
            ended: std::mem::take(&mut steps.ended),
            // A step refused before it ran loses its forks: each of their generations' steps
            // fails with it and is prefilled again, as any member's.
            forks: std::mem::take(&mut steps.forks),
        };
        let result = run_step(pool.as_ref(), &model, step).await;
        drop(pool);
        let result = match result {
            Ok(Stepped { logits, padded, shape }) => {
                if let Some(bytes) = padded {
                    padding.set(bytes);
                }
                if let Some((rows, slots)) = shape {
                    padding.shape(rows, slots);
                }
                Ok(logits)
            }
            Err(error) => {
                // A step that failed in the backend leaves it none of the model's caches (a
                // missing cache aside): every row is prefilled again, or moves, or ends. One
                // refused before it ran (the breaker, the queue) left them as they were.
                if matches!(&error, PoolError::Backend(e) if !matches!(e, BackendError::CacheMissing(_))) {
                    padding.set(0);
                    padding.shape(0, 0);
                }
                Err(error)
            }
        };
        answer(&mut steps, pending, result);
    }
}

/// Send each row its logits; on a missing cache, fail those rows and keep the others for the
/// next step; on any other failure, fail every row.
fn answer(steps: &mut Steps, pending: Vec<(DecodeRow, Reply)>, result: Result<Vec<f32>, PoolError>) {
    let rows = pending.len().max(1);
    match result {
        Ok(logits) => {
            let vocab = logits.len() / rows;
            for (i, (_, reply)) in pending.into_iter().enumerate() {
                let _ = reply.send(Ok(logits[i * vocab..(i + 1) * vocab].to_vec()));
            }
        }
        Err(PoolError::Backend(BackendError::CacheMissing(missing))) => {
            for (row, reply) in pending {
                if missing.contains(&row.seq) {
                    let _ = reply.send(Err(BackendError::CacheMissing(vec![row.seq]).into()));
                } else {
                    steps.pending.push((row, reply));
                }
            }
        }
        Err(error) => {
            for (_, reply) in pending {
                let _ = reply.send(Err(error.clone()));
            }
        }
    }
}

/// What a step gave back.
struct Stepped {
    /// The rows' logits, row-major.
    logits: Vec<f32>,
    /// The bytes the batch's masked slots hold, when the backend says.
    padded: Option<u64>,
    /// The batch's rows and slots, when the backend says ([`DecodeStep::BATCH`]).
    shape: Option<(u64, u64)>,
}

/// Run one step on `pool`: the breaker's permission, then the job.
async fn run_step<P: StepPool>(pool: &P, model: &str, step: DecodeStep) -> Result<Stepped, PoolError> {
    let rows = step.rows.len();
    if rows > 0 {
        pool.breaker_permit()?;
    }
    let job = InferJob {
        meta: RunMeta {
            request_id: format!("batch-step:{model}"),
            ..RunMeta::default()
        },
        model: model.to_string(),
        inputs: Inputs::default(),
        outputs: Vec::new(),
        op: RunOp::Decode(step),
        estimate_bytes: None,
        memory: RunMemory::default(),
        probe: false,
        cancel: RunCancel::default(),
    };
    let outputs = pool.submit(job)?.await.map_err(|_| PoolError::ShuttingDown {
        pool: pool.name().to_string(),
    })??;
    let padded = DecodeStep::reported(&outputs, DecodeStep::PADDING).map(|[bytes]| bytes);
    let shape = DecodeStep::reported(&outputs, DecodeStep::BATCH).map(|[rows, slots]| (rows, slots));
    let logits = outputs.into_iter().find_map(|t| match (t.name.as_str(), t.data) {
        ("logits", TensorData::Fp32(values)) => Some(values),
        _ => None,
    });
    let logits = match logits {
        Some(values) if values.len() % rows.max(1) == 0 => values,
        _ if rows == 0 => Vec::new(),
        _ => return Err(BackendError::Runtime("a decode step gave no FP32 `logits`".into()).into()),
    };
    Ok(Stepped { logits, padded, shape })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::model::BuiltinModel;
    use crate::core::snapshot::DeviceClass;
    use crate::core::tensor::DataType;
    use std::sync::Arc;

    use crate::pool::batch::next_sequence;
    use crate::pool::{Pool, PoolContext};
    use crate::runtime::decoder::{DecoderLayout, step_inputs};
    use crate::runtime::onnx::{OrtBackend, SessionOptions, runtime};

    /// The decoder fixture's layout (`models/decoder/README.md`).
    const FIXTURE: DecoderLayout = DecoderLayout {
        layers: 2,
        kv_heads: 2,
        head_size: 16,
        kv_datatype: DataType::Fp32,
        vocab: Some(512),
        position_ids: true,
        padding: crate::runtime::decoder::Padding::Left,
        context: None,
        prefill_logits: crate::runtime::decoder::PrefillLogits::EveryPosition,
        window: None,
        slot_window: None,
    };

    /// A CPU pool `p` of one backend serving the bundled decoder as `lm`.
    fn decoder_pool() -> Arc<Pool> {
        let rt = runtime(None).expect("ONNX Runtime loads");
        let model = [("lm".to_string(), BuiltinModel::Decoder.data())];
        let backend = OrtBackend::load(rt, &model, &SessionOptions::quiet_cpu()).unwrap();
        let config = crate::testing::config::pool("p", "host", &["lm"]);
        Pool::start(
            config,
            DeviceClass::Host,
            vec![Box::new(backend)],
            None,
            PoolContext::default(),
        )
    }

    #[tokio::test]
    async fn a_step_crosses_its_token_in_and_one_row_of_logits_out_at_every_position() {
        let pool = decoder_pool();
        assert!(pool.keeps_caches());
        let metrics = &pool.context.metrics;
        let prompt = [3u32, 40, 41, 42, 43];
        let seq = next_sequence();
        let job = prefill_job(seq, &prompt);
        let prompt_bytes: u64 = job.inputs.iter().map(|t| t.data.byte_len() as u64).sum();
        let prefilled = pool.submit(job).unwrap().await.unwrap().unwrap();
        assert_eq!(prefilled[0].shape, vec![1, 512], "the prompt's run brings one row back");
        // Ids, mask and positions of 5 tokens (8 bytes each), and empty pasts.
        assert_eq!(
            (metrics.to_pool.get(), metrics.from_pool.get()),
            (prompt_bytes, 512 * 4)
        );
        assert_eq!(prompt_bytes, 3 * 5 * 8);
        let mut member = pool.batch("lm").member(seq);
        for i in 0..400u32 {
            let past = prompt.len() as u64 + u64::from(i);
            let before = (metrics.to_pool.get(), metrics.from_pool.get());
            let logits = member.step(50 + i % 300, past).await.unwrap();
            assert_eq!(logits.len(), 512);
            assert!(logits.iter().all(|l| l.is_finite()), "position {past}");
            let after = (metrics.to_pool.get(), metrics.from_pool.get());
            assert_eq!(
                (after.0 - before.0, after.1 - before.1),
                (DecodeStep::ROW_BYTES, 512 * 4),
                "position {past}: the token in, one row of logits out, whatever the position"
            );
        }
    }

    /// A batch's masked rows cross too: with one member late, the step sends the whole batch's
    /// tokens in and brings every row's logits out, and the transfer metric says so.
    #[tokio::test]
    async fn a_step_with_a_masked_row_counts_the_whole_batch_crossing() {
        let pool = decoder_pool();
        let metrics = &pool.context.metrics;
        let prompt = [3u32, 40, 41, 42, 43];
        let (a, b) = (next_sequence(), next_sequence());
        for seq in [a, b] {
            pool.submit(prefill_job(seq, &prompt)).unwrap().await.unwrap().unwrap();
        }
        let (mut first, mut second) = (pool.batch("lm").member(a), pool.batch("lm").member(b));
        let past = prompt.len() as u64;
        let (one, two) = tokio::join!(first.step(50, past), second.step(60, past));
        assert_eq!((one.unwrap().len(), two.unwrap().len()), (512, 512));
        // The second member sends nothing: after the grace the step runs with its row masked.
        let before = (metrics.to_pool.get(), metrics.from_pool.get());
        assert_eq!(first.step(51, past + 1).await.unwrap().len(), 512);
        let after = (metrics.to_pool.get(), metrics.from_pool.get());
        assert_eq!(
            (after.0 - before.0, after.1 - before.1),
            (2 * DecodeStep::ROW_BYTES, 2 * 512 * 4),
            "both rows' inputs in and both rows' logits out, for one member's token"
        );
    }

    /// A member whose stream's reader stalls costs the others one grace, not one every step:
    /// once it missed a step, the others' steps no longer wait for it, until its next token
    /// comes and it is waited for again.
    #[tokio::test(start_paused = true)]
    async fn a_member_that_missed_a_step_is_not_waited_for_until_its_next_token() {
        use futures_util::FutureExt;
        let (messages, mut inbox) = mpsc::unbounded_channel();
        let step = |seq: u64| {
            let (reply, _) = tokio::sync::oneshot::channel();
            Message::Step(DecodeRow { seq, token: 7, past: 3 }, reply)
        };
        let rows = |steps: &mut Steps| -> Vec<u64> {
            std::mem::take(&mut steps.pending)
                .into_iter()
                .map(|(row, _)| row.seq)
                .collect()
        };
        let mut steps = Steps::default();
        for message in [Message::Join(1), Message::Join(2), step(1)] {
            messages.send(message).unwrap();
        }
        let start = tokio::time::Instant::now();
        assert!(steps.gather(&mut inbox).await);
        assert!(start.elapsed() >= GRACE, "the first miss waits out the grace");
        assert_eq!(rows(&mut steps), [1]);
        for _ in 0..3 {
            messages.send(step(1)).unwrap();
            let gathered = steps.gather(&mut inbox).now_or_never();
            assert_eq!(
                gathered,
                Some(true),
                "member 1's step does not wait for stalled member 2"
            );
            assert_eq!(rows(&mut steps), [1]);
        }
        // Member 2's token comes: it is in the next step, and waited for from then on.
        messages.send(step(2)).unwrap();
        messages.send(step(1)).unwrap();
        assert_eq!(steps.gather(&mut inbox).now_or_never(), Some(true));
        assert_eq!(rows(&mut steps), [2, 1]);
        messages.send(step(1)).unwrap();
        let start = tokio::time::Instant::now();
        assert!(steps.gather(&mut inbox).await);
        assert!(start.elapsed() >= GRACE, "member 2 rejoined: it is waited for again");
        assert_eq!(rows(&mut steps), [1]);
    }

    fn prefill_job(seq: u64, prompt: &[u32]) -> InferJob {
        InferJob {
            meta: RunMeta::default(),
            model: "lm".into(),
            inputs: step_inputs(&FIXTURE, prompt, 0, Vec::new()).into(),
            outputs: Vec::new(),
            op: RunOp::Prefill(seq),
            estimate_bytes: None,
            memory: RunMemory::default(),
            probe: false,
            cancel: RunCancel::default(),
        }
    }

    #[tokio::test]
    async fn prompts_that_wait_together_run_as_one_batch_with_each_its_own_logits() {
        let start = decoder_pool;
        let prompts: Vec<Vec<u32>> = vec![vec![5, 6, 7], (40..60).collect(), vec![9], (100..111).collect()];
        // Alone, one after another.
        let alone = start();
        let mut expected = Vec::new();
        for (i, prompt) in prompts.iter().enumerate() {
            let out = alone
                .submit(prefill_job(i as u64, prompt))
                .unwrap()
                .await
                .unwrap()
                .unwrap();
            expected.push(out);
        }
        // Together: queued while the worker takes or runs a long prompt, they run as one batch.
        let pool = start();
        let long: Vec<u32> = (0..500).map(|i| 3 + i % 400).collect();
        let first = pool.submit(prefill_job(100, &long)).unwrap();
        let replies: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| pool.submit(prefill_job(i as u64, prompt)).unwrap())
            .collect();
        first.await.unwrap().unwrap();
        for (i, reply) in replies.into_iter().enumerate() {
            let got = reply.await.unwrap().unwrap();
            let (TensorData::Fp32(a), TensorData::Fp32(b)) = (&got[0].data, &expected[i][0].data) else {
                panic!("{got:?}")
            };
            assert_eq!(got[0].shape, vec![1, 512]);
            let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            assert!(
                diff < 1e-4,
                "prompt {i}: its logits differ by {diff} from its run alone"
            );
        }
        // The four queue while the long one runs (or before it starts, and it joins them).
        let runs = pool.runs_started.load(std::sync::atomic::Ordering::SeqCst);
        assert!((1..=2).contains(&runs), "five prompts in {runs} runs");
    }
}
