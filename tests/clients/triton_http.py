#!/usr/bin/env python3
"""Compatibility check with Triton's own HTTP client (tritonclient.http), unchanged.

Starts `vramguard serve` (path in argv[1]) on the embedded default at 127.0.0.1:0, then drives
it with the stock client: health, metadata, binary-by-default inference, JSON inference, output
selection, and an error surfaced as the client's exception. Numerics are compared with the
committed references in models/reference.json (computed without ONNX Runtime).

Run by `make test` (which installs tritonclient into .deps/pyclients); prints
'N passed, N failed' and exits non-zero on any failure.
"""
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, ".deps", "pyclients"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tritonclient.http as http  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402
from serving import start  # noqa: E402


def main():
    proc, address = start(sys.argv[1])
    client = http.InferenceServerClient(address)
    ref = json.load(open(os.path.join(ROOT, "models", "reference.json")))
    checks = []

    def check(name):
        def wrap(fn):
            checks.append((name, fn))
            return fn
        return wrap

    @check("health and readiness")
    def _():
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("classifier") and client.is_model_ready("encoder")

    @check("server and model metadata")
    def _():
        assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
        meta = client.get_model_metadata("encoder")
        assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, -1, 64]}], meta

    @check("binary tensors by default, request id echoed")
    def _():
        case = ref["classifier"][1]
        x = np.array(case["inputs"]["features"]["data"], np.float32).reshape(case["inputs"]["features"]["shape"])
        inp = http.InferInput("features", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer("classifier", [inp], request_id="compat-1")
        want = np.array(case["outputs"]["probabilities"]["data"]).reshape(3, 4)
        assert np.abs(result.as_numpy("probabilities") - want).max() < 1e-5
        assert result.get_response()["id"] == "compat-1"

    @check("JSON tensors and output selection")
    def _():
        case = ref["encoder"][1]
        x = np.array(case["inputs"]["input"]["data"], np.float32).reshape(case["inputs"]["input"]["shape"])
        inp = http.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=False)
        out = http.InferRequestedOutput("pooled", binary_data=False)
        result = client.infer("encoder", [inp], outputs=[out])
        want = np.array(case["outputs"]["pooled"]["data"]).reshape(2, 64)
        assert np.abs(result.as_numpy("pooled") - want).max() < 1e-4
        assert result.as_numpy("hidden") is None

    @check("errors surface as the client's exception with our message")
    def _():
        bad = http.InferInput("features", [1, 8], "FP32")
        bad.set_data_from_numpy(np.ones((1, 8), np.float32))
        try:
            client.infer("classifier", [bad])
        except InferenceServerException as e:
            assert "dimension 1 is 8 but the model requires 16" in e.message(), e.message()
            assert e.status() == "400", e.status()
        else:
            raise AssertionError("no error for a wrong shape")

    passed = failed = 0
    try:
        for name, fn in checks:
            try:
                fn()
                passed += 1
                print(f"ok   {name}")
            except Exception:  # report every failing check, not just the first
                failed += 1
                print(f"FAIL {name}")
                traceback.print_exc()
    finally:
        proc.terminate()
        code = proc.wait(timeout=30)
        if code != 0:
            failed += 1
            print(f"FAIL vramguard exited {code} on SIGTERM")
    print(f"triton-client: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
