//! Image search through `POST /v1/embeddings` on the tiny CLIP of `models/embed/clip/` (random
//! weights, each tower exported by Optimum; `make_clip.py` made it): texts and images give
//! the vectors transformers' `get_text_features` and `get_image_features` give (normalized), in
//! every request form, texts and images mixed in one request; the text-to-image similarities
//! rank the images as transformers' do; and what is refused is refused naming the field or,
//! at start, the file and key.

use std::path::{Path, PathBuf};

use base64::Engine;
use serde_json::{Value, json};

use crate::common::TestServer;
use crate::embeddings::{cosine, embed, floats, max_difference, refused};

const CONFIG: &str = "
models:
  - {name: clip, path: models/embed/clip/text_model.onnx, images: clip-vision}
  - {name: clip-vision, path: models/embed/clip/vision_model.onnx}
  - {name: clip-text-only, path: models/embed/clip/text_model.onnx}
pools: [{name: cpu, provider: cpu, models: [clip, clip-vision, clip-text-only]}]
";

fn folder() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/embed/clip")
}

/// The reference of the fixture `name` (`clip` or `siglip`).
fn reference_of(name: &str) -> Value {
    let path = folder().with_file_name(name).join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn reference() -> Value {
    reference_of("clip")
}

/// The `data:` URL of a fixture image.
fn data_url(file: &str) -> String {
    let bytes = std::fs::read(folder().join("images").join(file)).unwrap();
    let media = match file.rsplit_once('.').unwrap().1 {
        "jpg" => "jpeg",
        other => other,
    };
    format!(
        "data:image/{media};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// How close a vector must be to transformers': a text's, a PNG's and a lossless WebP's within
/// float rounding. A
/// JPEG's pixels come from another decoder than Pillow's (zune-jpeg, not libjpeg-turbo; see
/// `runtime::image::tests::pixels_equal_transformers_processors_for_png_and_webp_and_nearly_for_jpeg`),
/// whose levels differ by 0 to 2 for 98% of the pixels of these 4:2:0 files and by ten or more
/// for a few (their IDCTs and chroma upsampling round differently), and this tiny model of random weights is far
/// more sensitive to that noise than a trained one: measured 0.17 at most and a cosine of 0.971
/// on `tall.jpg`, 0.23 and 0.922 on `small.jpg` (20 x 25, enlarged).
fn close(file: Option<&str>, got: &[f32], expected: &[f32]) {
    let (most, least_cosine) = match file {
        Some(f) if f.ends_with(".jpg") => (0.3, 0.9),
        _ => (1e-4, 0.9999),
    };
    let (difference, cos) = (max_difference(got, expected), cosine(got, expected));
    println!(
        "{}: differs by {difference:e} at most, cosine {cos}",
        file.unwrap_or("text")
    );
    assert!(
        difference <= most && cos >= least_cosine,
        "{file:?}: {difference} {cos}"
    );
}

#[tokio::test]
async fn texts_and_images_give_transformers_vectors_and_its_ranking() {
    let server = TestServer::start(CONFIG).await;
    let reference = reference();
    let texts = reference["texts"].as_array().unwrap();
    let images = reference["images"].as_array().unwrap();
    let files: Vec<&str> = images.iter().map(|i| i["file"].as_str().unwrap()).collect();

    // All texts in one request (padded to the longest): each as transformers gave it.
    let inputs: Vec<&str> = texts.iter().map(|t| t["input"].as_str().unwrap()).collect();
    let (text_vectors, answer) = embed(&server, json!({"model": "clip", "input": inputs})).await;
    for (got, t) in text_vectors.iter().zip(texts) {
        close(None, got, &floats(&t["embedding"]));
    }
    let tokens: usize = texts.iter().map(|t| t["ids"].as_array().unwrap().len()).sum();
    assert_eq!(answer["usage"]["prompt_tokens"], tokens);

    // Every image and a text between them, in Jina's form, through the one model name.
    let mut mixed: Vec<Value> = files.iter().map(|f| json!({"image": data_url(f)})).collect();
    mixed.insert(2, json!({"text": inputs[0]}));
    let (vectors, answer) = embed(&server, json!({"model": "clip", "input": mixed})).await;
    assert_eq!(vectors.len(), files.len() + 1);
    close(None, &vectors[2], &text_vectors[0]);
    let image_vectors: Vec<Vec<f32>> = vectors
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 2)
        .map(|(_, v)| v.clone())
        .collect();
    for ((got, image), file) in image_vectors.iter().zip(images).zip(&files) {
        close(Some(file), got, &floats(&image["embedding"]));
    }
    assert_eq!(
        answer["usage"]["prompt_tokens"],
        texts[0]["ids"].as_array().unwrap().len()
    );

    // The similarity of each text to each image: the same ranking as transformers'.
    let similarity = reference["similarity"].as_array().unwrap();
    for (t, row) in text_vectors.iter().zip(similarity) {
        let expected = floats(row);
        let got: Vec<f32> = image_vectors
            .iter()
            .map(|v| v.iter().zip(t).map(|(a, b)| a * b).sum())
            .collect();
        let argmax = |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
        assert_eq!(argmax(&got), argmax(&expected), "{got:?} vs {expected:?}");
        for ((got, expected), file) in got.iter().zip(&expected).zip(&files) {
            if !file.ends_with(".jpg") {
                assert!((got - expected).abs() <= 1e-5, "{file}: {got} vs {expected}");
            }
        }
    }

    // vLLM's form: one image part in `messages`; the vision tower named directly; base64;
    // and `dimensions` cut, then normalized again.
    let message = json!({"model": "clip", "encoding_format": "base64", "messages": [{"role": "user",
        "content": [{"type": "image_url", "image_url": {"url": data_url(files[0])}}]}]});
    let (one, _) = embed(&server, message).await;
    close(Some(files[0]), &one[0], &image_vectors[0]);
    let (direct, _) = embed(
        &server,
        json!({"model": "clip-vision", "input": [{"image": data_url(files[1])}]}),
    )
    .await;
    close(Some(files[1]), &direct[0], &image_vectors[1]);
    let (cut, _) = embed(&server, json!({"model": "clip", "input": inputs[1], "dimensions": 8})).await;
    let length = cut[0].iter().map(|x| x * x).sum::<f32>().sqrt();
    assert_eq!(cut[0].len(), 8);
    assert!((length - 1.0).abs() < 1e-5);
    server.stop().await;
}

#[tokio::test]
async fn each_tower_s_run_is_counted_under_its_model() {
    let server = TestServer::start(CONFIG).await;
    let body = json!({"model": "clip", "input": ["a cat", {"image": data_url("square.png")}]});
    embed(&server, body).await;
    let metrics = server.metrics().await;
    for model in ["clip", "clip-vision"] {
        let served = crate::common::sum_samples(&metrics, |l| {
            l.starts_with("vramguard_requests_total{")
                && l.contains(&format!("model=\"{model}\""))
                && l.contains("outcome=\"ok\"")
        });
        assert_eq!(served, 1.0, "{model}");
    }
    server.stop().await;
}

#[tokio::test]
async fn bad_images_and_inputs_a_tower_does_not_take_are_refused_naming_the_field() {
    let server = TestServer::start(CONFIG).await;
    let image = |url: &str| json!({"model": "clip", "input": [{"image": url}]});
    refused(
        &server,
        image("https://example.com/cat.png"),
        "input",
        "does not fetch images",
    )
    .await;
    refused(
        &server,
        image("data:image/png;base64,aGVsbG8="),
        "input",
        "`input[0]`: the image is not PNG, JPEG or WebP",
    )
    .await;
    let gif = format!(
        "data:image/gif;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(b"GIF89a\x01\0\x01\0\0\0\0;")
    );
    refused(&server, image(&gif), "input", "(it is Gif)").await;
    let png = std::fs::read(folder().join("images/wide.png")).unwrap();
    let cut = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(&png[..300])
    );
    refused(&server, image(&cut), "input", "the PNG image cannot be decoded").await;
    // A PNG that claims 50000 x 50000 pixels in a few bytes.
    let bomb = vramguard::testing::png_bomb(50_000, 50_000);
    let bomb = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(&bomb)
    );
    refused(
        &server,
        image(&bomb),
        "input",
        "the image is 50000 x 50000 pixels, above the limit",
    )
    .await;
    refused(
        &server,
        json!({"model": "clip-text-only", "input": [{"image": data_url("square.png")}]}),
        "input",
        "embeds text only",
    )
    .await;
    refused(
        &server,
        json!({"model": "clip-vision", "input": "a cat"}),
        "input",
        "embeds images only",
    )
    .await;
    let two = json!({"model": "clip", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a cat"}, {"type": "image_url", "image_url": {"url": data_url("square.png")}}]}]});
    refused(&server, two, "messages", "holds 2 parts").await;
    server.stop().await;
}

/// A copy of the CLIP folder with `change` applied, and a config serving its towers.
fn broken(scratch: &vramguard::testing::Scratch, change: impl Fn(&Path)) -> String {
    let dir = scratch.path().join("clip");
    std::fs::create_dir_all(&dir).unwrap();
    for file in [
        "text_model.onnx",
        "vision_model.onnx",
        "tokenizer.json",
        "config.json",
        "preprocessor_config.json",
    ] {
        std::fs::copy(folder().join(file), dir.join(file)).unwrap();
    }
    change(&dir);
    format!(
        "models:\n  - {{name: t, path: '{}', images: v}}\n  - {{name: v, path: '{}'}}\npools: [{{name: cpu, provider: cpu, models: [t, v]}}]\n",
        dir.join("text_model.onnx").display(),
        dir.join("vision_model.onnx").display()
    )
}

#[tokio::test]
async fn a_bad_vision_folder_is_refused_at_start_naming_the_file_and_key() {
    let scratch = vramguard::testing::Scratch::new();
    let config = broken(&scratch, |dir| {
        std::fs::remove_file(dir.join("preprocessor_config.json")).unwrap()
    });
    let err = TestServer::try_start(&config).await.err().expect("refused");
    assert!(
        err.contains("models[1].path") && err.contains("preprocessor_config.json is missing"),
        "{err}"
    );
    let scratch = vramguard::testing::Scratch::new();
    let config = broken(&scratch, |dir| {
        let file = dir.join("preprocessor_config.json");
        let text = std::fs::read_to_string(&file)
            .unwrap()
            .replace("\"resample\": 3", "\"resample\": 0");
        std::fs::write(file, text).unwrap();
    });
    let err = TestServer::try_start(&config).await.err().expect("refused");
    assert!(err.contains("preprocessor_config.json: `resample` is 0"), "{err}");
    // A text tower that names a model that is not a vision tower.
    let scratch = vramguard::testing::Scratch::new();
    let config = broken(&scratch, |_| {}).replace("images: v}", "images: t2}\n  - {name: t2, path: 'builtin:encoder'}");
    let config = config.replace("models: [t, v]", "models: [t, v, t2]");
    let err = TestServer::try_start(&config).await.err().expect("refused");
    assert!(
        err.contains("models[0].images") && err.contains("`t2` its vision tower"),
        "{err}"
    );
}

#[tokio::test]
async fn siglip_s_towers_give_transformers_vectors() {
    // Texts padded to SigLIP's positions (its processor's `padding="max_length"`), images
    // resized to 32 x 32 with Pillow's bilinear and not cropped (SiglipImageProcessor's steps).
    let config = "
models:
  - {name: siglip, path: models/embed/siglip/text_model.onnx, images: siglip-vision}
  - {name: siglip-vision, path: models/embed/siglip/vision_model.onnx}
pools: [{name: cpu, provider: cpu, models: [siglip, siglip-vision]}]
";
    let server = TestServer::start(config).await;
    let reference = reference_of("siglip");
    let texts = reference["texts"].as_array().unwrap();
    let images = reference["images"].as_array().unwrap();
    let mut inputs: Vec<Value> = texts.iter().map(|t| t["input"].clone()).collect();
    inputs.extend(
        images
            .iter()
            .map(|i| json!({"image": data_url(i["file"].as_str().unwrap())})),
    );
    let (vectors, answer) = embed(&server, json!({"model": "siglip", "input": inputs})).await;
    for (got, t) in vectors.iter().zip(texts) {
        close(None, got, &floats(&t["embedding"]));
    }
    for (got, image) in vectors[texts.len()..].iter().zip(images) {
        close(image["file"].as_str(), got, &floats(&image["embedding"]));
    }
    // `usage` counts the texts' own tokens, not the padding.
    let tokens: usize = texts.iter().map(|t| t["ids"].as_array().unwrap().len()).sum();
    assert_eq!(answer["usage"]["prompt_tokens"], tokens);
    server.stop().await;
}
