#!/usr/bin/env python3
"""Structured outputs through OpenAI's own Python client (the `openai` package), unchanged, on
every real export in models/real/ (random weights: only the grammar keeps their answers valid).

Starts `vramguard serve` (path in argv[1]) with each folder twice: as `<folder>`, with its real
chat template, and as `<folder>-calls`, with a ChatML template that leaves the tools out of the
prompt (the fixtures take 256 positions, fewer than their real templates' tool preambles; the
grammar forces a call whatever the prompt says). Then, for every folder: a strict
`json_schema` asked through the client's own `parse` (a pydantic model) and streamed,
`json_object` whole and streamed, a tool call forced by name and by `required`, each answer
validated with `jsonschema`; and a schema the engine cannot compile, refused as the client's
`BadRequestError` naming `response_format`, as is one whose `$ref` cycles; and a completion
(`client.completions.create`) under a `response_format`, whole and streamed.

Run by `make client-compat` (which installs openai and jsonschema into .deps/pyclients); prints
'N passed, N failed' and exits non-zero on any failure.
"""
import concurrent.futures
import json
import os
import sys
import tempfile
import traceback
from typing import List, Literal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, ".deps", "pyclients"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jsonschema  # noqa: E402
import openai  # noqa: E402
import pydantic  # noqa: E402
from serving import start  # noqa: E402

REAL = os.path.join(ROOT, "models", "real")
FOLDERS = sorted(d for d in os.listdir(REAL) if os.path.isfile(os.path.join(REAL, d, "model.onnx")))

BARE = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
        "{% endfor %}{{ '<|im_start|>assistant\\n' }}")


class Forecast(pydantic.BaseModel):
    """What the client's `parse` turns into a strict JSON schema."""
    sky: Literal["clear", "cloudy", "rain"]
    celsius: int = pydantic.Field(ge=-30, le=45)
    windy: bool


LISTING = {"type": "object", "additionalProperties": False, "required": ["title", "tags"], "properties": {
    "title": {"type": "string", "maxLength": 8},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}}

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}}

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "alarm", "strict": True, "parameters": {
             "type": "object", "additionalProperties": False, "required": ["minutes"],
             "properties": {"minutes": {"type": "integer", "minimum": 0, "maximum": 90}}}}}]

MESSAGES = [{"role": "user", "content": "Answer, please."}]


def config(tmp):
    bare = os.path.join(tmp, "bare.jinja")
    with open(bare, "w") as f:
        f.write(BARE)
    models, names = [], []
    for folder in FOLDERS:
        files = f"path: {REAL}/{folder}/model.onnx, tokenizer: {REAL}/{folder}/tokenizer.json"
        models += [f"  - {{name: {folder}, {files}}}",
                   f"  - {{name: {folder}-calls, {files}, chat_template: '{bare}'}}"]
        names += [folder, f"{folder}-calls"]
    return ("server: {admin_socket: 'off'}\nmodels:\n" + "\n".join(models) +
            f"\npools:\n  - {{name: cpu, provider: cpu, models: [{', '.join(names)}]}}\n")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "structured.yaml")
        with open(path, "w") as f:
            f.write(config(tmp))
        proc, address = start(sys.argv[1], "--config", path)
        try:
            return run(address)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def streamed(client, **request):
    """A streamed chat's content and finish_reason."""
    pieces, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **request):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(pieces), finish


