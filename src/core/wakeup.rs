//! A limit on how long an idle CPU may take to wake up, held while requests are in flight
//! (`server.cpu_wake_latency`), through Linux's CPU latency QoS request: the process writes the
//! limit to `/dev/cpu_dma_latency`, and the kernel keeps every CPU out of idle states that take
//! longer to leave, until the value is changed or the file is closed (by the process exiting,
//! crash included, so a limit never outlives its holder).
//!
//! Why: every request crosses threads twice (the connection's to a pool's worker and back),
//! and each crossing wakes a thread whose CPU went idle meanwhile. Leaving a deep idle state
//! takes tens to hundreds of µs (C6 on server CPUs; a halted vCPU, which exits to the
//! hypervisor), which the in-process runtime never pays. On the 2-core VM of the overhead
//! bench a limit of 0 µs (idle CPUs poll instead of halting) took the seq-1024 answer's
//! hand-back from ~90 to ~20 µs and seq-128 saturated throughput from 6090–6400 to
//! 6730–6950 req/s (docs/performance.md). What it costs: idle CPUs stay in shallow states, or
//! poll at 0, while the server is busy and for [`HOLD`] after, so it is for hosts that serve
//! inference first; absent, idle states are the kernel's choice.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The kernel's CPU latency QoS request file.
pub const DEVICE: &str = "/dev/cpu_dma_latency";
/// How long the limit stays after the last request ends: a client's next request, and
/// its answer's way out, still see it.
pub const HOLD: Duration = Duration::from_secs(1);
/// What the kernel reads as no limit (`PM_QOS_CPU_LATENCY_DEFAULT_VALUE`: 2000 s in µs).
pub const NO_LIMIT_US: i32 = 2_000_000_000;

/// A CPU wake-up latency limit, held while any [`Busy`] from it lives and lifted a hold after
/// the last one ends. Dropping it, and its requests, closes the file: the kernel lifts it then.
#[derive(Debug)]
pub struct WakeLimit {
    shared: Arc<Shared>,
    relaxer: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    limit_us: i32,
    hold: Duration,
    /// Requests in flight.
    busy: AtomicUsize,
    /// Whether the limit is written (the file holds `limit_us`, not [`NO_LIMIT_US`]).
    held: AtomicBool,
    epoch: Instant,
    /// When the last request ended, in ns since `epoch`.
    last_end_ns: AtomicU64,
    file: Mutex<Holder>,
    /// Signalled when the limit is written, and when the owner goes.
    changed: Condvar,
}

#[derive(Debug)]
struct Holder {
    file: File,
    closed: bool,
    /// A write failed once already (warned once, not per request).
    warned: bool,
}

impl WakeLimit {
    /// Open `path` (the kernel's [`DEVICE`] in production) to limit wake-ups to `limit` while
    /// busy and for `hold` after. Nothing is limited until the first request.
    pub fn open(path: &Path, limit: Duration, hold: Duration) -> Result<WakeLimit, String> {
        let file = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        let shared = Arc::new(Shared {
            limit_us: i32::try_from(limit.as_micros()).unwrap_or(i32::MAX).min(NO_LIMIT_US),
            hold,
            busy: AtomicUsize::new(0),
            held: AtomicBool::new(false),
            epoch: Instant::now(),
            last_end_ns: AtomicU64::new(0),
            file: Mutex::new(Holder {
                file,
                closed: false,
                warned: false,
            }),
            changed: Condvar::new(),
        });
        let relaxer = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("wake-limit".into())
                .spawn(move || shared.relax_when_idle())
                .map_err(|e| format!("cannot start the thread that lifts the limit: {e}"))?
        };
        Ok(WakeLimit {
            shared,
            relaxer: Some(relaxer),
        })
    }

    /// A request starts: the limit is written if it is not held already, and stays until a
    /// hold after the last request ends.
    pub fn busy(&self) -> Busy {
        let shared = &self.shared;
        // Paired with the relaxer, which clears `held` before it reads `busy`: either it sees
        // this request, or this request sees the limit lifted and writes it again.
        shared.busy.fetch_add(1, Ordering::SeqCst);
        if !shared.held.load(Ordering::SeqCst) {
            let mut holder = shared.lock();
            if !shared.held.load(Ordering::SeqCst) {
                holder.write(shared.limit_us);
                shared.held.store(true, Ordering::SeqCst);
                shared.changed.notify_all();
            }
        }
        Busy(Arc::clone(shared))
    }

    /// Whether the limit is written now.
    #[cfg(test)]
    fn is_held(&self) -> bool {
        self.shared.held.load(Ordering::SeqCst)
    }
}

impl Drop for WakeLimit {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.changed.notify_all();
        if let Some(relaxer) = self.relaxer.take() {
            let _ = relaxer.join();
        }
    }
}

/// One request in flight under a [`WakeLimit`].
#[derive(Debug)]
pub struct Busy(Arc<Shared>);

