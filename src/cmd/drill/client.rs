//! The drill as a client of its target: the requests it sends, the admin calls that squeeze
//! and heal the simulated device, the counters it reads back, and the `/status` sampler.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::phase::Phase;
use super::progress::Progress;
use super::record::{ErrorFields, Failure, Judged, Record, Samples};
use super::{CPU, CPU_ONLY, DEVICE, ENCODER, GPU};
use crate::protocol::headers::{HEADER_LENGTH, IDEMPOTENCY_KEY, REQUEST_ID};
use crate::protocol::status::StatusReport;

/// A drill under way: the target, what was recorded, what the sampler saw.
pub(super) struct Drill {
    pub(super) client: reqwest::Client,
    pub(super) base: String,
    pub(super) token: String,
    pub(super) started: Instant,
    pub(super) quick: bool,
    pub(super) records: Mutex<Vec<Record>>,
    /// The running phase (for the sampler).
    pub(super) phase: Mutex<Phase>,
    pub(super) samples: Mutex<std::collections::BTreeMap<Phase, Samples>>,
    /// What the sampler saw of models and evictions during the residency phase.
    pub(super) seen: Mutex<super::seen::Seen>,
    pub(super) progress: Progress,
}

/// Keeping a judged record is the drill's: it goes into the drill's record and counts as done.
impl Judged {
    /// Keep it in the drill's record, and hand it back.
    pub(super) fn keep(self, drill: &Drill) -> Record {
        drill.keep(self.0.clone());
        self.0
    }
}

/// An OpenAI-shaped error body, `{"error": {"message": …}}`.
#[derive(serde::Deserialize)]
struct OpenAiError {
    error: OpenAiErrorBody,
}

#[derive(serde::Deserialize)]
struct OpenAiErrorBody {
    message: String,
    #[serde(default)]
    tokens_sent: Option<u64>,
}

impl Drill {
    /// `quick` requests in a quick drill, `full` otherwise.
    pub(super) fn n(&self, quick: usize, full: usize) -> usize {
        if self.quick { quick } else { full }
    }

    /// `phase` starts, with `requests` to send.
    pub(super) fn begin(&self, phase: Phase, requests: usize) {
        *self.phase.lock().unwrap_or_else(|e| e.into_inner()) = phase;
        self.progress.phase(phase, requests);
    }

