//! `POST /v1/rerank` for cross-encoders ([`crate::runtime::reranker`]), in the shape Jina's and
//! Cohere's APIs gave it and llama.cpp, vLLM and LocalAI accept: `query` and `documents`
//! (strings, or objects with `text`), `top_n`, `return_documents`. Each document is read with
//! the query as one pair of texts (the tokenizer's pair template: `[CLS] query [SEP] document
//! [SEP]`, the document's tokens of type 1), all pairs run as one request through the lifecycle
//! (their number the batch axis), and the answer lists them by score, highest first, each score
//! what `CrossEncoder.predict` gives.

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
use crate::runtime::embedder::text_batch;
use crate::runtime::reranker::LOGITS;
use crate::serve::service::ModelEntry;

/// A checked rerank request.
struct Job {
    /// The model named.
    model: String,
    /// The documents' texts, in the request's order.
    documents: Vec<String>,
    /// Each pair's tokens, in the documents' order.
    pairs: Vec<Pair>,
    /// Answer with the best this many (all when `None`).
    top_n: Option<usize>,
    /// Send each document's text with its score.
    return_documents: bool,
}

/// A query and a document read as one pair: its token ids, and each token's type (the
/// document's are 1).
type Pair = (Vec<u32>, Vec<u32>);

impl encode::Job for Job {
    fn model(&self) -> &str {
        &self.model
    }
}

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

/// Read, run and answer one request.
async fn serve(
    state: &AppState,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    id: &str,
    received: Instant,
) -> Result<Response, OpenAiError> {
    let (job, served, logits) = encode::run(
        state,
        (headers, encode::parse(body, id), id, received),
        read,
        |entry, job: &Job| {
            let (ids, types): (Vec<Vec<u32>>, Vec<Vec<u32>>) = job.pairs.iter().cloned().unzip();
            // The padding's id is never seen: the attention mask leaves it out.
            (text_batch(&entry.signature, &ids, Some(&types), 0), LOGITS)
        },
    )
    .await?;
    let reranker = state
        .service
        .model(&job.model)
        .and_then(|entry| entry.reranker)
        .expect("checked by read");
    let scores = reranker
        .scores(&logits, job.pairs.len())
        .map_err(|e| OpenAiError::internal(e, id))?;
    let mut ranked: Vec<(usize, f32)> = scores.into_iter().enumerate().collect();
    // Highest first; equal scores keep the documents' order (a stable sort).
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    ranked.truncate(job.top_n.unwrap_or(ranked.len()));
    let results: Vec<Value> = ranked
        .into_iter()
        .map(|(index, score)| {
            let mut result = json!({"index": index, "relevance_score": score});
            if job.return_documents {
                result["document"] = json!({"text": job.documents[index]});
            }
            result
        })
        .collect();
    let tokens: usize = job.pairs.iter().map(|(ids, _)| ids.len()).sum();
    let body = json!({"id": format!("rerank-{id}"), "model": job.model, "results": results,
                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}});
    Ok(encode::answer(state, &job.model, &served, body))
}

/// Read and check a body into a [`Job`]. Fields this server does not know are accepted and not
/// read, as OpenAI's endpoints here do.
fn read(state: &AppState, body: &Value, id: &str) -> Result<Job, OpenAiError> {
    let model = encode::model_named(body)?;
    let entry = reranking_model(state, &model, id)?;
    let query = match &body["query"] {
        Value::String(query) if !query.is_empty() => query.as_str(),
        Value::String(_) => return Err(OpenAiError::invalid("`query` is an empty string", Some("query"))),
        Value::Null => return Err(OpenAiError::invalid("`query` is missing", Some("query"))),
        other => {
            return Err(OpenAiError::invalid(
                format!("`query` is {other}, not a string"),
                Some("query"),
            ));
        }
    };
    let documents = documents(&body["documents"])?;
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
    let flag = |name: &'static str, default: bool| match &body[name] {
        Value::Null => Ok(default),
        Value::Bool(b) => Ok(*b),
        other => Err(OpenAiError::invalid(
            format!("`{name}` is {other}, not true or false"),
            Some(name),
        )),
    };
    // Jina's default; vLLM always sends the documents, llama.cpp never does.
    let return_documents = flag("return_documents", true)?;
    let truncate = flag("truncate", false)?;
    let pairs = pairs(entry, query, &documents, truncate)?;
    Ok(Job {
        model,
        documents,
        pairs,
        top_n,
        return_documents,
    })
}

