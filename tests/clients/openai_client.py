#!/usr/bin/env python3
"""Compatibility check with OpenAI's own Python client (the `openai` package), unchanged.

Starts `vramguard serve` (path in argv[1]) with the decoder fixture (models/decoder/) at
127.0.0.1:0, then drives it with the stock client: model listing and retrieval, prompt lists,
echo and n, a greedy completion whose
text must equal the fixture's reference (computed without ONNX Runtime), seeded sampling that
repeats, streaming, chat (whole, streamed, with tools) answering as the completion of its
ChatML prompt, logprobs (chat and completions, whole and streamed, against the reference's
first-step logits), presence and frequency penalties and logit_bias, and errors (the server's own 404, 405 and 413 included) surfaced as the client's
own exception types in OpenAI's error body. Then it starts
`vramguard serve` with no config, as `make run` does, and chats with the embedded default's
`tiny` at once.

Run by `make test` (which installs openai into .deps/pyclients); prints 'N passed, N failed' per server
and exits non-zero on any failure.
"""
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, ".deps", "pyclients"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import openai  # noqa: E402
from serving import Checks, report, start  # noqa: E402

CONFIG = """
server: {admin_socket: 'off', body_limit: 1MiB}
models:
  - {name: tiny, path: %(root)s/models/decoder/model.onnx, tokenizer: %(root)s/models/decoder/tokenizer.json,
     chat_template: 'builtin:chatml'}
pools:
  - {name: cpu, provider: cpu, models: [tiny]}
"""


def main():
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "openai.yaml")
        with open(config, "w") as f:
            f.write(CONFIG % {"root": ROOT})
        proc, address = start(sys.argv[1], "--config", config)
        try:
            failed = run(address)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        # The embedded default, its admin socket in this run's own folder.
        proc, address = start(sys.argv[1], env={"RUNTIME_DIRECTORY": tmp})
        try:
            return failed | run_default(address)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def run_default(address):
    """`vramguard serve` with no config: its `tiny` chats, whole and streamed, and its
    `tiny-embed` embeds (one vector of length 1 per input); `tiny-whisper` is listed too."""
    client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0, timeout=60)

    def listed():
        assert [m.id for m in client.models.list()] == ["tiny", "tiny-embed", "tiny-whisper"]

    def chats():
        messages = [{"role": "user", "content": "Is the GPU full?"}]
        done = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        assert done.model == "tiny", done.model
        assert done.choices[0].message.role == "assistant"
        assert 1 <= done.usage.completion_tokens <= 8, done.usage
        pieces = [chunk.choices[0].delta.content or "" for chunk in
                  client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True) if chunk.choices]
        assert "".join(pieces) == done.choices[0].message.content, (pieces, done.choices[0].message.content)

    def embeds():
        answer = client.embeddings.create(model="tiny-embed", input=["The GPU is shared", "by two models"])
        assert [d.index for d in answer.data] == [0, 1], answer
        for item in answer.data:
            assert abs(sum(v * v for v in item.embedding) - 1.0) < 1e-5, item
        assert answer.data[0].embedding != answer.data[1].embedding

    return report([("the embedded default lists tiny, tiny-embed and tiny-whisper", listed),
                   ("the embedded default's tiny chats, whole and streamed", chats),
                   ("the embedded default's tiny-embed embeds", embeds)])


