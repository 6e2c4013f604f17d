#!/usr/bin/env python3
"""Whisper folders at the edges of what `transformers` decodes (issue 63), with its references.

    .deps/fixtures-venv-embed/bin/python models/speech/whisper/make_variants.py   # after make.py

Writes models/speech/whisper-endless/: the tiny Whisper of make.py (the same seed, tokenizer and
weights) but for <|endoftext|>'s bias, ENDLESS_EOT_BIAS instead of make.py's EOT_BIAS, so that a
window's decoder never ends, as a model of random weights does: it goes on to `max_length`, and
without timestamps asked it writes timestamp tokens all the same (nothing suppresses them then),
pairs of which `transformers` cuts the window at, seeking to the last pair's time and decoding
another window from there. Only what a server reads is kept of Optimum's export:
encoder_model.onnx, decoder_model_merged.onnx, config.json, generation_config.json,
preprocessor_config.json and tokenizer.json.

And its `reference.json`, what `WhisperForConditionalGeneration.generate` (torch, greedy) gives on
models/speech/audio/gpu-16k.wav with CASE's arguments:
- `with_keys`: on the folder as written (its generation_config.json has `max_length` 448 and
  `no_timestamps_token_id`): every window, its prompt, tokens and seek, and the text;
- `without_keys`: on the same folder with `max_length` and `no_timestamps_token_id` taken out of
  generation_config.json (as older Whisper exports lack them). `transformers` does not take them
  from elsewhere: the prompt has no <|notimestamps|>, no timestamp token is one (no window is cut
  at them, and asking for timestamps is refused), and the budget is GenerationConfig's default
  `max_length` of 20, which generate makes 20 new tokens. transformers 5.25 gives the same
  tokens (checked by hand: its `_set_max_new_tokens_and_length` leaves a missing `max_length`
  alone).

Deterministic, as make.py: the same versions write the same bytes.
"""
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SPEECH = os.path.dirname(HERE)
ENDLESS = os.path.join(SPEECH, "whisper-endless")
CLIP = os.path.join(SPEECH, "audio", "gpu-16k.wav")
# Far below any text logit: <|endoftext|> is never picked within a window's 448 positions.
ENDLESS_EOT_BIAS = -20.0
CASE = {"language": "en", "task": "transcribe"}
KEPT = ["encoder_model.onnx", "decoder_model_merged.onnx", "config.json", "generation_config.json",
        "preprocessor_config.json", "tokenizer.json"]
REMOVED_KEYS = ["max_length", "no_timestamps_token_id"]


def without_keys(hf, work):
    """A copy of the transformers folder `hf` whose generation_config.json lacks REMOVED_KEYS."""
    out = os.path.join(work, "without-keys")
    shutil.copytree(hf, out)
    path = os.path.join(out, "generation_config.json")
    with open(path) as f:
        config = json.load(f)
    for key in REMOVED_KEYS:
        del config[key]
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return out


def windows(result):
    return [{k: w[k] for k in ["prompt", "generated", "seek_frames", "window_frames", "advance_frames"]}
            for w in result["windows"]]


def main():
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, "PYTHONHASHSEED": "0"})
    sys.path.insert(0, HERE)
    import torch
    import make
    import references
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="whisper-variants-")
    hf, model, fast = make.build(work, eot_bias=ENDLESS_EOT_BIAS)
    make.export(hf, work, out=ENDLESS)
    for name in sorted(os.listdir(ENDLESS)):
        if name not in KEPT and name != "reference.json":
            os.remove(os.path.join(ENDLESS, name))
    samples = references.speech_make().decoded(CLIP)
    features = WhisperFeatureExtractor.from_pretrained(hf)(samples, sampling_rate=16000,
                                                           return_tensors="pt").input_features
    reference = {"clip": os.path.relpath(CLIP, os.path.dirname(SPEECH)), "generate_kwargs": CASE,
                 "eot_bias": ENDLESS_EOT_BIAS, "removed_keys": REMOVED_KEYS}
    with_keys = references.transcribe(model, features, CASE, fast)
    reference["with_keys"] = {"text": with_keys["text"], "generate_output": with_keys["generate_output"],
                              "windows": windows(with_keys)}
    bare = WhisperForConditionalGeneration.from_pretrained(without_keys(hf, work)).eval()
    result = references.transcribe(bare, features, CASE, fast)
    reference["without_keys"] = {"text": result["text"], "generate_output": result["generate_output"],
                                 "windows": windows(result)}
    try:
        bare.generate(features, **CASE, return_timestamps=True)
        raise AssertionError("transformers decoded timestamps without `no_timestamps_token_id`")
    except ValueError as e:
        assert "no_timestamps_token_id" in str(e), e
    reference["tools"] = make.versions()
    check(reference)
    with open(os.path.join(ENDLESS, "reference.json"), "w") as f:
        json.dump(reference, f, indent=1)
        f.write("\n")
    shutil.rmtree(work)


def check(reference):
    """What the tests rely on: with the keys, windows that reach `max_length` and a seek moved by
    timestamp pairs, so that more than one window is decoded from a clip of 30 s; without them,
    one window of 20 new tokens whose prompt has no <|notimestamps|>."""
    full = reference["with_keys"]["windows"]
    assert len(full) > 1, "one window: nothing is cut at timestamp pairs"
    assert all(len(w["prompt"]) + len(w["generated"]) == 448 for w in full), "a window ended"
    bare = reference["without_keys"]["windows"]
    assert len(bare) == 1 and len(bare[0]["generated"]) == 20 and len(bare[0]["prompt"]) == 3, bare


if __name__ == "__main__":
    sys.exit(main())
