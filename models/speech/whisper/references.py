"""The audio only the Whisper fixture needs and its reference transcriptions (make.py runs this).

audio/ beside this file:
- `queue-16k.wav`, `resident-16k.wav`: two more short sentences (16 kHz mono), so that four
  different clips (with models/speech/audio/'s gpu-16k.wav and memory-16k.wav) can be sent at
  once;
- `long-16k.wav` (16 kHz mono WAV) and `long-16k.flac` (the same samples in FLAC): 75 seconds of
  LONG_SENTENCES spoken by espeak-ng, each followed by PAUSE seconds of silence, cut or padded to
  exactly 75 s.

Every file here is at 16 kHz: a server resamples with another resampler than ffmpeg's (models/
README.md: within 0.01 of transformers' features, not 1e-4), which can move a greedy choice whose
margin is smaller, so the references that a server must match token for token are made from
files that need no resampling.

Every file is read as transformers' ASR pipeline reads one (ffmpeg to 16 kHz mono float32, as
models/speech/make.py's `decoded`), its features made by the folder's `WhisperFeatureExtractor`,
and transcribed by `WhisperForConditionalGeneration.generate` in torch, greedy (temperature 0, one
call; no fallback); then by Optimum's `ORTModelForSpeechSeq2Seq.generate` on the exported files,
which must give the same tokens.
"""
import importlib.util
import os
import shutil

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SPEECH = os.path.dirname(HERE)
AUDIO = os.path.join(HERE, "audio")

SHORT = {
    "queue": "When the queue is full, the server defers the request.",
    "resident": "The speech model stays resident, so a voice command is answered at once.",
}
LONG_SENTENCES = [
    "A small server in a home office often runs more than one model on the same GPU.",
    "A chat model answers questions, and an embedding model indexes notes.",
    "A speech model listens for commands.",
    "Each of them keeps its weights in GPU memory, and asks for more while it works.",
    "The memory is shared, but nobody is in charge of sharing it.",
    "When a new request arrives, it needs memory for its inputs and its temporary buffers.",
    "If the memory is not there, the request waits in the queue.",
    "The policy may also shrink the batch, or send the request to the processor instead.",
    "A model that has not been used for a while can be evicted.",
    "Its weights are loaded again when the next request comes.",
    "The metrics say how long each request waited and where it ran.",
    "Nothing is lost when the accelerator is taken away.",
]
PAUSE = 1.5
LONG_SECONDS = 75.0

# The four clips sent at once by the concurrency tests, each different.
CONCURRENT = ["gpu-16k.wav", "memory-16k.wav", "queue-16k.wav", "resident-16k.wav"]

# Short-form cases: name -> generate's keyword arguments.
CASES = {
    "transcribe": {"language": "en", "task": "transcribe"},
    "timestamps": {"language": "en", "task": "transcribe", "return_timestamps": True},
    "detect": {},
    "translate": {"language": "en", "task": "translate"},
    # What /v1/audio/translations asks (it has no language field): detect, then translate.
    "translate_detect": {"task": "translate"},
}
# Long-form: the features of the whole file (not cut at 30 s), as transformers' pipeline and model
# card give them for audio longer than a window.
LONG_FEATURES = {"truncation": False, "padding": "longest", "return_attention_mask": True}
LONG_GENERATE = {"language": "en", "task": "transcribe", "return_timestamps": True,
                 "condition_on_prev_tokens": False, "temperature": 0.0}


