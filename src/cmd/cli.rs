//! The command line (`vramguard …`). Each command validates its input fully before doing work;
//! a bad config exits with status 64 before any port is bound.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};

use crate::cmd::exit::EXIT_CONFIG;
use crate::config::{self, Config};
use crate::http::{self, AppState};
use crate::serve::service::Service;
use crate::telemetry::logging::{self, LogFormat};

/// vramguard: accelerator-memory exporter, admission policy and ONNX Runtime worker pools.
#[derive(Debug, Parser)]
#[command(name = "vramguard", version, about)]
pub struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value = "human")]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon: HTTP API, metrics and worker pools.
    Serve {
        /// Config file; without it the embedded default runs (`vramguard config default`).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Override `server.listen`, e.g. `127.0.0.1:9000`.
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
    },
    /// Monitoring only: device, per-process and host memory on /metrics; no pools, no ONNX
    /// Runtime. For accelerators shared with other runtimes (Ollama, llama.cpp, vLLM, PyTorch).
    Exporter {
        /// Config file (its `devices` and `exporter` sections are used, and `server.timeouts` and
        /// `server.max_connections` for its HTTP connections).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Override `exporter.listen` (default 127.0.0.1:9842).
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
    },
    /// Compile, test or try admission policies.
    Policy {
        /// What to do with policies.
        #[command(subcommand)]
        command: PolicyCommand,
    },
    /// Check this installation and say what is wrong, with a fix for each problem: the config
    /// and its policy, ONNX Runtime and its CUDA provider, NVML and who holds each device's
    /// memory, a running server's readiness and admin access, host memory against the reserve.
    /// Exits 1 when a check fails. Put its output (`--json`) in bug reports.
    Doctor {
        /// Config file; without it the embedded default.
        #[arg(long)]
        config: Option<PathBuf>,
        /// The running server to ask, e.g. `http://127.0.0.1:8080` (default: the config's
        /// `server.listen`).
        #[arg(long)]
        url: Option<String>,
        /// Print JSON (every check with its facts) instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// The acceptance drill: squeeze a simulated accelerator while sending real requests
    /// (baseline, pre-admission redirect, rising pressure, an injected allocator failure, a
    /// driver reset and restore, cancellations in the CPU queue, streams failing before and
    /// after their first token, non-replayable requests and a chat with tools, idempotent
    /// retries, three models that do not fit together beside a pinned one), then check the
    /// drill's pass criteria. Exits 1 naming each failed criterion.
    Drill {
        /// A running server started with the drill's config (`--print-config`), e.g.
        /// `http://127.0.0.1:8090`; its admin token comes from VRAMGUARD_ADMIN_TOKEN. Without
        /// it the drill serves itself on loopback.
        #[arg(long)]
        target: Option<String>,
        /// Write the full record (every request, every phase, every criterion) as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Fewer requests per phase: done in under a minute (what `make test` runs).
        #[arg(long)]
        quick: bool,
        /// Print the config of the drill's own server and exit.
        #[arg(long)]
        print_config: bool,
        /// Write the dense models the printed config names into DIR (`drill-models` beside the
        /// config file) and exit.
        #[arg(long, value_name = "DIR")]
        write_models: Option<PathBuf>,
    },
    /// Validate or print configuration.
    Config {
        /// What to do with configuration.
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// A process-isolated pool's worker process. vramguard starts it itself, with the pool's
    /// spec on its standard input; users never type it.
    #[command(hide = true)]
    Worker {
        /// The Unix socket to listen on.
        #[arg(long)]
        socket: PathBuf,
        /// The process that started it: it exits when that one is gone.
        #[arg(long)]
        parent: u32,
        /// The pool it serves (for its process listing and its log lines).
        #[arg(long)]
        pool: String,
    },
}

/// `vramguard policy …`
#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// Compile and lint scripts, then evaluate each once per model and pool of a config (as
    /// `serve` does at start); exits non-zero with file:line:col on error.
    Check {
        /// Policy scripts.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Config whose models, pools, devices and `policy.params` the scripts are tried
        /// against; the embedded default without it.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Run policy test cases (default `policies/tests/`); prints each case and `N passed, N failed`.
    Test {
        /// Case files or folders of them.
        paths: Vec<PathBuf>,
    },
    /// One dry-run decision for a request and state, with the evaluation time.
    Eval {
        /// Policy script.
        file: PathBuf,
        /// A case file: request, state, params (expect is optional).
        #[arg(long)]
        input: PathBuf,
        /// Print JSON instead of YAML.
        #[arg(long)]
        json: bool,
    },
}

/// `vramguard config …`
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate a config file: schema, values, cross-references, model files and signatures.
    Check {
        /// The file.
        file: PathBuf,
    },
    /// Print the embedded default config (as it would run on this machine).
    Default,
}