/// The model named, when it reranks: an unknown one is OpenAI's 404, one that does not rerank a
/// 400 naming `model`.
fn reranking_model<'a>(state: &'a AppState, model: &str, id: &str) -> Result<&'a ModelEntry, OpenAiError> {
    let service = &state.service;
    let entry = service
        .model(model)
        .ok_or_else(|| OpenAiError::unknown_model(service, model, id))?;
    if entry.reranker.is_none() || entry.tokenizer.is_none() {
        return Err(OpenAiError::invalid(
            format!(
                "model `{model}` does not rerank (it needs a cross-encoder's folder: a config.json of a one-label …ForSequenceClassification)"
            ),
            Some("model"),
        ));
    }
    Ok(entry)
}

/// The texts of `documents`: a non-empty list of strings, or of objects with a string `text`
/// (Jina's and Cohere's), none empty.
fn documents(documents: &Value) -> Result<Vec<String>, OpenAiError> {
    let invalid = |message: String| OpenAiError::invalid(message, Some("documents"));
    let items = match documents {
        Value::Array(items) if items.is_empty() => return Err(invalid("`documents` is an empty list".into())),
        Value::Array(items) => items,
        Value::Null => return Err(invalid("`documents` is missing".into())),
        other => return Err(invalid(format!("`documents` is {other}, not a list"))),
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let text = match item {
                Value::String(text) => text,
                Value::Object(object) => match object.get("text") {
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
                false => Ok(text.clone()),
            }
        })
        .collect()
}

/// Each document read with `query` as one pair: its token ids and types, at most the model's
/// limit, or cut to it when the client allows (`truncate`: the longer text first, as
/// `CrossEncoder.predict`'s tokenizer cuts a pair).
fn pairs(entry: &ModelEntry, query: &str, documents: &[String], truncate: bool) -> Result<Vec<Pair>, OpenAiError> {
    let tokenizer = entry.tokenizer.as_ref().expect("checked by reranking_model");
    let limit = encode::limit(entry, None);
    documents
        .iter()
        .enumerate()
        .map(|(i, document)| {
            let invalid = |e: tokenizers::Error| {
                OpenAiError::invalid(
                    format!("`documents[{i}]` with `query` cannot be tokenized: {e}"),
                    Some("documents"),
                )
            };
            let mut encoded = tokenizer.encode((query, document.as_str()), true).map_err(invalid)?;
            if let Some((limit, what)) = limit
                && encoded.len() > limit
            {
                if !truncate {
                    return Err(OpenAiError::invalid(
                        format!(
                            "`documents[{i}]` with `query` is {} tokens, above the model's {what} of {limit}; shorten them, or send `truncate: true` to cut them",
                            encoded.len()
                        ),
                        Some("documents"),
                    ));
                }
                encoded = cut_pair(tokenizer, query, document, limit).map_err(invalid)?;
            }
            Ok((encoded.get_ids().to_vec(), encoded.get_type_ids().to_vec()))
        })
        .collect()
}

/// `query` and `document` as a pair cut to `limit` tokens as Hugging Face's tokenizers cut one
/// (`longest_first`): their own tokens cut, a token at a time from the longer, then the special
/// tokens added around what is left.
fn cut_pair(
    tokenizer: &tokenizers::Tokenizer,
    query: &str,
    document: &str,
    limit: usize,
) -> tokenizers::Result<tokenizers::Encoding> {
    use tokenizers::PostProcessor;
    use tokenizers::utils::truncation::{TruncationParams, TruncationStrategy, truncate_encodings};
    let added = tokenizer.get_post_processor().map_or(0, |p| p.added_tokens(true));
    let params = TruncationParams {
        max_length: limit.saturating_sub(added),
        strategy: TruncationStrategy::LongestFirst,
        ..TruncationParams::default()
    };
    let (first, second) = truncate_encodings(
        tokenizer.encode(query, false)?,
        Some(tokenizer.encode(document, false)?),
        &params,
    )?;
    tokenizer.post_process(first, second, true)
}
