//! A Whisper model as the service holds it: what its folder says and its front end, made once
//! when the model is loaded, and what a window's decoding holds beside the encoder's measured
//! run (for its estimate).

use std::sync::Arc;

use super::Whisper;
use crate::runtime::audio::mel::LogMel;

/// A Whisper model's folder and its front end, made once when the model is loaded.
pub struct SpeechModel {
    /// What its folder says.
    pub whisper: Whisper,
    /// Its log-mel features (shared with the blocking threads that compute them).
    pub mel: Arc<LogMel>,
}

impl std::fmt::Debug for SpeechModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpeechModel")
            .field("whisper", &self.whisper)
            .finish_non_exhaustive()
    }
}

impl SpeechModel {
    /// The speech model of `folder`, when it is a Whisper folder.
    pub fn read(folder: &std::path::Path) -> Result<Option<SpeechModel>, String> {
        let Some(whisper) = Whisper::read(folder)? else {
            return Ok(None);
        };
        let mel = Arc::new(LogMel::new(whisper.mel)?);
        Ok(Some(SpeechModel { whisper, mel }))
    }

    /// Bytes of the decoder graph(s) in `folder` the window job loads beside the encoder: the
    /// merged decoder when there is one, else the first pass's and the steps' (two copies of
    /// the weights).
    pub fn decoder_bytes(folder: &std::path::Path) -> u64 {
        Self::decoder_files(folder)
            .iter()
            .map(|file| std::fs::metadata(file).map_or(0, |m| m.len()))
            .sum()
    }

    /// The decoder graph file(s) in `folder` the window job loads (see
    /// [`SpeechModel::decoder_bytes`]): those present of the merged decoder, else the pair.
    pub fn decoder_files(folder: &std::path::Path) -> Vec<std::path::PathBuf> {
        let merged = folder.join("decoder_model_merged.onnx");
        if merged.is_file() {
            return vec![merged];
        }
        ["decoder_model.onnx", "decoder_with_past_model.onnx"]
            .into_iter()
            .map(|name| folder.join(name))
            .filter(|file| file.is_file())
            .collect()
    }

    /// Device bytes one window's decoding holds beyond its encoder's run: the cross-attention
    /// cache (keys and values of every decoder layer over every encoder position, fixed per
    /// window), the self-attention cache at its longest (every target position), the encoder's
    /// output the decoder's first pass reads, and a step's logits. FP32 each.
    pub fn window_bytes(&self) -> u64 {
        let d = &self.whisper.dims;
        let kv = 2 * u64::from(d.decoder_layers) * u64::from(d.d_model) * 4;
        let cross = kv * u64::from(d.max_source_positions);
        let own = kv * u64::from(d.max_target_positions);
        let hidden = u64::from(d.max_source_positions) * u64::from(d.d_model) * 4;
        let logits = u64::from(d.vocab) * 4;
        cross + own + hidden + logits
    }
}
