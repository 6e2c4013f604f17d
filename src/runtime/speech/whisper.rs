//! What a Whisper folder says, as Optimum exports it (`automatic-speech-recognition-with-past`):
//! the model's sizes (`config.json`), its features (`preprocessor_config.json`), its decoding
//! rules and special tokens (`generation_config.json`) and its text (`tokenizer.json`). A
//! missing or wrong key refuses the folder with the file and key named.

use std::path::Path;
use std::sync::{Arc, LazyLock};

use serde_json::Value;

use super::Task;
use super::languages::{ALIASES, LANGUAGES};
use crate::runtime::audio::mel::MelConfig;
use crate::runtime::folder::json;

/// The slot of a prompt whose language is to be detected ([`Whisper::prompt`] with no
/// language): the window job puts the detected language's token there.
pub const DETECT: i64 = -1;

/// Seconds per timestamp token (`<|0.02|>` is one step).
pub const TIME_PRECISION: f64 = 0.02;

/// A timestamp token's text, as `transformers`' Whisper tokenizer finds them in decoded text
/// (its `timestamp_pat`).
static TIMESTAMP: LazyLock<regex::Regex> =
    LazyLock::new(|| regex::Regex::new(r"<\|(\d+\.\d+)\|>").expect("a valid pattern"));

/// The tokens a window generates when the generation config has no `max_length`
/// (`transformers`' GenerationConfig default).
const DEFAULT_NEW_TOKENS: u32 = 20;

/// Feature frames per encoder position (the two convolutions' strides): a timestamp step is
/// this many frames.
pub const INPUT_STRIDE: u64 = 2;

/// A Whisper model's folder, read.
#[derive(Debug, Clone)]
pub struct Whisper {
    /// `config.json`'s sizes.
    pub dims: Dims,
    /// `preprocessor_config.json`'s features.
    pub mel: MelConfig,
    /// The special tokens.
    pub tokens: Tokens,
    /// The languages of `generation_config.json`'s `lang_to_id`: code, full name, token.
    pub languages: Vec<(String, String, u32)>,
    /// Whether the model knows languages and tasks (`is_multilingual`, else whether it lists
    /// languages); an English-only one's prompt is `<|startoftranscript|>` alone.
    pub multilingual: bool,
    /// Tokens never picked (`suppress_tokens`).
    pub suppress: Vec<u32>,
    /// Tokens not picked first (`begin_suppress_tokens`).
    pub begin_suppress: Vec<u32>,
    /// The latest timestamp the first token may be, in steps from `<|0.00|>`
    /// (`max_initial_timestamp_index`; none when absent).
    pub max_initial_timestamp: Option<u32>,
    /// The most tokens a window's decoder sequence has, prompt included (`max_length`; none
    /// when absent: see [`Whisper::max_new_tokens`]).
    pub max_length: Option<u32>,
    tokenizer: Arc<tokenizers::Tokenizer>,
}

/// `config.json`'s sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// `d_model`.
    pub d_model: u32,
    /// `encoder_layers`.
    pub encoder_layers: u32,
    /// `decoder_layers`.
    pub decoder_layers: u32,
    /// `decoder_attention_heads`.
    pub decoder_heads: u32,
    /// `vocab_size`.
    pub vocab: u32,
    /// `num_mel_bins`.
    pub mel_bins: u32,
    /// `max_source_positions` (1,500: a 30 s window's encoder positions).
    pub max_source_positions: u32,
    /// `max_target_positions` (448).
    pub max_target_positions: u32,
}

/// The special tokens decoding uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tokens {
    /// `<|startoftranscript|>` (`decoder_start_token_id`).
    pub start: u32,
    /// `<|endoftext|>` (`eos_token_id`).
    pub eos: u32,
    /// `<|notimestamps|>` (`no_timestamps_token_id`). None when the generation config lacks
    /// it, and then, as in `transformers`, no prompt has it, no timestamp is decoded (asking
    /// for them is refused) and no window is cut at the timestamp tokens it writes.
    pub no_timestamps: Option<u32>,
    /// `<|0.00|>`: the first timestamp token, `no_timestamps + 1` (without it, the tokenizer's
    /// `<|0.00|>`: the text still leaves them out, as `transformers`' decoding does).
    pub timestamp_begin: u32,
    /// `<|startofprev|>` (`prev_sot_token_id`): what a prompt's previous text follows.
    pub previous: u32,
    /// `<|nospeech|>` (`<|nocaptions|>` in older tokenizers).
    pub no_speech: u32,
    /// `<|transcribe|>` and `<|translate|>` (`task_to_id`; none in an English-only model).
    pub transcribe: Option<u32>,
    /// See `transcribe`.
    pub translate: Option<u32>,
}

