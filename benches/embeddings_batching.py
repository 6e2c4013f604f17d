"""Dynamic batching of embeddings requests: vramguard with and without `batching`, against
sentence-transformers in process, and against PyTriton's dynamic batcher when it runs here.

The model has the all-MiniLM-L6-v2 shape (BERT, 6 layers, hidden 384, 12 heads, intermediate
1536, mean pooling, normalized) from seeded random weights, with the WordPiece tokenizer of the
embeddings fixtures (models/embed/make.py), saved by sentence-transformers and exported by
Optimum (`feature-extraction`) into one folder, made once under target/bench/minilm/ and never
committed. In one run:

- vramguard serves the folder twice from one config (one CPU pool, one worker): `mini` with
  `batching: {max_batch: 32, max_delay: 5ms}`, `mini-alone` without; the load generator `hey`,
  in its own process, sends single-sentence `POST /v1/embeddings` at c16 and at c1, alternating
  the two models, each figure the median of the rounds;
- sentence-transformers in this process on the same folder (its PyTorch weights), 16 threads
  each encoding single sentences: what a user would run instead;
- PyTriton (`--pytriton PYTHON`, a venv with nvidia-pytriton, onnxruntime and tokenizers): the
  same ONNX model behind Triton's dynamic batcher (max batch 32, 5 ms queue delay; the
  callable tokenizes, runs ONNX Runtime on the CPU and pools), driven by the same `hey` at c16.
  Make the venv from Debian's own Python (`/usr/bin/python3 -m venv`): under pyenv's 3.11.7
  Triton's Python stub fails to start the model (`'_thread.RLock' object has no attribute
  '_recursion_count'`, the stub's interpreter meeting another patch release's stdlib).

Targets (issue 52): c16 throughput with batching >= 2x without; c1 p50 with batching within 5%
of without; c16 >= 1.0x sentence-transformers'.

    /work/fix/opt/bin/python benches/embeddings_batching.py [--rounds 3] [--requests 800] \\
        [--binary target/release/vramguard] [--pytriton /tmp/pytriton-venv/bin/python]

Needs `hey` (apt-get install hey) and a Python with torch, transformers, optimum and
sentence-transformers (models/embed/requirements-embed.txt). Figures go to
target/bench/embeddings_batching.json.
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
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "target" / "bench"
MODEL = OUT / "minilm"
PORT = 18252
TRITON_PORT = 18253
SENTENCE = "The GPU is shared by a chat model, an embedding model and a speech model at home."


def build() -> None:
    """The folder: sentence-transformers modules saved, the transformer exported by Optimum."""
    if (MODEL / "model.onnx").exists():
        return
    import torch
    from optimum.exporters.onnx import main_export
    from sentence_transformers import SentenceTransformer, models as st
    from transformers import BertConfig, BertModel

    spec = importlib.util.spec_from_file_location("embed_make", ROOT / "models" / "embed" / "make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    work = Path(tempfile.mkdtemp(prefix="minilm-"))
    hf = work / "hf"
    fast = make.train_tokenizer(str(hf))
    torch.manual_seed(52)
    config = BertConfig(vocab_size=len(fast), hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536, max_position_embeddings=512, pad_token_id=fast.pad_token_id)
    BertModel(config).eval().save_pretrained(hf)
    word = st.Transformer(str(hf), max_seq_length=256)
    pooling = st.Pooling(word.get_word_embedding_dimension(), pooling_mode="mean")
    model = SentenceTransformer(modules=[word, pooling, st.Normalize()], device="cpu")
    shutil.rmtree(MODEL, ignore_errors=True)
    model.save(str(MODEL))
    onnx = work / "onnx"
    main_export(str(hf), str(onnx), task="feature-extraction", library_name="transformers", do_validation=False)
    shutil.copy(onnx / "model.onnx", MODEL / "model.onnx")
    shutil.rmtree(work)


def serve(binary: str) -> subprocess.Popen:
    config = OUT / "embeddings_batching.yaml"
    config.write_text(
        "server: {listen: '127.0.0.1:%d'}\n"
        "models:\n"
        "  - {name: mini, path: '%s', batching: {max_batch: 32, max_delay: 5ms}}\n"
        "  - {name: mini-alone, path: '%s'}\n"
        "pools: [{name: cpu, provider: cpu, models: [mini, mini-alone], workers: 1, intra_threads: %d,"
        " queue: {capacity: 256, max_wait: 30s}}]\n" % (PORT, MODEL / "model.onnx", MODEL / "model.onnx", os.cpu_count())
    )
    log = open(OUT / "embeddings_batching.log", "w")
    server = subprocess.Popen([binary, "serve", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT)
    wait_ready(f"http://127.0.0.1:{PORT}/v2/health/ready", server)
    return server


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    until = time.time() + timeout
    while time.time() < until:
        if process.poll() is not None:
            sys.exit(f"the server exited ({process.returncode}); see target/bench/*.log")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit(f"{url} not ready in {timeout}s")


def hey(url: str, body: dict, concurrency: int, requests: int) -> dict:
    """`hey` in its own process: throughput over its wall time, and latency percentiles."""
    started = time.perf_counter()
    out = subprocess.run(
        ["hey", "-n", str(requests), "-c", str(concurrency), "-m", "POST", "-T", "application/json",
         "-d", json.dumps(body), "-o", "csv", url],
        check=True, capture_output=True, text=True,
    ).stdout
    wall = time.perf_counter() - started
    rows = list(csv.DictReader(io.StringIO(out)))
    bad = [r for r in rows if r["status-code"] != "200"]
    if bad:
        sys.exit(f"{len(bad)} of {len(rows)} answers were not 200: {bad[0]}")
    latencies = sorted(float(r["response-time"]) for r in rows)
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]
    return {"rps": len(rows) / wall, "p50_ms": pick(0.50) * 1000, "p99_ms": pick(0.99) * 1000}


def vramguard(binary: str, rounds: int, requests: int) -> dict:
    server = serve(binary)
    url = f"http://127.0.0.1:{PORT}/v1/embeddings"
    try:
        for model in ("mini", "mini-alone"):
            hey(url, {"model": model, "input": SENTENCE}, 4, 64)  # warm-up
        runs = {(m, c): [] for m in ("mini", "mini-alone") for c in (16, 1)}
        for _ in range(rounds):
            for concurrency, n in ((16, requests), (1, max(100, requests // 4))):
                for model in ("mini", "mini-alone"):
                    runs[(model, concurrency)].append(hey(url, {"model": model, "input": SENTENCE}, concurrency, n))
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics").read().decode()
    finally:
        server.terminate()
        server.wait()
    median = lambda rs, k: statistics.median(r[k] for r in rs)
    figures = {f"{m}_c{c}": {k: median(rs, k) for k in ("rps", "p50_ms", "p99_ms")} for (m, c), rs in runs.items()}
    rows = [l for l in metrics.splitlines() if l.startswith("vramguard_batch_rows_") and 'model="mini"' in l]
    count = next(float(l.split()[-1]) for l in rows if l.startswith("vramguard_batch_rows_count"))
    total = next(float(l.split()[-1]) for l in rows if l.startswith("vramguard_batch_rows_sum"))
    figures["mean_rows_per_run"] = total / count if count else 0.0
    return figures


def sentence_transformers_c16(seconds: float) -> dict:
    """16 threads, each encoding one sentence at a time, on the folder's PyTorch weights."""
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(os.cpu_count())
    model = SentenceTransformer(str(MODEL), device="cpu")
    model.encode([SENTENCE])
    done = [0] * 16
    stop = time.perf_counter() + seconds

    def work(i: int) -> None:
        while time.perf_counter() < stop:
            model.encode([SENTENCE])
            done[i] += 1

    started = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"rps": sum(done) / (time.perf_counter() - started)}


