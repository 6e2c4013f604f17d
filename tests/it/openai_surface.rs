//! The OpenAI surface beyond one prompt and one answer, with real ONNX Runtime on the tiny
//! decoder fixture (`models/decoder/`), served from the CPU: `GET /v1/models/{id}` (OpenAI's 404
//! for any name not served, one with `/` in it included); a completion's `prompt` in each form
//! OpenAI takes, each prompt its own choice, and `echo`, whole and streamed; `n` generations of
//! each prompt from one run of it (on the fixture, on a real export of each padding side, and
//! in a worker process), admitted as `n` caches; a choice failing mid-stream named in the
//! stream's `error` event.

use crate::common::TestServer;
use reqwest::StatusCode;
use serde_json::{Value, json};

const CONFIG: &str = "\
models: [{name: tiny, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json,
          chat_template: 'builtin:chatml'},
         {name: encoder, path: 'builtin:encoder'}]
pools:
- {name: cpu, provider: cpu, models: [tiny, encoder]}
";

/// `GET path` on `server`: its status and JSON body.
async fn get(server: &TestServer, path: &str) -> (StatusCode, Value) {
    let response = reqwest::get(server.url(path)).await.unwrap();
    (response.status(), response.json().await.unwrap())
}

/// `client.models.retrieve(id)`: the list's own entry for a text model; OpenAI's 404
/// `model_not_found` for a name not served and for a model that does not generate text. A
/// configured name is one path segment, but an id with `/` in it (`org/model`, as OpenAI-style
/// clients write one) reaches the route too, and is answered as OpenAI answers it, not as a
/// path no route serves.
#[tokio::test]
async fn a_model_is_retrieved_by_its_id_and_any_other_is_model_not_found() {
    let server = TestServer::start(CONFIG).await;
    let (status, list) = get(&server, "/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    for entry in list["data"].as_array().unwrap() {
        let id = entry["id"].as_str().unwrap();
        let (status, model) = get(&server, &format!("/v1/models/{id}")).await;
        assert_eq!(status, StatusCode::OK, "{id}: {model}");
        assert_eq!(&model, entry, "the list's entry");
    }
    assert_eq!(crate::common::model_ids(&list), ["tiny"]);
    for id in ["nope", "encoder", "org/tiny", "tiny/extra"] {
        let (status, error) = get(&server, &format!("/v1/models/{id}")).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{id}: {error}");
        let error = &error["error"];
        assert_eq!(error["code"], "model_not_found", "{id}: {error}");
        assert_eq!(error["type"], "not_found_error", "{id}: {error}");
        assert_eq!(error["param"], "model", "{id}: {error}");
        assert!(error["message"].as_str().unwrap().contains(id), "{id}: {error}");
    }
    server.stop().await;
}

/// `client.models.list()` names every model a `/v1/` endpoint serves, each with the fields
/// OpenAI's model object has (and the `openai` package's `Model` requires), each retrieved by
/// its id: a decoder, a sentence-transformers embedder, a cross-encoder, both towers of CLIP
/// (texts to one, images to the other) and Whisper. A model only the tensor API serves is not.
#[tokio::test]
async fn every_model_a_v1_endpoint_serves_is_listed_with_openais_fields() {
    let server = TestServer::start(
        "\
models: [{name: tiny, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json},
         {name: encoder, path: 'builtin:encoder'},
         {name: mean, path: models/embed/bert-mean-normalize/model.onnx},
         {name: rerank, path: models/embed/bert-cross-encoder/model.onnx},
         {name: clip, path: models/embed/clip/text_model.onnx, images: clip-vision},
         {name: clip-vision, path: models/embed/clip/vision_model.onnx},
         {name: whisper, path: 'builtin:whisper'}]
pools:
- {name: cpu, provider: cpu, models: [tiny, encoder, mean, rerank, clip, clip-vision, whisper]}
",
    )
    .await;
    let (status, list) = get(&server, "/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(list["object"], "list", "{list}");
    let mut ids = crate::common::model_ids(&list);
    ids.sort_unstable();
    assert_eq!(
        ids,
        ["clip", "clip-vision", "mean", "rerank", "tiny", "whisper"],
        "{list}"
    );
    for entry in list["data"].as_array().unwrap() {
        let id = entry["id"].as_str().unwrap();
        assert_eq!(
            (
                &entry["object"],
                entry["created"].is_u64(),
                entry["owned_by"].is_string()
            ),
            (&json!("model"), true, true),
            "{entry}"
        );
        let (status, model) = get(&server, &format!("/v1/models/{id}")).await;
        assert_eq!((status, &model), (StatusCode::OK, entry), "{id}");
    }
    server.stop().await;
}