const CONFIG: &str = "config.json";
const PREPROCESSOR: &str = "preprocessor_config.json";
const GENERATION: &str = "generation_config.json";
const TOKENIZER: &str = "tokenizer.json";

/// `file`'s `key` as a whole number that fits a `u32`.
fn number(doc: &Value, file: &str, key: &str) -> Result<u32, String> {
    match &doc[key] {
        Value::Null => Err(format!("{file} has no `{key}`")),
        v => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| format!("{file}'s `{key}` is {v}, not a token id or size")),
    }
}

/// `file`'s `key` as a list of token ids (none when absent or null).
fn ids(doc: &Value, file: &str, key: &str) -> Result<Vec<u32>, String> {
    match &doc[key] {
        Value::Null => Ok(Vec::new()),
        Value::Array(items) => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| format!("{file}'s `{key}` holds {v}, not a token id"))
            })
            .collect(),
        v => Err(format!("{file}'s `{key}` is {v}, not a list of token ids")),
    }
}

impl Whisper {
    /// The Whisper model of `folder`, or `None` when its `config.json`'s `model_type` is not
    /// `whisper` (or it has none).
    pub fn read(folder: &Path) -> Result<Option<Whisper>, String> {
        let named = |file: &str| folder.join(file).display().to_string();
        let Some(config) = json(folder, CONFIG)? else {
            return Ok(None);
        };
        if config["model_type"] != "whisper" {
            return Ok(None);
        }
        let file = named(CONFIG);
        let dims = Dims {
            d_model: number(&config, &file, "d_model")?,
            encoder_layers: number(&config, &file, "encoder_layers")?,
            decoder_layers: number(&config, &file, "decoder_layers")?,
            decoder_heads: number(&config, &file, "decoder_attention_heads")?,
            vocab: number(&config, &file, "vocab_size")?,
            mel_bins: number(&config, &file, "num_mel_bins")?,
            max_source_positions: number(&config, &file, "max_source_positions")?,
            max_target_positions: number(&config, &file, "max_target_positions")?,
        };
        let mel = read_mel(folder, dims.mel_bins)?;
        let file = named(GENERATION);
        let generation = json(folder, GENERATION)?.ok_or_else(|| format!("{file} is missing"))?;
        let tokenizer = read_tokenizer(folder)?;
        // Older configs lack these two; `transformers` runs such a model all the same, without
        // timestamps and within GenerationConfig's default `max_length`.
        let no_timestamps = match &generation["no_timestamps_token_id"] {
            Value::Null => None,
            _ => Some(number(&generation, &file, "no_timestamps_token_id")?),
        };
        let max_length = match &generation["max_length"] {
            Value::Null => None,
            _ => Some(number(&generation, &file, "max_length")?),
        };
        let timestamp_begin = match no_timestamps {
            Some(token) => token + 1,
            None => tokenizer.token_to_id("<|0.00|>").unwrap_or(dims.vocab),
        };
        let no_speech = ["<|nospeech|>", "<|nocaptions|>"]
            .iter()
            .find_map(|t| tokenizer.token_to_id(t))
            .ok_or_else(|| format!("{} has neither `<|nospeech|>` nor `<|nocaptions|>`", named(TOKENIZER)))?;
        let tasks = &generation["task_to_id"];
        let task = |name: &str| match &tasks[name] {
            Value::Null => Ok(None),
            v => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| format!("{file}'s `task_to_id.{name}` is {v}, not a token id")),
        };
        let tokens = Tokens {
            start: number(&generation, &file, "decoder_start_token_id")?,
            eos: number(&generation, &file, "eos_token_id")?,
            no_timestamps,
            timestamp_begin,
            // Older configs lack it; `transformers` then takes the tokenizer's.
            previous: match &generation["prev_sot_token_id"] {
                Value::Null => tokenizer.token_to_id("<|startofprev|>").ok_or_else(|| {
                    format!("{file} has no `prev_sot_token_id` and the tokenizer no `<|startofprev|>`")
                })?,
                _ => number(&generation, &file, "prev_sot_token_id")?,
            },
            no_speech,
            transcribe: task("transcribe")?,
            translate: task("translate")?,
        };
        let languages = read_languages(&generation, &file)?;
        let multilingual = match &generation["is_multilingual"] {
            Value::Bool(b) => *b,
            Value::Null => !languages.is_empty(),
            v => return Err(format!("{file}'s `is_multilingual` is {v}, not true or false")),
        };
        if multilingual && (languages.is_empty() || tokens.transcribe.is_none() || tokens.translate.is_none()) {
            return Err(format!(
                "{file} says `is_multilingual` but has no `lang_to_id` or no `task_to_id` with `transcribe` and `translate`"
            ));
        }
        let max_initial_timestamp = match &generation["max_initial_timestamp_index"] {
            Value::Null => None,
            _ => Some(number(&generation, &file, "max_initial_timestamp_index")?),
        };
        let whisper = Whisper {
            dims,
            mel,
            tokens,
            languages,
            multilingual,
            suppress: ids(&generation, &file, "suppress_tokens")?,
            begin_suppress: ids(&generation, &file, "begin_suppress_tokens")?,
            max_initial_timestamp,
            max_length,
            tokenizer: Arc::new(tokenizer),
        };
        if let Some(no_timestamps) = no_timestamps
            && no_timestamps + 1 + 1500 >= dims.vocab
        {
            return Err(format!(
                "{file}'s `no_timestamps_token_id` {no_timestamps} leaves no room for the 1,501 timestamp tokens in a vocabulary of {} ({CONFIG}'s `vocab_size`)",
                dims.vocab
            ));
        }
        Ok(Some(whisper))
    }

    /// Its tokenizer.
    pub fn tokenizer(&self) -> &Arc<tokenizers::Tokenizer> {
        &self.tokenizer
    }

    /// The language token of `language`, a code (`en`) or a name (`english`, or another name
    /// `transformers` takes, `castilian`), in any case; an error names it and lists those the
    /// model knows.
    pub fn language_token(&self, language: &str) -> Result<u32, String> {
        let wanted = language.to_lowercase();
        let code = LANGUAGES
            .iter()
            .find(|(_, name)| *name == wanted)
            .or_else(|| ALIASES.iter().find(|(alias, _)| *alias == wanted))
            .map_or(wanted.as_str(), |(_, code)| code);
        let code = LANGUAGES
            .iter()
            .find(|(_, name)| *name == code)
            .map_or(code, |(c, _)| c);
        self.languages
            .iter()
            .find(|(c, _, _)| c == code)
            .map(|(_, _, token)| *token)
            .ok_or_else(|| {
                let known: Vec<&str> = self.languages.iter().map(|(c, _, _)| c.as_str()).collect();
                format!(
                    "the language `{language}` is not one this model knows (it knows: {})",
                    known.join(", ")
                )
            })
    }

    /// The full name of language token `token` (`english`), when it is one.
    pub fn language_name(&self, token: u32) -> Option<&str> {
        self.languages
            .iter()
            .find(|(_, _, t)| *t == token)
            .map(|(_, name, _)| name.as_str())
    }

    /// A window's prompt as `transformers` forms it: `<|startofprev|>` and the last of
    /// `previous` (the prompt's text tokens, at most `max_target_positions / 2 - 1` of them, as
    /// Whisper keeps) when there are any; `<|startoftranscript|>`; in a multilingual model the
    /// language's token ([`DETECT`] when `language` is `None`: detected for the window) and the
    /// task's; `<|notimestamps|>` when no timestamps are asked (and the model names it: else
    /// timestamps are refused, as `transformers` refuses them).
    pub fn prompt(
        &self,
        task: Task,
        language: Option<&str>,
        timestamps: bool,
        previous: &[u32],
    ) -> Result<Vec<i64>, String> {
        let mut prompt = Vec::new();
        if !previous.is_empty() {
            let keep = (self.dims.max_target_positions / 2).saturating_sub(1) as usize;
            prompt.push(i64::from(self.tokens.previous));
            prompt.extend(
                previous[previous.len().saturating_sub(keep)..]
                    .iter()
                    .map(|&t| i64::from(t)),
            );
        }
        prompt.push(i64::from(self.tokens.start));
        if self.multilingual {
            prompt.push(match language {
                Some(language) => i64::from(self.language_token(language)?),
                None => DETECT,
            });
            let task = match task {
                Task::Transcribe => self.tokens.transcribe,
                Task::Translate => self.tokens.translate,
            };
            prompt.push(i64::from(
                task.expect("a multilingual model's tasks are checked by read"),
            ));
        } else if task == Task::Translate
            || language.is_some_and(|l| !matches!(l.to_lowercase().as_str(), "en" | "english"))
        {
            return Err("this model is English-only: it neither takes another language nor translates".into());
        }
        match (timestamps, self.tokens.no_timestamps) {
            (false, Some(token)) => prompt.push(i64::from(token)),
            (false, None) => {}
            (true, Some(_)) => {}
            (true, None) => {
                return Err(format!(
                    "this model's {GENERATION} has no `no_timestamps_token_id`, so it is decoded without timestamps (as `transformers` decodes it): it transcribes audio of {} s at most, as text or json",
                    self.mel.chunk_seconds
                ));
            }
        }
        Ok(prompt)
    }

    /// The most tokens a window of a prompt of `prompt` tokens may generate, its end included
    /// (`max_length` counts the prompt, and no sequence passes `max_target_positions`). Without
    /// `max_length`, `transformers` takes GenerationConfig's default of 20 and, that being the
    /// default, counts it after the prompt: 20 new tokens.
    pub fn max_new_tokens(&self, prompt: usize) -> u32 {
        let room = self.dims.max_target_positions.saturating_sub(prompt as u32);
        match self.max_length {
            Some(most) => most.min(self.dims.max_target_positions).saturating_sub(prompt as u32),
            None => DEFAULT_NEW_TOKENS.min(room),
        }
    }

    /// The text of `tokens` as `decode(tokens, skip_special_tokens=True)` gives it: special
    /// tokens left out, then the timestamps' text (`<|1.00|>`) taken out of what is decoded, as
    /// `transformers`' Whisper tokenizer does; so the bytes of one character that a timestamp
    /// splits stay two broken characters, as there.
    pub fn text(&self, tokens: &[u32]) -> Result<String, String> {
        let text = self.tokenizer.decode(tokens, true).map_err(|e| e.to_string())?;
        Ok(TIMESTAMP.replace_all(&text, "").into_owned())
    }
}