PYTRITON_SERVER = r'''
import json, sys
import numpy as np, onnxruntime as ort
from tokenizers import Tokenizer
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig
folder, port = sys.argv[1], int(sys.argv[2])
tok = Tokenizer.from_file(folder + "/tokenizer.json")
session = ort.InferenceSession(folder + "/model.onnx", providers=["CPUExecutionProvider"])
@batch
def infer(text):
    ids = [tok.encode(t[0].decode()).ids for t in text]
    n = max(map(len, ids))
    input_ids = np.array([i + [0] * (n - len(i)) for i in ids], dtype=np.int64)
    mask = (np.arange(n)[None, :] < np.array([len(i) for i in ids])[:, None]).astype(np.int64)
    feeds = {"input_ids": input_ids, "attention_mask": mask}
    if any(i.name == "token_type_ids" for i in session.get_inputs()):
        feeds["token_type_ids"] = np.zeros_like(input_ids)
    hidden = session.run(["last_hidden_state"], feeds)[0]
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
    return {"embedding": pooled.astype(np.float32)}
with Triton(config=TritonConfig(http_port=port, grpc_port=port + 1, metrics_port=port + 2)) as triton:
    triton.bind(model_name="mini", infer_func=infer,
                inputs=[Tensor(name="text", dtype=bytes, shape=(1,))],
                outputs=[Tensor(name="embedding", dtype=np.float32, shape=(-1,))],
                config=ModelConfig(max_batch_size=32, batcher=DynamicBatcher(max_queue_delay_microseconds=5000)))
    triton.serve()
'''


