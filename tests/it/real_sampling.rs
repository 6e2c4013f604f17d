//! Log-probabilities and penalties on the models users download (`models/real/`): every folder
//! with `transformers`' weights (each Optimum export and fp32 GenAI build; not the int4 one)
//! gives, greedy through `/v1/completions`, the tokens and top-5 log-probabilities that
//! `transformers` computes on the same weights (models/real/logprobs.json, made by `make.py
//! logprobs`), plain and under `logit_bias`, `frequency_penalty`, `presence_penalty` and
//! `repetition_penalty` (`transformers`' own processors for the bias and the repetition
//! penalty). Streamed, the chunks carry the same log-probabilities, each with the text of its
//! tokens; a chat gives the log-probabilities of its rendered template's completion.

use std::sync::Arc;

use serde_json::{Map, Value, json};
use vramguard::runtime::text::TokenBytes;

use crate::common::TestServer;
use crate::generation::events;
use crate::real_models::{config, real};

/// How far a log-probability may be from `transformers`' (float32 ONNX graphs against PyTorch
/// in float64, through a log-softmax).
const TOLERANCE: f64 = 1e-3;

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(real().join("logprobs.json")).unwrap()).unwrap()
}

fn real_reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(real().join("reference.json")).unwrap()).unwrap()
}

/// The folders with `transformers`' weights and their family (the GenAI builds and the
/// external-data copy share their Optimum twin's weights).
fn folders() -> Vec<(String, String)> {
    let mut found: Vec<(String, String)> = real_reference()["models"]
        .as_object()
        .unwrap()
        .keys()
        // The builder's Gemma 2 graph gives transformers' greedy tokens but log-probabilities
        // up to 0.04 away at these weights' scale (its attention soft-capping), over TOLERANCE.
        .filter(|folder| !folder.ends_with("int4") && folder.as_str() != "gemma2-genai")
        .map(|folder| (folder.clone(), folder.split('-').next().unwrap().to_string()))
        .collect();
    found.sort();
    assert_eq!(found.len(), 13, "{found:?}");
    found
}

fn tokenizer(folder: &str) -> Arc<tokenizers::Tokenizer> {
    Arc::new(tokenizers::Tokenizer::from_file(real().join(folder).join("tokenizer.json")).unwrap())
}

/// How `folder`'s tokens read as bytes, and as text (lossy), as an answer gives them.
fn token_bytes(folder: &str) -> TokenBytes {
    TokenBytes::new(tokenizer(folder))
}

fn text(bytes: &TokenBytes, id: u64) -> String {
    String::from_utf8_lossy(&bytes.bytes(id as u32)).into_owned()
}

/// The differences between a completion's `logprobs` and the reference `steps` (`ids`,
/// `logprobs`, `top`) of its tokens, worst difference beside.
fn compare(got: &Value, steps: &Value, bytes: &TokenBytes) -> (Vec<String>, f64) {
    let mut wrong = Vec::new();
    let mut worst = 0.0f64;
    let mut near = |what: String, got: &Value, want: f64, wrong: &mut Vec<String>| match got.as_f64() {
        Some(g) if (g - want).abs() <= TOLERANCE => worst = worst.max((g - want).abs()),
        _ => wrong.push(format!("{what}: {got}, want {want}")),
    };
    let ids = steps["ids"].as_array().unwrap();
    let tokens: Vec<String> = ids.iter().map(|id| text(bytes, id.as_u64().unwrap())).collect();
    if got["tokens"] != json!(tokens) {
        wrong.push(format!("tokens {}, want {tokens:?}", got["tokens"]));
        return (wrong, worst);
    }
    for (i, want) in steps["logprobs"].as_array().unwrap().iter().enumerate() {
        near(
            format!("token {i}"),
            &got["token_logprobs"][i],
            want.as_f64().unwrap(),
            &mut wrong,
        );
        // The reference's top tokens keyed by their text, as an answer keys them.
        let want_top: Map<String, Value> = steps["top"][i]
            .as_array()
            .unwrap()
            .iter()
            .map(|pair| (text(bytes, pair[0].as_u64().unwrap()), pair[1].clone()))
            .collect();
        let got_top = got["top_logprobs"][i].as_object().cloned().unwrap_or_default();
        if got_top.keys().collect::<Vec<_>>() != want_top.keys().collect::<Vec<_>>() {
            wrong.push(format!("top of token {i}: {got_top:?}, want {want_top:?}"));
            continue;
        }
        for (token, want) in &want_top {
            near(
                format!("top {token:?} of token {i}"),
                &got_top[token],
                want.as_f64().unwrap(),
                &mut wrong,
            );
        }
    }
    (wrong, worst)
}

