//! The drill's own server, for a drill without `--target`: in this process, on a loopback
//! port, with the decoder fixture written to a folder of its own and a random admin token.

use std::path::Path;
use std::sync::Arc;

use crate::core::model::BuiltinModel;
use crate::core::scratch::OwnDir;

/// A running server of the drill's config.
pub(super) struct OwnServer {
    pub(super) addr: std::net::SocketAddr,
    pub(super) token: String,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    _dir: TempDir,
}

impl OwnServer {
    /// Write the fixture, validate the config, start the service and listen.
    pub(super) async fn start() -> Result<OwnServer, String> {
        let dir = TempDir::new()?;
        let config = dir.config()?;
        let service = tokio::task::spawn_blocking(move || crate::serve::service::Service::start(config))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("the drill's server did not start: {e}"))?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| format!("cannot listen on loopback: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let token = uuid::Uuid::new_v4().to_string();
        let state = crate::http::AppState::with_admin_token(Arc::new(service), Some(token.clone()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(crate::http::serve(state, listener, async {
            let _ = stopped.await;
        }));
        Ok(OwnServer {
            addr,
            token,
            stop,
            task,
            _dir: dir,
        })
    }

    /// Stop it and wait until it has.
    pub(super) async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// The drill's folder of its own (`vramguard-drill-<pid>-<unique>` in the temp directory),
/// removed when dropped; one an interrupted drill left is removed by the next.
struct TempDir(OwnDir);

impl TempDir {
    fn new() -> Result<TempDir, String> {
        OwnDir::new("drill").map(TempDir).map_err(|e| {
            let temp = std::env::temp_dir();
            format!("cannot create the drill's folder in {}: {e}", temp.display())
        })
    }

    fn path(&self) -> &Path {
        self.0.path()
    }

    /// The drill's config, validated, with the decoder fixture and the dense models written here.
    pub(super) fn config(&self) -> Result<crate::config::Config, String> {
        // The decoder fixture the binary carries, as files: the config is the one a --target
        // serves from a checkout (print_config), with the paths here.
        let decoder = BuiltinModel::Decoder;
        std::fs::write(self.path().join("decoder.onnx"), decoder.bytes()).map_err(|e| e.to_string())?;
        let tokenizer = decoder.tokenizer().expect("the decoder ships its tokenizer");
        std::fs::write(self.path().join("tokenizer.json"), tokenizer).map_err(|e| e.to_string())?;
        super::write_models(self.path())?;
        let path = |file: &str| self.path().join(file).display().to_string();
        let yaml = super::config_yaml(
            &path("decoder.onnx"),
            &path("tokenizer.json"),
            &self.path().display().to_string(),
        );
        let raw: crate::config::RawConfig =
            crate::config::parse_yaml(&yaml, "drill.yaml").map_err(|e| e.to_string())?;
        let mut config = raw.validate("drill.yaml", self.path()).map_err(|e| e.to_string())?;
        // What it optimizes goes with its folder: a drill leaves nothing in the user's cache.
        config.host_tier.optimized_cache = self.path().join("optimized");
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_printed_config_is_a_valid_config() {
        TempDir::new().unwrap().config().unwrap();
        // The printed one, saved at the top of the repository with the models written beside.
        let dir = TempDir::new().unwrap();
        std::fs::create_dir(dir.path().join("models")).unwrap();
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/decoder");
        std::os::unix::fs::symlink(fixture, dir.path().join("models/decoder")).unwrap();
        let written = super::super::write_models(&dir.path().join(super::super::DENSE_DIR)).unwrap();
        assert_eq!(written.len(), 3);
        let raw: crate::config::RawConfig =
            crate::config::parse_yaml(&super::super::print_config(), "drill.yaml").unwrap();
        raw.validate("drill.yaml", dir.path()).unwrap();
    }
}
