//! What a pool and its worker process say to each other over a Unix socket: frames of a small
//! JSON header followed by the raw little-endian bytes of the tensors (and model files) the
//! header lists, so a tensor crosses as one copy into the socket and one out, never as text.
//!
//! A frame is `u32` header length, `u64` payload length, the header, then the payload: the
//! blobs the header names, back to back, in its order.

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

use crate::core::backend::{AllocFailureKind, ArenaStats, BackendError};
use crate::core::model::{ModelBytes, ModelData};
use crate::core::tensor::{DataType, Tensor, TensorView};

/// How many lanes (pool backends) share a session connection's sessions; each has its own
/// shared memory.
pub const LANES: usize = 2;

/// Longest header accepted: headers carry names and shapes, never data.
const MAX_HEADER: usize = 16 << 20;
/// Longest payload accepted (model files included).
const MAX_PAYLOAD: u64 = 64 << 30;

/// A tensor in a frame's header; its bytes are the payload's next `bytes`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TensorHead {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
    pub bytes: u64,
}

/// A model in a frame's header: its graph's bytes are the payload's next `bytes`, unless they lie
/// in the pool process's shared memory (`shared`), which the worker maps instead; its external
/// data the worker reads from `folder` itself (the same machine), not through the socket.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelHead {
    /// The model's name.
    pub name: String,
    /// Its graph's length in the payload (0 when `shared`).
    pub bytes: u64,
    /// The pool process's descriptor of the sealed memfd that holds the graph (the host tier's
    /// ORT-format bytes, see [`ModelBytes::shared_fd`]): the worker maps
    /// `/proc/<pool's pid>/fd/<fd>`, and the bytes cross no socket.
    pub shared: Option<i32>,
    /// Its file's folder ([`ModelData::folder`]).
    pub folder: Option<std::path::PathBuf>,
    /// [`ModelData::external_bytes`].
    pub external_bytes: u64,
    /// [`ModelData::file`]: the worker builds the session from that file, mapping the same
    /// weights as every other process that loads it (the graph still comes as the blob, a few
    /// KiB, for what reads it).
    pub file: Option<std::path::PathBuf>,
}

impl ModelHead {
    /// The head of model `name`, sent with `data.graph` as its blob.
    pub fn of(name: &str, data: ModelData<'_>) -> ModelHead {
        ModelHead {
            name: name.to_string(),
            bytes: ModelHead::blob(&data).len() as u64,
            shared: data.owned_by().and_then(ModelBytes::shared_fd),
            folder: data.folder.map(std::path::Path::to_path_buf),
            external_bytes: data.external_bytes,
            file: data.file.map(std::path::Path::to_path_buf),
        }
    }

    /// What is sent with the head of `data` as its blob: its graph, unless the worker maps it
    /// from shared memory.
    pub fn blob<'a>(data: &ModelData<'a>) -> &'a [u8] {
        match data.owned_by().and_then(ModelBytes::shared_fd) {
            Some(_) => &[],
            None => data.graph,
        }
    }

    /// The graph as bytes of its own when it is an ORT-format graph (the optimized cache's): a
    /// session then uses its initializers where they lie and keeps them
    /// (`runtime::onnx::build_held`), which a borrowed blob would not allow. Mapped from the
    /// pool process `parent`'s shared memory when it lies there, else copied from the blob that
    /// came with this head. An ONNX graph is read from the blob ([`ModelHead::data`]).
    pub fn owned(&self, graph: &[u8], parent: u32) -> Result<Option<ModelBytes>, String> {
        let bytes = match self.shared {
            Some(fd) => {
                let path = format!("/proc/{parent}/fd/{fd}");
                let mapping = crate::runtime::onnx::Mapping::of(std::path::Path::new(&path))
                    .map_err(|e| format!("model `{}`: the pool's shared graph: {e}", self.name))?;
                ModelBytes::shared(mapping)
            }
            None if crate::runtime::onnx::is_ort_format(graph) => ModelBytes::inline(graph.to_vec()),
            None => return Ok(None),
        };
        if !crate::runtime::onnx::is_ort_format(bytes.data().graph) {
            return Err(format!(
                "model `{}`: the pool's shared graph is not an ORT-format graph",
                self.name
            ));
        }
        Ok(Some(
            bytes
                .with_external_bytes(self.external_bytes)
                .in_folder(self.folder.as_deref()),
        ))
    }

    /// The model again, its graph the blob that came with this head.
    pub fn data<'a>(&'a self, graph: &'a [u8]) -> ModelData<'a> {
        ModelData {
            graph,
            folder: self.folder.as_deref(),
            external_bytes: self.external_bytes,
            owner: None,
            file: self.file.as_deref(),
        }
    }
}