/// Whether each token's `text_offset` is where its text starts in the answer's `text`: a
/// token's text is there (a special token's is left out of the text), and the offsets never go
/// back. A token that holds part of a character, and the one after it, start where that
/// character does (bytes that never make one are U+FFFD in the text, when the next token
/// comes).
fn offsets_fit(text: &str, logprobs: &Value, special: &dyn Fn(&str) -> bool) -> Result<(), String> {
    let chars: Vec<char> = text.chars().collect();
    let offsets: Vec<usize> = serde_json::from_value(logprobs["text_offset"].clone()).unwrap();
    for (i, token) in logprobs["tokens"].as_array().unwrap().iter().enumerate() {
        let token = token.as_str().unwrap();
        let at = offsets[i];
        let there: String = chars.get(at..).unwrap_or_default().iter().collect();
        let after_part = i > 0 && logprobs["tokens"][i - 1].as_str().unwrap().contains('\u{FFFD}');
        let fits = match (special(token), token.contains('\u{FFFD}') || after_part) {
            (true, _) => offsets.get(i + 1).is_none_or(|next| *next == at),
            (false, true) => there.starts_with('\u{FFFD}') || there.starts_with(token.trim_start_matches('\u{FFFD}')),
            (false, false) => there.starts_with(token),
        };
        if !fits || offsets.get(i + 1).is_some_and(|next| *next < at) || at > chars.len() {
            return Err(format!("token {i} {token:?} at {at} of {text:?}: {offsets:?}"));
        }
    }
    Ok(())
}

/// A greedy completion of `prompt` with 5 log-probabilities a token, `extra` fields added.
fn completion(prompt: &Value, steps: u64, extra: &Value) -> Value {
    let mut body = json!({"model": "m", "prompt": prompt, "max_tokens": steps, "temperature": 0, "logprobs": 5});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

async fn answer(server: &TestServer, path: &str, body: &Value) -> Result<Value, String> {
    let response = server.post_json(path, body).await;
    let status = response.status();
    let answer: Value = response.json().await.unwrap();
    match status.is_success() {
        true => Ok(answer),
        false => Err(format!("{status}: {answer}")),
    }
}

/// Streamed: the chunks' text, and their `logprobs` joined (completions' lists end to end),
/// checking that each chunk's tokens' text was all sent by then: where the next token's text
/// starts is within what was sent.
async fn streamed(server: &TestServer, body: &Value) -> Result<(String, Value), String> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let response = server.post_json("/v1/completions", &body).await;
    if !response.status().is_success() {
        return Err(format!("{}: {}", response.status(), response.text().await.unwrap()));
    }
    let (mut sent, mut joined) = (String::new(), json!({}));
    // After each chunk: the tokens carried so far and the characters sent.
    let mut carried = Vec::new();
    for chunk in events(response).await {
        let choice = &chunk["choices"][0];
        sent.push_str(choice["text"].as_str().unwrap());
        if choice["logprobs"].is_null() {
            continue;
        }
        for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let list = joined[key].as_array().cloned().unwrap_or_default();
            joined[key] = json!([list, choice["logprobs"][key].as_array().unwrap().clone()].concat());
        }
        carried.push((joined["tokens"].as_array().unwrap().len(), sent.chars().count()));
    }
    let offsets = joined["text_offset"].as_array().cloned().unwrap_or_default();
    for (tokens, chars) in carried {
        if let Some(next) = offsets.get(tokens).and_then(Value::as_u64)
            && next as usize > chars
        {
            return Err(format!(
                "{tokens} tokens came with {chars} characters of {sent:?}: {joined}"
            ));
        }
    }
    Ok((sent, joined))
}

/// Serve `folder` and compare its log-probabilities with `family`'s reference, plain and
/// penalized, whole and streamed: what is wrong, and the worst difference.
async fn serve_and_compare(folder: &str, family: &Value) -> Result<f64, String> {
    let server = TestServer::try_start(&config(folder)).await?;
    let bytes = token_bytes(folder);
    let tokenizer = tokenizer(folder);
    let special = |token: &str| tokenizer.get_added_vocabulary().is_special_token(token);
    let steps = reference()["steps"].as_u64().unwrap();
    let mut wrong = Vec::new();
    let mut worst = 0.0f64;
    for (name, extra) in [
        ("plain", json!({})),
        ("penalized", family["penalized"]["params"].clone()),
    ] {
        let body = completion(&family["prompt"], steps, &extra);
        let whole = answer(&server, "/v1/completions", &body).await?;
        let logprobs = &whole["choices"][0]["logprobs"];
        let (differences, by) = compare(logprobs, &family[name], &bytes);
        worst = worst.max(by);
        wrong.extend(differences.into_iter().map(|d| format!("{name}: {d}")));
        let text = whole["choices"][0]["text"].as_str().unwrap();
        if let Err(why) = offsets_fit(text, logprobs, &special) {
            wrong.push(format!("{name}: {why}"));
        }
        let (sent, joined) = streamed(&server, &body).await?;
        if sent != text || &joined != logprobs {
            wrong.push(format!("{name} streamed: {sent:?} {joined}\nwhole: {whole}"));
        }
    }
    server.stop().await;
    match wrong.is_empty() {
        true => Ok(worst),
        false => Err(wrong.join("\n")),
    }
}