def pytriton(python: str, rounds: int, requests: int) -> dict:
    script = OUT / "pytriton_server.py"
    script.write_text(PYTRITON_SERVER)
    log = open(OUT / "pytriton.log", "w")
    server = subprocess.Popen([python, str(script), str(MODEL), str(TRITON_PORT)], stdout=log, stderr=subprocess.STDOUT)
    try:
        # Triton is ready before PyTriton has bound the model: wait for the model.
        wait_ready(f"http://127.0.0.1:{TRITON_PORT}/v2/models/mini/ready", server)
        url = f"http://127.0.0.1:{TRITON_PORT}/v2/models/mini/infer"
        body = {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [SENTENCE]}]}
        hey(url, body, 4, 64)
        runs = [hey(url, body, 16, requests) for _ in range(rounds)]
    finally:
        server.terminate()
        server.wait()
    return {k: statistics.median(r[k] for r in runs) for k in ("rps", "p50_ms", "p99_ms")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--binary", default=str(ROOT / "target" / "release" / "vramguard"))
    parser.add_argument("--pytriton", help="a Python with nvidia-pytriton, onnxruntime and tokenizers")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    build()
    figures = {"machine": {"cpus": os.cpu_count()}, "vramguard": vramguard(args.binary, args.rounds, args.requests)}
    v = figures["vramguard"]
    figures["sentence_transformers_c16"] = sentence_transformers_c16(seconds=10)
    figures["ratios"] = {
        "c16_batched_over_alone": v["mini_c16"]["rps"] / v["mini-alone_c16"]["rps"],
        "c1_p50_batched_over_alone": v["mini_c1"]["p50_ms"] / v["mini-alone_c1"]["p50_ms"],
        "c16_batched_over_sentence_transformers": v["mini_c16"]["rps"] / figures["sentence_transformers_c16"]["rps"],
    }
    if args.pytriton:
        try:
            figures["pytriton_c16"] = pytriton(args.pytriton, args.rounds, args.requests)
            figures["ratios"]["c16_batched_over_pytriton"] = v["mini_c16"]["rps"] / figures["pytriton_c16"]["rps"]
        except SystemExit as e:
            figures["pytriton_c16"] = {"error": str(e)}
    (OUT / "embeddings_batching.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
