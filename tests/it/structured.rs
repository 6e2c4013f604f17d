//! Structured outputs on the real exports (`models/real/`, random weights: only the grammar
//! keeps their answers valid): several models served at once, each given concurrent chat
//! requests with different schemas, a JSON object, a forced tool call and a streamed answer, so
//! that the rows of each model's batch run under different grammars; every answer parses and
//! follows its own schema. A schema the engine cannot compile is refused before admission.

use crate::common::TestServer;
use crate::generation::events;
use reqwest::StatusCode;
use serde_json::{Value, json};
use vramguard::testing::Scratch;

/// Three families, each its own model (and batch) on one CPU pool.
const FOLDERS: [&str; 3] = ["qwen2-optimum", "llama-genai", "gemma-optimum"];

/// A ChatML template that leaves the tools out of the prompt: the fixtures take 256 positions,
/// fewer than their real templates' tool preambles, and a grammar forces a call whatever the
/// prompt says.
const BARE: &str = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}{{ '<|im_start|>assistant\\n' }}";

/// Each folder as `<folder>`, with its real chat template, and as `<folder>-calls`, with
/// [`BARE`].
fn config(scratch: &Scratch) -> String {
    let bare = scratch.write("bare.jinja", BARE);
    let models: Vec<String> = FOLDERS
        .iter()
        .flat_map(|f| {
            let model = format!("path: models/real/{f}/model.onnx, tokenizer: models/real/{f}/tokenizer.json");
            [
                format!("{{name: {f}, {model}}}"),
                format!("{{name: {f}-calls, {model}, chat_template: '{}'}}", bare.display()),
            ]
        })
        .collect();
    let names: Vec<String> = FOLDERS
        .iter()
        .flat_map(|f| [f.to_string(), format!("{f}-calls")])
        .collect();
    format!(
        "models: [{}]\npools: [{{name: cpu, provider: cpu, models: [{}]}}]\n",
        models.join(", "),
        names.join(", ")
    )
}

/// A forecast: an enum, a bounded integer, a boolean, all required.
fn forecast() -> Value {
    json!({"type": "object", "properties": {
        "sky": {"enum": ["clear", "cloudy", "rain"]},
        "celsius": {"type": "integer", "minimum": -30, "maximum": 45},
        "windy": {"type": "boolean"}},
      "required": ["sky", "celsius", "windy"], "additionalProperties": false})
}

/// A list: a short string and one to three tags.
fn listing() -> Value {
    json!({"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
      "required": ["title", "tags"], "additionalProperties": false})
}

/// Whether `value` follows `schema`, for the keywords these tests use; why not, if it does not.
fn follows(value: &Value, schema: &Value) -> Result<(), String> {
    let fail = |why: &str| Err(format!("{value} {why} ({schema})"));
    if let Some(allowed) = schema["enum"].as_array()
        && !allowed.contains(value)
    {
        return fail("is not in the enum");
    }
    match schema["type"].as_str() {
        Some("object") => {
            let Some(object) = value.as_object() else {
                return fail("is not an object");
            };
            let properties = schema["properties"].as_object().cloned().unwrap_or_default();
            for name in schema["required"].as_array().into_iter().flatten() {
                if !object.contains_key(name.as_str().unwrap()) {
                    return fail(&format!("lacks {name}"));
                }
            }
            for (name, field) in object {
                match properties.get(name) {
                    Some(property) => follows(field, property)?,
                    None if schema["additionalProperties"] == false => return fail(&format!("has {name}")),
                    None => {}
                }
            }
        }
        Some("array") => {
            let Some(items) = value.as_array() else {
                return fail("is not an array");
            };
            let count = items.len() as u64;
            if schema["minItems"].as_u64().is_some_and(|m| count < m)
                || schema["maxItems"].as_u64().is_some_and(|m| count > m)
            {
                return fail("has a wrong number of items");
            }
            items.iter().try_for_each(|item| follows(item, &schema["items"]))?;
        }
        Some("integer") => {
            let Some(n) = value.as_i64() else {
                return fail("is not an integer");
            };
            if schema["minimum"].as_i64().is_some_and(|m| n < m) || schema["maximum"].as_i64().is_some_and(|m| n > m) {
                return fail("is out of range");
            }
        }
        Some("string") => {
            let Some(s) = value.as_str() else {
                return fail("is not a string");
            };
            if schema["maxLength"]
                .as_u64()
                .is_some_and(|m| s.chars().count() as u64 > m)
            {
                return fail("is too long");
            }
        }
        Some("boolean") if !value.is_boolean() => return fail("is not a boolean"),
        _ => {}
    }
    Ok(())
}