/// What the pool asks of a session connection (one per pool worker, holding its sessions).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Ask {
    /// First frame of a session connection: build a session for each model, their graphs the
    /// payload's blobs in order.
    Open { models: Vec<ModelHead> },
    /// First frame of the control connection.
    Control,
    /// Run `model` on the inputs (the payload, or the start of `lane`'s input region when
    /// `shared`); `stats`: read the arena after it. `seq` is its number, for interrupts.
    Run {
        model: String,
        outputs: Vec<String>,
        inputs: Vec<TensorHead>,
        stats: bool,
        shared: bool,
        lane: usize,
        seq: u64,
        /// A plain run, a generation's prompt or its batched step (whose caches the worker keeps).
        op: crate::pool::RunOp,
    },
    /// Map the pool's shared memory `fd` (`len` bytes) as `lane`'s region for a run's inputs
    /// (`to_worker`) or its outputs, in place of the one it had.
    Region {
        lane: usize,
        to_worker: bool,
        fd: i32,
        len: u64,
    },
    /// Read the arena of `model`'s session (or any).
    Stats { model: Option<String> },
    /// Build (or replace) `model`'s session, its graph the payload.
    Load { model: ModelHead },
    /// Drop `name`'s session.
    Unload { name: String },
    /// Give the allocator's free memory back, running each listed model once on its inputs
    /// (the payload) if it needs to.
    Release { probes: Vec<(String, Vec<TensorHead>)> },
    /// Control: are you there? The answer carries the simulated device's state.
    Ping,
    /// First frame of a session's interrupt connection (`seq` 0), then on it: stop run `seq`
    /// of session `session` (the one going, or the next before it starts).
    Interrupt { session: u64, seq: u64 },
    /// Control: change the simulated device (only what is given).
    Sim(SimChange),
}

/// A change to the worker's simulated device.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SimChange {
    pub pressure: Option<u64>,
    pub fail_next: Option<u64>,
    pub pass_first: Option<u64>,
    /// Set only: in a worker, a driver fault is sticky until the worker is replaced.
    pub driver_reset: bool,
    /// Stop answering: the heartbeat and every run hang from now on.
    pub hang: bool,
}

/// The worker's simulated device as it is now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimState {
    pub pressure: u64,
    pub fail_next: u64,
    pub pass_first: u64,
    pub driver_reset: bool,
    /// The shared arena's statistics, pressure included.
    pub arena: Option<WireStats>,
}

/// [`ArenaStats`] on the wire.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireStats {
    pub reserved: u64,
    pub active: u64,
    pub peak: u64,
    pub allocations: u64,
    pub reserves: u64,
    pub extensions: u64,
    pub shrinkages: u64,
    pub limit: Option<u64>,
}

impl From<ArenaStats> for WireStats {
    fn from(s: ArenaStats) -> Self {
        WireStats {
            reserved: s.reserved_bytes,
            active: s.active_bytes,
            peak: s.peak_active_bytes,
            allocations: s.allocations,
            reserves: s.reserves,
            extensions: s.extensions,
            shrinkages: s.shrinkages,
            limit: s.limit_bytes,
        }
    }
}

impl From<WireStats> for ArenaStats {
    fn from(s: WireStats) -> Self {
        ArenaStats {
            reserved_bytes: s.reserved,
            active_bytes: s.active,
            peak_active_bytes: s.peak,
            allocations: s.allocations,
            reserves: s.reserves,
            extensions: s.extensions,
            shrinkages: s.shrinkages,
            limit_bytes: s.limit,
        }
    }
}

/// A [`BackendError`] of the worker's, on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum WireError {
    Oom(String),
    Driver(String),
    InvalidInput(String),
    Runtime(String),
    Cancelled,
    Panicked(String),
    CacheMissing(Vec<u64>),
}