def run(address):
    client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0, timeout=60)
    ref = json.load(open(os.path.join(ROOT, "models", "decoder", "reference.json")))
    cases = {c["name"]: c for c in ref["cases"]}
    checks = Checks()
    check = checks.check

    @check("models.list names the decoder")
    def _():
        assert [m.id for m in client.models.list()] == ["tiny"]

    @check("models.retrieve gives the listed model, and NotFoundError for another")
    def _():
        assert client.models.retrieve("tiny") == next(iter(client.models.list()))
        for missing in ("nope", "org/tiny"):
            try:
                client.models.retrieve(missing)
                raise AssertionError(f"{missing} was retrieved")
            except openai.NotFoundError as e:
                assert e.code == "model_not_found", e.body

    @check("a greedy completion equals the reference")
    def _():
        for name in ("short", "chat"):
            case = cases[name]
            done = client.completions.create(model="tiny", prompt=case["prompt"], max_tokens=16, temperature=0)
            assert done.choices[0].text == case["text"], (name, done.choices[0].text)
            assert done.choices[0].finish_reason == "length"
            assert done.usage.prompt_tokens == len(case["prompt_ids"])
            assert done.usage.completion_tokens == 16

    @check("stop strings end the text")
    def _():
        case = cases["stop"]
        done = client.completions.create(model="tiny", prompt=case["prompt"], max_tokens=16, temperature=0,
                                         stop=case["stop"])
        assert done.choices[0].text == case["stop_text"], done.choices[0].text
        assert done.choices[0].finish_reason == "stop"

    @check("the same seed gives the same text")
    def _():
        ask = lambda seed: client.completions.create(model="tiny", prompt="The GPU", max_tokens=12,
                                                      temperature=0.9, seed=seed).choices[0].text
        assert ask(5) == ask(5)

    @check("a streamed completion sends the same text in pieces")
    def _():
        case = cases["short"]
        pieces = []
        finish = None
        for chunk in client.completions.create(model="tiny", prompt=case["prompt"], max_tokens=16,
                                               temperature=0, stream=True):
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        assert len(pieces) > 1, pieces
        assert "".join(pieces) == case["text"], pieces
        assert finish == "length", finish

    @check("a list of prompts is a choice each, with echo, whole and streamed")
    def _():
        names = ("short", "stop")
        prompts = [cases[n]["prompt"] for n in names]
        done = client.completions.create(model="tiny", prompt=prompts, max_tokens=16, temperature=0, echo=True)
        assert [c.index for c in done.choices] == [0, 1], done.choices
        for choice, name in zip(done.choices, names):
            assert choice.text == cases[name]["prompt"] + cases[name]["text"], (name, choice.text)
        assert done.usage.prompt_tokens == sum(len(cases[n]["prompt_ids"]) for n in names), done.usage
        ids = [cases[n]["prompt_ids"] for n in names]
        texts = ["", ""]
        for chunk in client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0,
                                               echo=True, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == [c.text for c in done.choices], texts

    @check("n=2 gives two choices, chat and completions, whole and streamed")
    def _():
        case = cases["short"]
        done = client.completions.create(model="tiny", prompt=case["prompt"], max_tokens=16, temperature=0, n=2)
        assert [(c.index, c.text) for c in done.choices] == [(0, case["text"]), (1, case["text"])], done.choices
        assert done.usage.prompt_tokens == len(case["prompt_ids"]), done.usage
        assert done.usage.completion_tokens == 32, done.usage
        texts = ["", ""]
        for chunk in client.completions.create(model="tiny", prompt=case["prompt"], max_tokens=16, temperature=0,
                                               n=2, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == [case["text"]] * 2, texts
        messages = [{"role": "user", "content": case["prompt"]}]
        chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, n=2)
        assert [c.index for c in chat.choices] == [0, 1], chat.choices
        assert chat.choices[0].message.content == chat.choices[1].message.content, chat.choices
        contents = ["", ""]
        for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                    n=2, stream=True):
            for choice in chunk.choices:
                contents[choice.index] += choice.delta.content or ""
        assert contents == [c.message.content for c in chat.choices], contents

    def chatml(user):
        return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"

    @check("a chat answers as the completion of its ChatML prompt, whole and streamed")
    def _():
        user = cases["short"]["prompt"]
        done = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": user}],
                                              max_tokens=12, temperature=0)
        plain = client.completions.create(model="tiny", prompt=chatml(user), max_tokens=12, temperature=0,
                                          stop=["<|im_end|>"])
        message = done.choices[0].message
        assert message.role == "assistant"
        assert message.content == plain.choices[0].text, (message.content, plain.choices[0].text)
        assert done.usage.prompt_tokens == plain.usage.prompt_tokens
        pieces, finish, role = [], None, None
        for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": user}],
                                                    max_tokens=12, temperature=0, stream=True):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            role = role or delta.role
            pieces.append(delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        assert role == "assistant", role
        assert "".join(pieces) == message.content, pieces
        assert finish == done.choices[0].finish_reason, finish

    @check("a chat offering tools is accepted and answered")
    def _():
        # Short: the fixture's small BPE spends many tokens on JSON.
        tools = [{"type": "function", "function": {"name": "free_vram"}}]
        done = client.chat.completions.create(
            model="tiny", tools=tools, max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": "How much VRAM is free?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "call_1", "type": "function",
                           "function": {"name": "free_vram", "arguments": "{\"gpu\": 0}"}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "12 GiB"}])
        assert done.choices[0].finish_reason in ("stop", "length", "tool_calls"), done
        try:
            client.chat.completions.create(model="tiny", tools=tools,
                                           tool_choice={"type": "function", "function": {"name": "absent"}},
                                           messages=[{"role": "user", "content": "x"}])
            raise AssertionError("a call forced of a function not offered was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "tool_choice", e.body

    @check("errors are the client's exception types")
    def _():
        try:
            client.completions.create(model="nope", prompt="x")
            raise AssertionError("an unknown model was accepted")
        except openai.NotFoundError as e:
            assert "nope" in e.message, e.message
        try:
            client.completions.create(model="tiny", prompt="x", temperature=5)
            raise AssertionError("temperature 5 was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "temperature", e.body

    top5 = ref["first_step_top5"]

    def near(got, want, what):
        assert abs(got - want) <= ref["logit_tolerance"], (what, got, want)

    @check("completion logprobs are the reference's logits, whole and streamed")
    def _():
        case = cases[top5["case"]]
        ask = dict(model="tiny", prompt=case["prompt"], max_tokens=8, temperature=0, logprobs=5)
        done = client.completions.create(**ask)
        lp = done.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8, lp
        assert "".join(lp.tokens) == done.choices[0].text == case["text"][:len(done.choices[0].text)], lp.tokens
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)], lp.text_offset
        for i, top in enumerate(lp.top_logprobs):
            # Greedy: the picked token is the most likely, and the probabilities are below 1.
            assert len(top) == 5 and max(top.values()) == lp.token_logprobs[i] <= 0, (i, top)
            assert top[lp.tokens[i]] == lp.token_logprobs[i]
            assert sum(2.718281828459045 ** v for v in top.values()) <= 1 + 1e-6
        # The first step's log-probabilities differ as the reference's logits do.
        first = sorted(lp.top_logprobs[0].values(), reverse=True)
        for got, logit in zip(first, top5["logits"]):
            near(got - first[0], logit - top5["logits"][0], "first step")
        joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in client.completions.create(**ask, stream=True):
            if chunk.choices[0].logprobs is not None:
                for key in joined:
                    joined[key] += getattr(chunk.choices[0].logprobs, key)
        assert joined == {k: getattr(lp, k) for k in joined}, (joined, lp)

    @check("chat logprobs: each token's bytes and top_logprobs, whole and streamed")
    def _():
        ask = dict(model="tiny", messages=[{"role": "user", "content": cases["short"]["prompt"]}], max_tokens=8,
                   temperature=0, logprobs=True, top_logprobs=2)
        done = client.chat.completions.create(**ask)
        content = done.choices[0].logprobs.content
        assert len(content) == done.usage.completion_tokens, content
        for token in content:
            assert token.logprob <= 0 and len(token.top_logprobs) == 2, token
            assert token.top_logprobs[0].logprob == token.logprob, token
            assert bytes(token.bytes).decode("utf-8", "replace") == token.token, token
        if done.choices[0].finish_reason == "length":
            text = b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace")
            assert text == done.choices[0].message.content, (text, done.choices[0].message.content)
        streamed = []
        for chunk in client.chat.completions.create(**ask, stream=True):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                streamed += chunk.choices[0].logprobs.content
        assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]
        # Without `logprobs`, none.
        plain = client.chat.completions.create(**{**ask, "logprobs": False, "top_logprobs": None})
        assert plain.choices[0].logprobs is None, plain

    @check("logit_bias adds to a token's logit: -100 keeps it out, +100 makes it every token")
    def _():
        case = cases[top5["case"]]
        ask = dict(model="tiny", prompt=case["prompt"], max_tokens=3, temperature=0, logprobs=5)
        greedy, second = top5["ids"][0], top5["ids"][1]
        banned = client.completions.create(**ask, logit_bias={str(greedy): -100})
        lp = banned.choices[0].logprobs
        # The second most likely leads, the others behind it as the logits say.
        first = sorted(lp.top_logprobs[0].values(), reverse=True)
        for got, logit in zip(first, top5["logits"][1:]):
            near(got - first[0], logit - top5["logits"][1], "first step, the best banned")
        forced = client.completions.create(**ask, logit_bias={str(second): 100})
        lp = forced.choices[0].logprobs
        assert len(set(lp.tokens)) == 1 and all(v > -1e-3 for v in lp.token_logprobs), lp
        assert lp.tokens[0] == banned.choices[0].logprobs.tokens[0], (lp.tokens, banned.choices[0].logprobs.tokens)
        for bad in ({"512": 1}, {"7": 101}):
            try:
                client.completions.create(**ask, logit_bias=bad)
                raise AssertionError(f"logit_bias {bad} was accepted")
            except openai.BadRequestError as e:
                assert e.body["param"] == "logit_bias", e.body

    @check("presence and frequency penalties act on the generated tokens only, as OpenAI defines them")
    def _():
        case = cases["short"]
        ask = dict(model="tiny", prompt=case["prompt"], max_tokens=16, temperature=0, logprobs=5)
        frequency, presence = 0.75, 0.5
        plain = client.completions.create(**ask).choices[0].logprobs
        bent = client.completions.create(**ask, presence_penalty=presence,
                                         frequency_penalty=frequency).choices[0].logprobs
        # Nothing was generated before the first token: its step is the plain one's.
        assert bent.top_logprobs[0] == plain.top_logprobs[0]
        # While both generated the same tokens, a step's logits were the same before the
        # penalties: each token's logprob moved by minus its penalty (count × frequency +
        # presence once generated), plus one shift for the whole step (the log-sum-exp).
        penalized = 0
        for k in range(len(plain.tokens)):
            if plain.tokens[:k] != bent.tokens[:k]:
                break
            shifts = []
            for token in set(plain.top_logprobs[k]) & set(bent.top_logprobs[k]):
                count = plain.tokens[:k].count(token)
                penalty = count * frequency + (presence if count else 0)
                penalized += penalty > 0
                shifts.append(bent.top_logprobs[k][token] - plain.top_logprobs[k][token] + penalty)
            assert max(shifts) - min(shifts) < 1e-4, (k, shifts)
        assert penalized, "no step had a generated token among its top"
        for field in ("presence_penalty", "frequency_penalty"):
            try:
                client.completions.create(**ask, **{field: 2.5})
                raise AssertionError(f"{field} 2.5 was accepted")
            except openai.BadRequestError as e:
                assert e.body["param"] == field, e.body

    def openai_shaped(error, status, kind):
        """`error` came with `status` and OpenAI's body, `kind` its type."""
        assert error.status_code == status, (error.status_code, error.body)
        body = error.response.json()["error"]
        assert set(body) >= {"message", "type", "param", "code"}, body
        assert error.body == body and error.type == kind and error.message, error.body

    @check("errors the server writes itself are in OpenAI's shape too")
    def _():
        try:
            client.audio.speech.create(model="tiny", input="x", voice="alloy")
            raise AssertionError("an endpoint that is not served answered")
        except openai.NotFoundError as e:
            openai_shaped(e, 404, "not_found_error")
            assert e.body["message"] == "Invalid URL (POST /v1/audio/speech)", e.body
        try:
            client.get("/chat/completions", cast_to=object)
            raise AssertionError("GET /v1/chat/completions answered")
        except openai.APIStatusError as e:
            openai_shaped(e, 405, "invalid_request_error")
            assert e.response.headers["allow"] == "POST", e.response.headers
        try:
            client.post("/chat/completions", cast_to=object, content=b'{"model": "tiny", "messages": [')
            raise AssertionError("a body that is not JSON was accepted")
        except openai.BadRequestError as e:
            openai_shaped(e, 400, "invalid_request_error")
        try:
            # Over server.body_limit: refused by its length before any route reads it.
            client.post("/chat/completions", cast_to=object, content=b" " * (1024 * 1024 + 1))
            raise AssertionError("a body over server.body_limit was accepted")
        except openai.APIStatusError as e:
            openai_shaped(e, 413, "invalid_request_error")
            assert "server.body_limit" in e.body["message"], e.body

    return report(checks)


if __name__ == "__main__":
    sys.exit(main())