/// The fixture's reference cases, by name: prompt, its token ids and its greedy text.
fn case(name: &str) -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/models/decoder/reference.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = reference["cases"].as_array().unwrap();
    cases.iter().find(|c| c["name"] == name).unwrap().clone()
}

/// A greedy completion of 16 tokens of `prompt`, with `extra` fields.
fn greedy(prompt: Value, extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

/// `POST /v1/completions`: its status and JSON body.
async fn complete(server: &TestServer, body: &Value) -> (StatusCode, Value) {
    let response = server.post_json("/v1/completions", body).await;
    (response.status(), response.json().await.unwrap())
}

/// Each choice's text, joined from a stream's chunks by `index`, and each one's finish reason;
/// the stream's `usage` (on its last chunk).
fn joined(chunks: &[Value], choices: usize) -> (Vec<String>, Vec<String>, Value) {
    let mut texts = vec![String::new(); choices];
    let mut finishes = vec![String::new(); choices];
    for chunk in chunks {
        let choice = &chunk["choices"][0];
        let index = choice["index"].as_u64().unwrap() as usize;
        texts[index].push_str(choice["text"].as_str().unwrap());
        if let Some(finish) = choice["finish_reason"].as_str() {
            assert!(finishes[index].is_empty(), "choice {index} finished twice: {chunks:?}");
            finishes[index] = finish.to_string();
        }
    }
    let last = chunks.last().unwrap();
    assert!(last["usage"].is_object(), "usage comes last: {last}");
    (texts, finishes, last["usage"].clone())
}

/// `prompt` as a string, an array of strings, token ids and arrays of token ids: each prompt
/// is its own choice, in order, with the text it has alone; usage sums them; streamed, each
/// chunk names its choice, and the choices' texts are the same. Each prompt is a generation
/// of its own, counted as one request.
#[tokio::test]
async fn every_prompt_form_is_its_own_choice_with_the_text_it_has_alone() {
    let server = TestServer::start(CONFIG).await;
    let names = ["short", "stop", "long"];
    let cases: Vec<Value> = names.iter().map(|n| case(n)).collect();
    let mut alone = Vec::new();
    for case in &cases {
        let (status, body) = complete(&server, &greedy(case["prompt"].clone(), json!({}))).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["choices"][0]["text"], case["text"], "{body}");
        alone.push(body);
    }
    let texts: Vec<Value> = cases.iter().map(|c| c["prompt"].clone()).collect();
    let ids: Vec<Value> = cases.iter().map(|c| c["prompt_ids"].clone()).collect();
    let forms = [
        ("strings", json!(texts)),
        ("token arrays", json!(ids)),
        ("one string in an array", json!([texts[0]])),
        ("token ids", ids[0].clone()),
    ];
    for (form, prompt) in forms {
        let (status, body) = complete(&server, &greedy(prompt.clone(), json!({}))).await;
        assert_eq!(status, StatusCode::OK, "{form}: {body}");
        let choices = body["choices"].as_array().unwrap();
        let count = if prompt[0].is_string() || prompt[0].is_array() {
            prompt.as_array().unwrap().len()
        } else {
            1
        };
        assert_eq!(choices.len(), count, "{form}: {body}");
        let mut usage = (0, 0);
        for (i, choice) in choices.iter().enumerate() {
            assert_eq!(choice["index"], i, "{form}: {body}");
            assert_eq!(choice["text"], alone[i]["choices"][0]["text"], "{form}: choice {i}");
            assert_eq!(choice["finish_reason"], alone[i]["choices"][0]["finish_reason"]);
            usage.0 += alone[i]["usage"]["prompt_tokens"].as_u64().unwrap();
            usage.1 += alone[i]["usage"]["completion_tokens"].as_u64().unwrap();
        }
        assert_eq!(
            body["usage"],
            json!({"prompt_tokens": usage.0, "completion_tokens": usage.1, "total_tokens": usage.0 + usage.1}),
            "{form}"
        );
        // Streamed: the same choices, each chunk naming its own.
        let response = server
            .post_json("/v1/completions", &greedy(prompt, json!({"stream": true})))
            .await;
        let chunks = crate::generation::events(response).await;
        let (streamed, finishes, streamed_usage) = joined(&chunks, count);
        for i in 0..count {
            assert_eq!(
                streamed[i],
                alone[i]["choices"][0]["text"].as_str().unwrap(),
                "{form}: {i}"
            );
            assert_eq!(finishes[i], alone[i]["choices"][0]["finish_reason"].as_str().unwrap());
        }
        assert_eq!(streamed_usage, body["usage"], "{form}");
    }
    // 4 alone, then 3 + 3 + 1 + 1 prompts, twice each: one request per prompt.
    let metrics = server.metrics().await;
    let ok = crate::common::requests_with(&metrics, |o| o == "ok");
    assert_eq!(ok, (3 + 2 * (3 + 3 + 1 + 1)) as f64, "{metrics}");
    server.stop().await;
}

