//! Structured outputs: what constrained decoding costs.
//!
//! - **Compile time of a typical tool schema** (a weather tool: a string, an enum, a bounded
//!   integer, a boolean and an array of enums; forced, in the Hermes call format), per request,
//!   and the vocabulary's one-time build per model, on the fixture's tokenizer and on a
//!   synthetic byte-level vocabulary of 129k pieces (the size of Llama 3's and Qwen's; no
//!   such tokenizer is in the repository).
//! - **The mask of one step**: computed after each token of a walk through that call (tokens
//!   picked under the mask from varying logits), and applied to a row of logits, on both.
//! - **Tokens/s constrained against unconstrained at c1 and c8** through a real `vramguard
//!   serve` on the fixture decoder and, when `make bench` has made it, the larger one (one CPU
//!   pool, one worker with one intra-op thread, as the generation bench): greedy chat
//!   completions of the same prompt, with `response_format` a JSON schema that does not end
//!   (an array of small objects) and without, in alternating pairs of runs; the figure is each
//!   pair's constrained tokens/s over its unconstrained, the median over the pairs. Target:
//!   ≥ 0.95 (the mask is computed while the step runs).
//!
//! `cargo bench --bench structured [-- --runs N --seconds S]`. Figures go to
//! `target/bench/structured.json`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use vramguard::runtime::grammar::{Grammar, Grammars, Json, Shape, Tool};
use vramguard::testing::Scratch;
use vramguard::testing::bench::server::Server;
use vramguard::testing::bench::{Figure, Machine, Paired, Target, arg, out_dir, print_table, record};

/// The arguments of a typical tool.
/// The arguments of a typical tool (`n`: its location's most characters less 40, so that each
/// compilation measured is of a schema not compiled before).
fn weather(n: u64) -> Value {
    json!({"type": "object", "additionalProperties": false,
           "required": ["location", "unit", "days", "hourly", "fields"],
           "properties": {
               "location": {"type": "string", "description": "City and country, e.g. Paris, France", "maxLength": 40 + n},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
               "days": {"type": "integer", "minimum": 1, "maximum": 14},
               "hourly": {"type": "boolean"},
               "fields": {"type": "array", "maxItems": 4,
                          "items": {"type": "string", "enum": ["temperature", "wind", "rain", "humidity"]}}}})
}

/// A byte-level BPE tokenizer of about 129k pieces: the 256 bytes, then letter strings of one
/// to four letters with and without a leading space (`Ġ`), numbers and JSON punctuation runs,
/// and an end-of-text token. Its pieces need no merges: only their bytes matter here.
fn synthetic_tokenizer() -> tokenizers::Tokenizer {
    let alphabet: Vec<char> = (0..=255u8)
        .map(|b| {
            let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            if printable {
                char::from(b)
            } else {
                char::from_u32(0x100 + u32::from(b)).unwrap()
            }
        })
        .collect();
    let mut pieces: Vec<String> = alphabet.iter().map(char::to_string).collect();
    let letters: Vec<char> = ('a'..='z').collect();
    let mut words = vec![String::new()];
    for _ in 0..3 {
        words = words
            .iter()
            .flat_map(|w| letters.iter().map(move |c| format!("{w}{c}")))
            .collect();
        for w in &words {
            pieces.push(w.clone());
            pieces.push(format!("Ġ{w}"));
        }
    }
    // Four letters, every fifth combination, to reach the size of today's vocabularies.
    for (i, w) in words.iter().enumerate() {
        for (j, c) in letters.iter().enumerate() {
            if (i + j) % 5 == 0 {
                pieces.push(format!("Ġ{w}{c}"));
            }
        }
    }
    pieces.extend((0..1000).map(|n| n.to_string()));
    pieces.extend(["\",", "\":", "{\"", "\"}", "[\"", "\"]", "Ġ\"", "Ġ[", "Ġ{", "},", "],"].map(String::from));
    let vocab: serde_json::Map<String, Value> = pieces.iter().enumerate().map(|(i, p)| (p.clone(), json!(i))).collect();
    let eos = vocab.len();
    let config = json!({
        "version": "1.0",
        "added_tokens": [{"id": eos, "content": "<|endoftext|>", "special": true, "single_word": false,
                          "lstrip": false, "rstrip": false, "normalized": false}],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []},
    });
    tokenizers::Tokenizer::from_bytes(config.to_string()).unwrap()
}