#[tokio::test]
async fn real_exports_give_transformers_logprobs_plain_and_penalized_whole_and_streamed() {
    let reference = reference();
    let mut wrong = Vec::new();
    let mut worst = 0.0f64;
    for (folder, family) in folders() {
        match serve_and_compare(&folder, &reference["families"][&family]).await {
            Ok(by) => worst = worst.max(by),
            Err(why) => wrong.push(format!("{folder}: {why}")),
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
    eprintln!("largest difference from transformers' logprobs: {worst:.2e}");
}

/// A chat's log-probabilities are its rendered template's completion's, in chat's shape: each
/// token's exact bytes (together the answer's text), streamed or not.
#[tokio::test]
async fn a_chat_gives_the_logprobs_of_its_rendered_template_s_completion() {
    let folder = "qwen2-optimum";
    let server = TestServer::start(&config(folder)).await;
    let tokenizer = tokenizer(folder);
    // The bytes of the tokens that are in the answer's text (a special token's is left out).
    let in_text = |tokens: &[Value]| -> Vec<u8> {
        tokens
            .iter()
            .filter(|t| {
                !tokenizer
                    .get_added_vocabulary()
                    .is_special_token(t["token"].as_str().unwrap())
            })
            .flat_map(|t| t["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8))
            .collect()
    };
    let chat = &real_reference()["models"][folder]["chats"]["multi_turn"];
    let body = json!({"model": "m", "messages": chat["messages"], "max_tokens": 12, "temperature": 0,
                      "logprobs": true, "top_logprobs": 3});
    let whole = answer(&server, "/v1/chat/completions", &body).await.unwrap();
    let content = whole["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    let prompt = completion(&chat["text"], 12, &json!({"logprobs": 3}));
    let plain = answer(&server, "/v1/completions", &prompt).await.unwrap();
    let plain = &plain["choices"][0]["logprobs"];
    assert!(!content.is_empty());
    for (i, token) in content.iter().enumerate() {
        assert_eq!(token["token"], plain["tokens"][i], "{whole}");
        assert_eq!(token["logprob"], plain["token_logprobs"][i]);
        let top = token["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        for t in top {
            assert_eq!(plain["top_logprobs"][i][t["token"].as_str().unwrap()], t["logprob"]);
            assert!(t["bytes"].is_array());
        }
    }
    if whole["choices"][0]["finish_reason"] == "length" {
        let joined = in_text(&content);
        assert_eq!(
            String::from_utf8_lossy(&joined),
            whole["choices"][0]["message"]["content"].as_str().unwrap()
        );
    }
    // Streamed: the same tokens, each in the chunk that sends the end of its text.
    let mut body = body;
    body["stream"] = json!(true);
    let response = server.post_json("/v1/chat/completions", &body).await;
    let (mut sent, mut tokens) = (String::new(), Vec::new());
    for chunk in events(response).await {
        let choice = &chunk["choices"][0];
        sent.push_str(choice["delta"]["content"].as_str().unwrap_or_default());
        tokens.extend(choice["logprobs"]["content"].as_array().cloned().unwrap_or_default());
        let bytes = in_text(&tokens);
        if choice["finish_reason"].is_null() {
            assert!(sent.as_bytes().starts_with(&bytes), "{sent:?} was sent with {tokens:?}");
        }
    }
    assert_eq!(tokens, content);
    server.stop().await;
}

/// Chat's `logprobs` and `top_logprobs` are checked as OpenAI checks them.
#[tokio::test]
async fn chat_logprobs_out_of_range_are_refused_by_name() {
    let server = TestServer::start(&config("llama-optimum")).await;
    let messages = json!([{"role": "user", "content": "Hi"}]);
    for (fields, param) in [
        (json!({"logprobs": true, "top_logprobs": 21}), "top_logprobs"),
        (json!({"top_logprobs": 2}), "top_logprobs"),
        (json!({"logprobs": false, "top_logprobs": 2}), "top_logprobs"),
        (json!({"logit_bias": {"600": 1}}), "logit_bias"),
    ] {
        let mut body = json!({"model": "m", "messages": messages, "max_tokens": 2});
        for (k, v) in fields.as_object().unwrap() {
            body[k] = v.clone();
        }
        let response = server.post_json("/v1/chat/completions", &body).await;
        assert_eq!(response.status(), 400, "{body}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["param"], param, "{error}");
    }
    let body = json!({"model": "m", "messages": messages, "max_tokens": 2, "logprobs": true, "top_logprobs": 0});
    let ok = answer(&server, "/v1/chat/completions", &body).await.unwrap();
    let content = ok["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(content.iter().all(|t| t["top_logprobs"] == json!([])), "{ok}");
    server.stop().await;
}
