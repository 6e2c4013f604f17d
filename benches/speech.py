"""Speech to text: vramguard's `POST /v1/audio/transcriptions` against Optimum's
`ORTModelForSpeechSeq2Seq` in process (ONNX Runtime on the CPU), same model, same audio.

The model is the Whisper fixture (models/speech/whisper/make.py: Whisper's tokenizer and
generation config, random weights shaped so that a transcription ends) at whisper-tiny's
dimensions (d_model 384, 4 + 4 layers of 6 heads, MLP 1536), built once under
target/bench/whisper-tiny/ by the same code and exported by Optimum; `--model fixture` uses the
committed fixture itself. The audio is the fixture's 75-second clip
(models/speech/whisper/audio/long-16k.wav), transcribed in English in long-form windows.

- Optimum: the folder loaded by `ORTModelForSpeechSeq2Seq` (encoder, decoder, decoder with past),
  one transcription at a time in this process: the front end (ffmpeg decode and resample, as
  transformers' pipeline reads a file, then `WhisperFeatureExtractor` over the whole file) and
  the model (`generate`, long-form, greedy, timestamps, as the references are made) timed apart;
- vramguard (`--url`, a server already serving the folder as `--served-model`): the load
  generator `hey`, in its own process, posts the clip as multipart (the body OpenAI's client
  sends) at c1 and at c4; each figure the median of the rounds.

Figures: real-time factor (processing seconds per audio second) at c1 for both, and aggregate
audio seconds per second at c4 for vramguard; the front end's share of the model's time for one
30 s window (Optimum's side: the server does not report its own). Targets (issue 53): vramguard's
c1 real-time factor within 1/0.95 of Optimum's; its c4 aggregate >= 1.5x its c1.

    /work/fix/opt/bin/python benches/speech.py [--url http://127.0.0.1:8080] [--served-model whisper]
        [--model tiny|fixture] [--rounds 3] [--requests 8]

Without `--url` only Optimum's side runs. Needs `hey` (apt-get install hey), ffmpeg, and a Python
with torch, transformers, optimum and onnxruntime (models/embed/requirements-embed.txt). Figures
go to target/bench/speech.json.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "target" / "bench"
FIXTURE = ROOT / "models" / "speech" / "whisper"
AUDIO = FIXTURE / "audio" / "long-16k.wav"
TINY = {"d_model": 384, "encoder_layers": 4, "encoder_attention_heads": 6, "decoder_layers": 4,
        "decoder_attention_heads": 6, "encoder_ffn_dim": 1536, "decoder_ffn_dim": 1536}
GENERATE = {"language": "en", "task": "transcribe", "return_timestamps": True, "condition_on_prev_tokens": False,
            "temperature": 0.0}


def fixture_module(name: str):
    spec = importlib.util.spec_from_file_location(name, FIXTURE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def folder(which: str) -> Path:
    """The model folder: the committed fixture, or whisper-tiny's size built once."""
    if which == "fixture":
        return FIXTURE
    out = OUT / "whisper-tiny"
    if (out / "decoder_with_past_model.onnx").exists():
        return out
    make = fixture_module("make")
    work = tempfile.mkdtemp(prefix="whisper-tiny-")
    hf, _, _ = make.build(work, TINY)
    make.export(hf, work, str(out))
    shutil.rmtree(work)
    return out


def optimum(model_dir: Path, rounds: int) -> dict:
    """Front end and model timed apart, one transcription at a time, the median of the rounds."""
    import torch
    from optimum.onnxruntime import ORTModelForSpeechSeq2Seq
    from transformers import WhisperFeatureExtractor
    speech = fixture_module("references").speech_make()
    extractor = WhisperFeatureExtractor.from_pretrained(model_dir)
    model = ORTModelForSpeechSeq2Seq.from_pretrained(model_dir, use_merged=False, use_cache=True,
                                                     provider="CPUExecutionProvider")
    front, front_window, run, tokens = [], [], [], 0
    for _ in range(rounds + 1):
        started = time.perf_counter()
        samples = speech.decoded(str(AUDIO))
        inputs = extractor(samples, sampling_rate=16000, return_tensors="pt", truncation=False, padding="longest",
                           return_attention_mask=True)
        front.append(time.perf_counter() - started)
        started = time.perf_counter()
        extractor(samples[:16000 * 30], sampling_rate=16000, return_tensors="pt")
        front_window.append(time.perf_counter() - started)
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(inputs.input_features, attention_mask=inputs.attention_mask, **GENERATE)
        run.append(time.perf_counter() - started)
        tokens = int(out.shape[-1])
    # The first round warms ONNX Runtime's sessions up; it is left out.
    seconds = len(samples) / 16000
    model_s, front_s = statistics.median(run[1:]), statistics.median(front[1:])
    windows = max(1, round(seconds / 30))
    return {"audio_s": seconds, "model_s": model_s, "front_end_s": front_s, "tokens": tokens,
            "rtf": model_s / seconds, "rtf_with_front_end": (model_s + front_s) / seconds,
            "front_end_share_of_30s_window": statistics.median(front_window[1:]) / (model_s / windows)}


