#!/usr/bin/env python3
"""Image search through `POST /v1/embeddings` with OpenAI's own Python client (the `openai`
package), unchanged.

Starts `vramguard serve` (path in argv[1]) with the tiny CLIP of models/embed/clip/ (`clip`: its
text tower, naming `clip-vision`, its vision tower), then: `embeddings.create` on the texts, on
the images and a text mixed in Jina's form (`input: [{"image": "data:..."}, {"text": ...}]`,
which the client sends as given), one image per request from concurrent requests, as base64 (the client's default) and floats; vLLM's
`messages` form (one `image_url` part) through the client's own `post`, as vLLM's examples do;
every vector against transformers' `get_text_features` / `get_image_features`, normalized
(models/embed/clip/reference.json: cosine >= 0.9999 for texts, PNGs and WebP; JPEGs are decoded by
another decoder than Pillow's, see docs/embeddings.md); the similarity ranking; and a web URL
refused as the client's `BadRequestError` naming `input`.

Run by `make client-compat` (which installs openai into .deps/pyclients); prints
'N passed, N failed' and exits non-zero on any failure.
"""
import base64
import concurrent.futures
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, ".deps", "pyclients"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import openai  # noqa: E402
from serving import Checks, cosine, report, serve_config  # noqa: E402

CLIP = os.path.join(ROOT, "models", "embed", "clip")

CONFIG = """
server: {admin_socket: 'off'}
models:
  - {name: clip, path: %(clip)s/text_model.onnx, images: clip-vision}
  - {name: clip-vision, path: %(clip)s/vision_model.onnx}
pools:
  - {name: cpu, provider: cpu, models: [clip, clip-vision]}
"""


def main():
    return serve_config(sys.argv[1], CONFIG % {"clip": CLIP}, run)


def data_url(file):
    with open(os.path.join(CLIP, "images", file), "rb") as f:
        data = base64.b64encode(f.read()).decode()
    media = {"png": "png", "jpg": "jpeg", "webp": "webp"}[file.rsplit(".", 1)[1]]
    return f"data:image/{media};base64,{data}"


def near(got, want, what):
    """`got` is `want` in direction: to float rounding, or within the JPEG decoders' difference."""
    assert len(got) == len(want), (what, len(got), len(want))
    c = cosine(got, want)
    assert c >= (0.9 if what.endswith(".jpg") else 0.9999), (what, c)


def run(address):
    client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0, timeout=60)
    reference = json.load(open(os.path.join(CLIP, "reference.json")))
    texts = [t["input"] for t in reference["texts"]]
    files = [i["file"] for i in reference["images"]]
    checks = Checks()
    check = checks.check

    @check("texts: transformers' get_text_features, normalized, base64 and floats")
    def _():
        for fmt in ({}, {"encoding_format": "float"}):
            got = client.embeddings.create(model="clip", input=texts, **fmt)
            assert got.model == "clip" and [d.index for d in got.data] == list(range(len(texts))), got
            assert got.usage.prompt_tokens == sum(len(t["ids"]) for t in reference["texts"]), got.usage
            for d, t in zip(got.data, reference["texts"]):
                near(d.embedding, t["embedding"], t["input"])

    @check("images and a text in one request (Jina's form): in order, transformers' vectors")
    def _():
        inputs = [{"image": data_url(f)} for f in files] + [{"text": texts[0]}]
        got = client.embeddings.create(model="clip", input=inputs)
        assert len(got.data) == len(files) + 1, got.data
        for d, image in zip(got.data, reference["images"]):
            near(d.embedding, image["embedding"], image["file"])
        near(got.data[-1].embedding, reference["texts"][0]["embedding"], texts[0])

    @check("concurrent requests, one image each, each get their own image's vector")
    def _():
        with concurrent.futures.ThreadPoolExecutor(len(files)) as pool:
            got = list(pool.map(lambda f: client.embeddings.create(model="clip", input=[{"image": data_url(f)}]), files))
        for g, image in zip(got, reference["images"]):
            near(g.data[0].embedding, image["embedding"], image["file"])

    @check("the similarity of each text to each image ranks the images as transformers' does")
    def _():
        t = [d.embedding for d in client.embeddings.create(model="clip", input=texts).data]
        i = [d.embedding for d in client.embeddings.create(model="clip", input=[{"image": data_url(f)} for f in files]).data]
        for row, want in zip(t, reference["similarity"]):
            got = [sum(a * b for a, b in zip(row, image)) for image in i]
            assert got.index(max(got)) == want.index(max(want)), (got, want)

    @check("vLLM's messages form: one image_url part, through the client's post")
    def _():
        body = {"model": "clip", "encoding_format": "float", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(files[0])}}]}]}
        got = client.post("/embeddings", cast_to=openai.types.CreateEmbeddingResponse, body=body)
        near(got.data[0].embedding, reference["images"][0]["embedding"], files[0])

    @check("a web URL is the client's BadRequestError naming input")
    def _():
        try:
            client.embeddings.create(model="clip", input=[{"image": "https://example.com/cat.png"}])
            raise AssertionError("a web URL was fetched")
        except openai.BadRequestError as e:
            assert e.body["param"] == "input" and "does not fetch images" in e.body["message"], e.body

    return report(checks)


if __name__ == "__main__":
    sys.exit(main())
