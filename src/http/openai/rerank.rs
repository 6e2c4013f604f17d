//! `POST /v1/rerank` for cross-encoders ([`crate::serve::encoders::rerank`]), in the shape
//! Jina's and Cohere's APIs gave it and llama.cpp, vLLM and LocalAI accept: `query` and
//! `documents` (strings, or objects with `text`), `top_n`, `return_documents`. The request's
//! fields are read into a rerank job, handed down through the encoders' door, and the
//! documents it ranks (highest score first) are listed with their scores.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::encode;
use super::error::OpenAiError;
use crate::http::state::AppState;
use crate::serve::encoders::rerank::{Asked, Ranked, Rerank};
use crate::serve::service::{Api, Kind};

/// `POST /v1/rerank`.
pub async fn rerank(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let (state, headers) = (&*state, &headers);
    encode::respond(headers, |id, received| async move {
        serve(state, headers, body, &id, received).await
    })
    .await
}

/// How an answer is sent: for the model named, by the request of this id, with the documents'
/// texts or without.
struct Format {
    model: String,
    id: String,
    return_documents: bool,
}

/// Read, run and answer one request.
async fn serve(
    state: &AppState,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    id: &str,
    received: Instant,
) -> Result<Response, OpenAiError> {
    let parsed = encode::parse(body, id);
    encode::encoded(state, (headers, parsed, id, received), read, answer).await
}

/// The answer's body: the documents ranked, each with its score (and its text, when asked).
fn answer(ranked: Ranked, format: Format) -> Value {
    let results: Vec<Value> = (ranked.results.into_iter())
        .map(|(index, score)| {
            let mut result = json!({"index": index, "relevance_score": score});
            if format.return_documents {
                result["document"] = json!({"text": ranked.documents[index]});
            }
            result
        })
        .collect();
    let tokens = ranked.tokens;
    json!({"id": format!("rerank-{}", format.id), "model": format.model, "results": results,
           "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
}

/// Read and check a body into a [`Rerank`] job, with how its answer is sent. Fields this
/// server does not know are accepted and not read, as OpenAI's endpoints here do.
fn read(state: &AppState, mut body: Value, model: String, id: &str) -> Result<(Rerank, Format), OpenAiError> {
    let (entry, parts) = super::model_for(state, &model, Api::Rerank, id, Kind::reranker)?;
    let query = match body["query"].take() {
        Value::String(query) if !query.is_empty() => query,
        Value::String(_) => return Err(OpenAiError::invalid("`query` is an empty string", Some("query"))),
        Value::Null => return Err(OpenAiError::invalid("`query` is missing", Some("query"))),
        other => {
            return Err(OpenAiError::invalid(
                format!("`query` is {other}, not a string"),
                Some("query"),
            ));
        }
    };
    let documents = documents(body["documents"].take())?;
    let top_n = match &body["top_n"] {
        // 0 is vLLM's default for "all".
        Value::Null => None,
        v => match v.as_u64() {
            Some(0) => None,
            Some(n) => Some(n as usize),
            None => {
                return Err(OpenAiError::invalid(
                    format!("`top_n` is {v}, not a number of documents"),
                    Some("top_n"),
                ));
            }
        },
    };
    // A flag the request may leave unsaid.
    let flag = |name: &'static str| match &body[name] {
        Value::Null => Ok(None),
        Value::Bool(b) => Ok(Some(*b)),
        other => Err(OpenAiError::invalid(
            format!("`{name}` is {other}, not true or false"),
            Some(name),
        )),
    };
    // Jina's default; vLLM always sends the documents, llama.cpp never does.
    let return_documents = flag("return_documents")?.unwrap_or(true);
    // Unsaid: the model's `auto_truncate`.
    let truncate = flag("truncate")?;
    let asked = Asked {
        query,
        documents,
        top_n,
        truncate,
    };
    let format = Format {
        model,
        id: id.to_string(),
        return_documents,
    };
    Ok((Rerank::new(entry, parts, asked), format))
}

/// The texts of `documents`: a non-empty list of strings, or of objects with a string `text`
/// (Jina's and Cohere's), none empty.
fn documents(documents: Value) -> Result<Vec<String>, OpenAiError> {
    let invalid = |message: String| OpenAiError::invalid(message, Some("documents"));
    let items = match documents {
        Value::Array(items) if items.is_empty() => return Err(invalid("`documents` is an empty list".into())),
        Value::Array(items) => items,
        Value::Null => return Err(invalid("`documents` is missing".into())),
        other => return Err(invalid(format!("`documents` is {other}, not a list"))),
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            let text = match item {
                Value::String(text) => text,
                Value::Object(mut object) => match object.remove("text") {
                    Some(Value::String(text)) => text,
                    _ => return Err(invalid(format!("`documents[{i}]` has no string `text`"))),
                },
                other => {
                    return Err(invalid(format!(
                        "`documents[{i}]` is {other}; each document is a string or an object with `text`"
                    )));
                }
            };
            match text.is_empty() {
                true => Err(invalid(format!("`documents[{i}]` is an empty string"))),
                false => Ok(text),
            }
        })
        .collect()
}
