//! How a command learns it should stop: SIGINT (Ctrl-C) or SIGTERM (systemd, Kubernetes).

/// Resolves on SIGINT or SIGTERM. The handlers are installed when this is called, not when the
/// future is first polled, so a signal that comes before is not the default action's (an exit
/// that cleans nothing up) but wakes the future. Call it inside the async runtime.
pub fn shutdown() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let installed = signal(SignalKind::interrupt()).and_then(|int| Ok((int, signal(SignalKind::terminate())?)));
    async move {
        match installed {
            Ok((mut int, mut term)) => {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot handle SIGINT and SIGTERM; stop with SIGKILL");
                std::future::pending::<()>().await;
            }
        }
    }
}
