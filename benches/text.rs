//! A generation's text as its tokens come: what a token costs over answers of 50 and 2000
//! tokens, decoded incrementally ([`Detokenizer`], with stop strings looked for in the new tail
//! only, as generation and streaming do) and, for comparison, decoded and searched whole on
//! every token (how both did it before, which grows with the answer). The tokens are the fixture
//! tokenizer's of its own training text (`models/decoder_corpus.txt`), repeated.
//!
//! `cargo bench --bench text`.

use std::sync::Arc;

use criterion::{Criterion, Throughput};
use std::hint::black_box;
use vramguard::core::model::BuiltinModel;
use vramguard::runtime::text::{Detokenizer, first_at, tail_start};

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    let tokenizer = Arc::new(
        tokenizers::Tokenizer::from_bytes(BuiltinModel::Decoder.tokenizer().expect("ships one")).expect("parses"),
    );
    let corpus = include_str!("../models/decoder_corpus.txt").repeat(4);
    let tokens = tokenizer
        .encode(corpus.as_str(), false)
        .expect("encodes")
        .get_ids()
        .to_vec();
    let stop = vec!["<|im_end|>".to_string(), "<tool_call>".to_string()];
    for n in [50usize, 2000] {
        assert!(tokens.len() >= n, "{} tokens of text", tokens.len());
        let answer = &tokens[..n];
        // A whole answer of n tokens, a token at a time: the time per token is the time over n
        // (criterion's throughput, in tokens per second).
        let mut group = criterion.benchmark_group(format!("answer{n}"));
        group.throughput(Throughput::Elements(n as u64));
        group.sample_size(if n > 100 { 10 } else { 100 });
        group.bench_function("incremental", |b| {
            b.iter(|| {
                let mut text = Detokenizer::new(Arc::clone(&tokenizer));
                for &id in black_box(answer) {
                    let searched = text.text().len();
                    text.push(id).unwrap();
                    let grown = text.text();
                    black_box(first_at(grown, tail_start(grown, searched, &stop), &stop));
                }
                text
            })
        });
        group.bench_function("whole", |b| {
            b.iter(|| {
                for i in 1..=n {
                    let text = tokenizer.decode(black_box(&answer[..i]), true).unwrap();
                    black_box(first_at(&text, 0, &stop));
                }
            })
        });
        group.finish();
    }
    criterion.final_summary();
}