impl From<&BackendError> for WireError {
    fn from(e: &BackendError) -> Self {
        match e {
            BackendError::Allocation {
                kind: AllocFailureKind::Oom,
                message,
            } => WireError::Oom(message.clone()),
            BackendError::Allocation {
                kind: AllocFailureKind::Driver,
                message,
            } => WireError::Driver(message.clone()),
            BackendError::InvalidInput(m) => WireError::InvalidInput(m.clone()),
            BackendError::Cancelled => WireError::Cancelled,
            BackendError::Panicked(m) => WireError::Panicked(m.clone()),
            BackendError::CacheMissing(seqs) => WireError::CacheMissing(seqs.clone()),
            other => WireError::Runtime(other.to_string()),
        }
    }
}

impl From<WireError> for BackendError {
    fn from(e: WireError) -> Self {
        match e {
            WireError::Oom(message) => BackendError::Allocation {
                kind: AllocFailureKind::Oom,
                message,
            },
            WireError::Driver(message) => BackendError::Allocation {
                kind: AllocFailureKind::Driver,
                message,
            },
            WireError::InvalidInput(m) => BackendError::InvalidInput(m),
            WireError::Runtime(m) => BackendError::Runtime(m),
            WireError::Cancelled => BackendError::Cancelled,
            WireError::Panicked(m) => BackendError::Panicked(m),
            WireError::CacheMissing(seqs) => BackendError::CacheMissing(seqs),
        }
    }
}

/// The worker's answer to one [`Ask`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Answer {
    /// Done; for `Open`, the session connection's id (for `Interrupt`).
    Done { session: Option<u64> },
    /// A run's outputs (the payload, or the start of its lane's output region when `shared`),
    /// and the arena after it when asked, with all the lane's arenas summed (`held`).
    Ran {
        outputs: Vec<TensorHead>,
        stats: Option<WireStats>,
        held: Option<WireStats>,
        shared: bool,
    },
    /// A run (or a load) failed.
    Failed(WireError),
    /// Could not do what was asked (a load that failed, a bad frame).
    Refused(String),
    /// Arena statistics: the arena asked about, and all the lane's summed.
    Stats {
        last: Option<WireStats>,
        held: Option<WireStats>,
    },
    /// The simulated device (or its absence).
    Sim(Option<SimState>),
}

/// What `poll` asks to learn whether `stream` has bytes to read.
fn poll_in(stream: &impl std::os::fd::AsRawFd) -> libc::pollfd {
    libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }
}

/// `poll` of `stream` for bytes to read, without waiting: 1 when it has some (or is closed), 0
/// when not, -1 when poll failed.
#[allow(unsafe_code)]
fn poll_now(stream: &impl std::os::fd::AsRawFd) -> i32 {
    let mut poll = poll_in(stream);
    // SAFETY: one valid pollfd, a timeout of 0: poll only reads the descriptor's state.
    unsafe { libc::poll(&mut poll, 1, 0) }
}

/// Wait up to `budget` for `stream` to have bytes to read without sleeping, yielding the core
/// between looks.
pub fn spin_until_readable(stream: &impl std::os::fd::AsRawFd, budget: std::time::Duration) {
    let started = std::time::Instant::now();
    // A failed poll ends the look as bytes do: the read that follows reports it.
    while poll_now(stream) == 0 && started.elapsed() < budget {
        std::thread::yield_now();
    }
}

/// Sleep until `stream` has bytes to read or `timeout` has passed, whichever comes first.
#[allow(unsafe_code)]
pub fn wait_readable(stream: &impl std::os::fd::AsRawFd, timeout: std::time::Duration) {
    let mut poll = poll_in(stream);
    // `poll` counts whole milliseconds; `ppoll` takes the timeout to the nanosecond.
    let timeout = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: one valid pollfd, a valid timespec and no signal mask: ppoll only reads them and
    // the descriptor's state. An interrupted or failed wait only ends the wait early.
    unsafe { libc::ppoll(&mut poll, 1, &timeout, std::ptr::null()) };
}