/// What a request asks for and how its answer is checked.
enum Ask {
    /// A `json_schema` response format, streamed or not.
    Schema(Value, bool),
    /// `json_object`.
    Object,
    /// A call of `forecast`, forced by name, its arguments the forecast schema.
    Call,
}

fn body(model: &str, ask: &Ask, seed: u64) -> Value {
    let mut body = json!({"model": model, "messages": [{"role": "user", "content": "Answer, please."}],
                          "max_tokens": 120, "temperature": 1.0, "seed": seed});
    match ask {
        Ask::Schema(schema, stream) => {
            body["response_format"] =
                json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": true}});
            body["stream"] = json!(stream);
        }
        Ask::Object => body["response_format"] = json!({"type": "json_object"}),
        Ask::Call => {
            body["tools"] = json!([
                {"type": "function", "function": {"name": "forecast", "parameters": forecast(), "strict": true}},
                {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]);
            body["tool_choice"] = json!({"type": "function", "function": {"name": "forecast"}});
        }
    }
    body
}

/// Ask `model` and check the answer: it ended by its grammar and follows its schema.
async fn ask(server: &TestServer, model: String, ask: Ask, seed: u64) -> Result<(), String> {
    let response = server
        .post_json("/v1/chat/completions", &body(&model, &ask, seed))
        .await;
    let status = response.status();
    if status != StatusCode::OK {
        return Err(format!("{model}: {status} {}", response.text().await.unwrap()));
    }
    let (content, finish, calls) = if matches!(ask, Ask::Schema(_, true)) {
        let chunks = events(response).await;
        let content: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        let finish = chunks
            .iter()
            .find_map(|c| c["choices"][0]["finish_reason"].as_str().map(str::to_string));
        (content, finish.unwrap_or_default(), Value::Null)
    } else {
        let body: Value = response.json().await.unwrap();
        let choice = &body["choices"][0];
        let content = choice["message"]["content"].as_str().unwrap_or_default().to_string();
        (
            content,
            choice["finish_reason"].as_str().unwrap().to_string(),
            choice["message"]["tool_calls"].clone(),
        )
    };
    let what = |why: String| format!("{model}, seed {seed}: {why}");
    match &ask {
        Ask::Call => {
            if finish != "tool_calls" || calls[0]["function"]["name"] != "forecast" {
                return Err(what(format!("no call of forecast: {finish} {calls} {content:?}")));
            }
            let arguments: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap())
                .map_err(|e| what(format!("arguments: {e}")))?;
            follows(&arguments, &forecast()).map_err(what)
        }
        Ask::Schema(..) | Ask::Object if finish == "stop" => {
            let value: Value = serde_json::from_str(&content).map_err(|e| what(format!("{e}: {content:?}")))?;
            let schema = if let Ask::Schema(schema, _) = &ask {
                schema.clone()
            } else {
                json!({"type": "object"})
            };
            follows(&value, &schema).map_err(what)
        }
        // Any object's keys and strings are unbounded, and random weights rarely close one: it
        // may run to `max_tokens`, as OpenAI's may.
        Ask::Object if finish == "length" => Ok(()),
        _ => Err(what(format!("finished by {finish}: {content:?}"))),
    }
}

