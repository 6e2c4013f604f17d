//! A generation job made from a protocol's parsed request ([`Asked`]): a chat rendered by its
//! model's template (`chat.rs`), the grammar of a structured output compiled, how to sample
//! (each field checked; what the request leaves out, the model folder's
//! `generation_config.json`, else OpenAI's defaults), and the prompts tokenized by the model's
//! tokenizer and bounded by its context, a prompt far past it found too long from its first
//! tokens. The protocol reads its wire format and checks what needs no model; everything that
//! needs the model is here, and what is wrong comes back as an [`Invalid`] naming the field.

use serde_json::Value;

use super::chat::{self, Chat};
use super::{Invalid, Params, Penalties, Prompt, Shorten};
use crate::runtime::folder::SamplingDefaults;
use crate::runtime::leading::{Bounded, encode_within};
use crate::serve::service::{Generator, ModelEntry};

/// A prompt as the client sent it: text, or token ids.
#[derive(Debug, Clone)]
pub enum PromptIn {
    /// Text, tokenized here.
    Text(String),
    /// Token ids, checked against the tokenizer and sent to the model as they are.
    Tokens(Vec<u32>),
}

/// What a request generates from.
#[derive(Debug, Clone)]
pub enum Prompts {
    /// A completion's prompts, each its own.
    Completion(Vec<PromptIn>),
    /// A chat: one prompt, rendered by the model's template.
    Chat(Chat),
}

/// The sampling fields as the request sets them (`None`: left out).
#[derive(Debug, Clone, Default)]
pub struct Sampling {
    /// Softmax temperature (0 to 2).
    pub temperature: Option<f32>,
    /// Nucleus sampling's mass (above 0, at most 1).
    pub top_p: Option<f32>,
    /// Only the most likely tokens (0: all).
    pub top_k: Option<u32>,
    /// The sampler's seed; left out, one from the request id.
    pub seed: Option<u64>,
    /// Strings that end the text (a chat's end of turn is added here).
    pub stop: Vec<String>,
    /// OpenAI's `presence_penalty` (-2 to 2).
    pub presence_penalty: Option<f32>,
    /// OpenAI's `frequency_penalty` (-2 to 2).
    pub frequency_penalty: Option<f32>,
    /// OpenAI's `logit_bias`: token ids as strings, to -100 to 100.
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// `transformers`' penalty (above 0).
    pub repetition_penalty: Option<f32>,
}

/// A generation request as a protocol parsed it, before anything needs the model.
#[derive(Debug, Clone)]
pub struct Asked {
    /// What it generates from.
    pub prompts: Prompts,
    /// How to pick tokens.
    pub sampling: Sampling,
    /// The most tokens to generate; `None`: as many as the model's context leaves.
    pub max_tokens: Option<u32>,
    /// How many of the most likely tokens' log-probabilities to give beside each token's
    /// (`None`: no log-probabilities).
    pub logprobs: Option<u32>,
    /// Each prompt's text is given back before its answers' (a completion's `echo`).
    pub echo: bool,
    /// The JSON schema the answer follows, and whether strictly (`response_format`).
    pub format: Option<(Value, bool)>,
}

/// A checked generation job for one model: its prompts' tokens and how to generate.
pub struct Job {
    /// The prompts, tokenized.
    pub prompts: Vec<Prompt>,
    /// With `echo`, each prompt's text.
    pub echo: Option<Vec<String>>,
    /// How to generate.
    pub params: Params,
    /// The names of the tools offered to the model (empty: none).
    pub tools: Vec<String>,
}

/// `asked` made a job for `entry`'s model, which generates text with `text` (request `id`
/// seeds a sampler the request does not seed): a chat rendered, its grammar compiled, each
/// sampling field checked, the prompts tokenized within the model's context.
pub fn job(entry: &ModelEntry, text: &Generator, asked: Asked, id: &str) -> Result<Job, Invalid> {
    let Asked {
        prompts,
        mut sampling,
        max_tokens,
        logprobs,
        echo,
        format,
    } = asked;
    let chat = matches!(prompts, Prompts::Chat(_));
    let (prompts, grammar, shorten, tools) = match prompts {
        Prompts::Completion(prompts) => {
            let grammar = format.as_ref().map(|f| chat::format_grammar(text, f)).transpose()?;
            (prompts, grammar, None, Vec::new())
        }
        Prompts::Chat(asked) => {
            let rendered = chat::rendered(entry, text, asked, format.as_ref())?;
            // The end of the turn ends the answer even where it is not a single token.
            sampling.stop.extend(rendered.end_of_turn);
            let prompt = PromptIn::Text(rendered.text);
            (vec![prompt], rendered.grammar, Some(rendered.shorten), rendered.tools)
        }
    };
    // The ids `logit_bias` may name: the model's logits, or where the graph leaves their
    // number open, its tokenizer's vocabulary.
    let vocab = entry
        .kind
        .decoder()
        .and_then(|layout| layout.vocab)
        .unwrap_or(text.tokenizer.get_vocab_size(true) as u64);
    let defaults = &entry.folder.sampling;
    let params = Params {
        grammar,
        ..params(
            &sampling,
            defaults,
            (max_tokens, logprobs),
            !tools.is_empty(),
            vocab,
            id,
        )?
    };
    let generated = u64::from(params.max_tokens.unwrap_or(1));
    let (prompts, texts) = tokenized(entry, text, prompts, (chat, echo, generated), shorten)?;
    Ok(Job {
        prompts,
        echo: echo.then_some(texts),
        params,
        tools,
    })
}

