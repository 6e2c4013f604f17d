#!/usr/bin/env python3
"""`POST /v1/embeddings` through OpenAI's own Python client (the `openai` package), unchanged.

Starts `vramguard serve` (path in argv[1]) with the sentence-transformers folders of
models/embed/ (`mean`: bert-mean-normalize, `cls`: bert-cls, `qwen3`: qwen3-lasttoken, a
decoder whose last token is pooled), then for each: `embeddings.create`
on each sentence alone, on all of them in one request, on their token ids, and on all of them
at once from concurrent requests, as the client asks by default (base64, which it decodes) and
as floats; every vector against what `SentenceTransformer.encode` gave on the same folder
(models/embed/reference.json: cosine >= 0.9999 and every component within 1e-4 of the
vector's length, since random weights leave different sentences' vectors close in direction);
`dimensions` cut and renormalized; `usage`; the models listed; and a too-long input refused
as the client's `BadRequestError` naming `input`.

Run by `make client-compat` (which installs openai into .deps/pyclients); prints
'N passed, N failed' and exits non-zero on any failure.
"""
import concurrent.futures
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, ".deps", "pyclients"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import openai  # noqa: E402
from serving import Checks, cosine, report, serve_config  # noqa: E402

EMBED = os.path.join(ROOT, "models", "embed")
MODELS = {"mean": "bert-mean-normalize", "cls": "bert-cls", "qwen3": "qwen3-lasttoken"}

CONFIG = """
server: {admin_socket: 'off'}
models:
  - {name: mean, path: %(embed)s/bert-mean-normalize/model.onnx}
  - {name: cls, path: %(embed)s/bert-cls/model.onnx}
  - {name: qwen3, path: %(embed)s/qwen3-lasttoken/model.onnx}
pools:
  - {name: cpu, provider: cpu, models: [mean, cls, qwen3]}
"""


def main():
    return serve_config(sys.argv[1], CONFIG % {"embed": EMBED}, run)


def length(v):
    return math.sqrt(sum(x * x for x in v))


def near(got, want, what):
    """`got` is `want`: in direction, and component by component."""
    assert len(got) == len(want), (what, len(got), len(want))
    c = cosine(got, want)
    assert c >= 0.9999, (what, c)
    far = max(abs(x - y) for x, y in zip(got, want))
    assert far <= 1e-4 * length(want), (what, far)


def run(address):
    client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0, timeout=60)
    reference = json.load(open(os.path.join(EMBED, "reference.json")))["models"]
    checks = Checks()
    check = checks.check

    @check("the embedders are listed")
    def _():
        assert [m.id for m in client.models.list()] == list(MODELS)

    for model, folder in MODELS.items():
        cases = reference[folder]["cases"]
        sentences = [c["input"] for c in cases]

        @check(f"{model}: each sentence alone, base64 (the client's default) and floats")
        def _(model=model, cases=cases):
            for i, case in enumerate(cases):
                for fmt in ({}, {"encoding_format": "float"}):
                    got = client.embeddings.create(model=model, input=case["input"], **fmt)
                    assert got.model == model and got.object == "list", got
                    assert got.usage.prompt_tokens == len(case["ids"]) == got.usage.total_tokens, got.usage
                    near(got.data[0].embedding, case["alone"], f"case {i} {fmt}")

        @check(f"{model}: every sentence in one request, and as token ids")
        def _(model=model, cases=cases, sentences=sentences):
            for input in (sentences, [c["ids"] for c in cases]):
                got = client.embeddings.create(model=model, input=input)
                assert [d.index for d in got.data] == list(range(len(cases))), got.data
                for i, (d, case) in enumerate(zip(got.data, cases)):
                    near(d.embedding, case["embedding"], f"case {i} batched")
            one = client.embeddings.create(model=model, input=cases[0]["ids"])
            near(one.data[0].embedding, cases[0]["alone"], "one list of token ids")

        @check(f"{model}: concurrent requests each get their own sentence's vector")
        def _(model=model, cases=cases):
            with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
                got = list(pool.map(lambda c: client.embeddings.create(model=model, input=c["input"]), cases))
            for i, (g, case) in enumerate(zip(got, cases)):
                near(g.data[0].embedding, case["alone"], f"case {i} concurrent")

        @check(f"{model}: dimensions cuts, and renormalizes where the model normalizes")
        def _(model=model, folder=folder, cases=cases):
            got = client.embeddings.create(model=model, input=cases[0]["input"], dimensions=8)
            want = cases[0]["alone"][:8]
            if reference[folder]["normalize"]:
                want = [x / length(want) for x in want]
            assert len(got.data[0].embedding) == 8
            near(got.data[0].embedding, want, "dimensions 8")

    @check("a too-long input is the client's BadRequestError naming input, unless truncate")
    def _():
        long = "the server defers the request " * 200
        try:
            client.embeddings.create(model="mean", input=long)
            raise AssertionError("a too-long input was embedded")
        except openai.BadRequestError as e:
            assert e.body["param"] == "input" and "max_seq_length of 512" in e.body["message"], e.body
        got = client.embeddings.create(model="mean", input=long, extra_body={"truncate": True})
        assert got.usage.prompt_tokens == 512, got.usage

    return report(checks)


if __name__ == "__main__":
    sys.exit(main())
