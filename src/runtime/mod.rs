//! Running models: audio decoded into a speech model's features, ONNX Runtime sessions and their arena, decoders with past key values (and what
//! ONNX Runtime GenAI's `genai_config.json` says of them), chat templates, a text's first tokens read without the rest of it (and a prompt found too long so), a generation's text as
//! it comes, the grammars that constrain it, and what a request will need in memory. Above
//! `core` and `config`; below devices, pools and everything that serves requests.

pub mod audio;
pub mod chat;
pub mod decoder;
pub mod embedder;
pub mod estimate;
pub mod folder;
pub mod genai;
pub mod grammar;
pub mod image;
pub mod leading;
pub mod onnx;
pub mod reranker;
pub mod speech;
pub mod text;
pub mod tower;