def checks_for(client, folder):
    """The checks of one folder: (name, function)."""
    asked = dict(messages=MESSAGES, max_tokens=120, temperature=1.0)

    def parsed():
        schema_format = {"type": "json_schema", "json_schema": {"name": "listing", "schema": LISTING, "strict": True}}
        for seed in (1, 2):
            done = client.chat.completions.parse(model=folder, response_format=Forecast, seed=seed, **asked)
            choice = done.choices[0]
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), Forecast.model_json_schema())
            assert isinstance(choice.message.parsed, Forecast), choice.message
            content, finish = streamed(client, model=folder, response_format=schema_format, seed=seed, **asked)
            assert finish == "stop", (finish, content)
            jsonschema.validate(json.loads(content), LISTING)

    def any_object():
        # Any object's keys and strings are unbounded, and random weights rarely close one: an
        # answer cut by max_tokens says `length`, as OpenAI's does; one that ended is an object.
        for seed in (1, 2):
            done = client.chat.completions.create(model=folder, response_format={"type": "json_object"},
                                                  seed=seed, **asked)
            answers = [(done.choices[0].message.content, done.choices[0].finish_reason),
                       streamed(client, model=folder, response_format={"type": "json_object"}, seed=seed, **asked)]
            for content, finish in answers:
                assert finish in ("stop", "length"), (finish, content)
                if finish == "stop":
                    jsonschema.validate(json.loads(content), {"type": "object"})

    def calls():
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for choice, allowed in (({"type": "function", "function": {"name": "weather"}}, ["weather"]),
                                ("required", ["weather", "alarm"])):
            for seed in (1, 2):
                done = client.chat.completions.create(model=f"{folder}-calls", tools=TOOLS, tool_choice=choice,
                                                      seed=seed, **asked)
                answer = done.choices[0]
                assert answer.finish_reason == "tool_calls", answer
                call = answer.message.tool_calls[0].function
                assert call.name in allowed, call
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])

    def refused():
        bad = {"type": "json_schema", "json_schema": {"name": "bad", "strict": True,
                                                      "schema": {"type": "string", "format": "no-such-format"}}}
        try:
            client.chat.completions.create(model=folder, response_format=bad, **asked)
            raise AssertionError("a schema the engine cannot compile was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "response_format", e.body
            assert "no-such-format" in e.body["message"], e.body

    def completion():
        # The legacy completions API has no `response_format` in the client's signature: vLLM's
        # clients send it as an extra field, as here.
        schema_format = {"type": "json_schema", "json_schema": {"name": "listing", "schema": LISTING, "strict": True}}
        for seed in (1, 2):
            done = client.completions.create(model=folder, prompt="A listing:", max_tokens=120, seed=seed,
                                             extra_body={"response_format": schema_format})
            assert done.choices[0].finish_reason == "stop", done.choices[0]
            jsonschema.validate(json.loads(done.choices[0].text), LISTING)
            pieces, finish = [], None
            for chunk in client.completions.create(model=folder, prompt="A listing:", max_tokens=120, seed=seed,
                                                   stream=True, extra_body={"response_format": schema_format}):
                if chunk.choices:
                    pieces.append(chunk.choices[0].text)
                    finish = chunk.choices[0].finish_reason or finish
            assert finish == "stop", (finish, pieces)
            jsonschema.validate(json.loads("".join(pieces)), LISTING)

    def cycle():
        looped = {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
            "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}}}
        try:
            client.chat.completions.create(model=folder, response_format=looped, **asked)
            raise AssertionError("a schema whose $ref cycles was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "response_format", e.body
            assert "`$ref` cycles" in e.body["message"], e.body

    return [(f"{folder}: strict json_schema, parsed by the client and streamed, validates", parsed),
            (f"{folder}: a completion's response_format, whole and streamed, validates", completion),
            (f"{folder}: a schema whose $ref cycles is a 400 naming response_format", cycle),
            (f"{folder}: json_object, whole and streamed, is an object", any_object),
            (f"{folder}: a forced tool call's arguments validate", calls),
            (f"{folder}: a schema the engine cannot compile is a 400 naming response_format", refused)]


def run(address):
    client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0, timeout=120)
    checks = [check for folder in FOLDERS for check in checks_for(client, folder)]

    def outcome(check):
        name, fn = check
        try:
            fn()
            return name, None
        except Exception:
            return name, traceback.format_exc()

    # Every folder at once: each model's batch holds rows under different grammars.
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(outcome, checks))
    failed = 0
    for name, error in results:
        print(("ok    " if error is None else "FAIL  ") + name)
        if error is not None:
            failed += 1
            print(error)
    print(f"structured outputs: {len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