/// `preprocessor_config.json`'s features, which must have the model's `num_mel_bins` bands.
fn read_mel(folder: &Path, bins: u32) -> Result<MelConfig, String> {
    let file = folder.join(PREPROCESSOR).display().to_string();
    let doc = json(folder, PREPROCESSOR)?.ok_or_else(|| format!("{file} is missing"))?;
    let mel = MelConfig {
        bins: number(&doc, &file, "feature_size")? as usize,
        n_fft: number(&doc, &file, "n_fft")? as usize,
        hop: number(&doc, &file, "hop_length")? as usize,
        rate: number(&doc, &file, "sampling_rate")?,
        chunk_seconds: number(&doc, &file, "chunk_length")?,
    };
    if mel.bins != bins as usize {
        return Err(format!(
            "{file}'s `feature_size` is {}, but {CONFIG}'s `num_mel_bins` is {bins}",
            mel.bins
        ));
    }
    crate::runtime::audio::mel::LogMel::new(mel).map_err(|e| format!("{file}: {e}"))?;
    Ok(mel)
}

/// `tokenizer.json`, which a Whisper folder must have.
fn read_tokenizer(folder: &Path) -> Result<tokenizers::Tokenizer, String> {
    let path = folder.join(TOKENIZER);
    if !path.exists() {
        return Err(format!("{} is missing", path.display()));
    }
    tokenizers::Tokenizer::from_file(&path).map_err(|e| format!("{}: {e}", path.display()))
}