/// What `command` logs when `RUST_LOG` sets nothing.
fn log_filters(command: &Command) -> logging::Filters {
    let only = |own| logging::Filters { own, workers: None };
    match command {
        // The drill's own server, its worker processes included, logs only what goes wrong and
        // ONNX Runtime nothing (the allocation failures it reports are the drill's own): the
        // report is the output.
        Command::Drill { .. } => logging::Filters {
            own: "error,ort=off",
            workers: Some("error,ort=off"),
        },
        // Its parent logs its lifecycle; a worker says only what goes wrong inside it.
        Command::Worker { .. } => only("warn,ort=error"),
        // Every finding is a line of the report; a log line would only break it up.
        Command::Doctor { .. } => only("off"),
        _ => logging::DEFAULT_FILTERS,
    }
}

/// Run the parsed command line.
pub fn run(cli: Cli) -> ExitCode {
    logging::init_with(cli.log_format, log_filters(&cli.command));
    // Before any thread starts (logging starts none), for every command: a worker runs ONNX
    // Runtime, a drill or doctor reads whole answers.
    crate::telemetry::malloc::set_up_allocators();
    match cli.command {
        Command::Worker { socket, parent, pool } => match crate::pool::process::child::serve(&socket, parent) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(format!("worker for pool `{pool}`: {e}"), crate::cmd::exit::EXIT_FAILED),
        },
        Command::Serve { config, listen } => serve(config, listen),
        Command::Exporter { config, listen } => exporter(config, listen),
        Command::Policy { command } => match command {
            PolicyCommand::Check { files, config } => crate::cmd::policy::check(&files, config.as_deref()),
            PolicyCommand::Test { paths } => crate::cmd::policy::test(&paths),
            PolicyCommand::Eval { file, input, json } => crate::cmd::policy::eval(&file, &input, json),
        },
        Command::Doctor { config, url, json } => {
            crate::cmd::doctor::run(&crate::cmd::doctor::Options { config, url, json })
        }
        Command::Drill {
            target,
            json,
            quick,
            print_config,
            write_models,
        } => {
            if print_config {
                print!("{}", crate::cmd::drill::print_config());
                return ExitCode::SUCCESS;
            }
            if let Some(dir) = write_models {
                return match crate::cmd::drill::write_models(&dir) {
                    Ok(paths) => {
                        for path in paths {
                            println!("{}", path.display());
                        }
                        ExitCode::SUCCESS
                    }
                    Err(e) => fail(e, crate::cmd::exit::EXIT_FAILED),
                };
            }
            drill(crate::cmd::drill::Options {
                target,
                admin_token: std::env::var("VRAMGUARD_ADMIN_TOKEN").ok(),
                json,
                quick,
            })
        }
        Command::Config {
            command: ConfigCommand::Check { file },
        } => config_check(&file),
        Command::Config {
            command: ConfigCommand::Default,
        } => {
            print!(
                "# vramguard embedded default ({})\n{}",
                if crate::device::nvidia_gpu_present() {
                    "NVIDIA GPU found: the `gpu` pool uses CUDA"
                } else {
                    "no NVIDIA GPU: the `gpu` pool is a SIMULATED accelerator"
                },
                config::to_yaml(&config::embedded_raw(crate::device::nvidia_gpu_present()))
            );
            ExitCode::SUCCESS
        }
    }
}

fn drill(options: crate::cmd::drill::Options) -> ExitCode {
    match crate::cmd::drill::run(&options) {
        Ok(report) => {
            print!("{}", report.table());
            if report.passed {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(crate::cmd::exit::EXIT_FAILED)
            }
        }
        Err(e) => fail(format!("the drill could not run: {e}"), crate::cmd::exit::EXIT_FAILED),
    }
}

fn fail(message: impl std::fmt::Display, code: u8) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::from(code)
}

fn load_config(path: Option<&PathBuf>) -> Result<Config, ExitCode> {
    match path {
        Some(p) => Config::load(p).map_err(|e| fail(e, EXIT_CONFIG)),
        None => Ok(Config::embedded(crate::device::nvidia_gpu_present())),
    }
}