/// Each of `prompts` tokenized by `text`'s tokenizer (token ids checked against it), with its
/// text (a prompt of ids decoded only with `echo`), within `entry`'s context less the
/// `generated` tokens asked for; a `chat`'s prompt cut by `shorten` (by whole turns), a
/// completion's from its start.
fn tokenized(
    entry: &ModelEntry,
    text: &Generator,
    prompts: Vec<PromptIn>,
    (chat, echo, generated): (bool, bool, u64),
    shorten: Option<Shorten>,
) -> Result<(Vec<Prompt>, Vec<String>), Invalid> {
    let tokenizer = &text.tokenizer;
    let field = if chat { "messages" } else { "prompt" };
    // The positions the model takes bound the prompt, with room for what it asks to generate
    // (at least one token): a longer one is refused before anything runs, found so from as
    // much of its text as that many tokens could cover.
    let context = entry.kind.decoder().and_then(|layout| layout.context);
    let too_long = |prompt: usize, whole: bool| Invalid::TooLong {
        limit: context.unwrap_or(u64::MAX),
        prompt: (prompt as u64, whole),
        generated,
        field,
    };
    let limit = context.map(|c| c.saturating_sub(generated));
    if limit == Some(0) {
        return Err(too_long(1, false));
    }
    let limit = limit.map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(usize::MAX));
    let mut texts = Vec::with_capacity(prompts.len());
    let mut tokenized = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let (text, tokens) = match prompt {
            // A completion's prompt gets what the tokenizer adds to any text (Llama's and
            // Gemma's BOS), as `transformers` and vLLM encode it; a chat's rendered template
            // already holds it.
            PromptIn::Text(text) => match encode_within(tokenizer, &text, !chat, limit) {
                Ok(Bounded::Tokens(ids)) => (text, ids),
                Ok(Bounded::Over { at_least, whole }) => return Err(too_long(at_least, whole)),
                Err(e) => return Err(Invalid::field(format!("the prompt cannot be tokenized: {e}"), field)),
            },
            PromptIn::Tokens(ids) if ids.len() > limit => return Err(too_long(ids.len(), true)),
            // Token ids go to the model as they are: nothing is added.
            PromptIn::Tokens(ids) => {
                if let Some(id) = ids.iter().find(|&&id| tokenizer.id_to_token(id).is_none()) {
                    return Err(Invalid::field(
                        format!(
                            "token id {id} is not in the model's vocabulary ({} tokens)",
                            tokenizer.get_vocab_size(true)
                        ),
                        "prompt",
                    ));
                }
                let text = match echo {
                    true => tokenizer
                        .decode(&ids, false)
                        .map_err(|e| Invalid::field(format!("the prompt's tokens cannot be decoded: {e}"), "prompt"))?,
                    false => String::new(),
                };
                (text, ids)
            }
        };
        if tokens.is_empty() {
            return Err(Invalid::field("the prompt is empty", field));
        }
        let mut prompt = Prompt::from(tokens);
        if shorten.is_some() {
            prompt.shorten = shorten.clone();
        }
        texts.push(text);
        tokenized.push(prompt);
    }
    Ok((tokenized, texts))
}

/// How to generate, from the `sampling` fields, `max_tokens` and `logprobs`: each checked;
/// what the request leaves out, the model folder's `defaults` (its `generation_config.json`),
/// else OpenAI's. `tools` says whether the prompt offers tools; `vocab` is how many token ids
/// the model has; request `id` seeds a sampler the request does not seed.
fn params(
    sampling: &Sampling,
    defaults: &SamplingDefaults,
    (max_tokens, logprobs): (Option<u32>, Option<u32>),
    tools: bool,
    vocab: u64,
    id: &str,
) -> Result<Params, Invalid> {
    if max_tokens == Some(0) {
        return Err(Invalid::field("`max_tokens` must be at least 1", "max_tokens"));
    }
    let temperature = sampling.temperature.or(defaults.temperature).unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(Invalid::field("`temperature` must be between 0 and 2", "temperature"));
    }
    let top_p = sampling.top_p.or(defaults.top_p).unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(Invalid::field("`top_p` must be greater than 0 and at most 1", "top_p"));
    }
    if sampling.stop.iter().any(String::is_empty) {
        return Err(Invalid::field("`stop` strings must not be empty", "stop"));
    }
    Ok(Params {
        max_tokens,
        temperature,
        top_p,
        top_k: sampling.top_k.or(defaults.top_k).unwrap_or(0),
        // Without a seed, one from the request id: still the same tokens if it is retried.
        seed: sampling.seed.unwrap_or_else(|| {
            id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
            })
        }),
        stop: sampling.stop.clone(),
        tools,
        grammar: None,
        penalties: penalties(sampling, defaults, vocab)?,
        logprobs,
    })
}

