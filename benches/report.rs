//! The one table of `make bench`: gathers what the other benches wrote under `target/bench/`
//! (each also runs alone), prints it, and writes it as `target/bench/results.json` and as the
//! Markdown table docs/performance.md shows (`target/bench/results.md`).
//!
//! `cargo bench --bench report` (`make bench` runs it last).

use std::fmt::Write as _;
use std::process::Command;

use serde_json::json;
use vramguard::testing::bench::{BenchFile, Figure, Target, number, out_dir, print_table};

/// The benches, in the order the table shows them.
const BENCHES: [&str; 8] = [
    "policy",
    "estimate",
    "exporter",
    "failover",
    "overhead",
    "isolation",
    "generation",
    "residency",
];

fn markdown(figures: &[Figure]) -> String {
    let mut out = String::from("| figure | median | spread | target | |\n|---|---:|---|---|---|\n");
    for f in figures {
        let target = match f.target {
            Some(Target::AtMost(t)) => format!("≤ {} {}", number(t), f.unit),
            Some(Target::AtLeast(t)) => format!("≥ {} {}", number(t), f.unit),
            None => String::new(),
        };
        let note = if f.note.is_empty() {
            String::new()
        } else {
            format!("; {}", f.note)
        };
        let _ = writeln!(
            out,
            "| {} | {} {} | {}–{} ({}{note}) | {target} | {} |",
            f.name,
            number(f.median),
            f.unit,
            number(f.low),
            number(f.high),
            f.spread,
            f.verdict()
        );
    }
    out
}

fn main() {
    let dir = out_dir(env!("CARGO_TARGET_TMPDIR"));
    let mut files = Vec::new();
    for bench in BENCHES {
        let path = dir.join(format!("{bench}.json"));
        match std::fs::read_to_string(&path) {
            Ok(text) => files.push(serde_json::from_str::<BenchFile>(&text).unwrap()),
            Err(_) => eprintln!("report: no {} (run `cargo bench --bench {bench}`)", path.display()),
        }
    }
    let Some(first) = files.first() else {
        eprintln!("report: nothing to report");
        std::process::exit(1);
    };
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let machine = &first.machine;
    let load: Vec<String> = files
        .iter()
        .map(|f| format!("{} {:.2}→{:.2}", f.bench, f.machine.load_average, f.load_average_after))
        .collect();
    let figures: Vec<Figure> = files.iter().flat_map(|f| f.figures.clone()).collect();
    let header = format!(
        "machine: {}, {} cores; load average (1 min) at start→end of each bench: {}\ncommit {commit}, {:.0} s of benches",
        machine.cpu,
        machine.cores,
        load.join(", "),
        files.iter().map(|f| f.seconds).sum::<f64>()
    );
    println!();
    println!("vramguard benchmarks (make bench)");
    println!("{header}");
    println!();
    print_table(&figures);
    let missed: Vec<&str> = figures
        .iter()
        .filter(|f| f.verdict() == "MISSED")
        .map(|f| f.name.as_str())
        .collect();
    println!();
    println!(
        "{} targets met, {} missed{}",
        figures.iter().filter(|f| f.verdict() == "MET").count(),
        missed.len(),
        if missed.is_empty() {
            String::new()
        } else {
            format!(": {}", missed.join("; "))
        }
    );
    let results = json!({
        "command": "make bench",
        "commit": commit,
        "machine": machine,
        "benches": files,
    });
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(&results).unwrap(),
    )
    .unwrap();
    std::fs::write(dir.join("results.md"), format!("{header}\n\n{}", markdown(&figures))).unwrap();
    println!(
        "written to {} and {}",
        dir.join("results.json").display(),
        dir.join("results.md").display()
    );
}