def multipart(path: Path, model: str) -> tuple[Path, str]:
    """The body OpenAI's client posts: file, model, language, response_format (json)."""
    boundary = "vramguard-bench-speech"
    parts = []
    for name, value in (("model", model), ("language", "en"), ("response_format", "json")):
        parts.append(f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n".encode())
    parts.append(f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{path.name}\"\r\n"
                 f"Content-Type: audio/wav\r\n\r\n".encode() + path.read_bytes() + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    body = OUT / "speech-body.bin"
    body.write_bytes(b"".join(parts))
    return body, f"multipart/form-data; boundary={boundary}"


def hey(url: str, body: Path, content_type: str, concurrency: int, requests: int) -> dict:
    """`hey` in its own process: requests per second over its wall time, and the mean latency."""
    started = time.perf_counter()
    out = subprocess.run(
        ["hey", "-n", str(requests), "-c", str(concurrency), "-t", "600", "-m", "POST", "-T", content_type,
         "-D", str(body), "-o", "csv", url],
        check=True, capture_output=True, text=True,
    ).stdout
    wall = time.perf_counter() - started
    rows = list(csv.DictReader(io.StringIO(out)))
    bad = [r for r in rows if r["status-code"] != "200"]
    if bad:
        sys.exit(f"{len(bad)} of {len(rows)} answers were not 200: {bad[0]}")
    return {"rps": len(rows) / wall, "mean_s": statistics.mean(float(r["response-time"]) for r in rows)}


def vramguard(url: str, model: str, audio_s: float, rounds: int, requests: int) -> dict:
    body, content_type = multipart(AUDIO, model)
    endpoint = f"{url.rstrip('/')}/v1/audio/transcriptions"
    hey(endpoint, body, content_type, 1, 1)  # warm-up
    c1 = [hey(endpoint, body, content_type, 1, max(2, requests // 4)) for _ in range(rounds)]
    c4 = [hey(endpoint, body, content_type, 4, requests) for _ in range(rounds)]
    rtf_c1 = statistics.median(r["mean_s"] for r in c1) / audio_s
    c1_aggregate = statistics.median(r["rps"] for r in c1) * audio_s
    c4_aggregate = statistics.median(r["rps"] for r in c4) * audio_s
    return {"rtf_c1": rtf_c1, "audio_s_per_s_c1": c1_aggregate, "audio_s_per_s_c4": c4_aggregate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a vramguard serving the model folder")
    parser.add_argument("--served-model", default="whisper", help="its name in that server's config")
    parser.add_argument("--model", choices=["tiny", "fixture"], default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    model_dir = folder(args.model)
    figures = {"machine": {"cpus": os.cpu_count()}, "model": str(model_dir.relative_to(ROOT)),
               "audio": str(AUDIO.relative_to(ROOT)), "optimum": optimum(model_dir, args.rounds)}
    rows = [("optimum c1", figures["optimum"]["rtf"], figures["optimum"]["audio_s"] / figures["optimum"]["model_s"])]
    if args.url:
        v = figures["vramguard"] = vramguard(args.url, args.served_model, figures["optimum"]["audio_s"], args.rounds,
                                             args.requests)
        figures["ratios"] = {"optimum_rtf_over_vramguard_c1": figures["optimum"]["rtf"] / v["rtf_c1"],
                             "vramguard_c4_over_c1": v["audio_s_per_s_c4"] / v["audio_s_per_s_c1"]}
        rows += [("vramguard c1", v["rtf_c1"], v["audio_s_per_s_c1"]), ("vramguard c4", None, v["audio_s_per_s_c4"])]
    (OUT / "speech.json").write_text(json.dumps(figures, indent=1))
    print(f"{'':14} {'RTF':>8} {'audio s/s':>10}")
    for name, rtf, rate in rows:
        print(f"{name:14} {('%.4f' % rtf) if rtf is not None else '-':>8} {rate:10.1f}")
    o = figures["optimum"]
    print(f"front end (decode + resample + log-mel, 30 s window): {100 * o['front_end_share_of_30s_window']:.1f}% "
          f"of the model's time for a window; {o['tokens']} tokens for {o['audio_s']:.0f} s")
    if "ratios" in figures:
        print(json.dumps(figures["ratios"], indent=1))


if __name__ == "__main__":
    main()
