//! The real `vramguard` binary as a child process, the way an operator starts it. The binary's
//! path comes from the caller (`env!("CARGO_BIN_EXE_vramguard")`): Cargo tells it only to
//! integration tests and benches, not to this library.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Stdio};
use std::thread::JoinHandle;

use serde_json::Value;

/// A `vramguard` process that said where it listens. Dropping it kills and reaps the process,
/// also while a failed assertion unwinds, so no server outlives its test; a test that stops it
/// itself (SIGTERM, then `child.wait()`) loses nothing, as a reaped child is not signalled.
pub struct Serving {
    /// The process.
    pub child: Child,
    /// The `host:port` it logged.
    pub addr: String,
    /// The thread reading its log, which returns the lines after the one that said where it
    /// listens (its worker processes' too: they share its stderr).
    drain: Option<JoinHandle<Vec<String>>>,
}

impl Serving {
    /// Its `/metrics` text now, asked with `client` (blocking: benches drive it from outside).
    pub fn metrics(&self, client: &reqwest::blocking::Client) -> String {
        client
            .get(format!("http://{}/metrics", self.addr))
            .send()
            .and_then(|r| r.text())
            .unwrap_or_else(|e| panic!("{} does not answer /metrics: {e}", self.addr))
    }

    /// Its log lines after the one that said where it listens, once it has exited (wait for it
    /// first): this waits until its worker processes, which follow it, have closed the log too.
    pub fn log_after_exit(&mut self) -> Vec<String> {
        let drain = self.drain.take().expect("the log is read once");
        drain.join().expect("the log reader does not panic")
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Run `bin` with JSON logs, `args` and the test cache ([`super::cache_home`]; `env` may name
/// another) from the project root, and wait for the log line
/// `message`, whose `address` says where it listens (a server on port 0 says so only there).
/// The log keeps being drained afterwards, so the child never blocks on a full pipe, and kept
/// ([`Serving::log_after_exit`]).
pub fn spawn_serving(bin: &str, args: &[&str], env: &[(&str, &str)], message: &str) -> Serving {
    spawn_serving_in(Path::new(env!("CARGO_MANIFEST_DIR")), bin, args, env, message)
}

/// [`spawn_serving`] with `dir` as the working directory (what a path relative to it, or
/// looked for in it, finds).
pub fn spawn_serving_in(dir: &Path, bin: &str, args: &[&str], env: &[(&str, &str)], message: &str) -> Serving {
    let mut child = super::vramguard_command(bin)
        .current_dir(dir)
        .args(["--log-format", "json"])
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("start {bin}: {e}"));
    let mut lines = BufReader::new(child.stderr.take().expect("piped stderr")).lines();
    let addr = loop {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("{bin} {args:?} exited before logging `{message}`"))
            .expect("read the child's log");
        let log: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        if log["message"] == message {
            break log["address"].as_str().expect("an address in the log line").to_string();
        }
    };
    let drain = std::thread::spawn(move || lines.map_while(Result::ok).collect());
    Serving {
        child,
        addr,
        drain: Some(drain),
    }
}