#[tokio::test]
async fn concurrent_rows_of_each_model_s_batch_keep_their_own_grammars() {
    let scratch = Scratch::new();
    let server = TestServer::start(&config(&scratch)).await;
    let mut asks = Vec::new();
    for folder in FOLDERS {
        let calls = format!("{folder}-calls");
        for seed in 0..2 {
            asks.push(ask(
                &server,
                folder.to_string(),
                Ask::Schema(forecast(), seed == 1),
                seed,
            ));
            asks.push(ask(&server, folder.to_string(), Ask::Schema(listing(), false), seed));
            asks.push(ask(&server, calls.clone(), Ask::Call, seed));
        }
        asks.push(ask(&server, folder.to_string(), Ask::Object, 7));
        asks.push(ask(&server, calls, Ask::Schema(listing(), true), 7));
    }
    let failures: Vec<String> = futures_util::future::join_all(asks)
        .await
        .into_iter()
        .filter_map(Result::err)
        .collect();
    assert!(failures.is_empty(), "{failures:#?}");
    server.stop().await;
}

#[tokio::test]
async fn a_schema_the_engine_cannot_compile_is_a_400_naming_it_before_admission() {
    let scratch = Scratch::new();
    let server = TestServer::start(&config(&scratch)).await;
    let model = FOLDERS[0];
    let cases = [
        (
            body(
                model,
                &Ask::Schema(json!({"type": "string", "format": "no-such-format"}), false),
                0,
            ),
            "response_format",
            "no-such-format",
        ),
        (
            {
                let mut b = body(model, &Ask::Call, 0);
                b["tools"][0]["function"]["parameters"] =
                    json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}});
                b
            },
            "tools",
            "gone",
        ),
        (
            {
                let mut b = body(model, &Ask::Call, 0);
                b["tool_choice"] = json!({"type": "function", "function": {"name": "absent"}});
                b
            },
            "tool_choice",
            "absent",
        ),
        (
            {
                let mut b = body(model, &Ask::Object, 0);
                b["response_format"] = json!({"type": "yaml"});
                b
            },
            "response_format.type",
            "json_schema",
        ),
    ];
    for (body, param, named) in cases {
        let response = server.post_json("/v1/chat/completions", &body).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["param"], param, "{error}");
        assert!(error["error"]["message"].as_str().unwrap().contains(named), "{error}");
    }
    // None of them was admitted: nothing ran.
    let metrics = server.metrics().await;
    let generated = crate::common::sum_samples(&metrics, |l| l.starts_with("vramguard_generated_tokens_total{"));
    assert_eq!(generated, 0.0, "{metrics}");
    server.stop().await;
}

/// What a choice of a combined request said: its text, why it ended, its tokens' logprobs.
type Said = (String, String, Vec<Value>);

/// The choices of `body`'s answer by index, whole or streamed (deltas joined per index).
async fn choices(server: &TestServer, body: &Value) -> Vec<Said> {
    let response = server.post_json("/v1/chat/completions", body).await;
    assert_eq!(response.status(), StatusCode::OK);
    let n = body["n"].as_u64().unwrap() as usize;
    let mut said: Vec<Said> = vec![Default::default(); n];
    let take = |said: &mut Said, choice: &Value, text: Option<&str>| {
        said.0.push_str(text.unwrap_or_default());
        if let Some(finish) = choice["finish_reason"].as_str() {
            said.1 = finish.to_string();
        }
        said.2
            .extend(choice["logprobs"]["content"].as_array().into_iter().flatten().cloned());
    };
    if body["stream"] == true {
        for chunk in events(response).await {
            for choice in chunk["choices"].as_array().into_iter().flatten() {
                let index = choice["index"].as_u64().unwrap() as usize;
                take(&mut said[index], choice, choice["delta"]["content"].as_str());
            }
        }
    } else {
        let answer: Value = response.json().await.unwrap();
        for choice in answer["choices"].as_array().unwrap() {
            let index = choice["index"].as_u64().unwrap() as usize;
            take(&mut said[index], choice, choice["message"]["content"].as_str());
        }
    }
    said
}

