//! Nothing left behind in the temp directory: a server stopped by SIGTERM or SIGINT removes its
//! worker sockets' folder and its admin socket's, an interrupted drill removes its own, and the
//! folder of a server killed with SIGKILL (which cannot clean up) is removed by the next start.
//! Each process gets a temp directory and runtime directory of its own (`TMPDIR`,
//! `XDG_RUNTIME_DIR`), so tests running beside it cannot add or take folders from the count.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vramguard::testing::Scratch;

/// What `vramguard` made in `dir`, sorted.
fn ours(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("vramguard"))
        .collect();
    names.sort();
    names
}

/// `vramguard serve` on the embedded default (its simulated accelerator's pool runs in a worker
/// process) with `dir` as its temp and runtime directory.
fn serve(dir: &Path) -> vramguard::testing::process::Serving {
    let dir = dir.to_str().unwrap();
    crate::common::spawn_serving(
        &["serve", "--listen", "127.0.0.1:0"],
        &[("TMPDIR", dir), ("XDG_RUNTIME_DIR", dir)],
        "vramguard serving",
    )
}

fn signal(pid: u32, name: &str) {
    let sent = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success(), "kill -{name} {pid}");
}

#[test]
fn a_server_stopped_by_sigterm_or_sigint_leaves_no_folder() {
    for name in ["TERM", "INT"] {
        let scratch = Scratch::new();
        let mut server = serve(scratch.path());
        let made = ours(scratch.path());
        assert!(
            made.iter().any(|n| n.starts_with("vramguard-workers-")) && made.contains(&"vramguard".to_string()),
            "the worker sockets' and the admin socket's folders while it runs: {made:?}"
        );
        signal(server.child.id(), name);
        assert_eq!(server.child.wait().unwrap().code(), Some(0), "SIG{name}");
        assert_eq!(ours(scratch.path()), Vec::<String>::new(), "after SIG{name}");
    }
}

#[test]
fn what_a_killed_server_left_is_removed_by_the_next_start() {
    let scratch = Scratch::new();
    let mut killed = serve(scratch.path());
    signal(killed.child.id(), "KILL");
    killed.child.wait().unwrap();
    let left = ours(scratch.path());
    assert!(
        left.iter().any(|n| n.starts_with("vramguard-workers-")),
        "SIGKILL cannot clean up: {left:?}"
    );
    // And one of the folders earlier builds named without a kind and never removed (its pid is
    // above the kernel's limit: no process has it).
    let old = scratch
        .path()
        .join(format!("vramguard-9999999-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir(&old).unwrap();
    let mut next = serve(scratch.path());
    let now = ours(scratch.path());
    let workers: Vec<&String> = now.iter().filter(|n| n.starts_with("vramguard-workers-")).collect();
    assert_eq!(workers.len(), 1, "only the running server's: {now:?}");
    assert!(!left.contains(workers[0]), "{left:?} then {now:?}");
    assert!(!old.exists(), "{now:?}");
    signal(next.child.id(), "TERM");
    next.child.wait().unwrap();
    assert_eq!(ours(scratch.path()), Vec::<String>::new());
}

#[test]
fn an_interrupted_drill_removes_its_folders() {
    let scratch = Scratch::new();
    let mut drill = crate::common::binary()
        .args(["drill", "--quick"])
        .env("TMPDIR", scratch.path())
        .env("XDG_RUNTIME_DIR", scratch.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Interrupted once its own server runs: its models' folder and its workers' are there.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let made = ours(scratch.path());
        if made.iter().any(|n| n.starts_with("vramguard-drill-"))
            && made.iter().any(|n| n.starts_with("vramguard-workers-"))
        {
            break;
        }
        assert!(Instant::now() < deadline, "the drill's server never started: {made:?}");
        assert!(
            drill.try_wait().unwrap().is_none(),
            "the drill ended before its server ran"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    signal(drill.id(), "INT");
    let status = drill.wait().unwrap();
    assert_ne!(status.code(), Some(0), "an interrupted drill did not pass");
    assert_eq!(ours(scratch.path()), Vec::<String>::new());
}
