//! What every handler of the HTTP layer shares: the service and the server's own state.

use crate::serve::batching::Batchers;
use crate::serve::service::Service;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::SystemTime;

/// Shared state of the HTTP layer.
pub struct AppState {
    /// The running service.
    pub service: Arc<Service>,
    /// The batchers of its models with `batching`, through which requests are placed.
    pub batching: Batchers,
    /// Set once shutdown starts: readiness turns false.
    pub shutting_down: AtomicBool,
    /// Wall-clock start, for `/status`.
    pub started: SystemTime,
    /// Bearer token for `/admin` (from the env var `server.admin_token_env` names).
    pub admin_token: Option<String>,
}

impl AppState {
    /// Wrap an service. The admin token is read from the environment variable the config names;
    /// a named variable that is unset or empty is an error (the operator meant to set a token).
    pub fn new(service: Arc<Service>) -> Result<Arc<AppState>, String> {
        let admin_token = match &service.config.server.admin_token_env {
            None => None,
            Some(var) => match std::env::var(var) {
                Ok(token) if !token.trim().is_empty() => Some(token),
                _ => {
                    return Err(format!(
                        "{}: server.admin_token_env names `{var}`, which is not set (or empty) in the environment",
                        service.config.source
                    ));
                }
            },
        };
        Ok(AppState::with_admin_token(service, admin_token))
    }

    /// Wrap a service with the admin token given (`None`: no admin over TCP).
    pub fn with_admin_token(service: Arc<Service>, admin_token: Option<String>) -> Arc<AppState> {
        Arc::new(AppState {
            batching: Batchers::new(Arc::clone(&service)),
            service,
            shutting_down: AtomicBool::new(false),
            started: SystemTime::now(),
            admin_token,
        })
    }
}