/// The penalties and bias, each checked: OpenAI's `presence_penalty` and `frequency_penalty`
/// (-2 to 2) and `logit_bias` (token ids below `vocab`, as strings, to -100 to 100), and
/// `repetition_penalty` (above 0) from the request, else the model folder's `defaults`.
fn penalties(sampling: &Sampling, defaults: &SamplingDefaults, vocab: u64) -> Result<Penalties, Invalid> {
    let openai = |value: Option<f32>, name: &'static str| match value.unwrap_or(0.0) {
        p if (-2.0..=2.0).contains(&p) => Ok(p),
        _ => Err(Invalid::field(format!("`{name}` must be between -2 and 2"), name)),
    };
    let repetition = sampling
        .repetition_penalty
        .or(defaults.repetition_penalty)
        .unwrap_or(1.0);
    if !(repetition > 0.0 && repetition.is_finite()) {
        return Err(Invalid::field(
            "`repetition_penalty` must be a number above 0",
            "repetition_penalty",
        ));
    }
    let mut bias = Vec::new();
    for (key, value) in sampling.logit_bias.iter().flatten() {
        let id = key
            .parse::<u32>()
            .ok()
            .filter(|&id| u64::from(id) < vocab)
            .ok_or_else(|| {
                Invalid::field(
                    format!("`logit_bias` names `{key}`, not a token id below the model's {vocab}"),
                    "logit_bias",
                )
            })?;
        let value = value.as_f64().filter(|v| (-100.0..=100.0).contains(v)).ok_or_else(|| {
            Invalid::field(
                format!("`logit_bias` of token {id} is {value}, not a number from -100 to 100"),
                "logit_bias",
            )
        })?;
        bias.push((id, value as f32));
    }
    // Two keys may name one id (`"7"` and `"07"`).
    bias.sort_unstable_by_key(|&(id, _)| id);
    if let Some(twice) = bias.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(Invalid::field(
            format!("`logit_bias` names token {} twice", twice[0].0),
            "logit_bias",
        ));
    }
    Ok(Penalties {
        presence: openai(sampling.presence_penalty, "presence_penalty")?,
        frequency: openai(sampling.frequency_penalty, "frequency_penalty")?,
        repetition,
        bias,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_left_out_takes_the_folders_defaults_and_each_field_is_checked_by_name() {
        let defaults = SamplingDefaults {
            temperature: Some(0.7),
            top_p: Some(0.9),
            top_k: Some(20),
            repetition_penalty: Some(1.1),
        };
        let asked = Sampling {
            top_k: Some(5),
            ..Sampling::default()
        };
        let got = params(&asked, &defaults, (Some(8), None), false, 100, "req").expect("valid");
        assert_eq!((got.temperature, got.top_p, got.top_k), (0.7, 0.9, 5));
        assert_eq!(got.penalties.repetition, 1.1);
        // The seed a request leaves out comes from its id: the same id, the same tokens.
        let again = params_of(&asked, "req");
        assert_eq!(got.seed, again.seed);
        assert_ne!(got.seed, params_of(&asked, "other").seed);
        let refused = |sampling: Sampling, max_tokens: Option<u32>| match params(
            &sampling,
            &SamplingDefaults::default(),
            (max_tokens, None),
            false,
            100,
            "req",
        ) {
            Err(Invalid::Field { message, at }) => (at, message),
            other => panic!("{other:?}"),
        };
        let (at, message) = refused(Sampling::default(), Some(0));
        assert_eq!(
            (at.as_str(), message.as_str()),
            ("max_tokens", "`max_tokens` must be at least 1")
        );
        let hot = Sampling {
            temperature: Some(2.5),
            ..Sampling::default()
        };
        assert_eq!(refused(hot, None).0, "temperature");
        let empty_stop = Sampling {
            stop: vec![String::new()],
            ..Sampling::default()
        };
        assert_eq!(refused(empty_stop, None).0, "stop");
        let mut bias = serde_json::Map::new();
        bias.insert("100".into(), Value::from(1.0));
        let past_vocab = Sampling {
            logit_bias: Some(bias),
            ..Sampling::default()
        };
        let (at, message) = refused(past_vocab, None);
        assert_eq!(at, "logit_bias");
        assert!(message.contains("below the model's 100"), "{message}");
    }

    /// `params` of `sampling` with no folder defaults, for request `id`.
    fn params_of(sampling: &Sampling, id: &str) -> Params {
        params(sampling, &SamplingDefaults::default(), (None, None), false, 100, id).expect("valid")
    }
}