    /// Every record kept so far.
    pub(super) fn records(&self) -> Vec<Record> {
        self.records.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Keep `record`, and count it done.
    pub(super) fn keep(&self, record: Record) {
        self.progress.step();
        self.records.lock().unwrap_or_else(|e| e.into_inner()).push(record);
    }

    /// Milliseconds since the drill started.
    pub(super) fn elapsed_ms(&self) -> f64 {
        self.started.elapsed().as_secs_f64() * 1000.0
    }

    /// `GET path` on the target, its JSON read as `T`.
    pub(super) async fn get_json<T: DeserializeOwned>(&self, path: &str) -> Result<T, String> {
        get_json(&self.client, &format!("{}{path}", self.base)).await
    }

    /// The target's `/status`.
    pub(super) async fn status(&self) -> Result<StatusReport, String> {
        self.get_json("/status").await
    }

    /// `count` requests made by `make`, at most `parallel` at once; each is kept.
    pub(super) async fn concurrently<F, Fut>(self: &Arc<Self>, count: usize, parallel: usize, make: F)
    where
        F: Fn(Arc<Drill>, usize) -> Fut + Send + Sync + 'static + Clone,
        Fut: std::future::Future<Output = Judged> + Send + 'static,
    {
        let next = Arc::new(AtomicUsize::new(0));
        let mut lanes = Vec::new();
        for _ in 0..parallel.max(1) {
            let (drill, next, make) = (Arc::clone(self), Arc::clone(&next), make.clone());
            lanes.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        break;
                    }
                    make(Arc::clone(&drill), i).await.keep(&drill);
                }
            }));
        }
        for lane in lanes {
            let _ = lane.await;
        }
    }

    /// `POST path` on the target's admin API with `body`.
    pub(super) async fn post_admin(&self, path: &str, body: Value) -> Result<(), String> {
        self.post_admin_answer(path, body).await.map(|_| ())
    }

    /// `POST path` on the target's admin API with `body`; its JSON answer (null when it is not
    /// JSON).
    pub(super) async fn post_admin_answer(&self, path: &str, body: Value) -> Result<Value, String> {
        let response = self
            .client
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await
            .map_err(|e| format!("{path}: {e}"))?;
        if !response.status().is_success() {
            let status = response.status();
            let text = response.text().await.unwrap_or_default();
            return Err(format!("{path} answered {status}: {text}"));
        }
        Ok(response.json().await.unwrap_or(Value::Null))
    }

    /// Set the simulated device's pressure or faults.
    pub(super) async fn admin(&self, body: Value) -> Result<(), String> {
        self.post_admin(&format!("/admin/sim/{DEVICE}"), body).await
    }

    /// Set the simulated device's faults; the admin API's answer (`killed_worker_pid`, …).
    pub(super) async fn admin_answer(&self, body: Value) -> Result<Value, String> {
        self.post_admin_answer(&format!("/admin/sim/{DEVICE}"), body).await
    }

    /// The operator's restore of the accelerator pool: the server's health check then closes
    /// the breaker.
    pub(super) async fn restore_gpu(&self) -> Result<(), String> {
        self.post_admin(&format!("/admin/pools/{GPU}/restore"), json!({})).await
    }

    /// Apply `bytes` of external pressure, or as much of it as the device can give now (a
    /// competing workload gets no more than is free either); returns what was applied.
    pub(super) async fn squeeze(&self, bytes: u64) -> Result<u64, String> {
        let mut want = bytes;
        for _ in 0..5 {
            let response = self
                .client
                .post(format!("{}/admin/sim/{DEVICE}", self.base))
                .bearer_auth(&self.token)
                .json(&json!({"pressure": want}))
                .send()
                .await
                .map_err(|e| format!("/admin/sim/{DEVICE}: {e}"))?;
            if response.status().is_success() {
                return Ok(want);
            }
            let text = response.text().await.unwrap_or_default();
            // "… Available memory of N is smaller than requested bytes of M"
            let available = text
                .split("Available memory of ")
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
                .ok_or_else(|| format!("/admin/sim/{DEVICE} refused {want} bytes of pressure: {text}"))?;
            want = want.min(available.saturating_sub(1 << 20));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(format!("/admin/sim/{DEVICE} kept refusing pressure"))
    }

    /// Poll `/status`, sending nothing to the accelerator, until its breaker reads closed (the
    /// server's own health check closes it: no client's request is the probe), then confirm with
    /// one short request that it is served there; the time to the breaker closing is returned,
    /// and that request is kept in the record when `keep_in` is given.
    /// Wait (up to `within`) until the accelerator pool's breaker is closed: a phase that
    /// injects a fault into the accelerator's next run needs that run to be a request's, on a
    /// healthy pool, not a health check's on a pool still recovering from the phase before.
    pub(super) async fn until_gpu_closed(&self, within: Duration) -> bool {
        let since = Instant::now();
        while since.elapsed() < within {
            let closed = self.status().await.ok().is_some_and(|status| {
                status
                    .pool(GPU)
                    .is_some_and(|gpu| gpu.breaker == crate::core::snapshot::BreakerState::Closed)
            });
            if closed {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    pub(super) async fn until_served_on_gpu(
        &self,
        since: Instant,
        within: Duration,
        keep_in: Option<Phase>,
    ) -> Option<f64> {
        // A request that is not kept belongs to no phase; it is filed under the running one.
        let phase = keep_in.unwrap_or_else(|| *self.phase.lock().unwrap_or_else(|e| e.into_inner()));
        while since.elapsed() < within {
            let closed = self.status().await.ok().is_some_and(|status| {
                status
                    .pool(GPU)
                    .is_some_and(|gpu| gpu.breaker == crate::core::snapshot::BreakerState::Closed)
            });
            if !closed {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let at = since.elapsed().as_secs_f64() * 1000.0;
            let expect = "served on gpu after the restore";
            let served = self.encoder(phase, "after-recovery", 16, &[], None, expect).await;
            if served.pool.as_deref() == Some(GPU) {
                if keep_in.is_some() {
                    served.judge(|r| r.status == Some(200)).keep(self);
                }
                return Some(at);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }

    /// Between phases: no pressure, no injected faults, and the accelerator pool serving with a
    /// clean breaker, so each phase starts from a healthy device. A phase's real or injected
    /// allocator failures stay in the breaker's window (and could open it in the next phase),
    /// so when there were some the operator's restore is used, after which the server's own
    /// probe closes the breaker and forgets them.
    pub(super) async fn settle(&self) -> Result<(), String> {
        self.admin(json!({"pressure": 0, "fail_next": 0, "pass_first": 0}))
            .await?;
        let status = self.status().await?;
        let healthy = status.pool(GPU).is_some_and(|gpu| {
            gpu.alloc_failures_recent == 0 && gpu.breaker == crate::core::snapshot::BreakerState::Closed
        });
        if !healthy {
            self.restore_gpu().await?;
        }
        let phase = *self.phase.lock().unwrap_or_else(|e| e.into_inner());
        self.until_served_on_gpu(Instant::now(), Duration::from_secs(60), None)
            .await
            .map(|_| ())
            .ok_or_else(|| {
                format!(
                    "pool `{GPU}` did not serve again within 60 s after the `{}` phase",
                    phase.label()
                )
            })
    }

    /// The samples whose line starts with `series` (`vramguard_requests_total{`) summed over
    /// those carrying `label` (e.g. `outcome="cancelled"`), as the target's `/metrics` says now
    /// (0 when it cannot be read).
    pub(super) async fn counted(&self, series: &str, label: &str) -> f64 {
        let Ok(response) = self.client.get(format!("{}/metrics", self.base)).send().await else {
            return 0.0;
        };
        let text = response.text().await.unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with(series) && l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// `vramguard_requests_total` summed over the series carrying `label`.
    async fn requests_counted(&self, label: &str) -> f64 {
        self.counted("vramguard_requests_total{", label).await
    }

    /// Requests the target has counted cancelled.
    pub(super) async fn cancelled(&self) -> f64 {
        self.requests_counted("outcome=\"cancelled\"").await
    }

    /// Requests the CPU pool has counted, whatever their outcome.
    pub(super) async fn cpu_requests(&self) -> u64 {
        self.requests_counted(&format!("pool=\"{CPU}\"")).await as u64
    }

    /// A server notices a hang-up when it next touches the connection or the request: wait (at
    /// most 5 s) for the cancelled count to reach the hang-ups, and return what it reached.
    pub(super) async fn settle_cancelled(&self, before: f64, hung_up: u64) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let counted = self.cancelled().await - before;
            if counted >= hung_up as f64 || Instant::now() > deadline {
                return counted;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A client's retry of an encoder request under idempotency key `key`.
    pub(super) async fn keyed(&self, phase: Phase, id: &str, key: &str) -> Record {
        self.encoder(
            phase,
            id,
            64,
            &[(IDEMPOTENCY_KEY, key)],
            None,
            "one run, the rest replayed",
        )
        .await
    }

    /// An encoder request of `seq` tokens in binary tensors; `patience` makes the client hang up.
    pub(super) async fn encoder(
        &self,
        phase: Phase,
        id: &str,
        seq: usize,
        headers: &[(&str, &str)],
        patience: Option<Duration>,
        expect: &'static str,
    ) -> Record {
        let record = Record::new(phase, id, format!("encoder seq {seq}"), expect, self.elapsed_ms());
        self.send_encoder(ENCODER, record, seq, headers, patience).await
    }

    /// A request of `seq` tokens in binary tensors to `model`, a copy of the bundled encoder;
    /// its kind starts with the model's name.
    pub(super) async fn encoder_of(
        &self,
        model: &str,
        phase: Phase,
        id: &str,
        seq: usize,
        expect: &'static str,
    ) -> Record {
        let record = Record::new(phase, id, format!("{model} seq {seq}"), expect, self.elapsed_ms());
        self.send_encoder(model, record, seq, &[], None).await
    }

    /// Send `record`'s encoder request to `model` and read its answer into it.
    pub(super) async fn send_encoder(
        &self,
        model: &str,
        mut record: Record,
        seq: usize,
        headers: &[(&str, &str)],
        patience: Option<Duration>,
    ) -> Record {
        let id = record.id.clone();
        let id = id.as_str();
        let input = crate::core::tensor::Tensor {
            name: "input".into(),
            shape: vec![1, seq as i64, 64],
            data: crate::core::tensor::TensorData::Fp32((0..seq * 64).map(|i| (i % 7) as f32 * 0.01).collect()),
        };
        // A client's retry of a keyed request sends the same body: the protocol's `id` is the key.
        let body_id = headers
            .iter()
            .find(|(name, _)| *name == IDEMPOTENCY_KEY)
            .map_or(id, |(_, key)| *key);
        let (body, header_len) = crate::protocol::oip::encode_request(body_id, &[input], &["pooled".to_string()]);
        let mut request = self
            .client
            .post(format!("{}/v2/models/{model}/infer", self.base))
            .header(HEADER_LENGTH, header_len)
            .header(REQUEST_ID, id);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let sent = record.sent_ms;
        let exchange = async {
            let response = request.body(body).send().await?;
            let headers = response.headers().clone();
            let status = response.status().as_u16();
            let bytes = response.bytes().await?;
            Ok::<_, reqwest::Error>((status, headers, bytes))
        };
        let answer = match patience {
            Some(p) => tokio::time::timeout(p, exchange).await.ok(),
            None => Some(exchange.await),
        };
        record.latency_ms = self.elapsed_ms() - sent;
        match answer {
            None => record.connection_held = false,
            Some(Err(e)) => record.first_failure = Some(Failure::NoAnswer(e.to_string())),
            Some(Ok((status, headers, bytes))) => {
                record.status = Some(status);
                record.read_headers(&headers);
                read_infer_answer(&mut record, &headers, &bytes);
            }
        }
        record
    }

    /// A request of the CPU-only model.
    pub(super) async fn classifier(&self, phase: Phase, id: &str) -> Record {
        self.classifier_of(phase, id, CPU_ONLY, "ok on cpu").await
    }

    /// A request of `model`, a copy of the bundled classifier; its kind starts with the model's
    /// name.
    pub(super) async fn classifier_of(&self, phase: Phase, id: &str, model: &str, expect: &'static str) -> Record {
        let data: Vec<f32> = (0..64 * 16).map(|i| (i % 11) as f32 * 0.1).collect();
        let body = json!({"inputs": [{"name": "features", "shape": [64, 16], "datatype": "FP32", "data": data}]});
        let kind = format!("{model} (cpu only)");
        self.infer_json(phase, id, model, &body, kind, expect).await
    }

    /// A request of a dense model of the residency phase: one row; its kind is the model's name.
    pub(super) async fn dense(&self, phase: Phase, id: &str, model: &str) -> Record {
        let data: Vec<f32> = (0..crate::runtime::onnx::dense::ROWS)
            .map(|i| (i % 5) as f32 * 0.2)
            .collect();
        let body = json!({"inputs": [{"name": "x", "shape": [1, data.len()], "datatype": "FP32", "data": data}]});
        let kind = format!("{model} [1, {}]", crate::runtime::onnx::dense::ROWS);
        self.infer_json(phase, id, model, &body, kind, "200, on either pool")
            .await
    }

    /// An Open Inference Protocol request of `model` in JSON.
    async fn infer_json(
        &self,
        phase: Phase,
        id: &str,
        model: &str,
        body: &Value,
        kind: String,
        expect: &'static str,
    ) -> Record {
        let sent = self.elapsed_ms();
        let mut record = Record::new(phase, id, kind, expect, sent);
        match self
            .client
            .post(format!("{}/v2/models/{model}/infer", self.base))
            .header(REQUEST_ID, id)
            .json(body)
            .send()
            .await
        {
            Ok(response) => {
                record.status = Some(response.status().as_u16());
                record.read_headers(response.headers());
                let headers = response.headers().clone();
                let bytes = response.bytes().await.unwrap_or_default();
                read_infer_answer(&mut record, &headers, &bytes);
            }
            Err(e) => record.first_failure = Some(Failure::NoAnswer(e.to_string())),
        }
        record.latency_ms = self.elapsed_ms() - sent;
        record
    }

    /// A whole (not streamed) generation.
    pub(super) async fn generate(
        &self,
        phase: Phase,
        id: &str,
        path: &str,
        body: &Value,
        expect: &'static str,
    ) -> Record {
        let mut record = Record::new(phase, id, format!("POST {path}"), expect, self.elapsed_ms());
        if let Some(answer) = self.post_json(&mut record, path, body).await {
            record.first_failure = refusal(&answer);
            record.text = answer["choices"][0]["message"]["content"]
                .as_str()
                .or(answer["choices"][0]["text"].as_str())
                .map(str::to_string);
        }
        record
    }

    /// POST `body` as JSON to `path` under `record`'s request id, `record` filled with what came
    /// back (status, headers, latency from its `sent_ms`; no answer at all is its failure): the
    /// answer's JSON (`Null` when it is not JSON), or `None` when nothing answered.
    pub(super) async fn post_json(&self, record: &mut Record, path: &str, body: &Value) -> Option<Value> {
        let sent = self
            .client
            .post(format!("{}{path}", self.base))
            .header(REQUEST_ID, &record.id)
            .json(body)
            .send();
        let answer = match sent.await {
            Ok(response) => {
                record.status = Some(response.status().as_u16());
                record.read_headers(response.headers());
                Some(response.json().await.unwrap_or(Value::Null))
            }
            Err(e) => {
                record.first_failure = Some(Failure::NoAnswer(e.to_string()));
                None
            }
        };
        record.latency_ms = self.elapsed_ms() - record.sent_ms;
        answer
    }

    /// A streamed generation, read to its end: its text, and an error event if one came.
    pub(super) async fn stream(
        &self,
        phase: Phase,
        id: &str,
        path: &str,
        body: &Value,
        headers: &[(&str, &str)],
        expect: &'static str,
    ) -> Record {
        let sent = self.elapsed_ms();
        let mut record = Record::new(phase, id, format!("POST {path} stream"), expect, sent);
        let mut request = self
            .client
            .post(format!("{}{path}", self.base))
            .header(REQUEST_ID, id)
            .json(body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        match request.send().await {
            Ok(response) => {
                record.status = Some(response.status().as_u16());
                record.read_headers(response.headers());
                let text = response.text().await.unwrap_or_default();
                if record.status == Some(200) {
                    read_events(&mut record, &text);
                } else {
                    record.first_failure = refusal(&serde_json::from_str(&text).unwrap_or(Value::Null));
                }
            }
            Err(e) => record.first_failure = Some(Failure::NoAnswer(e.to_string())),
        }
        record.latency_ms = self.elapsed_ms() - sent;
        record
    }
}

/// An Open Inference Protocol answer (JSON, or binary after its JSON header): the retry it
/// reports, or the error it gives.
fn read_infer_answer(record: &mut Record, headers: &reqwest::header::HeaderMap, bytes: &[u8]) {
    let json_len = headers
        .get(HEADER_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
        .unwrap_or(bytes.len());
    let head: Value = serde_json::from_slice(&bytes[..json_len.min(bytes.len())]).unwrap_or(Value::Null);
    if record.status == Some(200) {
        record.retry = head["parameters"]["reason"].as_str().map(str::to_string);
        record.cpu_started_ms = head["parameters"]["retry_started_ms"].as_f64();
    } else {
        record.first_failure = head["error"].as_str().map(|e| Failure::Refused(e.to_string()));
        let text = |field: &str| head[field].as_str().map(str::to_string);
        if head.is_object() {
            record.error = Some(ErrorFields {
                reason: text("reason"),
                retried: head["retried"].as_bool(),
                request_id: text("request_id"),
            });
        }
    }
}

/// An OpenAI-shaped error body's message.
pub(super) fn refusal(answer: &Value) -> Option<Failure> {
    let error = OpenAiError::deserialize(answer).ok()?;
    Some(Failure::Refused(error.error.message))
}

/// A stream's server-sent events: the text it gave, the pool it moved to, and its error event.
fn read_events(record: &mut Record, text: &str) {
    let mut out = String::new();
    record.done = Some(false);
    for data in text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
        record.done = Some(data.trim() == "[DONE]");
        let Ok(event) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        if !event["error"].is_null() {
            let tokens_sent = OpenAiError::deserialize(&event).ok().and_then(|e| e.error.tokens_sent);
            record.first_failure = Some(Failure::StreamError {
                event: event["error"].to_string(),
                tokens_sent,
            });
        }
        if let Some(pool) = event["vramguard"]["pool"].as_str() {
            record.pool = Some(pool.to_string());
        }
        if let Some(piece) = event["choices"][0]["text"]
            .as_str()
            .or(event["choices"][0]["delta"]["content"].as_str())
        {
            out.push_str(piece);
        }
    }
    record.text = Some(out);
}

/// `GET url`, its JSON read as `T`.
pub(super) async fn get_json<T: DeserializeOwned>(client: &reqwest::Client, url: &str) -> Result<T, String> {
    let response = client.get(url).send().await.map_err(|e| e.to_string())?;
    response.json().await.map_err(|e| e.to_string())
}

/// Sample `/status` every 25 ms into the running phase's samples.
pub(super) async fn sample(drill: Arc<Drill>, sampling: Arc<AtomicBool>) {
    while sampling.load(Ordering::Relaxed) {
        // A document it cannot read leaves the phase unsampled, which the report names ("never
        // sampled"); the reason goes to the log.
        let status = drill
            .status()
            .await
            .inspect_err(|e| tracing::debug!(error = %e, "cannot read /status"));
        if let Ok(status) = status {
            let age = status.pools.iter().map(|p| p.queue_oldest_age_ms).max().unwrap_or(0);
            let available = status.host.mem_available_bytes;
            let phase = *drill.phase.lock().unwrap_or_else(|e| e.into_inner());
            if phase == Phase::Residency {
                let mut seen = drill.seen.lock().unwrap_or_else(|e| e.into_inner());
                seen.observe(&status, drill.elapsed_ms());
            }
            let mut samples = drill.samples.lock().unwrap_or_else(|e| e.into_inner());
            let s = samples.entry(phase).or_default();
            s.max_queue_age_ms = s.max_queue_age_ms.max(age);
            if available > 0 {
                s.min_host_available = Some(s.min_host_available.map_or(available, |m| m.min(available)));
            }
            if let Some(device) = status.devices.get(DEVICE) {
                let (used, total) = (device.memory.used_bytes, device.memory.total_bytes);
                if s.max_device_used.is_none_or(|(seen, _)| used > seen) {
                    s.max_device_used = Some((used, total));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
