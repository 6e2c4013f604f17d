//! What one run's crossing to a worker process costs, without HTTP: the bundled encoder run
//! back to back on ONNX Runtime in this process (`OrtBackend`), and on the same session options
//! in a worker process (`ProcessBackend`, the socket and shared memory), at seq 128 and 1024.
//!
//! `cargo bench --bench crossing [-- --runs N]`. For each it reports the median wall time of a
//! run and the CPU time a run costs both processes together (this one's, plus the worker's from
//! `/proc/<pid>/stat`): on a machine whose cores are all busy, the CPU a crossing adds is what
//! it takes from throughput, and CPU time is less disturbed than wall time by other work.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vramguard::core::backend::{Backend, RunMeta};
use vramguard::core::model::BuiltinModel;
use vramguard::core::tensor::{Tensor, TensorData};
use vramguard::pool::process::{ProcessBackend, WorkerHost};
use vramguard::runtime::onnx::{OrtBackend, SessionOptions};
use vramguard::testing::bench::{ENCODER_DIM, arg, encoder_input};

const SEQS: [usize; 2] = [128, 1024];

/// CPU seconds `pid` has used (user + system), from `/proc/<pid>/stat`.
fn cpu_of(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command's closing parenthesis; utime and stime are the 12th and 13th.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    #[allow(unsafe_code)]
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks / hz
}

/// Median wall time per run and CPU time per run (both processes), over `runs` runs.
fn measure(backend: &mut dyn Backend, seq: usize, runs: usize, worker: Option<u32>) -> (Duration, Duration) {
    let input = Tensor {
        name: "input".into(),
        shape: vec![1, seq as i64, ENCODER_DIM as i64],
        data: TensorData::Fp32(encoder_input(seq)),
    };
    let outputs = ["pooled".to_string()];
    let meta = RunMeta::default();
    for _ in 0..runs / 10 + 5 {
        backend.run("encoder", vec![input.clone()], &outputs, &meta).unwrap();
    }
    let cpu = || cpu_of(std::process::id()) + worker.map_or(0.0, cpu_of);
    let mut times = Vec::with_capacity(runs);
    let cpu_before = cpu();
    for _ in 0..runs {
        let inputs = vec![input.clone()];
        let started = Instant::now();
        backend.run("encoder", inputs, &outputs, &meta).unwrap();
        times.push(started.elapsed());
    }
    let cpu_used = cpu() - cpu_before;
    times.sort();
    (times[runs / 2], Duration::from_secs_f64(cpu_used / runs as f64))
}

fn main() {
    let runs: usize = arg("--runs", 2000);
    let rt = vramguard::runtime::onnx::runtime(None).expect("ONNX Runtime");
    let exe = vramguard::testing::config::built_binary().expect("target/release/vramguard (cargo build --release)");
    let model = BuiltinModel::Encoder.data();
    let options = SessionOptions::quiet_cpu();
    let mut local = OrtBackend::load(rt, &[("encoder".to_string(), model)], &options).unwrap();
    let spec = vramguard::testing::config::cpu_worker("bench", &rt.library);
    let host: Arc<WorkerHost> = WorkerHost::new(spec, exe, Duration::from_secs(5)).unwrap();
    host.start().unwrap();
    let pid = host.pid().unwrap();
    let mut remote = ProcessBackend::open(&host, &[("encoder".to_string(), model)]).unwrap();
    println!(
        "crossing: bundled encoder, 1 intra-op thread, {runs} runs back to back, this process vs a worker process"
    );
    println!(
        "{:<10} {:>14} {:>14} {:>12} {:>14} {:>14} {:>12}",
        "", "in-process", "worker", "added", "in-process", "worker", "added"
    );
    println!(
        "{:<10} {:>14} {:>14} {:>12} {:>14} {:>14} {:>12}",
        "", "wall µs", "wall µs", "wall µs", "CPU µs", "CPU µs", "CPU µs"
    );
    for seq in SEQS {
        // In turn, twice, so drift of a shared machine shows.
        for _ in 0..2 {
            let (lw, lc) = measure(&mut local, seq, runs, None);
            let (rw, rc) = measure(&mut remote, seq, runs, Some(pid));
            let us = |d: Duration| d.as_secs_f64() * 1e6;
            println!(
                "seq {seq:<6} {:>14.1} {:>14.1} {:>12.1} {:>14.1} {:>14.1} {:>12.1}",
                us(lw),
                us(rw),
                us(rw) - us(lw),
                us(lc),
                us(rc),
                us(rc) - us(lc)
            );
        }
    }
    host.stop();
}