/// Write one frame: `header`, then `blobs` as its payload.
pub fn write_frame<T: Serialize>(out: &mut impl Write, header: &T, blobs: &[&[u8]]) -> std::io::Result<()> {
    let head = serde_json::to_vec(header).map_err(std::io::Error::other)?;
    let payload: u64 = blobs.iter().map(|b| b.len() as u64).sum();
    let mut prefix = [0u8; 12];
    prefix[..4].copy_from_slice(&(head.len() as u32).to_le_bytes());
    prefix[4..].copy_from_slice(&payload.to_le_bytes());
    // Small frames go out in one write (one syscall); large blobs are written where they lie.
    let mut first = Vec::with_capacity(12 + head.len() + if payload < 65536 { payload as usize } else { 0 });
    first.extend_from_slice(&prefix);
    first.extend_from_slice(&head);
    if payload < 65536 {
        for blob in blobs {
            first.extend_from_slice(blob);
        }
        return out.write_all(&first);
    }
    out.write_all(&first)?;
    for blob in blobs {
        out.write_all(blob)?;
    }
    Ok(())
}

/// Read one frame: its header and its payload.
pub fn read_frame<T: for<'de> Deserialize<'de>>(input: &mut impl Read) -> std::io::Result<(T, Vec<u8>)> {
    let mut payload = Vec::new();
    let header = read_frame_into(input, &mut payload)?;
    Ok((header, payload))
}

/// [`read_frame`], its payload read into `payload` (whose allocation is kept from frame to
/// frame: a fresh large one costs a page fault per page, each run).
pub fn read_frame_into<T: for<'de> Deserialize<'de>>(
    input: &mut impl Read,
    payload: &mut Vec<u8>,
) -> std::io::Result<T> {
    let mut prefix = [0u8; 12];
    input.read_exact(&mut prefix)?;
    let head_len = u32::from_le_bytes(prefix[..4].try_into().expect("4 bytes")) as usize;
    let payload_len = u64::from_le_bytes(prefix[4..].try_into().expect("8 bytes"));
    if head_len > MAX_HEADER || payload_len > MAX_PAYLOAD {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a frame of {head_len} header bytes and {payload_len} payload bytes is over the limits"),
        ));
    }
    let mut head = vec![0u8; head_len];
    input.read_exact(&mut head)?;
    let header = serde_json::from_slice(&head).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    payload.clear();
    payload.resize(payload_len as usize, 0);
    input.read_exact(payload)?;
    Ok(header)
}

/// The heads of `tensors`, their bytes written back to back into `bytes` (cleared first; its
/// allocation is kept from run to run), for a frame whose one blob is `bytes`.
pub fn encode_tensors_into(tensors: &[Tensor], bytes: &mut Vec<u8>) -> Vec<TensorHead> {
    bytes.clear();
    tensors
        .iter()
        .map(|t| {
            t.data.write_le_bytes(bytes);
            head(t)
        })
        .collect()
}

/// The heads of `tensors`, their bytes written back to back from the start of `region`, or
/// `None` when they do not fit there.
pub fn encode_tensors_at(tensors: &[Tensor], region: &mut [u8]) -> Option<Vec<TensorHead>> {
    if tensor_bytes(tensors) > region.len() {
        return None;
    }
    let mut at = 0;
    let heads = tensors
        .iter()
        .map(|t| {
            let len = t.data.byte_len();
            t.data.write_le_bytes_to(&mut region[at..at + len]);
            at += len;
            head(t)
        })
        .collect();
    Some(heads)
}

/// `t`'s head: its bytes are its elements' little-endian encoding.
fn head(t: &Tensor) -> TensorHead {
    TensorHead {
        name: t.name.clone(),
        datatype: t.data.datatype().name().to_string(),
        shape: t.shape.clone(),
        bytes: t.data.byte_len() as u64,
    }
}

/// The bytes `tensors` take on the wire.
pub fn tensor_bytes(tensors: &[Tensor]) -> usize {
    tensors.iter().map(|t| t.data.byte_len()).sum()
}

/// The heads of `tensors` and their bytes, for a frame.
pub fn encode_tensors(tensors: &[Tensor]) -> (Vec<TensorHead>, Vec<Vec<u8>>) {
    tensors
        .iter()
        .map(|t| {
            let mut bytes = Vec::with_capacity(t.data.byte_len());
            t.data.write_le_bytes(&mut bytes);
            (head(t), bytes)
        })
        .unzip()
}