/// `echo` puts the prompt's text before each choice's (the first chunk of each streamed
/// choice); token ids are echoed as their text. A prompt OpenAI would not take, a token id the
/// model does not have, and `echo` with `logprobs` (the prompt's run has no logits for the
/// prompt's own tokens) are 400s naming the field.
#[tokio::test]
async fn echo_puts_the_prompt_first_and_bad_prompts_are_refused_by_name() {
    let server = TestServer::start(CONFIG).await;
    let short = case("short");
    let stop = case("stop");
    let prompts = json!([short["prompt_ids"], stop["prompt_ids"]]);
    let (status, body) = complete(&server, &greedy(prompts.clone(), json!({"echo": true}))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    for (i, case) in [&short, &stop].into_iter().enumerate() {
        let want = format!("{}{}", case["prompt"].as_str().unwrap(), case["text"].as_str().unwrap());
        assert_eq!(body["choices"][i]["text"], want, "{body}");
    }
    let response = server
        .post_json(
            "/v1/completions",
            &greedy(prompts, json!({"echo": true, "stream": true})),
        )
        .await;
    let chunks = crate::generation::events(response).await;
    for (i, case) in [&short, &stop].into_iter().enumerate() {
        let first = chunks.iter().find(|c| c["choices"][0]["index"] == i).unwrap();
        assert_eq!(first["choices"][0]["text"], case["prompt"], "{chunks:?}");
    }
    let (texts, _, _) = joined(&chunks, 2);
    assert_eq!(texts[0], body["choices"][0]["text"].as_str().unwrap());
    assert_eq!(texts[1], body["choices"][1]["text"].as_str().unwrap());
    let (_, body) = complete(&server, &greedy(stop["prompt"].clone(), json!({"echo": true}))).await;
    assert_eq!(body["choices"][0]["text"], texts[1], "a text prompt echoes as sent");

    let vocabulary = 512;
    for (prompt, extra, param) in [
        (json!([1, vocabulary]), json!({}), "prompt"),
        (json!([[1, 2], [3, -1]]), json!({}), "prompt"),
        (json!([]), json!({}), "prompt"),
        (json!([[]]), json!({}), "prompt"),
        (json!(["x", 5]), json!({}), "prompt"),
        (json!({"text": "x"}), json!({}), "prompt"),
        (json!("x"), json!({"echo": true, "logprobs": 2}), "echo"),
        (json!("x"), json!({"best_of": 2}), "best_of"),
    ] {
        let (status, error) = complete(&server, &greedy(prompt.clone(), extra)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{prompt}: {error}");
        assert_eq!(error["error"]["param"], param, "{prompt}: {error}");
    }
    let (_, error) = complete(&server, &greedy(json!([1, vocabulary]), json!({}))).await;
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains(&format!("token id {vocabulary}")), "{message}");
    let (_, error) = complete(&server, &greedy(json!("x"), json!({"echo": true, "logprobs": 2}))).await;
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("last position"), "says why: {message}");
    server.stop().await;
}

