//! `vramguard exporter`: monitoring only, for accelerators shared with other runtimes (Ollama,
//! llama.cpp, vLLM, PyTorch). Device, per-process and host memory on `/metrics` under the same
//! names as `serve`, with no pools and no ONNX Runtime.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, DeviceKind};
use crate::telemetry::exporter::{LiveCollector, Sampler, SnapshotStore, metrics_response};
use crate::telemetry::metrics::ProcessMetrics;
use crate::telemetry::services::ServicesCollector;

/// A running exporter.
pub struct Exporter {
    config: Config,
    metrics: ProcessMetrics,
    registry: Registry,
    store: Arc<SnapshotStore>,
    sampler: Option<Sampler>,
}

impl std::fmt::Debug for Exporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exporter").finish_non_exhaustive()
    }
}

impl Exporter {
    /// Open the memory sources and take a first sample.
    pub fn start(config: Config) -> Exporter {
        for device in &config.devices {
            if matches!(device.kind, DeviceKind::Simulated { .. }) {
                tracing::warn!(
                    device = %device.name,
                    "simulated devices live inside `vramguard serve` (they are ONNX Runtime arenas); not exported here"
                );
            }
        }
        // Only what the sampler and the HTTP server measure: no requests, no policy, no pools,
        // so none of their series that could never move.
        let (metrics, mut registry) = ProcessMetrics::new("none");
        let store = Arc::new(SnapshotStore::default());
        let mut sampler = Sampler::new(
            crate::device::sources(&config),
            config.exporter.services.clone(),
            config.host_reserve,
            metrics.clone(),
            Arc::clone(&store),
        );
        sampler.sample();
        registry.register_collector(Box::new(LiveCollector::new(Arc::clone(&store), Vec::new(), Vec::new())));
        // Every service here is another runtime's: its memory is what its processes use.
        let devices = config
            .devices
            .iter()
            .filter(|d| !matches!(d.kind, DeviceKind::Simulated { .. }))
            .map(|d| d.name.clone())
            .collect();
        registry.register_collector(Box::new(ServicesCollector::new(&config, devices, Arc::clone(&store))));
        Exporter {
            config,
            metrics,
            registry,
            store,
            sampler: Some(sampler),
        }
    }

    /// Serve `/metrics` and `/status` until `shutdown` resolves, behind the same connection
    /// limits as `serve` (`server.timeouts`, `server.max_connections`): the exporter faces the
    /// same slow clients.
    pub async fn serve(
        mut self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let cancel = CancellationToken::new();
        if let Some(sampler) = self.sampler.take() {
            tokio::spawn(sampler.run(
                self.config.exporter.sample_interval,
                cancel.clone(),
                Arc::new(tokio::sync::Notify::new()),
            ));
        }
        let state = Arc::new(Served {
            registry: self.registry,
            store: self.store,
        });
        let app = Router::new()
            .route("/metrics", get(metrics))
            .route("/status", get(status))
            .route("/", get(|| async { "vramguard exporter: see /metrics and /status\n" }))
            .with_state(state);
        let limits = crate::net::conn::Limits::new(&self.config.server, &self.metrics);
        let server = tokio::spawn(crate::net::conn::serve(listener, app, limits, cancel.clone()));
        shutdown.await;
        cancel.cancel();
        server.await.map_err(std::io::Error::other)
    }
}

/// What the HTTP handlers read.
struct Served {
    registry: Registry,
    store: Arc<SnapshotStore>,
}

async fn metrics(State(exporter): State<Arc<Served>>, headers: HeaderMap) -> Response {
    metrics_response(&exporter.registry, &headers)
}

async fn status(State(exporter): State<Arc<Served>>) -> Response {
    let sample = exporter.store.latest();
    axum::Json(json!({
        "mode": "exporter",
        "version": env!("CARGO_PKG_VERSION"),
        "devices": sample.snapshot.devices,
        "processes": sample.snapshot.processes,
        "host": sample.snapshot.host,
        "sample_age_ms": sample.taken_at.map(|t| t.elapsed().as_millis() as u64),
    }))
    .into_response()
}
