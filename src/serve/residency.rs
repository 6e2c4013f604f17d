//! Loading and unloading a model on every pool serving it, as an operator asks (the admin API's
//! `POST /admin/models/{model}/load|unload`, Triton's repository API): what each pool did, as
//! plain facts the protocol layers format.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::Residency;
use crate::pool::{Pool, ResidencyError};
use crate::serve::service::Service;

/// Why a load or unload was refused before any pool was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No configured model has the name.
    #[error("no model `{0}`")]
    NoModel(String),
    /// An unload of a `pinned` model.
    #[error("{0}")]
    Pinned(String),
    /// The work stopped before it finished (a shutdown, or a fault of ours).
    #[error("the change did not finish: {0}")]
    Unfinished(String),
}

/// What one pool did.
#[derive(Debug, Clone)]
pub struct PoolChange {
    /// The pool's name.
    pub pool: String,
    /// What it did (`loaded`, `already_loaded`, `unloaded`, …), or why it failed.
    pub result: Result<&'static str, Failure>,
    /// How long it took.
    pub took: Duration,
}

/// Why a pool could not load or unload.
#[derive(Debug, Clone)]
pub struct Failure {
    /// For people.
    pub message: String,
    /// The pool is remote: its server loads its own models, so this is no failure of the
    /// operator's request.
    pub remote: bool,
}

impl Service {
    /// Load (`load`) or unload `model` on every pool serving it, off the async runtime; what
    /// happened on each pool, in config order. Its facts are sampled again after.
    pub async fn change_residency(&self, model: &str, load: bool) -> Result<Vec<PoolChange>, Refusal> {
        let residency = self
            .model(model)
            .map(|m| m.config.residency)
            .ok_or_else(|| Refusal::NoModel(model.to_string()))?;
        if !load && residency == Residency::Pinned {
            let refusal = ResidencyError::Pinned {
                model: model.to_string(),
            };
            return Err(Refusal::Pinned(refusal.to_string()));
        }
        let pools: Vec<Arc<Pool>> = self.pools.iter().filter(|p| p.serves(model)).cloned().collect();
        let name = model.to_string();
        let changes = tokio::task::spawn_blocking(move || {
            pools
                .iter()
                .map(|pool| change_on(pool, &name, load))
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|e| Refusal::Unfinished(e.to_string()))?;
        self.resample_now().await;
        Ok(changes)
    }
}

/// Load or unload `model` on `pool`, timed.
fn change_on(pool: &Pool, model: &str, load: bool) -> PoolChange {
    let started = Instant::now();
    let result = if load {
        pool.residency().load_model(model)
    } else {
        pool.residency().unload_model(model)
    };
    PoolChange {
        pool: pool.name().to_string(),
        result: result.map(|outcome| outcome.label()).map_err(|e| Failure {
            message: e.to_string(),
            remote: matches!(e, ResidencyError::Remote { .. }),
        }),
        took: started.elapsed(),
    }
}