impl Drop for Busy {
    fn drop(&mut self) {
        let shared = &self.0;
        let now = shared.epoch.elapsed().as_nanos() as u64;
        shared.last_end_ns.fetch_max(now, Ordering::SeqCst);
        shared.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Holder> {
        self.file.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The relaxer's loop: lifts the limit once no request has been in flight for the hold. While
    /// requests are in flight it looks again every hold, so it wakes before the last one's hold
    /// is over and lifts the limit on time.
    fn relax_when_idle(&self) {
        let mut holder = self.lock();
        while !holder.closed {
            if !self.held.load(Ordering::SeqCst) {
                holder = self.changed.wait(holder).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            let wait = if self.busy.load(Ordering::SeqCst) > 0 {
                Some(self.hold)
            } else {
                let idle = self
                    .epoch
                    .elapsed()
                    .saturating_sub(Duration::from_nanos(self.last_end_ns.load(Ordering::SeqCst)));
                (idle < self.hold).then(|| self.hold - idle)
            };
            if let Some(wait) = wait {
                holder = self
                    .changed
                    .wait_timeout(holder, wait)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                continue;
            }
            self.held.store(false, Ordering::SeqCst);
            if self.busy.load(Ordering::SeqCst) > 0 {
                // A request came in between: it saw the limit held and wrote nothing.
                self.held.store(true, Ordering::SeqCst);
                continue;
            }
            holder.write(NO_LIMIT_US);
        }
    }
}

impl Holder {
    fn write(&mut self, value_us: i32) {
        if let Err(e) = self.file.write_all(&value_us.to_ne_bytes())
            && !std::mem::replace(&mut self.warned, true)
        {
            tracing::warn!(error = %e, value_us, "cannot change the CPU wake-up latency limit; it stays as it was");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOLD_FOR_TESTS: Duration = Duration::from_millis(50);

    /// The values written so far, in order (a regular file keeps every write; the kernel's
    /// device keeps the last).
    fn written(path: &Path) -> Vec<i32> {
        std::fs::read(path)
            .unwrap()
            .chunks_exact(4)
            .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
            .collect()
    }

    /// Waits up to 5 s for the writes to be `want`.
    fn until_written(path: &Path, want: &[i32]) -> Vec<i32> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let got = written(path);
            if got == want || Instant::now() > deadline {
                return got;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// An empty file standing for the kernel's device, removed when dropped.
    struct LimitFile(std::path::PathBuf);

    impl Drop for LimitFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn limit_file() -> (LimitFile, std::path::PathBuf) {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "vramguard-wakeup-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, b"").unwrap();
        (LimitFile(path.clone()), path)
    }

    #[test]
    fn the_limit_is_held_from_the_first_request_until_a_hold_after_the_last() {
        let (_dir, path) = limit_file();
        let limit = WakeLimit::open(&path, Duration::from_micros(20), HOLD_FOR_TESTS).unwrap();
        assert!(written(&path).is_empty(), "nothing is limited before a request");
        let first = limit.busy();
        let second = limit.busy();
        assert_eq!(written(&path), [20], "written once, by the first request");
        drop(first);
        std::thread::sleep(HOLD_FOR_TESTS * 3);
        assert_eq!(written(&path), [20], "held while a request is in flight");
        let ended = Instant::now();
        drop(second);
        assert_eq!(until_written(&path, &[20, NO_LIMIT_US]), [20, NO_LIMIT_US]);
        assert!(ended.elapsed() >= HOLD_FOR_TESTS, "lifted only after the hold");
        assert!(!limit.is_held());
        drop(limit.busy());
        assert_eq!(
            until_written(&path, &[20, NO_LIMIT_US, 20, NO_LIMIT_US]),
            [20, NO_LIMIT_US, 20, NO_LIMIT_US]
        );
    }

    #[test]
    fn requests_racing_the_lift_never_run_without_the_limit() {
        let (_file, path) = limit_file();
        let hold = Duration::from_micros(200);
        let limit = Arc::new(WakeLimit::open(&path, Duration::ZERO, hold).unwrap());
        let rounds = Arc::new(std::sync::Barrier::new(4));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let (limit, path, rounds) = (Arc::clone(&limit), path.clone(), Arc::clone(&rounds));
                std::thread::spawn(move || {
                    for round in 0..300u64 {
                        rounds.wait();
                        // Arrivals spread around the moment the hold of the last round ends.
                        std::thread::sleep(hold * ((round * 7 + t * 3) % 5) as u32 / 2);
                        let busy = limit.busy();
                        assert_eq!(written(&path).last(), Some(&0), "a request in flight without the limit");
                        std::thread::sleep(Duration::from_micros((round + t) % 3 * 50));
                        drop(busy);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let writes = written(&path);
        assert!(writes.len() >= 3, "lifted between rounds: {} writes", writes.len());
        assert!(
            writes.windows(2).all(|w| w[0] != w[1]),
            "each write changes the limit: {writes:?}"
        );
        assert_eq!(writes[0], 0);
        let lifted = [writes.as_slice(), &[NO_LIMIT_US]].concat();
        let settled = until_written(&path, if writes.last() == Some(&0) { &lifted } else { &writes });
        assert_eq!(settled.last(), Some(&NO_LIMIT_US), "lifted once all ended");
    }

    #[test]
    fn dropping_it_stops_its_thread_even_while_held() {
        let (_dir, path) = limit_file();
        let limit = WakeLimit::open(&path, Duration::ZERO, Duration::from_secs(3600)).unwrap();
        drop(limit.busy());
        let started = Instant::now();
        drop(limit);
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_file_it_cannot_open_is_named() {
        let err = WakeLimit::open(Path::new("/nonexistent/cpu_dma_latency"), Duration::ZERO, HOLD).unwrap_err();
        assert!(err.starts_with("cannot open /nonexistent/cpu_dma_latency: "), "{err}");
    }
}