/// The tensors `heads` describe, read from `payload` starting at `*at` (moved past them).
pub fn decode_tensors(heads: &[TensorHead], payload: &[u8], at: &mut usize) -> Result<Vec<Tensor>, String> {
    decode_views(heads, payload, at)?
        .iter()
        .map(TensorView::to_tensor)
        .collect()
}

/// The tensors `heads` describe, borrowed where they lie in `payload` from `*at` (moved past
/// them), each checked to hold exactly its shape's elements.
pub fn decode_views<'a>(
    heads: &'a [TensorHead],
    payload: &'a [u8],
    at: &mut usize,
) -> Result<Vec<TensorView<'a>>, String> {
    heads
        .iter()
        .map(|head| {
            let datatype = DataType::from_name(&head.datatype)
                .ok_or_else(|| format!("tensor `{}`: unknown datatype `{}`", head.name, head.datatype))?;
            let bytes = take(payload, at, head.bytes)?;
            let elements = Tensor::element_count(&head.shape)
                .ok_or_else(|| format!("tensor `{}`: shape {:?} is not valid", head.name, head.shape))?;
            if elements.checked_mul(datatype.size()) != Some(bytes.len()) {
                return Err(format!(
                    "tensor `{}`: {} bytes for shape {:?} of {datatype}",
                    head.name,
                    bytes.len(),
                    head.shape
                ));
            }
            Ok(TensorView {
                name: &head.name,
                datatype,
                shape: &head.shape,
                bytes,
            })
        })
        .collect()
}