/// What the in-process figures measure on one vocabulary.
fn in_process(label: &str, tokenizer: tokenizers::Tokenizer, figures: &mut Vec<Figure>) {
    let tokenizer = Arc::new(tokenizer);
    let eos = vec![tokenizer.token_to_id("<|endoftext|>").expect("an end-of-text token")];
    let vocab = tokenizer.get_vocab_size(true);
    let parameters = weather(0);
    let tools = [Tool {
        name: "get_weather",
        parameters: Some(&parameters),
        strict: true,
    }];
    let shape = Shape::ToolCall {
        tools: &tools,
        otherwise: None,
    };
    // The first compilation builds the model's vocabulary and trie as well, once.
    let grammars = Grammars::new(Arc::clone(&tokenizer), eos.clone());
    let started = Instant::now();
    grammars.compile(shape).unwrap();
    figures.push(
        Figure::of_samples(
            format!("first compilation, vocabulary built ({label})"),
            "ms",
            &[started.elapsed().as_secs_f64() * 1e3],
        )
        .note(format!("{vocab} tokens; once per model")),
    );
    // Each one of a schema not compiled before: a compiled grammar is kept for the next request
    // that sends the same.
    let samples: Vec<f64> = (1..=50)
        .map(|n| {
            let parameters = weather(n);
            let tools = [Tool {
                name: "get_weather",
                parameters: Some(&parameters),
                strict: true,
            }];
            let started = Instant::now();
            std::hint::black_box(
                grammars
                    .compile(Shape::ToolCall {
                        tools: &tools,
                        otherwise: None,
                    })
                    .unwrap(),
            );
            started.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    figures.push(
        Figure::of_samples(format!("compile a typical tool schema ({label})"), "ms", &samples)
            .note("per request sending a new schema, before admission; its first mask included"),
    );
    let samples: Vec<f64> = (0..50)
        .map(|_| {
            let started = Instant::now();
            std::hint::black_box(grammars.compile(shape).unwrap());
            started.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    figures.push(
        Figure::of_samples(format!("the same tool schema again ({label})"), "ms", &samples)
            .note("found among the model's recent grammars"),
    );
    let samples: Vec<f64> = (1..=50)
        .map(|n| {
            let readings = readings(n);
            let started = Instant::now();
            std::hint::black_box(
                grammars
                    .compile(Shape::Json(Json {
                        schema: &readings,
                        strict: true,
                    }))
                    .unwrap(),
            );
            started.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    figures.push(
        Figure::of_samples(format!("compile the served schema ({label})"), "ms", &samples)
            .note("the array of at least 100 readings the tokens/s figures ask for, each new"),
    );
    let readings = readings(0);
    let grammar = grammars.compile(shape).unwrap();
    let (accepted, masks, applied) = walk(&grammar, vocab, &eos);
    figures.push(Figure::of_samples(
        format!("token taken by the matcher ({label})"),
        "µs",
        &accepted,
    ));
    let served = grammars
        .compile(Shape::Json(Json {
            schema: &readings,
            strict: true,
        }))
        .unwrap();
    let (accepted, masks2, _) = walk(&served, vocab, &eos);
    figures.push(Figure::of_samples(
        format!("token taken by the matcher, served schema ({label})"),
        "µs",
        &accepted,
    ));
    figures.push(Figure::of_samples(
        format!("mask of one step, served schema ({label})"),
        "µs",
        &masks2,
    ));
    figures.push(
        Figure::of_samples(format!("mask of one step ({label})"), "µs", &masks).note("computed while the step runs"),
    );
    figures.push(Figure::of_samples(
        format!("mask applied to a row of logits ({label})"),
        "µs",
        &applied,
    ));
}

/// Walks through `grammar` from varying logits until it finishes, again and again: the time
/// of each step's token taken by the matcher, of its mask computation and of its application to
/// a row, in µs.
fn walk(grammar: &Grammar, vocab: usize, eos: &[u32]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut accepted, mut masks, mut applied) = (Vec::new(), Vec::new(), Vec::new());
    for walk in 0..20usize {
        let (mut matcher, mut mask) = grammar.start();
        for step in 0..400usize {
            let mut logits: Vec<f32> = (0..vocab)
                .map(|i| ((i * 131 + step * 71 + walk * 17) % 1009) as f32)
                .collect();
            let started = Instant::now();
            mask.apply(&mut logits);
            applied.push(started.elapsed().as_secs_f64() * 1e6);
            let next = (0..vocab).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap() as u32;
            if eos.contains(&next) {
                break;
            }
            let started = Instant::now();
            let finished = matcher.accept(next).unwrap();
            accepted.push(started.elapsed().as_secs_f64() * 1e6);
            if finished {
                break;
            }
            let started = Instant::now();
            mask = matcher.mask().unwrap();
            masks.push(started.elapsed().as_secs_f64() * 1e6);
        }
    }
    (accepted, masks, applied)
}

/// A decoder to serve: the fixture, and the larger one when `make bench` made it.
fn decoders() -> Vec<(&'static str, PathBuf, u32)> {
    let mut out = vec![(
        "fixture",
        Path::new(env!("CARGO_MANIFEST_DIR")).join("models/decoder"),
        64,
    )];
    let large = out_dir(env!("CARGO_TARGET_TMPDIR")).join("decoder-large");
    if large.join("model.onnx").exists() {
        out.push(("large", large, 32));
    } else {
        eprintln!(
            "structured: no {} (`make bench` makes it): the fixture only",
            large.display()
        );
    }
    out
}

/// The generation bench's server: one CPU pool, one one-thread worker, ChatML.
fn config(dir: &Path) -> String {
    format!(
        "models:\n  - {{name: lm, path: '{}', tokenizer: '{}', chat_template: 'builtin:chatml'}}\n\
         pools:\n  - {{name: cpu, provider: cpu, models: [lm], workers: 1, intra_threads: 1}}\n\
         policy:\n  path: 'builtin:default'\n  params: {{cpu_pool: cpu, reserve_bytes: 32MiB, min_context_tokens: 16, defer_ms: 25, defer_max_queue: 4}}\n",
        dir.join("model.onnx").display(),
        dir.join("tokenizer.json").display()
    )
}

/// More readings than `max_tokens` can hold: a constrained answer runs to `max_tokens`, as the
/// unconstrained one does, rather than ending at `[]`.
/// (`n`: its fewest readings less 100, so that each compilation measured is of a new schema.)
fn readings(n: u64) -> Value {
    let reading = json!({"type": "object", "additionalProperties": false, "required": ["id", "celsius", "note"],
                         "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "celsius": {"type": "number"},
                                        "note": {"type": "string", "maxLength": 24}}});
    json!({"type": "array", "items": reading, "minItems": 100 + n})
}

/// A greedy chat of `max_tokens`, constrained by [`readings`], or not.
fn body(max_tokens: u32, constrained: bool) -> Vec<u8> {
    let mut body = json!({"model": "lm", "max_tokens": max_tokens, "temperature": 0,
                          "messages": [{"role": "user", "content": "List the readings of the sensors in the server room."}]});
    if constrained {
        body["response_format"] = json!({"type": "json_schema", "json_schema":
                                         {"name": "readings", "strict": true, "schema": readings(0)}});
    }
    body.to_string().into_bytes()
}

/// `connections` clients asking for `body` back to back for `seconds`: tokens/s over all of
/// them, and the tokens of each answer on average.
fn rate(server: &Server, body: &[u8], connections: usize, seconds: f64) -> (f64, f64) {
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(seconds);
    let counts: Vec<(u64, u64)> = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..connections)
            .map(|_| {
                scope.spawn(|| {
                    let client = reqwest::blocking::Client::new();
                    let (mut tokens, mut answers) = (0, 0);
                    while Instant::now() < until {
                        let response = client
                            .post(server.url("/v1/chat/completions"))
                            .header("content-type", "application/json")
                            .body(body.to_vec())
                            .send()
                            .unwrap();
                        assert!(response.status().is_success(), "{:?}", response.text());
                        let answer: Value = response.json().unwrap();
                        tokens += answer["usage"]["completion_tokens"].as_u64().unwrap();
                        answers += 1;
                    }
                    (tokens, answers)
                })
            })
            .collect();
        clients.into_iter().map(|c| c.join().unwrap()).collect()
    });
    let tokens: u64 = counts.iter().map(|c| c.0).sum();
    let answers: u64 = counts.iter().map(|c| c.1).sum();
    (
        tokens as f64 / started.elapsed().as_secs_f64(),
        tokens as f64 / answers as f64,
    )
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument, if any, is ignored.
    let started = Instant::now();
    let machine = Machine::now();
    let runs: usize = arg("--runs", 6);
    let seconds: f64 = arg("--seconds", 4.0);
    let mut figures = Vec::new();
    let fixture =
        tokenizers::Tokenizer::from_file(Path::new(env!("CARGO_MANIFEST_DIR")).join("models/decoder/tokenizer.json"))
            .unwrap();
    in_process("fixture", fixture, &mut figures);
    in_process("129k vocabulary", synthetic_tokenizer(), &mut figures);
    let scratch = Scratch::new();
    for (label, dir, max_tokens) in decoders() {
        let server = Server::vramguard(env!("CARGO_BIN_EXE_vramguard"), &scratch, label, &config(&dir));
        let (plain, constrained) = (body(max_tokens, false), body(max_tokens, true));
        for connections in [1, 8] {
            let mut lengths = (Vec::new(), Vec::new());
            let paired = Paired::measure(
                runs,
                || {
                    let (r, n) = rate(&server, &plain, connections, seconds);
                    lengths.0.push(n);
                    r
                },
                || {
                    let (r, n) = rate(&server, &constrained, connections, seconds);
                    lengths.1.push(n);
                    r
                },
            );
            let ratios: Vec<f64> = paired.b.iter().zip(&paired.a).map(|(b, a)| b / a).collect();
            let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
            figures.push(Figure::of_runs(
                format!("tokens/s unconstrained, c{connections} ({label})"),
                "tok/s",
                &paired.a,
            ));
            figures.push(Figure::of_runs(
                format!("tokens/s constrained, c{connections} ({label})"),
                "tok/s",
                &paired.b,
            ));
            figures.push(
                Figure::of_runs(format!("constrained / unconstrained tokens/s, c{connections} ({label})"), "×", &ratios)
                    .target(Target::AtLeast(0.95))
                    .note(format!(
                        "the median of {runs} pairs of {seconds} s runs, order alternated; {:.1} and {:.1} tokens an answer",
                        mean(&lengths.1),
                        mean(&lengths.0)
                    )),
            );
        }
    }
    print_table(&figures);
    record(
        "structured",
        &out_dir(env!("CARGO_TARGET_TMPDIR")),
        machine,
        started,
        figures,
    );
}
