#!/usr/bin/env python3
"""`POST /v1/rerank` as Jina's and Cohere's API users call it: plain HTTP with a JSON body (the
`openai` client has no rerank), as llama.cpp, vLLM and LocalAI accept it.

Starts `vramguard serve` (path in argv[1]) with the cross-encoder of models/embed/
(`rerank`: bert-cross-encoder, saved by `CrossEncoder.save`, exported by Optimum's
`text-classification`), then for each query of models/embed/reference.json: every document in
one request, its order and scores against `CrossEncoder.rank` and `predict` on the same folder
(scores within 1e-5), the documents sent back; `top_n` with documents as `{"text"}` objects
and `return_documents: false`; concurrent requests each for one document; the model listed by
`GET /v1/models`; and an empty `documents` refused as a 400 naming it.

Run by `make client-compat`; prints 'N passed, N failed' and exits non-zero on any failure.
"""
import concurrent.futures
import json
import os
import sys
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serving import Checks, report, serve_config  # noqa: E402

EMBED = os.path.join(ROOT, "models", "embed")

CONFIG = """
server: {admin_socket: 'off'}
models:
  - {name: rerank, path: %(embed)s/bert-cross-encoder/model.onnx}
pools:
  - {name: cpu, provider: cpu, models: [rerank]}
"""


def main():
    return serve_config(sys.argv[1], CONFIG % {"embed": EMBED}, run)


def post(address, path, body):
    """(status, JSON answer) of a POST."""
    request = urllib.request.Request(f"http://{address}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def run(address):
    reference = json.load(open(os.path.join(EMBED, "reference.json")))["rerankers"]["bert-cross-encoder"]
    checks = Checks()
    check = checks.check

    def rerank(body):
        status, answer = post(address, "/v1/rerank", {"model": "rerank", **body})
        assert status == 200, (status, answer)
        assert answer["model"] == "rerank", answer
        return answer

    for n, case in enumerate(reference["cases"]):
        query, documents = case["query"], case["documents"]

        @check(f"query {n}: the order and scores of CrossEncoder.rank, the documents sent back")
        def _(query=query, documents=documents, case=case):
            answer = rerank({"query": query, "documents": documents})
            results = answer["results"]
            assert [r["index"] for r in results] == case["order"], results
            for r in results:
                assert abs(r["relevance_score"] - case["scores"][r["index"]]) <= 1e-5, r
                assert r["document"] == {"text": documents[r["index"]]}, r
            tokens = sum(len(ids) for ids in case["ids"])
            assert answer["usage"]["total_tokens"] == tokens, answer["usage"]

        @check(f"query {n}: top_n of {{text}} objects, without documents")
        def _(query=query, documents=documents, case=case):
            answer = rerank({"query": query, "documents": [{"text": d} for d in documents], "top_n": 2,
                             "return_documents": False})
            assert [r["index"] for r in answer["results"]] == case["order"][:2], answer
            assert all("document" not in r for r in answer["results"]), answer

        @check(f"query {n}: concurrent requests each score their own document")
        def _(query=query, documents=documents, case=case):
            with concurrent.futures.ThreadPoolExecutor(len(documents)) as pool:
                answers = list(pool.map(lambda d: rerank({"query": query, "documents": [d]}), documents))
            for i, answer in enumerate(answers):
                assert abs(answer["results"][0]["relevance_score"] - case["alone"][i]) <= 1e-5, (i, answer)

    @check("the reranker is listed, and empty documents are a 400 naming them")
    def _():
        with urllib.request.urlopen(f"http://{address}/v1/models", timeout=60) as response:
            assert [m["id"] for m in json.load(response)["data"]] == ["rerank"]
        status, answer = post(address, "/v1/rerank", {"model": "rerank", "query": "q", "documents": []})
        assert status == 400 and answer["error"]["param"] == "documents", (status, answer)

    return report(checks)


if __name__ == "__main__":
    sys.exit(main())
