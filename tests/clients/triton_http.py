#!/usr/bin/env python3
"""Compatibility check with Triton's own HTTP client (tritonclient.http), unchanged.

Starts `vramguard serve` (path in argv[1]) on the embedded default at 127.0.0.1:0, with an admin
token added (the client has no Unix socket), then drives it with the stock client: health,
metadata, binary-by-default inference, JSON inference, output selection, errors surfaced as the
client's exception, and Triton's extensions: the model repository (index, load, unload with the
token), model configuration and inference statistics. Numerics are compared with the committed
references in models/reference.json (computed without ONNX Runtime).

Run by `make test` (which installs tritonclient into .deps/pyclients); prints
'N passed, N failed' and exits non-zero on any failure.
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, ".deps", "pyclients"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tritonclient.http as http  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402
from serving import Checks, start  # noqa: E402


TOKEN = "triton-client-test-token"


def main():
    with tempfile.TemporaryDirectory() as tmp:
        # The embedded default with an admin token, its admin socket in this run's own folder.
        default = subprocess.run([sys.argv[1], "config", "default"], capture_output=True, text=True,
                                 check=True).stdout
        assert "admin_token_env: null" in default, default
        config = os.path.join(tmp, "default.yaml")
        with open(config, "w") as f:
            f.write(default.replace("admin_token_env: null", "admin_token_env: VRAMGUARD_TRITON_TEST_TOKEN"))
        proc, address = start(sys.argv[1], "--config", config,
                              env={"VRAMGUARD_TRITON_TEST_TOKEN": TOKEN, "RUNTIME_DIRECTORY": tmp})
        return run(proc, address)


def run(proc, address):
    """Drive the server `proc` serves at `address`, then stop it; 1 when any check failed."""
    client = http.InferenceServerClient(address)
    admin = {"Authorization": f"Bearer {TOKEN}"}
    ref = json.load(open(os.path.join(ROOT, "models", "reference.json")))
    checks = Checks()
    check = checks.check

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

    def classify(n):
        case = ref["classifier"][0]
        x = np.array(case["inputs"]["features"]["data"], np.float32).reshape(case["inputs"]["features"]["shape"])
        inp = http.InferInput("features", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        for _ in range(n):
            client.infer("classifier", [inp])

    def refused(status, fn, *args, **kwargs):
        """The client's exception with `status`, from `fn(*args, **kwargs)`; its message."""
        try:
            fn(*args, **kwargs)
        except InferenceServerException as e:
            assert e.status() == status, (e.status(), e.message())
            return e.message()
        raise AssertionError(f"no error from {fn.__name__}{args}")

    @check("server metadata lists Triton's extensions")
    def _():
        extensions = client.get_server_metadata()["extensions"]
        for name in ("model_repository", "model_configuration", "statistics"):
            assert name in extensions, extensions

    @check("model repository index")
    def _():
        index = client.get_model_repository_index()
        assert [m["name"] for m in index] == ["encoder", "classifier", "tiny", "tiny-embed", "tiny-whisper"], index
        assert all(m["state"] == "READY" and m["version"] == "1" for m in index), index

    @check("model configuration")
    def _():
        config = client.get_model_config("classifier")
        assert config["name"] == "classifier" and config["platform"] == "onnxruntime_onnx", config
        assert config["max_batch_size"] == 0, config
        assert config["input"] == [{"name": "features", "data_type": "TYPE_FP32", "dims": [-1, 16]}], config
        assert [o["name"] for o in config["output"]] == ["logits", "probabilities"], config
        kinds = {g["name"]: g["kind"] for g in config["instance_group"]}
        assert kinds == {"gpu": "KIND_GPU", "cpu": "KIND_CPU"}, config
        # A machine without an NVIDIA GPU serves `gpu` on the simulated accelerator, and says so.
        parameters = config["parameters"]
        simulated = parameters["pool.gpu.provider"]["string_value"] == "simulated"
        assert parameters["pool.gpu.simulated"]["string_value"] == str(simulated).lower(), config
        assert client.get_model_config("classifier", "1") == config

    @check("load and unload with the admin token")
    def _():
        assert "Bearer" in refused("401", client.unload_model, "encoder")
        client.unload_model("encoder", headers=admin)
        encoder = client.get_model_repository_index()[0]
        assert encoder["state"] == "READY" and "next request loads it" in encoder["reason"], encoder
        client.load_model("encoder", headers=admin)
        assert client.get_model_repository_index()[0]["reason"] == ""
        message = refused("400", client.load_model, "encoder", headers=admin, config='{"max_batch_size": 8}')
        assert "`config`" in message, message

    @check("inference statistics count each answer")
    def _():
        def stats():
            [s] = client.get_inference_statistics("classifier")["model_stats"]
            return s
        before = stats()
        classify(3)
        after = stats()
        assert after["inference_count"] - before["inference_count"] == 3, (before, after)
        success = after["inference_stats"]["success"]
        assert success["count"] - before["inference_stats"]["success"]["count"] == 3, (before, after)
        assert success["ns"] > before["inference_stats"]["success"]["ns"], (before, after)
        assert after["last_inference"] >= before["last_inference"] > 0, (before, after)
        every = client.get_inference_statistics()["model_stats"]
        assert [s["name"] for s in every] == ["encoder", "classifier", "tiny", "tiny-embed", "tiny-whisper"], every

    @check("an unknown model is a 404 from every extension")
    def _():
        refused("404", client.get_model_config, "nope")
        refused("404", client.get_inference_statistics, "nope")
        refused("404", client.load_model, "nope", headers=admin)
        refused("404", client.get_model_config, "classifier", "2")

    passed = failed = 0
    try:
        passed, failed = checks.run()
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