def speech_make():
    """models/speech/make.py, for its `run` and `decoded` (the pipeline's ffmpeg read)."""
    spec = importlib.util.spec_from_file_location("speech_make", os.path.join(SPEECH, "make.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_audio(sm):
    """The short clips and the 75-second one, written under audio/ (made afresh)."""
    shutil.rmtree(AUDIO, ignore_errors=True)
    os.makedirs(AUDIO)
    for clip, text in SHORT.items():
        spoken = os.path.join(AUDIO, f"{clip}-espeak.wav")
        sm.run("espeak-ng", "-v", "en-us", "-s", "160", "-w", spoken, text)
        sm.run("sox", "-D", "-R", spoken, "-r", "16000", "-b", "16", "-c", "1", os.path.join(AUDIO, f"{clip}-16k.wav"))
        os.remove(spoken)
    parts = []
    for i, text in enumerate(LONG_SENTENCES):
        spoken = os.path.join(AUDIO, f"long-{i:02}-espeak.wav")
        sm.run("espeak-ng", "-v", "en-us", "-s", "160", "-w", spoken, text)
        part = os.path.join(AUDIO, f"long-{i:02}.wav")
        sm.run("sox", "-D", "-R", spoken, "-r", "16000", "-b", "16", "-c", "1", part, "pad", "0", str(PAUSE))
        os.remove(spoken)
        parts.append(part)
    long_wav = os.path.join(AUDIO, "long-16k.wav")
    # Cut or padded to exactly LONG_SECONDS.
    sm.run("sox", "-D", "-R", *parts, long_wav, "pad", "0", str(LONG_SECONDS), "trim", "0", str(LONG_SECONDS))
    for part in parts:
        os.remove(part)
    sm.run("sox", "-D", "-R", long_wav, os.path.join(AUDIO, "long-16k.flac"))


class Recorder:
    """A logits processor, last in generate's list, that keeps what greedy decoding chose from:
    each step's input ids (the sequence so far, prompt first) and the gap between its best and
    second-best score after every other processor (suppressions, timestamp rules) ran."""

    def __init__(self):
        self.steps = []

    def __call__(self, input_ids, scores):
        top = torch.topk(scores[0], 2)
        self.steps.append({"ids": input_ids[0].tolist(), "chosen": int(top.indices[0]),
                           "gap": float(top.values[0] - top.values[1])})
        return scores

    def windows(self):
        """One entry per call of the underlying generate (a window): prompt, generated tokens, the
        smallest top-1/top-2 gap along them."""
        out, current = [], None
        for step in self.steps:
            continues = current is not None and step["ids"][:-1] == current["ids"]
            if not continues:
                current = {"prompt": step["ids"], "generated": [], "gaps": []}
                out.append(current)
            current["generated"].append(step["chosen"])
            current["gaps"].append(step["gap"])
            current["ids"] = step["ids"]
        return [{"prompt": w["prompt"], "generated": w["generated"], "min_gap": min(w["gaps"])} for w in out]


def tolist(x):
    return x.tolist() if hasattr(x, "tolist") else list(x)


def segments_of(output, fast):
    """generate(..., return_segments=True)'s segments of the one input: start, end (seconds), the
    tokens, and their text as the tokenizer decodes it (skip_special_tokens=True)."""
    return [{"start": round(float(s["start"]), 2), "end": round(float(s["end"]), 2), "tokens": tolist(s["tokens"]),
             "text": fast.decode(tolist(s["tokens"]), skip_special_tokens=True)}
            for s in output["segments"][0]]


def transcribe(model, features, kwargs, fast, attention_mask=None):
    """generate's output for one input, its segments when it has timestamps, and its windows (one
    per call of the underlying generate: prompt, generated tokens, smallest top-1/top-2 gap, and
    the seek, read from the loop itself: `_retrieve_segment` returns how far a window moves it)."""
    from transformers import LogitsProcessorList
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin
    recorder, seeks = Recorder(), []
    original = WhisperGenerationMixin._retrieve_segment

    def recording(*args, **kw):
        segments, offset = original(*args, **kw)
        prev = kw["prev_idx"]
        seeks.append({"seek_frames": int(round(float(kw["time_offset"][prev]) * 100)),
                      "window_frames": int(kw["seek_num_frames"][prev]), "advance_frames": int(offset),
                      "segments": len(segments)})
        return segments, offset

    extra = {"attention_mask": attention_mask} if attention_mask is not None else {}
    timestamps = kwargs.get("return_timestamps", False)
    WhisperGenerationMixin._retrieve_segment = staticmethod(recording)
    try:
        out = model.generate(features, **kwargs, **extra, logits_processor=LogitsProcessorList([recorder]),
                             return_segments=timestamps)
    finally:
        WhisperGenerationMixin._retrieve_segment = staticmethod(original)
    windows = recorder.windows()
    assert len(windows) == len(seeks), (len(windows), len(seeks))
    for window, seek in zip(windows, seeks):
        window.update(seek)
    sequence = tolist((out["sequences"] if timestamps else out)[0])
    return {"generate_output": sequence, "text": fast.decode(sequence, skip_special_tokens=True),
            "segments": segments_of(out, fast) if timestamps else None, "windows": windows,
            "min_margin": min(w["min_gap"] for w in windows)}


def short_reference(model, ort, fast, extractor, samples):
    features = extractor(samples, sampling_rate=16000, return_tensors="pt").input_features
    cases = {}
    for name, kwargs in CASES.items():
        result = transcribe(model, features, kwargs, fast)
        first = result["windows"][0]
        case = {"generate_kwargs": kwargs, "prompt_ids": first["prompt"],
                "sequence": first["prompt"] + first["generated"]}
        case.update({k: v for k, v in result.items() if v is not None})
        if name == "timestamps":
            case["offsets"] = fast.decode(result["generate_output"], output_offsets=True,
                                          skip_special_tokens=True)["offsets"]
        if name in ("detect", "translate_detect"):
            case["detected_language"] = fast.convert_ids_to_tokens(first["prompt"][1])
        ort_output = transcribe(ort, features, kwargs, fast)["generate_output"]
        case["optimum_same_tokens"] = ort_output == result["generate_output"]
        cases[name] = case
    return cases


def long_reference(model, ort, fast, extractor, samples):
    """Long-form as transformers does it (LONG_FEATURES, LONG_GENERATE)."""
    inputs = extractor(samples, sampling_rate=16000, return_tensors="pt", **LONG_FEATURES)
    features, mask = inputs.input_features, inputs.attention_mask
    result = transcribe(model, features, LONG_GENERATE, fast, attention_mask=mask)
    ort_result = transcribe(ort, features, LONG_GENERATE, fast, attention_mask=mask)
    logmel = features[0].numpy()
    entry = {
        "features": {"frames": int(features.shape[-1]), "attended_frames": int(mask.sum()),
                     "max": float(logmel.max()), "min": float(logmel.min()),
                     "note": "log-mel of the whole file at once: the clamp at (max - 8) uses the maximum over all "
                             "of it, not each window's"},
        "generate_kwargs": LONG_GENERATE, "feature_kwargs": LONG_FEATURES,
        "optimum_same_tokens": ort_result["generate_output"] == result["generate_output"],
    }
    entry.update(result)
    return entry


LONG_FORM_RULES = (
    "transformers 4.57 WhisperForConditionalGeneration.generate, long-form: features of the whole file "
    "(truncation=False, padding='longest'); seek starts at 0 (frames of 10 ms); each window is "
    "features[:, seek : seek + min(3000, total - seek)], zero-padded on the right to 3000 frames (F.pad value 0.0, "
    "not the log-mel of silence); its prompt is <|startoftranscript|><|en|><|transcribe|> (no previous text: "
    "condition_on_prev_tokens=False); greedy with the timestamp rules. Then: if the window's tokens hold two "
    "consecutive timestamps, it is cut into segments at each such pair; when it ends with a single timestamp "
    "(the last two tokens are text then timestamp, eos not counted), the seek moves by the whole window "
    "(min(3000, total - seek)); otherwise by the last pair's timestamp: (token - <|0.00|>) * 2 frames, and "
    "the unfinished text after it is dropped. With no pair, the whole window is one segment, ending at its last "
    "timestamp if it has one other than <|0.00|>, else at the window's end, and the seek moves by the whole "
    "window. Segment times are seek / 100 + timestamp * 0.02 s. It stops when seek >= total frames. "
    "A clip of 30 s or less goes through the same loop: its features are the extractor's default (padded "
    "to 3000 frames with the log-mel of silence, padding='max_length'), total = 3000, so with timestamps a "
    "window that seeks to a last pair before 30 s is followed by another over the rest (the 'timestamps' "
    "cases here have two windows); without timestamps it is one window.")


def write(folder, model, fast):
    """Make the audio and return the reference (make.py writes it to reference.json)."""
    from optimum.onnxruntime import ORTModelForSpeechSeq2Seq
    from transformers import WhisperFeatureExtractor
    sm = speech_make()
    make_audio(sm)
    extractor = WhisperFeatureExtractor.from_pretrained(folder)
    ort = ORTModelForSpeechSeq2Seq.from_pretrained(folder, use_merged=False, use_cache=True)
    ids = fast.convert_tokens_to_ids
    reference = {
        "special_tokens": {t: ids(t) for t in ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>",
                                               "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                                               "<|notimestamps|>", "<|0.00|>", "<|30.00|>"]},
        "vocab_size": len(fast), "time_precision": 0.02, "short": {}, "long": {}, "concurrent": CONCURRENT,
        "long_form_rules": LONG_FORM_RULES,
    }
    short_files = [("../audio", "gpu-16k.wav"), ("../audio", "memory-16k.wav"), ("audio", "queue-16k.wav"),
                   ("audio", "resident-16k.wav")]
    for where, name in short_files:
        path = os.path.normpath(os.path.join(HERE, where, name))
        samples = sm.decoded(path)
        reference["short"][name] = {"path": os.path.relpath(path, os.path.dirname(SPEECH)),
                                    "samples_16k": int(len(samples)),
                                    "cases": short_reference(model, ort, fast, extractor, samples)}
    for name in ["long-16k.wav", "long-16k.flac"]:
        samples = sm.decoded(os.path.join(AUDIO, name))
        entry = long_reference(model, ort, fast, extractor, samples)
        entry["samples_16k"] = int(len(samples))
        reference["long"][name] = entry
    return reference


def check(reference):
    """Different clips must transcribe differently, or a server ignoring the audio would pass."""
    for case in CASES:
        texts = [r["cases"][case]["sequence"] for n, r in reference["short"].items() if n in CONCURRENT]
        assert len({tuple(t) for t in texts}) == len(texts), f"{case}: two clips transcribe the same"
    seq = {c: tuple(reference["short"]["gpu-16k.wav"]["cases"][c]["sequence"][4:]) for c in CASES}
    assert seq["transcribe"] != seq["translate"], "the task token changes nothing"