/// The next `len` bytes of `payload` from `*at`.
pub fn take<'a>(payload: &'a [u8], at: &mut usize, len: u64) -> Result<&'a [u8], String> {
    let end = at
        .checked_add(len as usize)
        .filter(|&end| end <= payload.len())
        .ok_or_else(|| {
            format!(
                "a frame's payload of {} bytes is short of what its header lists",
                payload.len()
            )
        })?;
    let bytes = &payload[*at..end];
    *at = end;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::tensor::TensorData;
    use std::time::{Duration, Instant};

    /// The host tier's ORT-format bytes, in a sealed memfd, cross as its descriptor: the worker
    /// maps the same bytes, which nobody can change; a graph on the heap crosses as its bytes.
    #[test]
    fn a_graph_in_shared_memory_crosses_as_its_descriptor_not_its_bytes() {
        let mut graph = vec![7u8; 4096];
        graph[4..8].copy_from_slice(b"ORTM");
        let shared = ModelBytes::shared(crate::runtime::onnx::Mapping::sealed(&graph).unwrap());
        let head = ModelHead::of("m", shared.data());
        assert_eq!(head.bytes, 0);
        assert!(ModelHead::blob(&shared.data()).is_empty());
        let mapped = head
            .owned(&[], std::process::id())
            .unwrap()
            .expect("an ORT-format graph");
        assert_eq!(mapped.data().graph, graph.as_slice());
        let path = format!("/proc/self/fd/{}", head.shared.unwrap());
        let written = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut file| file.write_all(b"changed"));
        assert!(written.is_err(), "sealed: no process can change the bytes");

        let inline = ModelBytes::inline(graph.clone());
        let head = ModelHead::of("m", inline.data());
        assert_eq!((head.bytes, head.shared), (4096, None));
        assert_eq!(ModelHead::blob(&inline.data()), graph.as_slice());
        let copied = head
            .owned(&graph, std::process::id())
            .unwrap()
            .expect("an ORT-format graph");
        assert_eq!(copied.data().graph, graph.as_slice());
        assert!(
            head.owned(&[1, 2, 3, 4, 5, 6, 7, 8], 0).unwrap().is_none(),
            "an ONNX graph is read from the blob"
        );
    }

    #[test]
    fn a_frame_carries_its_header_and_tensors_back_intact() {
        let tensors = vec![
            Tensor {
                name: "input".into(),
                shape: vec![1, 3],
                data: TensorData::Fp32(vec![1.5, -2.0, 3.25]),
            },
            Tensor {
                name: "ids".into(),
                shape: vec![2],
                data: TensorData::Int64(vec![7, -9]),
            },
        ];
        let (heads, blobs) = encode_tensors(&tensors);
        let ask = Ask::Run {
            model: "m".into(),
            outputs: vec![],
            inputs: heads,
            stats: true,
            shared: false,
            lane: 0,
            seq: 1,
            op: crate::pool::RunOp::Decode(crate::core::backend::DecodeStep {
                rows: vec![crate::core::backend::DecodeRow {
                    seq: 4,
                    token: 17,
                    past: 9,
                }],
                ended: vec![3],
                forks: vec![crate::core::backend::Fork {
                    from: 4,
                    to: vec![5, 6],
                }],
            }),
        };
        let refs: Vec<&[u8]> = blobs.iter().map(Vec::as_slice).collect();
        let mut buffer = Vec::new();
        write_frame(&mut buffer, &ask, &refs).unwrap();
        let (back, payload): (Ask, Vec<u8>) = read_frame(&mut buffer.as_slice()).unwrap();
        let Ask::Run { inputs, op, .. } = back else {
            panic!("{back:?}")
        };
        let crate::pool::RunOp::Decode(step) = op else {
            panic!("{op:?}")
        };
        assert_eq!((step.rows[0].token, step.ended.as_slice()), (17, &[3][..]));
        assert_eq!(step.forks[0].to, [5, 6], "a fork reaches the worker process");
        let mut at = 0;
        assert_eq!(decode_tensors(&inputs, &payload, &mut at).unwrap(), tensors);
        assert_eq!(at, payload.len());
    }

    #[test]
    fn views_borrow_the_bytes_and_check_them_against_their_shapes() {
        let tensors = vec![
            Tensor {
                name: "x".into(),
                shape: vec![2, 2],
                data: TensorData::Fp32(vec![1.0, 2.0, 3.0, 4.0]),
            },
            Tensor {
                name: "ids".into(),
                shape: vec![3],
                data: TensorData::Int64(vec![1, -2, 3]),
            },
        ];
        let mut region = vec![0u8; 64];
        let heads = encode_tensors_at(&tensors, &mut region).unwrap();
        let views = decode_views(&heads, &region, &mut 0).unwrap();
        let back: Vec<Tensor> = views.iter().map(|v| v.to_tensor().unwrap()).collect();
        assert_eq!(back, tensors);
        assert_eq!(views[1].bytes.as_ptr(), region[16..].as_ptr());
        // Too small a region is not written past its end.
        assert!(encode_tensors_at(&tensors, &mut [0u8; 39]).is_none());
        let mut wrong = heads.clone();
        wrong[0].shape = vec![3];
        assert!(
            decode_views(&wrong, &region, &mut 0)
                .unwrap_err()
                .contains("16 bytes for shape [3]")
        );
    }

    #[test]
    fn a_short_payload_or_an_oversized_frame_is_an_error_not_a_panic() {
        let heads = vec![TensorHead {
            name: "x".into(),
            datatype: "FP32".into(),
            shape: vec![4],
            bytes: 16,
        }];
        assert!(decode_tensors(&heads, &[0u8; 8], &mut 0).is_err());
        let mut frame = Vec::new();
        frame.extend_from_slice(&u32::MAX.to_le_bytes());
        frame.extend_from_slice(&0u64.to_le_bytes());
        assert!(read_frame::<Ask>(&mut frame.as_slice()).is_err());
    }

    #[test]
    fn a_wait_for_an_answer_ends_when_it_comes_not_at_its_timeout() {
        use std::io::Write as _;
        let (mut worker, lane) = std::os::unix::net::UnixStream::pair().unwrap();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            worker.write_all(b"answer").unwrap();
            worker
        });
        let started = Instant::now();
        // A window guessed from a longer run of the same kind: the answer still ends the wait.
        wait_readable(&lane, Duration::from_secs(60));
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "waited {:?}",
            started.elapsed()
        );
        assert_eq!(poll_now(&lane), 1, "readable when the wait ended");
        drop(writer.join().unwrap());
        // Nothing to read and a short timeout: it returns after it.
        let (_quiet, idle) = std::os::unix::net::UnixStream::pair().unwrap();
        let started = Instant::now();
        wait_readable(&idle, Duration::from_millis(5));
        assert!(started.elapsed() >= Duration::from_millis(5));
    }
}
