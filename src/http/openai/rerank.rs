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
use crate::runtime::leading::{Leading, leading};
use crate::runtime::reranker::{LOGITS, Reranker};
use crate::serve::service::{Api, Kind};

/// A checked rerank request.
struct Job {
    /// The model named.
    model: String,
    /// How it scores a pair.
    reranker: Reranker,
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
    let reranker = job.reranker;
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

/// Read and check a body into a [`Job`], its texts tokenized off the async runtime (stopping
/// when the client goes away). Fields this server does not know are accepted and not read, as
/// OpenAI's endpoints here do.
async fn read(state: &AppState, mut body: Value, id: &str) -> Result<Job, OpenAiError> {
    let model = encode::model_named(&body)?;
    let (entry, (reranker, tokenizer)) = super::model_for(state, &model, Api::Rerank, id, Kind::reranker)?;
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
    let truncate = flag("truncate", entry.config.auto_truncate)?;
    let tokenizer = Arc::clone(tokenizer);
    let limit = encode::limit(entry, None);
    let (documents, pairs) = encode::blocking(id, move |gone| {
        let pairs = pairs(&tokenizer, &query, &documents, (limit, truncate), gone)?;
        Ok((documents, pairs))
    })
    .await?;
    Ok(Job {
        model,
        reranker,
        documents,
        pairs,
        top_n,
        return_documents,
    })
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

/// Each document read with `query` as one pair: its token ids and types, at most the model's
/// limit, or cut to it when the client allows (`truncate`: the longer text first, as
/// `CrossEncoder.predict`'s tokenizer cuts a pair). The query is tokenized once, and each text
/// only as far as the limit's tokens reach ([`leading`]): a pair's texts of megabytes cost what
/// the model takes. Stops when `gone` says the client went away.
///
/// Cut as Hugging Face's tokenizers cut a pair (`longest_first`) from the texts' first tokens
/// alone: when one text fits in the room the special tokens leave, the other is cut to the
/// rest; when neither does, each keeps half, and the odd token (an odd room) goes to the
/// document, where Hugging Face gives it to the longer of the two (the same unless the query
/// is the longer, which only tokenizing both whole could tell).
fn pairs(
    tokenizer: &tokenizers::Tokenizer,
    query: &str,
    documents: &[String],
    (limit, truncate): (Option<(usize, &'static str)>, bool),
    gone: &dyn Fn() -> bool,
) -> Result<Vec<Pair>, OpenAiError> {
    use tokenizers::PostProcessor;
    use tokenizers::utils::truncation::{TruncationParams, TruncationStrategy, truncate_encodings};
    let unreadable = |what: String| {
        move |e: tokenizers::Error| {
            OpenAiError::invalid(format!("`{what}` cannot be tokenized: {e}"), Some("documents"))
        }
    };
    let added = tokenizer.get_post_processor().map_or(0, |p| p.added_tokens(true));
    // Each text's first tokens: one more than the room (a text that has them cannot fit).
    let room = limit.map(|(limit, _)| limit.saturating_sub(added));
    let own = |text: &str| match room {
        Some(room) => leading(tokenizer, text, room + 1),
        None => tokenizer.encode(text, false).map(|encoding| Leading {
            total: Some(encoding.len()),
            encoding,
        }),
    };
    let query = own(query).map_err(unreadable("query".into()))?;
    documents
        .iter()
        .enumerate()
        .map(|(i, document)| {
            if gone() {
                return Err(OpenAiError::invalid("the client went away", None));
            }
            let document = own(document).map_err(unreadable(format!("documents[{i}]")))?;
            let (mut first, mut second) = (query.encoding.clone(), document.encoding);
            if let (Some((limit, what)), Some(room)) = (limit, room)
                && first.len() + second.len() > room
            {
                if !truncate {
                    let how = match (query.total, document.total) {
                        (Some(q), Some(d)) => {
                            format!("is {} tokens, above the model's {what} of {limit}", q + d + added)
                        }
                        _ => format!("is longer than the model's {what} of {limit} tokens"),
                    };
                    return Err(OpenAiError::invalid(
                        format!(
                            "`documents[{i}]` with `query` {how}; shorten them, or send `truncate: true` to cut them"
                        ),
                        Some("documents"),
                    ));
                }
                let params = TruncationParams {
                    max_length: room,
                    strategy: TruncationStrategy::LongestFirst,
                    ..TruncationParams::default()
                };
                let unreadable = unreadable(format!("documents[{i}]` with `query"));
                let (cut, pair) = truncate_encodings(first, Some(second), &params).map_err(&unreadable)?;
                (first, second) = (cut, pair.expect("given a pair"));
            }
            let encoded = tokenizer
                .post_process(first, Some(second), true)
                .map_err(unreadable(format!("documents[{i}]` with `query")))?;
            Ok((encoded.get_ids().to_vec(), encoded.get_type_ids().to_vec()))
        })
        .collect()
}