/// `n` choices under one schema with logprobs, whole and streamed: each choice follows the
/// schema (its own matcher, from one prefill), carries the logprobs of exactly its tokens
/// (joined, their bytes are its text), and the same seed gives the same choices either way.
#[tokio::test]
async fn n_choices_each_follow_the_schema_and_carry_their_own_logprobs() {
    let scratch = Scratch::new();
    let server = TestServer::start(&config(&scratch)).await;
    let mut body = body(FOLDERS[1], &Ask::Schema(forecast(), false), 11);
    body["n"] = json!(3);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(2);
    let whole = choices(&server, &body).await;
    body["stream"] = json!(true);
    let streamed = choices(&server, &body).await;
    assert_eq!(whole, streamed, "streamed choices are the whole answer's");
    for (index, (text, finish, logprobs)) in whole.iter().enumerate() {
        assert_eq!(finish, "stop", "choice {index}: {text:?}");
        let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("choice {index}: {e}: {text:?}"));
        follows(&value, &forecast()).unwrap();
        let bytes: Vec<u8> = logprobs
            .iter()
            .flat_map(|t| t["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8))
            .collect();
        assert_eq!(
            String::from_utf8(bytes).unwrap(),
            *text,
            "choice {index}'s tokens are its text"
        );
        for token in logprobs {
            let logprob = token["logprob"].as_f64().unwrap();
            assert!(logprob <= 0.0, "{token}");
            let top = token["top_logprobs"].as_array().unwrap();
            assert!(!top.is_empty() && top.len() <= 2, "{token}");
            // The most likely first, and none of them less likely than the token picked among them.
            let tops: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
            assert!(tops.windows(2).all(|w| w[0] >= w[1]), "{token}");
            assert!(tops[0] >= logprob - 1e-6, "{token}");
        }
    }
    assert!(
        whole[0].0 != whole[1].0 || whole[1].0 != whole[2].0,
        "sampled choices from seeds 11, 12, 13 are not all one answer: {whole:?}"
    );
    server.stop().await;
}

/// `response_format` on `/v1/completions` (as vLLM's completions take it) constrains the
/// completion as it does a chat's answer: on each family, whole and streamed, the text ends by
/// its grammar and follows the schema. Random weights alone would not write it.
#[tokio::test]
async fn a_completion_follows_its_response_format_whole_and_streamed() {
    let scratch = Scratch::new();
    let server = TestServer::start(&config(&scratch)).await;
    for folder in FOLDERS {
        for stream in [false, true] {
            let body = json!({"model": folder, "prompt": "The forecast:", "max_tokens": 120,
                              "temperature": 1.0, "seed": 3, "stream": stream,
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "forecast", "schema": forecast(), "strict": true}}});
            let response = server.post_json("/v1/completions", &body).await;
            assert_eq!(response.status(), StatusCode::OK, "{folder}");
            let (text, finish) = if stream {
                let chunks = events(response).await;
                let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
                let finish = chunks
                    .iter()
                    .find_map(|c| c["choices"][0]["finish_reason"].as_str().map(str::to_string));
                (text, finish.unwrap_or_default())
            } else {
                let answer: Value = response.json().await.unwrap();
                let choice = &answer["choices"][0];
                (
                    choice["text"].as_str().unwrap().to_string(),
                    choice["finish_reason"].as_str().unwrap().to_string(),
                )
            };
            assert_eq!(finish, "stop", "{folder}, streamed {stream}: {text:?}");
            let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{folder}: {e}: {text:?}"));
            follows(&value, &forecast()).unwrap();
        }
    }
    server.stop().await;
}