fn config_check(file: &PathBuf) -> ExitCode {
    let config = match load_config(Some(file)) {
        Ok(c) => c,
        Err(code) => return code,
    };
    // Loading the models proves the files, signatures and context axes, not just the YAML.
    match Service::start(config) {
        Ok(service) => {
            service.shutdown(std::time::Instant::now() + std::time::Duration::from_secs(1));
            println!(
                "{}: ok ({} models, {} pools)",
                file.display(),
                service.models.len(),
                service.pools.len()
            );
            ExitCode::SUCCESS
        }
        Err(e) => fail(e, EXIT_CONFIG),
    }
}

fn serve(config_path: Option<PathBuf>, listen: Option<std::net::SocketAddr>) -> ExitCode {
    let mut config = match load_config(config_path.as_ref()) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if let Some(addr) = listen {
        config.server.listen = addr;
    }
    let addr = config.server.listen;
    // Before the async runtime: starting the service moves this thread, and so every thread
    // started after it (the runtime's), to `server.cpus`. A signal while the models load ends
    // the process at once; the next start removes what it left in the temp directory.
    let service = match Service::start(config) {
        Ok(e) => Arc::new(e),
        Err(e) => return fail(e, EXIT_CONFIG),
    };
    let state = match AppState::new(service) {
        Ok(state) => state,
        Err(e) => return fail(e, EXIT_CONFIG),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return fail(format!("cannot start the async runtime: {e}"), 1),
    };
    // Handled from here on, before the port is bound: a signal once it serves is a shutdown.
    let stopped = {
        let _in_runtime = runtime.enter();
        crate::cmd::signal::shutdown()
    };
    let result = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let address = listener.local_addr().map_err(|e| e.to_string())?;
        // The admin socket lives as long as the server, and goes with it.
        let stop_admin = tokio_util::sync::CancellationToken::new();
        let socket = match &state.service.config.server.admin_socket {
            config::AdminSocket::Off => None,
            config::AdminSocket::At(path) => Some((http::admin::bind(path)?, path.clone())),
            config::AdminSocket::Default(path) => match http::admin::bind(path) {
                Ok(socket) => Some((socket, path.clone())),
                Err(e) => {
                    tracing::warn!(error = %e, "running without an admin socket; set server.admin_socket to give this instance its own");
                    None
                }
            },
        };
        let admin = socket.map(|(socket, path)| {
            tracing::info!(socket = %path.display(), "admin API on its Unix socket (owner only)");
            tokio::spawn(http::admin::serve_socket(
                Arc::clone(&state),
                socket,
                path,
                stop_admin.clone(),
            ))
        });
        tracing::info!(address = %address, "vramguard serving");
        let shutdown = {
            let stop_admin = stop_admin.clone();
            async move {
                stopped.await;
                stop_admin.cancel();
            }
        };
        let served = http::serve(state, listener, shutdown).await.map_err(|e| e.to_string());
        stop_admin.cancel();
        if let Some(admin) = admin {
            let _ = admin.await;
        }
        served
    });
    match result {
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(e) => fail(e, 1),
    }
}

fn exporter(config_path: Option<PathBuf>, listen: Option<std::net::SocketAddr>) -> ExitCode {
    let config = match &config_path {
        Some(p) => match Config::load_for(p, config::Mode::Exporter) {
            Ok(c) => c,
            Err(e) => return fail(e, EXIT_CONFIG),
        },
        None => {
            let raw: config::RawConfig =
                config::parse_yaml("devices: []\n", "<exporter default>").expect("the exporter default parses");
            raw.validate_for("<exporter default>", std::path::Path::new("."), config::Mode::Exporter)
                .expect("the exporter default is valid")
        }
    };
    let addr = listen.unwrap_or(config.exporter.listen);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(format!("cannot start the async runtime: {e}"), 1),
    };
    let result = runtime.block_on(async move {
        let exporter = tokio::task::spawn_blocking(move || crate::cmd::exporter::Exporter::start(config))
            .await
            .map_err(|e| e.to_string())?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        tracing::info!(address = %listener.local_addr().map_err(|e| e.to_string())?, "vramguard exporter serving");
        exporter
            .serve(listener, crate::cmd::signal::shutdown())
            .await
            .map_err(|e| e.to_string())
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e, 1),
    }
}
