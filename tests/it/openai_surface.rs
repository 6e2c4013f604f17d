//! The OpenAI surface beyond one prompt and one answer, with real ONNX Runtime on the tiny
//! decoder fixture (`models/decoder/`), served from the CPU: `GET /v1/models/{id}` (OpenAI's 404
//! for any name not served, one with `/` in it included).

use crate::common::TestServer;
use reqwest::StatusCode;
use serde_json::Value;

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