/// `lang_to_id`'s languages: each one's code, its full name and its token, in token order.
fn read_languages(generation: &Value, file: &str) -> Result<Vec<(String, String, u32)>, String> {
    let Some(map) = generation["lang_to_id"].as_object() else {
        return match &generation["lang_to_id"] {
            Value::Null => Ok(Vec::new()),
            v => Err(format!("{file}'s `lang_to_id` is {v}, not an object")),
        };
    };
    let mut languages = Vec::with_capacity(map.len());
    for (key, id) in map {
        let code = key
            .strip_prefix("<|")
            .and_then(|k| k.strip_suffix("|>"))
            .ok_or_else(|| format!("{file}'s `lang_to_id` has `{key}`, not a token `<|code|>`"))?;
        let name = LANGUAGES
            .iter()
            .find(|(c, _)| *c == code)
            .map_or(code, |(_, name)| name);
        let id = id
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| format!("{file}'s `lang_to_id.{key}` is {id}, not a token id"))?;
        languages.push((code.to_string(), name.to_string(), id));
    }
    languages.sort_by_key(|(_, _, id)| *id);
    Ok(languages)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::core::scratch::OwnDir;

    /// The tiny Whisper of `models/speech/whisper/` (its `make.py` says how it was made).
    pub(crate) fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("models/speech/whisper")
    }

    /// A copy of the fixture's JSON files and tokenizer, `edit` applied to `file`'s JSON.
    fn edited(file: &str, edit: impl FnOnce(&mut Value)) -> OwnDir {
        let dir = OwnDir::new("whisper-test").unwrap();
        for name in [CONFIG, PREPROCESSOR, GENERATION, TOKENIZER] {
            std::fs::copy(fixture().join(name), dir.path().join(name)).unwrap();
        }
        let mut doc: Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join(file)).unwrap()).unwrap();
        edit(&mut doc);
        std::fs::write(dir.path().join(file), doc.to_string()).unwrap();
        dir
    }

    #[test]
    fn the_fixture_folder_reads_as_whisper_with_its_special_tokens() {
        let w = Whisper::read(&fixture()).unwrap().expect("a Whisper folder");
        assert_eq!(w.mel, MelConfig::WHISPER);
        assert_eq!(
            (w.dims.decoder_layers, w.dims.mel_bins, w.dims.max_source_positions),
            (2, 80, 1500)
        );
        assert_eq!(w.dims.max_target_positions, 448);
        let id = |t: &str| w.tokenizer().token_to_id(t).unwrap();
        assert_eq!(w.tokens.start, id("<|startoftranscript|>"));
        assert_eq!(w.tokens.eos, id("<|endoftext|>"));
        assert_eq!(w.tokens.no_speech, id("<|nospeech|>"));
        assert_eq!(w.tokens.previous, id("<|startofprev|>"));
        assert_eq!(w.tokens.timestamp_begin, id("<|0.00|>"));
        assert_eq!(w.tokens.translate, Some(id("<|translate|>")));
        assert_eq!(w.languages.len(), 99);
        assert_eq!(w.language_name(id("<|en|>")), Some("english"));
        assert_eq!(w.language_name(id("<|de|>")), Some("german"));
        assert_eq!((w.max_length, w.max_initial_timestamp), (Some(448), Some(50)));
    }

    #[test]
    fn prompts_are_formed_as_transformers_forms_them() {
        let w = Whisper::read(&fixture()).unwrap().unwrap();
        let id = |t: &str| i64::from(w.tokenizer().token_to_id(t).unwrap());
        let (sot, en, transcribe) = (id("<|startoftranscript|>"), id("<|en|>"), id("<|transcribe|>"));
        let plain = vec![sot, en, transcribe, id("<|notimestamps|>")];
        assert_eq!(w.prompt(Task::Transcribe, Some("en"), false, &[]).unwrap(), plain);
        assert_eq!(w.prompt(Task::Transcribe, Some("English"), false, &[]).unwrap(), plain);
        assert_eq!(
            w.prompt(Task::Transcribe, Some("castilian"), true, &[]).unwrap(),
            [sot, id("<|es|>"), transcribe]
        );
        assert_eq!(
            w.prompt(Task::Transcribe, None, true, &[]).unwrap(),
            [sot, DETECT, transcribe]
        );
        assert_eq!(
            w.prompt(Task::Translate, Some("de"), false, &[]).unwrap(),
            [sot, id("<|de|>"), id("<|translate|>"), id("<|notimestamps|>")]
        );
        let previous = w.prompt(Task::Transcribe, Some("en"), true, &[40, 41]).unwrap();
        assert_eq!(previous, [id("<|startofprev|>"), 40, 41, sot, en, transcribe]);
        // Whisper keeps the last max_target_positions / 2 - 1 tokens of a long prompt.
        let long: Vec<u32> = (0..300).collect();
        let kept = w.prompt(Task::Transcribe, Some("en"), true, &long).unwrap();
        assert_eq!(kept.len(), 1 + 223 + 3);
        assert_eq!(kept[1], 300 - 223);
        assert_eq!(w.max_new_tokens(4), 444);
    }

    #[test]
    fn an_unknown_language_is_named_with_those_the_model_knows() {
        let w = Whisper::read(&fixture()).unwrap().unwrap();
        let e = w.prompt(Task::Transcribe, Some("klingon"), false, &[]).unwrap_err();
        assert!(e.contains("`klingon`") && e.contains("en, zh, de"), "{e}");
    }

    #[test]
    fn text_leaves_special_and_timestamp_tokens_out() {
        let w = Whisper::read(&fixture()).unwrap().unwrap();
        let words = w.tokenizer().encode(" hello world", false).unwrap().get_ids().to_vec();
        let mut tokens = vec![w.tokens.start, w.tokens.timestamp_begin];
        tokens.extend(&words);
        tokens.extend([w.tokens.timestamp_begin + 50, w.tokens.eos]);
        assert_eq!(w.text(&tokens).unwrap(), " hello world");
        // A timestamp between the two bytes of "é" leaves them apart, as `transformers`
        // decodes them (" \u{fffd}\u{fffd} how"); a special token there does not.
        let split = w.tokenizer().encode(" é how", false).unwrap().get_ids().to_vec();
        assert_eq!(split.len(), 4, "{split:?}");
        let mut tokens = split.clone();
        tokens.insert(2, w.tokens.timestamp_begin + 1000);
        assert_eq!(w.text(&tokens).unwrap(), " \u{fffd}\u{fffd} how");
        tokens[2] = w.language_token("de").unwrap();
        assert_eq!(w.text(&tokens).unwrap(), " é how");
    }

    #[test]
    fn a_folder_without_max_length_or_no_timestamps_is_decoded_as_transformers_decodes_it() {
        let dir = edited(GENERATION, |g| {
            let g = g.as_object_mut().unwrap();
            g.remove("max_length");
            g.remove("no_timestamps_token_id");
        });
        let w = Whisper::read(dir.path()).unwrap().expect("a Whisper folder");
        let id = |t: &str| w.tokenizer().token_to_id(t).unwrap();
        assert_eq!((w.max_length, w.tokens.no_timestamps), (None, None));
        // Its timestamp tokens are still left out of the text.
        assert_eq!(w.tokens.timestamp_begin, id("<|0.00|>"));
        // No <|notimestamps|> in a prompt, no timestamp rules, 20 new tokens.
        let prompt = w.prompt(Task::Transcribe, Some("en"), false, &[]).unwrap();
        let want = ["<|startoftranscript|>", "<|en|>", "<|transcribe|>"].map(|t| i64::from(id(t)));
        assert_eq!(prompt, want);
        assert_eq!(w.max_new_tokens(prompt.len()), 20);
        let mut logits = vec![0.0; w.dims.vocab as usize];
        w.rules(&prompt).apply(&[], &mut logits);
        assert_eq!(logits[id("<|0.00|>") as usize + 700], 0.0, "a timestamp is not forced");
        let e = w.prompt(Task::Transcribe, Some("en"), true, &[]).unwrap_err();
        assert!(
            e.contains("no `no_timestamps_token_id`") && e.contains("30 s at most"),
            "{e}"
        );
    }

    #[test]
    fn a_folder_of_another_model_is_not_whisper() {
        let dir = edited(CONFIG, |c| c["model_type"] = "bert".into());
        assert!(Whisper::read(dir.path()).unwrap().is_none());
        let empty = OwnDir::new("whisper-test").unwrap();
        assert!(Whisper::read(empty.path()).unwrap().is_none());
    }

    #[test]
    fn a_missing_or_wrong_key_names_its_file_and_key() {
        type Edit = fn(&mut Value);
        let cases: [(&str, Edit, &str); 5] = [
            (
                GENERATION,
                |g| g["no_timestamps_token_id"] = "<|notimestamps|>".into(),
                "`no_timestamps_token_id`",
            ),
            (
                GENERATION,
                |g| drop(g.as_object_mut().unwrap().remove("decoder_start_token_id")),
                "`decoder_start_token_id`",
            ),
            (
                GENERATION,
                |g| g["suppress_tokens"] = "none".into(),
                "`suppress_tokens`",
            ),
            (
                CONFIG,
                |c| drop(c.as_object_mut().unwrap().remove("d_model")),
                "`d_model`",
            ),
            (
                PREPROCESSOR,
                |p| p["feature_size"] = 128.into(),
                "`feature_size` is 128",
            ),
        ];
        for (file, edit, key) in cases {
            let dir = edited(file, edit);
            let e = Whisper::read(dir.path()).unwrap_err();
            assert!(e.contains(file) && e.contains(key), "{file} {key}: {e}");
        }
        let dir = edited(CONFIG, |_| {});
        std::fs::remove_file(dir.path().join(GENERATION)).unwrap();
        let e = Whisper::read(dir.path()).unwrap_err();
        assert!(e.contains("generation_config.json is missing"), "{e}");
    }
}
