//! Triton's model-repository extension. `POST /v2/repository/index` lists every configured model
//! with its state; `POST /v2/repository/models/{model}/load|unload` are the admin API's load and
//! unload ([`residency::change`]), served where the admin API is and under its authorization.
//!
//! vramguard's models come from its config file, not from a repository folder: a load builds
//! the sessions of a configured model, and a request for an unloaded model loads it again. So
//! a model that is not loaded anywhere but would load on its next request is `READY`, as
//! `GET /v2/models/{model}/ready` says, with the reason saying its next request waits for it.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use crate::core::human::clipped;
use crate::serve::service::Service;

use super::super::error::ApiError;
use super::super::residency::{self, Done};
use super::super::state::AppState;

/// Body of `POST /v2/repository/index`; none (as Triton's client sends) is `{}`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct IndexRequest {
    /// Only the models ready for inference.
    #[serde(default)]
    ready: bool,
}

/// Body of a load or unload: Triton's clients send their options as `parameters`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ControlRequest {
    /// The options, by name.
    #[serde(default)]
    parameters: Map<String, Value>,
}

/// The load and unload routes, for the admin API's router (which guards them as its own).
pub(crate) fn control_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v2/repository/models/{model}/load", post(load))
        .route("/v2/repository/models/{model}/unload", post(unload))
}

/// `POST /v2/repository/index`: `[{name, version, state, reason}]` for every configured model,
/// in config order; with `{"ready": true}`, only those `READY`.
pub(super) async fn index(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let request: IndexRequest = read_body(body, "the body must be empty or a JSON object like {\"ready\": true}")?;
    let service = &state.service;
    let models = service
        .models
        .iter()
        .map(|entry| (entry.config.name.as_str(), state_of(service, &entry.config.name)))
        .filter(|(_, (state, _))| !request.ready || *state == "READY")
        .map(|(name, (state, reason))| json!({"name": name, "version": "1", "state": state, "reason": reason}))
        .collect();
    Ok(Json(Value::Array(models)))
}

/// `model`'s state as Triton names it, and why (empty when it is loaded and ready):
/// `UNAVAILABLE` when no ready pool serves it; `READY` when a ready pool holds its sessions, or
/// when none does but its next request would load them; `LOADING` while a ready pool loads them.
fn state_of(service: &Service, model: &str) -> (&'static str, String) {
    let ready: Vec<_> = service
        .pools
        .iter()
        .filter(|p| p.serves(model) && p.is_ready())
        .collect();
    if ready.is_empty() {
        return ("UNAVAILABLE", format!("no ready pool serves `{model}`"));
    }
    if ready.iter().any(|p| p.residency().is_resident(model)) {
        return ("READY", String::new());
    }
    if let Some(pool) = ready.iter().find(|p| p.residency().is_loading(model)) {
        return (
            "LOADING",
            format!("loading on pool `{}`; its requests wait for it", pool.name()),
        );
    }
    (
        "READY",
        "not loaded on any pool: its next request loads it (a cold start)".to_string(),
    )
}

/// `POST /v2/repository/models/{model}/load`: `POST /admin/models/{model}/load`.
async fn load(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let request: ControlRequest = read_body(body, LOAD_BODY)?;
    refuse_unsupported(&request.parameters, &[])?;
    answered(residency::change(&state, model, true).await?)
}

/// `POST /v2/repository/models/{model}/unload`: `POST /admin/models/{model}/unload`.
async fn unload(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let request: ControlRequest = read_body(body, LOAD_BODY)?;
    refuse_unsupported(&request.parameters, &["unload_dependents"])?;
    // Triton unloads the ensembles built on a model with it. vramguard has none: no model
    // depends on another, so either value asks for the same unload.
    if let Some(value) = request.parameters.get("unload_dependents")
        && !value.is_boolean()
    {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("parameter `unload_dependents` must be true or false, not {value}"),
        ));
    }
    answered(residency::change(&state, model, false).await?)
}

/// What a load's or an unload's body must be.
const LOAD_BODY: &str = "the body must be empty or a JSON object like {\"parameters\": {}}";

/// Refuse the parameters other than `supported`, naming them: an option that would be ignored
/// (Triton's `config` or `file:` overrides) must not look as if it had been applied.
fn refuse_unsupported(parameters: &Map<String, Value>, supported: &[&str]) -> Result<(), ApiError> {
    let unsupported: Vec<String> = parameters
        .keys()
        .filter(|k| !supported.contains(&k.as_str()))
        .map(|k| format!("`{}`", clipped(k, 64)))
        .collect();
    if unsupported.is_empty() {
        return Ok(());
    }
    let takes = match supported {
        [] => "none".to_string(),
        names => names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", "),
    };
    Err(ApiError::new(
        StatusCode::BAD_REQUEST,
        format!(
            "unsupported parameters {}: vramguard serves the models its config file names (models[]), \
             a load builds a configured model's sessions (parameters taken here: {takes})",
            unsupported.join(", ")
        ),
    ))
}

/// The admin API's answer, or an error when some pool could not do it (Triton's client reports
/// nothing but an error status). A remote pool is no failure: its server loads its own models.
fn answered(done: Done) -> Result<Json<Value>, ApiError> {
    match done.failures.iter().find(|(_, remote)| !remote) {
        None => Ok(Json(done.answer)),
        Some((failure, _)) => {
            Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, failure.clone())
                .with("pools", done.answer["pools"].clone()))
        }
    }
}

/// A JSON body whatever its `Content-Type` (as the admin API reads one); none is `T::default()`.
fn read_body<T: DeserializeOwned + Default>(
    body: Result<Bytes, BytesRejection>,
    expected: &str,
) -> Result<T, ApiError> {
    let body = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(&body).map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("{expected}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_not_taken_are_named_in_the_refusal() {
        let parameters: Map<String, Value> =
            serde_json::from_str(r#"{"config": "{}", "file:1/model.onnx": "AAAA", "unload_dependents": false}"#)
                .unwrap();
        let refused = refuse_unsupported(&parameters, &["unload_dependents"]).unwrap_err();
        let response = axum::response::IntoResponse::into_response(refused);
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        let message = error_text(response);
        assert!(message.contains("`config`, `file:1/model.onnx`"), "{message}");
        assert!(!message.contains("`unload_dependents`:"), "{message}");
        assert!(refuse_unsupported(&Map::new(), &[]).is_ok());
    }

    #[test]
    fn an_empty_body_is_the_default_and_other_keys_are_refused() {
        let empty: IndexRequest = read_body(Ok(Bytes::from_static(b" \n")), "x").unwrap();
        assert!(!empty.ready);
        let ready: IndexRequest = read_body(Ok(Bytes::from_static(br#"{"ready": true}"#)), "x").unwrap();
        assert!(ready.ready);
        let wrong = read_body::<IndexRequest>(Ok(Bytes::from_static(br#"{"redy": true}"#)), "x").unwrap_err();
        assert!(error_text(axum::response::IntoResponse::into_response(wrong)).contains("unknown field `redy`"));
    }

    /// The `error` of an answer's body.
    fn error_text(response: axum::response::Response) -> String {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let body = runtime
            .block_on(axum::body::to_bytes(response.into_body(), usize::MAX))
            .unwrap();
        let value: Value = serde_json::from_slice(&body).unwrap();
        value["error"].as_str().unwrap().to_string()
    }
}
