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
- vramguard (`--serve BINARY`): the release binary started by this script on the folder, one CPU
  pool of `--workers` (default one) whose sessions take `--intra-threads` (default: every CPU, as ONNX Runtime's
  default that Optimum runs under), once per config: without `batching` and with `batching:
  {max_batch: 4, max_delay: 50ms}` (`--configs` picks); or (`--url`) a server already serving
  the folder as `--served-model`. The load generator `hey`, in its own process, posts the clip
  as multipart (the body OpenAI's client sends) at c1 and at c4, the rounds interleaved; each
  figure the median of the rounds, and the rows per window run at c4 from the server's
  `vramguard_batch_rows` histogram.

Figures: real-time factor (processing seconds per audio second) at c1 for both, and aggregate
audio seconds per second at c4 for vramguard; the front end's share of the model's time for one
30 s window (Optimum's side: the server does not report its own). Targets (issue 53): vramguard's
c1 real-time factor within 1/0.95 of Optimum's; its c4 aggregate >= 1.5x its c1.

    /work/fix/opt/bin/python benches/speech.py [--serve target/release/vramguard] [--intra-threads N] [--workers N]
        [--configs plain,batching] [--url http://127.0.0.1:8080 --served-model whisper]
        [--model tiny|fixture] [--rounds 3] [--requests 8]

Without `--serve` or `--url` only Optimum's side runs. Needs `hey` (apt-get install hey), ffmpeg, and a Python
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
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "target" / "bench"
FIXTURE = ROOT / "models" / "speech" / "whisper"
PORT = 18093
CONFIGS = {"plain": "", "batching": ", batching: {max_batch: 4, max_delay: 50ms}"}
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


class Optimum:
    """Optimum's `ORTModelForSpeechSeq2Seq` on the folder (its default: ONNX Runtime's threads on
    every CPU), one transcription at a time, the front end and the model timed apart."""

    def __init__(self, model_dir: Path):
        from optimum.onnxruntime import ORTModelForSpeechSeq2Seq
        from transformers import WhisperFeatureExtractor
        self.speech = fixture_module("references").speech_make()
        self.extractor = WhisperFeatureExtractor.from_pretrained(model_dir)
        self.model = ORTModelForSpeechSeq2Seq.from_pretrained(model_dir, use_merged=False, use_cache=True,
                                                              provider="CPUExecutionProvider")
        self.front, self.front_window, self.run, self.tokens, self.seconds = [], [], [], 0, 0.0
        self.once()  # warms ONNX Runtime's sessions up; left out
        self.front, self.front_window, self.run = [], [], []

    def once(self) -> None:
        import torch
        started = time.perf_counter()
        samples = self.speech.decoded(str(AUDIO))
        inputs = self.extractor(samples, sampling_rate=16000, return_tensors="pt", truncation=False,
                                padding="longest", return_attention_mask=True)
        self.front.append(time.perf_counter() - started)
        started = time.perf_counter()
        self.extractor(samples[:16000 * 30], sampling_rate=16000, return_tensors="pt")
        self.front_window.append(time.perf_counter() - started)
        started = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(inputs.input_features, attention_mask=inputs.attention_mask, **GENERATE)
        self.run.append(time.perf_counter() - started)
        self.tokens, self.seconds = int(out.shape[-1]), len(samples) / 16000

    def figures(self) -> dict:
        """The medians of the rounds so far."""
        model_s, front_s = statistics.median(self.run), statistics.median(self.front)
        windows = max(1, round(self.seconds / 30))
        return {"audio_s": self.seconds, "model_s": model_s, "front_end_s": front_s, "tokens": self.tokens,
                "rtf": model_s / self.seconds, "rtf_with_front_end": (model_s + front_s) / self.seconds,
                "front_end_share_of_30s_window": statistics.median(self.front_window) / (model_s / windows),
                "model_s_runs": self.run}


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


def serve(binary: str, model_dir: Path, config: str, intra_threads: int, workers: int) -> subprocess.Popen:
    """`binary` serving the folder as `whisper` on a CPU pool of `workers`, `config` its model's extra keys."""
    path = OUT / f"speech-{config}.yaml"
    path.write_text(
        "server: {listen: '127.0.0.1:%d'}\n"
        "models:\n"
        "  - {name: whisper, path: '%s'%s}\n"
        "pools: [{name: cpu, provider: cpu, models: [whisper], workers: %d, intra_threads: %d,"
        " queue: {capacity: 64, max_wait: 600s}}]\n"
        % (PORT, model_dir.resolve() / "encoder_model.onnx", CONFIGS[config], workers, intra_threads)
    )
    log = open(OUT / f"speech-{config}.log", "w")
    server = subprocess.Popen([binary, "serve", "--config", str(path)], stdout=log, stderr=subprocess.STDOUT)
    until = time.time() + 300
    while time.time() < until:
        if server.poll() is not None:
            sys.exit(f"the server exited ({server.returncode}); see {log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit("the server was not ready in 300 s")


def batch_rows(url: str) -> tuple[float, float]:
    """The model's batched runs so far and their rows (`vramguard_batch_rows`; 0 without batching)."""
    metrics = urllib.request.urlopen(f"{url.rstrip('/')}/metrics").read().decode()
    read = lambda name: sum(float(l.split()[-1]) for l in metrics.splitlines() if l.startswith(name + "{"))
    return read("vramguard_batch_rows_count"), read("vramguard_batch_rows_sum")


def compare(optimum: Optimum, url: str, model: str, rounds: int, requests: int) -> dict:
    """Optimum one transcription, then vramguard at c1 and at c4, `rounds` times interleaved
    (the machine's load moves both alike); the medians, and the rows per window run."""
    body, content_type = multipart(AUDIO, model)
    endpoint = f"{url.rstrip('/')}/v1/audio/transcriptions"
    hey(endpoint, body, content_type, 1, 1)  # warm-up
    optimum.run, c1, c4, runs, rows = [], [], [], 0.0, 0.0
    for _ in range(rounds):
        optimum.once()
        c1.append(hey(endpoint, body, content_type, 1, max(2, requests // 4)))
        before = batch_rows(url)
        c4.append(hey(endpoint, body, content_type, 4, requests))
        after = batch_rows(url)
        runs, rows = runs + after[0] - before[0], rows + after[1] - before[1]
    o = optimum.figures()
    audio_s = o["audio_s"]
    v = {"rtf_c1": statistics.median(r["mean_s"] for r in c1) / audio_s,
         "audio_s_per_s_c1": statistics.median(r["rps"] for r in c1) * audio_s,
         "audio_s_per_s_c4": statistics.median(r["rps"] for r in c4) * audio_s,
         "c1_runs": c1, "c4_runs": c4, "c4_rows_per_run": rows / runs if runs else None}
    ratios = {"optimum_rtf_over_vramguard_c1": o["rtf"] / v["rtf_c1"],
              "vramguard_c4_over_c1": v["audio_s_per_s_c4"] / v["audio_s_per_s_c1"]}
    return {"optimum": o, "vramguard": v, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", help="a vramguard binary to start on the folder, once per config")
    parser.add_argument("--intra-threads", type=int, default=os.cpu_count(), help="its sessions' intra-op threads")
    parser.add_argument("--workers", type=int, default=1, help="the CPU pool's workers (each runs a window at a time)")
    parser.add_argument("--configs", default="plain,batching", help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--url", help="instead of --serve: a vramguard serving the model folder")
    parser.add_argument("--served-model", default="whisper", help="its name in that server's config")
    parser.add_argument("--model", choices=["tiny", "fixture"], default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    model_dir = folder(args.model)
    optimum = Optimum(model_dir)
    figures = {"machine": {"cpus": os.cpu_count()}, "model": str(model_dir.relative_to(ROOT)),
               "audio": str(AUDIO.relative_to(ROOT)), "intra_threads": args.intra_threads, "workers": args.workers, "runs": {}}
    if args.serve:
        for config in args.configs.split(","):
            server = serve(args.serve, model_dir, config, args.intra_threads, args.workers)
            try:
                figures["runs"][config] = compare(optimum, f"http://127.0.0.1:{PORT}", "whisper", args.rounds,
                                                  args.requests)
            finally:
                server.terminate()
                server.wait()
    elif args.url:
        figures["runs"]["url"] = compare(optimum, args.url, args.served_model, args.rounds, args.requests)
    else:
        for _ in range(args.rounds):
            optimum.once()
        figures["runs"]["optimum"] = {"optimum": optimum.figures()}
    (OUT / "speech.json").write_text(json.dumps(figures, indent=1))
    print(f"{'':24} {'RTF':>8} {'audio s/s':>10} {'rows/run':>9}")
    for config, run in figures["runs"].items():
        o = run["optimum"]
        print(f"{config + ': optimum c1':24} {o['rtf']:8.4f} {o['audio_s'] / o['model_s']:10.1f}")
        if "vramguard" in run:
            v, rows = run["vramguard"], run["vramguard"]["c4_rows_per_run"]
            print(f"{config + ': vramguard c1':24} {v['rtf_c1']:8.4f} {v['audio_s_per_s_c1']:10.1f}")
            print(f"{config + ': vramguard c4':24} {'-':>8} {v['audio_s_per_s_c4']:10.1f} "
                  f"{'%.2f' % rows if rows else '-':>9}")
            print(f"{'':24} Optimum / vramguard c1 {run['ratios']['optimum_rtf_over_vramguard_c1']:.2f}, "
                  f"c4 / c1 {run['ratios']['vramguard_c4_over_c1']:.2f}")
    o = optimum.figures()
    print(f"front end (decode + resample + log-mel, 30 s window): {100 * o['front_end_share_of_30s_window']:.1f}% "
          f"of the model's time for a window; {o['tokens']} tokens for {o['audio_s']:.0f} s")


if __name__ == "__main__":
    main()
