//! A rerank request for a cross-encoder ([`Kind::Reranker`]): each document is read with the
//! query as one pair of texts (the tokenizer's pair template: `[CLS] query [SEP] document
//! [SEP]`, the document's tokens of type 1), all pairs run as one batch, and the documents are
//! ranked by score, highest first, each score what `CrossEncoder.predict` gives.
//!
//! [`Kind::Reranker`]: crate::serve::service::Kind::Reranker

use std::sync::Arc;

use tokenizers::Tokenizer;

use super::job::{Failure, Invalid, Job, Run, only_output};
use super::tokens::{Limit, limit};
use crate::core::signature::ModelSignature;
use crate::core::tensor::Tensor;
use crate::runtime::embedder::text_batch;
use crate::runtime::leading::{Leading, leading};
use crate::runtime::reranker::{LOGITS, Reranker};
use crate::serve::service::ModelEntry;

/// A rerank request as its API asked it.
#[derive(Debug, Clone, PartialEq)]
pub struct Asked {
    /// The query (not empty).
    pub query: String,
    /// The documents' texts, in the request's order (none empty).
    pub documents: Vec<String>,
    /// Answer with the best this many (all when `None`).
    pub top_n: Option<usize>,
    /// Cut a pair longer than the model takes rather than refuse it; when the request does not
    /// say, the model's `auto_truncate`.
    pub truncate: Option<bool>,
}

/// The documents ranked.
#[derive(Debug, Clone, PartialEq)]
pub struct Ranked {
    /// Each document's index and score, highest first (equal scores in the documents' order),
    /// at most `top_n` of them.
    pub results: Vec<(usize, f32)>,
    /// The documents' texts, in the request's order.
    pub documents: Vec<String>,
    /// The tokens of every pair, for `usage`.
    pub tokens: usize,
}

/// A rerank request checked against its cross-encoder.
pub struct Rerank {
    model: String,
    /// How it scores a pair.
    reranker: Reranker,
    tokenizer: Arc<Tokenizer>,
    signature: ModelSignature,
    limit: Limit,
    truncate: bool,
    query: String,
    documents: Vec<String>,
    top_n: Option<usize>,
}

impl Rerank {
    /// `asked` of `entry`, a cross-encoder scoring with `reranker` and reading with
    /// `tokenizer` (what [`Kind::reranker`](crate::serve::service::Kind::reranker) gives).
    pub fn new(entry: &ModelEntry, (reranker, tokenizer): (Reranker, &Arc<Tokenizer>), asked: Asked) -> Rerank {
        Rerank {
            model: entry.config.name.clone(),
            reranker,
            tokenizer: Arc::clone(tokenizer),
            signature: entry.signature.clone(),
            limit: limit(entry, None),
            truncate: asked.truncate.unwrap_or(entry.config.auto_truncate),
            query: asked.query,
            documents: asked.documents,
            top_n: asked.top_n,
        }
    }
}

/// A query and a document read as one pair: its token ids, and each token's type (the
/// document's are 1).
type Pair = (Vec<u32>, Vec<u32>);

/// What a [`Rerank`] keeps for its answer.
pub struct Ready {
    reranker: Reranker,
    documents: Vec<String>,
    top_n: Option<usize>,
    /// The pairs' tokens.
    tokens: usize,
}

impl Job for Rerank {
    type Ready = Ready;
    type Answer = Ranked;

    fn model(&self) -> &str {
        &self.model
    }

    fn prepare(self, gone: &dyn Fn() -> bool) -> Result<(Ready, Vec<Run>), Invalid> {
        let pairs = pairs(
            &self.tokenizer,
            &self.query,
            &self.documents,
            (self.limit, self.truncate),
            gone,
        )?;
        let (ids, types): (Vec<Vec<u32>>, Vec<Vec<u32>>) = pairs.into_iter().unzip();
        let run = Run {
            model: self.model,
            // The padding's id is never seen: the attention mask leaves it out.
            inputs: text_batch(&self.signature, &ids, Some(&types), 0),
            output: LOGITS,
            pads: true,
        };
        let ready = Ready {
            reranker: self.reranker,
            documents: self.documents,
            top_n: self.top_n,
            tokens: ids.iter().map(Vec::len).sum(),
        };
        Ok((ready, vec![run]))
    }

    fn answer(ready: Ready, outputs: Vec<Tensor>) -> Result<Ranked, Failure> {
        let logits = only_output(&outputs)?;
        let scores = (ready.reranker)
            .scores(logits, ready.documents.len())
            .map_err(Failure::Internal)?;
        let mut results: Vec<(usize, f32)> = scores.into_iter().enumerate().collect();
        // Highest first; equal scores keep the documents' order (a stable sort).
        results.sort_by(|a, b| b.1.total_cmp(&a.1));
        results.truncate(ready.top_n.unwrap_or(results.len()));
        Ok(Ranked {
            results,
            documents: ready.documents,
            tokens: ready.tokens,
        })
    }
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
    tokenizer: &Tokenizer,
    query: &str,
    documents: &[String],
    (limit, truncate): (Limit, bool),
    gone: &dyn Fn() -> bool,
) -> Result<Vec<Pair>, Invalid> {
    use tokenizers::PostProcessor;
    use tokenizers::utils::truncation::{TruncationParams, TruncationStrategy, truncate_encodings};
    let unreadable = |what: String| {
        move |e: tokenizers::Error| Invalid::new(format!("`{what}` cannot be tokenized: {e}"), Some("documents"))
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
                return Err(Invalid::new("the client went away", None));
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
                    return Err(Invalid::new(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::tensor::TensorData;
    use crate::runtime::reranker::Activation;

    fn ranked(logits: Vec<f32>, top_n: Option<usize>) -> Vec<(usize, f32)> {
        let ready = Ready {
            reranker: Reranker {
                activation: Activation::Identity,
            },
            documents: (0..logits.len()).map(|i| format!("d{i}")).collect(),
            top_n,
            tokens: 9,
        };
        let logits = Tensor {
            name: LOGITS.into(),
            shape: vec![logits.len() as i64, 1],
            data: TensorData::Fp32(logits),
        };
        let Ok(answer) = Rerank::answer(ready, vec![logits]) else {
            panic!("not ranked");
        };
        assert_eq!((answer.tokens, answer.documents.len()), (9, 3));
        answer.results
    }

    #[test]
    fn documents_rank_highest_first_ties_in_their_order_cut_to_top_n() {
        assert_eq!(ranked(vec![0.5, 2.0, 0.5], None), [(1, 2.0), (0, 0.5), (2, 0.5)]);
        assert_eq!(ranked(vec![0.5, 2.0, 0.5], Some(2)), [(1, 2.0), (0, 0.5)]);
        assert_eq!(ranked(vec![0.5, 2.0, 0.5], Some(7)).len(), 3);
    }
}