/// `n` for completions and chat: at temperature 0, `n` copies of the one answer; sampled with a
/// seed, the same `n` answers each time, not all alike; streamed, the same choices. Each
/// choice is a request of its own (and a first token of its own); the prompt counts once in
/// `usage`. Prompts times `n` past 128, and `best_of` other than `n`, are 400s.
#[tokio::test]
async fn n_choices_are_n_generations_of_one_prompt() {
    let server = TestServer::start(CONFIG).await;
    let short = case("short");
    let (_, one) = complete(&server, &greedy(short["prompt"].clone(), json!({}))).await;
    let (status, three) = complete(&server, &greedy(short["prompt"].clone(), json!({"n": 3, "best_of": 3}))).await;
    assert_eq!(status, StatusCode::OK, "{three}");
    let choices = three["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{three}");
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["text"], one["choices"][0]["text"], "{three}");
    }
    let prompt_tokens = one["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(three["usage"]["prompt_tokens"], prompt_tokens, "the prompt counts once");
    assert_eq!(three["usage"]["completion_tokens"], 3 * 16);

    // Two prompts, two choices each: prompt 0's, then prompt 1's.
    let stop = case("stop");
    let both = json!([short["prompt"], stop["prompt"]]);
    let (_, four) = complete(&server, &greedy(both.clone(), json!({"n": 2}))).await;
    let texts: Vec<&str> = four["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    let (short_text, stop_text) = (short["text"].as_str().unwrap(), stop["text"].as_str().unwrap());
    assert_eq!(texts, [short_text, short_text, stop_text, stop_text], "{four}");
    let response = server
        .post_json("/v1/completions", &greedy(both, json!({"n": 2, "stream": true})))
        .await;
    let chunks = crate::generation::events(response).await;
    let (streamed, _, usage) = joined(&chunks, 4);
    assert_eq!(streamed, texts);
    assert_eq!(usage, four["usage"]);

    // Sampled: repeatable with a seed, and the choices are not all one answer.
    let sampled = json!({"model": "tiny", "prompt": short["prompt"], "max_tokens": 16, "temperature": 1,
                         "seed": 11, "n": 4});
    let (_, first) = complete(&server, &sampled).await;
    let (_, again) = complete(&server, &sampled).await;
    assert_eq!(first["choices"], again["choices"], "the same seed, the same choices");
    let texts: Vec<&str> = first["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert!(texts.iter().any(|t| *t != texts[0]), "{texts:?}");

    // Chat, whole and streamed.
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": short["prompt"]}],
                      "max_tokens": 8, "temperature": 0, "n": 2});
    let response = server.post_json("/v1/chat/completions", &chat).await;
    assert_eq!(response.status(), StatusCode::OK);
    let whole: Value = response.json().await.unwrap();
    let choices = whole["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{whole}");
    assert_eq!(choices[0]["message"], choices[1]["message"], "{whole}");
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let chunks = crate::generation::events(server.post_json("/v1/chat/completions", &streamed).await).await;
    let mut contents = [String::new(), String::new()];
    for chunk in &chunks {
        let choice = &chunk["choices"][0];
        let index = choice["index"].as_u64().unwrap() as usize;
        contents[index].push_str(choice["delta"]["content"].as_str().unwrap_or_default());
    }
    for (index, content) in contents.iter().enumerate() {
        assert_eq!(
            content,
            choices[index]["message"]["content"].as_str().unwrap(),
            "{chunks:?}"
        );
        let role = chunks.iter().find(|c| c["choices"][0]["index"] == index).unwrap();
        assert_eq!(role["choices"][0]["delta"]["role"], "assistant", "{chunks:?}");
    }

    // Each choice counted as a request, each with its first token: 1 + 3 + 2 × (2 + 2) + 2 × 4
    // + 2 × 2 completions and chats.
    let metrics = server.metrics().await;
    let generations = (1 + 3 + 2 * (2 + 2) + 2 * 4 + 2 * 2) as f64;
    assert_eq!(
        crate::common::requests_with(&metrics, |o| o == "ok"),
        generations,
        "{metrics}"
    );
    let first_tokens = crate::common::sum_samples(&metrics, |l| {
        l.starts_with("vramguard_time_to_first_token_seconds_count{model=\"tiny\"")
    });
    assert_eq!(first_tokens, generations, "{metrics}");

    for (extra, param) in [
        (json!({"n": 129}), "n"),
        (json!({"n": 0}), "n"),
        (json!({"n": 2, "best_of": 3}), "best_of"),
    ] {
        let (status, error) = complete(&server, &greedy(json!("x"), extra.clone())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{extra}: {error}");
        assert_eq!(error["error"]["param"], param, "{extra}: {error}");
    }
    let prompts: Vec<&str> = vec!["x"; 65];
    let (status, error) = complete(&server, &greedy(json!(prompts), json!({"n": 2}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{error}");
    assert!(
        error["error"]["message"].as_str().unwrap().contains("130 choices"),
        "{error}"
    );
    server.stop().await;
}

/// On real exports, one padded on the left (Optimum's Llama) and one on the right (the GenAI
/// builder's Qwen2, `GroupQueryAttention`): `n` copies of a prompt's cache made on the runtime's
/// side generate the text `transformers` does for that prompt alone, two prompts at once.
#[tokio::test]
async fn n_choices_of_real_exports_each_generate_the_reference_text() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/models/real/reference.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let max_tokens = reference["max_new_tokens"].clone();
    for folder in ["llama-optimum", "qwen2-genai"] {
        let config = format!(
            "models: [{{name: m, path: models/real/{folder}/model.onnx, tokenizer: models/real/{folder}/tokenizer.json}}]\n\
             pools: [{{name: cpu, provider: cpu, models: [m]}}]\n"
        );
        let server = TestServer::start(&config).await;
        let cases = reference["models"][folder]["cases"].as_array().unwrap();
        let prompts: Vec<&Value> = cases.iter().take(2).map(|c| &c["prompt"]).collect();
        let body = json!({"model": "m", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "n": 3});
        let (status, answer) = complete(&server, &body).await;
        assert_eq!(status, StatusCode::OK, "{folder}: {answer}");
        let choices = answer["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 6, "{folder}: {answer}");
        for (i, choice) in choices.iter().enumerate() {
            assert_eq!(choice["text"], cases[i / 3]["text"], "{folder}: choice {i}");
        }
        server.stop().await;
    }
}

/// `n` generations are admitted as `n` caches: the policy sees them as the request's batch,
/// and the estimate holds `n` caches of the prompt and `max_tokens`.
#[tokio::test]
async fn n_generations_are_admitted_as_n_caches() {
    const POLICY: &str = r#"fn decide(req, state) {
        if req.max_new_tokens == 7 { reject(`batch=${req.batch} context_bytes=${req.estimate.context_bytes}.`) } else { admit() }
    }"#;
    let server = TestServer::with_policy(CONFIG, POLICY).await;
    let seen = async |n: u64| -> (u64, u64) {
        let body = json!({"model": "tiny", "prompt": "The GPU", "max_tokens": 7, "n": n});
        let (status, body) = complete(&server, &body).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        let message = body["error"]["message"].as_str().unwrap().to_string();
        let number = |key: &str| -> u64 {
            let at = message.find(key).unwrap_or_else(|| panic!("{message}")) + key.len();
            message[at..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .unwrap()
        };
        (number("batch="), number("context_bytes="))
    };
    let (one, one_bytes) = seen(1).await;
    let (three, three_bytes) = seen(3).await;
    assert_eq!((one, three), (1, 3));
    assert_eq!(three_bytes, 3 * one_bytes, "three caches of the prompt and max_tokens");
    server.stop().await;
}

/// On a pool whose caches live in a worker process, `n` copies are made there: three
/// generations of a long prompt give its text each, and move less to the pool than one more
/// run of the prompt would (each step sends 24 bytes a row; the prompt's run 24 a token).
#[tokio::test]
async fn n_copies_are_made_in_the_worker_process_without_running_the_prompt_again() {
    let config = "\
models: [{name: tiny, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json}]
pools: [{name: cpu, provider: cpu, isolation: process, models: [tiny]}]
";
    let server = TestServer::start(config).await;
    let long = case("long");
    let to_pool = async || {
        let metrics = server.metrics().await;
        crate::common::sum_samples(&metrics, |l| {
            l.starts_with("vramguard_pool_transfer_bytes_total{pool=\"cpu\",direction=\"to_pool\"}")
        })
    };
    let mut moved = Vec::new();
    for n in [1, 3] {
        let before = to_pool().await;
        let (status, body) = complete(&server, &greedy(long["prompt"].clone(), json!({"n": n}))).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        for choice in body["choices"].as_array().unwrap() {
            assert_eq!(choice["text"], long["text"], "{body}");
        }
        moved.push(to_pool().await - before);
    }
    let prompt_run = 24.0 * long["prompt_ids"].as_array().unwrap().len() as f64;
    assert!(moved[0] >= prompt_run, "{moved:?}");
    assert!(
        moved[1] - moved[0] < prompt_run,
        "no second run of the prompt: {moved:?}"
    );
    server.stop().await;
}

/// A streamed answer of two choices whose step fails after tokens were sent (not replayable,
/// on a simulated accelerator told to fail its 6th run) ends with one `error` event naming the
/// choice that failed and what every choice had sent, then `[DONE]`; each choice's text sent
/// is the start of its text.
#[tokio::test]
async fn a_choice_failing_mid_stream_ends_the_stream_with_an_error_naming_it() {
    if crate::common::ran_in_own_process() {
        return;
    }
    let config = "\
devices: [{name: gpu0, kind: simulated, capacity: 256MiB}]
models: [{name: tiny, path: models/decoder/model.onnx, tokenizer: models/decoder/tokenizer.json}]
pools:
- {name: gpu, provider: simulated, device: gpu0, models: [tiny], breaker: {failures: 100, window: 60s, cooldown: 1h}}
";
    let server = TestServer::start(config).await;
    let injected = server
        .post_json("/admin/sim/gpu0", &json!({"pass_first": 5, "fail_next": 1}))
        .await;
    assert_eq!(injected.status(), StatusCode::OK);
    let short = case("short");
    let response = reqwest::Client::new()
        .post(server.url("/v1/completions"))
        .header("x-request-id", "two-1")
        .header("x-vramguard-replayable", "false")
        .json(&greedy(short["prompt"].clone(), json!({"n": 2, "stream": true})))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let chunks = crate::generation::events(response).await;
    let (last, sent) = chunks.split_last().unwrap();
    let error = &last["error"];
    assert_eq!(error["request_id"], "two-1", "{chunks:?}");
    let failed = error["index"].as_u64().expect("the choice that failed") as usize;
    assert!(failed < 2, "{error}");
    let choices = error["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{error}");
    assert_eq!(error["tokens_sent"], choices[failed]["tokens_sent"], "{error}");
    assert!(
        error["message"].as_str().unwrap().contains(&format!("choice {failed}")),
        "{error}"
    );
    for (index, choice) in choices.iter().enumerate() {
        let text: String = sent
            .iter()
            .filter(|c| c["choices"][0]["index"] == index)
            .map(|c| c["choices"][0]["text"].as_str().unwrap())
            .collect();
        assert!(
            short["text"].as_str().unwrap().starts_with(&text),
            "choice {index}: {text:?}"
        );
        assert!(choice["tokens_sent"].as_u64().unwrap() <= 5, "{error}");
    }
    server.stop().await;
}
