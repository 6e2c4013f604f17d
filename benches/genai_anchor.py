"""vramguard against ONNX Runtime GenAI's own generator, on the same GenAI-built model.

The anchor a user of ONNX LLMs would pick instead of vramguard is `onnxruntime_genai`'s generator
in their own process. This bench builds one model with the builder users run (a 6-layer Llama of
hidden 768, 12 query and 4 KV heads of 64, SwiGLU 2048, 1024 positions, random weights, the
fixture's tokenizer: the generation bench's larger decoder, as the GenAI builder writes it), then,
in the same run, alternating:

- GenAI in process, one intra-op thread: a greedy generation of N tokens at batch 1 (time to
  first token = the first `generate_next_token`, which runs the prompt) and 8 prompts as one
  batch of 8;
- vramguard serving the same folder (one CPU pool, one worker, one intra-op thread), the client
  in this other process: c1 = one non-streamed completion at a time, c8 = eight at once, and
  time to first token at c1 (a one-token completion, answered whole).

Targets (issue 50): vramguard's tokens/s at c1 >= 0.95 x GenAI's batch 1, at c8 >= 1.0 x GenAI's
batch 8, time to first token at c1 <= 1.1 x GenAI's.

Needs the fixtures' GenAI environment (torch, transformers 5, onnxruntime-genai: `make
fixtures` makes it under .deps/fixtures-venv-genai, or give FIXTURE_PYTHON_GENAI) and a built
`target/release/vramguard`:

    .deps/fixtures-venv-genai/bin/python benches/genai_anchor.py [--rounds 3] [--tokens 64]

Figures go to target/bench/genai_anchor.json. The model (~150 MB) is made once under
target/bench/genai-large/ and never committed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "target" / "bench"
MODEL = OUT / "genai-large"
PORT = 18237
PROMPTS = [
    "A home server runs a chat model, an embedding model and a speech model on one GPU. When a long prompt arrives, the server",
    "The pool keeps each generation's cache on the device, and when memory runs short it",
    "Requests wait in the queue until the policy admits them, and the operator",
    "When the accelerator is taken away, the fallback pool on the CPU",
    "Every token of a batched step costs one row of logits, so the gateway",
    "An allocator failure before the first token moves the request to",
    "The status page shows which pool is degraded and why, so",
    "Eviction of an idle model frees memory for the request that",
]


def build(python_env: str) -> None:
    """The HF model with random weights, then the GenAI builder's fp32 CPU export (made once)."""
    stamp = MODEL / "genai_config.json"
    if stamp.exists():
        return
    hf = OUT / "genai-large-hf"
    code = f"""
import torch, shutil
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
tok = PreTrainedTokenizerFast(tokenizer_file={str(ROOT / 'models/decoder/tokenizer.json')!r}, eos_token='<|endoftext|>')
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, tie_word_embeddings=False)
LlamaForCausalLM(cfg).save_pretrained({str(hf)!r}); tok.save_pretrained({str(hf)!r})
"""
    subprocess.run([python_env, "-c", code], check=True)
    subprocess.run([python_env, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(MODEL),
                    "-p", "fp32", "-e", "cpu"], check=True, stdout=subprocess.DEVNULL)


def genai_figures(tokens: int) -> dict:
    """GenAI's generator in this process, one intra-op thread: batch 1 and batch 8."""
    import onnxruntime_genai as og

    config = og.Config(str(MODEL))
    config.clear_providers()
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": 1,
                                                                          "inter_op_num_threads": 1}}}}))
    model = og.Model(config)
    tokenizer = og.Tokenizer(model)

    def run(prompts: list[str]) -> tuple[float, float, int]:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, batch_size=len(prompts), max_length=1024,
                                  min_length=0)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(tokenizer.encode_batch(prompts))
        generator.generate_next_token()
        first = time.perf_counter() - start
        made = 1
        while made < tokens and not generator.is_done():
            generator.generate_next_token()
            made += 1
        return first, time.perf_counter() - start, made

    run(PROMPTS[:1])
    first, total, made = run(PROMPTS[:1])
    _, total8, made8 = run(PROMPTS)
    return {"ttft_s": first, "tok_s_1": made / total, "tok_s_8": 8 * made8 / total8, "tokens": made}


def post(body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def first_token_s(prompt: str) -> float:
    """A completion of one token, answered whole: its prompt's run and its first token, as
    GenAI's first `generate_next_token` is (a stream's first text can come a token later, held
    back while it ends in half a character, which random weights often pick)."""
    start = time.perf_counter()
    answer = post({"model": "llama", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert answer["usage"]["completion_tokens"] == 1, answer
    return time.perf_counter() - start


def vramguard_figures(tokens: int) -> dict:
    def completion(prompt: str) -> int:
        answer = post({"model": "llama", "prompt": prompt, "max_tokens": tokens, "temperature": 0})
        return answer["usage"]["completion_tokens"]

    completion(PROMPTS[0])
    start = time.perf_counter()
    made = completion(PROMPTS[0])
    tok_s_1 = made / (time.perf_counter() - start)
    counts = [0] * 8
    def one(i: int) -> None:
        counts[i] = completion(PROMPTS[i])
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tok_s_8 = sum(counts) / (time.perf_counter() - start)
    ttft = statistics.median(first_token_s(PROMPTS[0]) for _ in range(5))
    return {"ttft_s": ttft, "tok_s_1": tok_s_1, "tok_s_8": tok_s_8, "tokens": made}


def serve() -> subprocess.Popen:
    config = OUT / "genai_anchor.yaml"
    config.write_text(f"""server: {{listen: 127.0.0.1:{PORT}}}
models:
  - {{name: llama, path: {MODEL / 'model.onnx'}, tokenizer: {MODEL / 'tokenizer.json'}}}
pools:
  - {{name: cpu, provider: cpu, models: [llama], workers: 1, intra_threads: 1, queue: {{capacity: 64, max_wait: 600s}}}}
host: {{reserve: 1GiB}}
""")
    server = subprocess.Popen([str(ROOT / "target/release/vramguard"), "serve", "--config", str(config)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v2/health/ready", timeout=1)
            return server
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError("vramguard did not become ready in 60 s")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    build(os.environ.get("FIXTURE_PYTHON_GENAI", sys.executable))
    server = serve()
    rounds = []
    try:
        for _ in range(args.rounds):
            rounds.append({"genai": genai_figures(args.tokens), "vramguard": vramguard_figures(args.tokens)})
    finally:
        server.terminate()
        server.wait()
    med = lambda who, key: statistics.median(r[who][key] for r in rounds)  # noqa: E731
    figures = {who: {key: med(who, key) for key in ("ttft_s", "tok_s_1", "tok_s_8")} for who in ("genai", "vramguard")}
    ratios = {
        "tok_s_c1": figures["vramguard"]["tok_s_1"] / figures["genai"]["tok_s_1"],
        "tok_s_c8": figures["vramguard"]["tok_s_8"] / figures["genai"]["tok_s_8"],
        "ttft_c1": figures["vramguard"]["ttft_s"] / figures["genai"]["ttft_s"],
    }
    targets = {"tok_s_c1": ">= 0.95", "tok_s_c8": ">= 1.0", "ttft_c1": "<= 1.1"}
    result = {"rounds": rounds, "median": figures, "ratio": ratios, "targets": targets}
    (OUT / "genai_anchor.json").write_text(json.dumps(result, indent=2) + "\n")
    for key, ratio in ratios.items():
        print(f"{key}: vramguard / GenAI = {ratio:.2f} (target {targets[key]})")
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
