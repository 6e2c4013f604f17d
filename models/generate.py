#!/usr/bin/env python3
"""Generate vramguard's small ONNX models and their reference outputs.

This script writes:

* ``models/encoder.onnx``      - a 4-head self-attention encoder layer whose
  working memory grows with seq^2 (the attention score tensor is
  [batch, 4, seq, seq]).
* ``models/classifier.onnx``   - a tiny MLP (16 -> 32 -> 4) with softmax.
* ``tests/fixtures/dtypes.onnx`` - one Identity per tensor datatype, used to
  test tensor encoding/decoding end to end.
* ``models/reference.json``    - inputs and expected outputs for the encoder
  and the classifier.

Why the references are computed WITHOUT ONNX Runtime
----------------------------------------------------
vramguard serves these models through ONNX Runtime. If the expected outputs
were produced by ONNX Runtime as well, a test comparing the server's answers
with them would only show that ONNX Runtime agrees with itself: a wrong graph
(bad transpose, wrong softmax axis, swapped weights), a broken export, or a
bug in the server's tensor plumbing that is mirrored in the reference
pipeline could all pass unnoticed. The references are therefore computed
from the same float32 weights with plain numpy, in float64, following the
mathematical definition of each model, and only then rounded to float32.
That gives an independent oracle; ONNX Runtime's float32 results must match
it to within a small tolerance.

``--check`` is a separate self-check: it regenerates everything in memory,
verifies that the files on disk are byte-identical to what this script
produces (i.e. that the committed files are up to date), and then runs the
on-disk models with ONNX Runtime (imported from ``.deps/onnxruntime`` or
``.deps/ort`` if present, else ``--ort-path`` or the normal ``sys.path``) and compares its outputs to the numpy references
(max abs diff must be < 1e-4). ONNX Runtime is never used to produce a file.

Determinism
-----------
All random values come from ``numpy.random.RandomState`` with fixed seeds
(the legacy generator whose streams numpy guarantees not to change), the
models are serialised from protobuf messages built in a fixed order, and
the JSON is written with a fixed key order, so every run produces
byte-identical files.

Usage::

    pip install onnx numpy
    python3 models/generate.py            # (re)write all files
    python3 models/generate.py --check    # verify files + compare with ORT
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
FIXTURES_DIR = REPO_ROOT / "tests" / "fixtures"

OPSET = 17
IR_VERSION = 8  # ONNX Runtime 1.31 loads ir_version <= 10; 8 matches opset 17.
PRODUCER_NAME = "vramguard-models-generate"
PRODUCER_VERSION = "1"

TOLERANCE = 1e-4

# Where --check looks for a `pip install --target` copy of onnxruntime.
DEFAULT_ORT_PATHS = [REPO_ROOT / ".deps" / "onnxruntime", REPO_ROOT / ".deps" / "ort"]

# Encoder hyper-parameters.
D_MODEL = 64
N_HEADS = 4
HEAD_DIM = D_MODEL // N_HEADS  # 16

# Classifier hyper-parameters.
CLS_IN = 16
CLS_HIDDEN = 32
CLS_OUT = 4

# Seeds (one per purpose so that changing one thing does not shift the rest).
SEED_ENCODER_WEIGHTS = 1001
SEED_CLASSIFIER_WEIGHTS = 2002
SEED_ENCODER_INPUTS = 3003
SEED_CLASSIFIER_INPUTS = 4004

WEIGHT_SCALE = 0.1

ENCODER_CASES = [  # (name, batch, seq)
    ("batch1_seq8", 1, 8),
    ("batch2_seq5", 2, 5),
    ("batch1_seq1", 1, 1),
]
CLASSIFIER_CASES = [  # (name, batch)
    ("batch1", 1),
    ("batch3", 3),
]

# (lowercase suffix, KServe-style datatype name, ONNX element type, numpy dtype)
DTYPES = [
    ("fp32", "FP32", TensorProto.FLOAT, np.float32),
    ("fp64", "FP64", TensorProto.DOUBLE, np.float64),
    ("fp16", "FP16", TensorProto.FLOAT16, np.float16),
    ("int8", "INT8", TensorProto.INT8, np.int8),
    ("int16", "INT16", TensorProto.INT16, np.int16),
    ("int32", "INT32", TensorProto.INT32, np.int32),
    ("int64", "INT64", TensorProto.INT64, np.int64),
    ("uint8", "UINT8", TensorProto.UINT8, np.uint8),
    ("bool", "BOOL", TensorProto.BOOL, np.bool_),
]


# --------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------


def _normal(rng: np.random.RandomState, shape: tuple[int, ...], scale: float) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def encoder_weights() -> dict[str, np.ndarray]:
    rng = np.random.RandomState(SEED_ENCODER_WEIGHTS)
    w: dict[str, np.ndarray] = {}
    for name in ("q", "k", "v", "o"):
        w[f"W_{name}"] = _normal(rng, (D_MODEL, D_MODEL), WEIGHT_SCALE)
        w[f"b_{name}"] = _normal(rng, (D_MODEL,), WEIGHT_SCALE)
    return w


def classifier_weights() -> dict[str, np.ndarray]:
    rng = np.random.RandomState(SEED_CLASSIFIER_WEIGHTS)
    return {
        "fc1_weight": _normal(rng, (CLS_IN, CLS_HIDDEN), WEIGHT_SCALE * 3),
        "fc1_bias": _normal(rng, (CLS_HIDDEN,), WEIGHT_SCALE),
        "fc2_weight": _normal(rng, (CLS_HIDDEN, CLS_OUT), WEIGHT_SCALE * 3),
        "fc2_bias": _normal(rng, (CLS_OUT,), WEIGHT_SCALE),
    }


# --------------------------------------------------------------------------
# Graph construction
# --------------------------------------------------------------------------


def _finish_model(graph: onnx.GraphProto, doc: str) -> onnx.ModelProto:
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name=PRODUCER_NAME,
        producer_version=PRODUCER_VERSION,
        doc_string=doc,
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def build_encoder(w: dict[str, np.ndarray]) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(arr, name) for name, arr in w.items()]
    inits += [
        numpy_helper.from_array(np.array([0, 0, N_HEADS, HEAD_DIM], dtype=np.int64), "split_heads_shape"),
        numpy_helper.from_array(np.array([0, 0, D_MODEL], dtype=np.int64), "merge_heads_shape"),
        numpy_helper.from_array(np.array(1.0 / math.sqrt(HEAD_DIM), dtype=np.float32), "attn_scale"),
    ]

    nodes = []
    # Q, K, V projections and head split: [b,s,64] -> [b,s,4,16] -> [b,4,s,16]
    for p in ("q", "k", "v"):
        nodes += [
            helper.make_node("MatMul", ["input", f"W_{p}"], [f"{p}_mm"], name=f"{p}_matmul"),
            helper.make_node("Add", [f"{p}_mm", f"b_{p}"], [f"{p}_proj"], name=f"{p}_bias"),
            helper.make_node("Reshape", [f"{p}_proj", "split_heads_shape"], [f"{p}_split"], name=f"{p}_reshape"),
        ]
    nodes += [
        helper.make_node("Transpose", ["q_split"], ["q_heads"], perm=[0, 2, 1, 3], name="q_transpose"),
        helper.make_node("Transpose", ["k_split"], ["k_heads_t"], perm=[0, 2, 3, 1], name="k_transpose"),
        helper.make_node("Transpose", ["v_split"], ["v_heads"], perm=[0, 2, 1, 3], name="v_transpose"),
        # scores: [b,4,s,16] @ [b,4,16,s] -> [b,4,s,s]  (the seq^2 working set)
        helper.make_node("MatMul", ["q_heads", "k_heads_t"], ["scores_raw"], name="scores_matmul"),
        helper.make_node("Mul", ["scores_raw", "attn_scale"], ["scores"], name="scores_scale"),
        helper.make_node("Softmax", ["scores"], ["attn"], axis=-1, name="attn_softmax"),
        # context: [b,4,s,s] @ [b,4,s,16] -> [b,4,s,16] -> [b,s,4,16] -> [b,s,64]
        helper.make_node("MatMul", ["attn", "v_heads"], ["ctx_heads"], name="ctx_matmul"),
        helper.make_node("Transpose", ["ctx_heads"], ["ctx_split"], perm=[0, 2, 1, 3], name="ctx_transpose"),
        helper.make_node("Reshape", ["ctx_split", "merge_heads_shape"], ["ctx"], name="ctx_reshape"),
        helper.make_node("MatMul", ["ctx", "W_o"], ["o_mm"], name="o_matmul"),
        helper.make_node("Add", ["o_mm", "b_o"], ["o_proj"], name="o_bias"),
        helper.make_node("Add", ["o_proj", "input"], ["hidden"], name="residual"),
        helper.make_node("ReduceMean", ["hidden"], ["pooled"], axes=[1], keepdims=0, name="pool"),
    ]

    graph = helper.make_graph(
        nodes,
        "encoder",
        inputs=[helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "seq", D_MODEL])],
        outputs=[
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "seq", D_MODEL]),
            helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", D_MODEL]),
        ],
        initializer=inits,
    )
    doc = (
        "vramguard test encoder: one 4-head (head dim 16) self-attention layer over "
        "input[batch, seq, 64] with Q/K/V/output projections and a residual connection. "
        "Outputs hidden[batch, seq, 64] and pooled[batch, 64] = mean of hidden over seq. "
        "The attention scores are [batch, 4, seq, seq], so working memory grows with seq^2. "
        "Weights are random (fixed seed); generated by models/generate.py."
    )
    return _finish_model(graph, doc)


def build_classifier(w: dict[str, np.ndarray]) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(arr, name) for name, arr in w.items()]
    nodes = [
        helper.make_node("Gemm", ["features", "fc1_weight", "fc1_bias"], ["fc1"], name="fc1_gemm"),
        helper.make_node("Relu", ["fc1"], ["fc1_relu"], name="fc1_relu"),
        helper.make_node("Gemm", ["fc1_relu", "fc2_weight", "fc2_bias"], ["logits"], name="fc2_gemm"),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1, name="softmax"),
    ]
    graph = helper.make_graph(
        nodes,
        "classifier",
        inputs=[helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", CLS_IN])],
        outputs=[
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLS_OUT]),
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", CLS_OUT]),
        ],
        initializer=inits,
    )
    doc = (
        "vramguard test classifier: features[batch, 16] -> Gemm(16->32) -> Relu -> "
        "Gemm(32->4) = logits[batch, 4]; probabilities[batch, 4] = Softmax(logits). "
        "Weights are random (fixed seed); generated by models/generate.py."
    )
    return _finish_model(graph, doc)


def build_dtypes() -> onnx.ModelProto:
    nodes, inputs, outputs = [], [], []
    for suffix, _, elem, _ in DTYPES:
        inputs.append(helper.make_tensor_value_info(f"in_{suffix}", elem, ["n"]))
        outputs.append(helper.make_tensor_value_info(f"out_{suffix}", elem, ["n"]))
        nodes.append(helper.make_node("Identity", [f"in_{suffix}"], [f"out_{suffix}"], name=f"identity_{suffix}"))
    graph = helper.make_graph(nodes, "dtypes", inputs=inputs, outputs=outputs)
    doc = (
        "vramguard tensor-encoding fixture: out_<dtype> = Identity(in_<dtype>), shape [n], "
        "for dtypes " + ", ".join(d[1] for d in DTYPES) + ". Generated by models/generate.py."
    )
    return _finish_model(graph, doc)


# --------------------------------------------------------------------------
# Independent numpy references (float64 math on the float32 weights)
# --------------------------------------------------------------------------


def _softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def encoder_reference(w: dict[str, np.ndarray], x: np.ndarray) -> dict[str, np.ndarray]:
    w64 = {k: v.astype(np.float64) for k, v in w.items()}
    x64 = x.astype(np.float64)
    b, s, _ = x64.shape

    def heads(t: np.ndarray) -> np.ndarray:  # [b,s,64] -> [b,4,s,16]
        return t.reshape(b, s, N_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)

    q = heads(x64 @ w64["W_q"] + w64["b_q"])
    k = heads(x64 @ w64["W_k"] + w64["b_k"])
    v = heads(x64 @ w64["W_v"] + w64["b_v"])
    scores = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(HEAD_DIM)  # [b,4,s,s]
    ctx = _softmax64(scores) @ v  # [b,4,s,16]
    ctx = ctx.transpose(0, 2, 1, 3).reshape(b, s, D_MODEL)
    hidden = ctx @ w64["W_o"] + w64["b_o"] + x64
    pooled = hidden.mean(axis=1)
    return {"hidden": hidden.astype(np.float32), "pooled": pooled.astype(np.float32)}


def classifier_reference(w: dict[str, np.ndarray], x: np.ndarray) -> dict[str, np.ndarray]:
    w64 = {k: v.astype(np.float64) for k, v in w.items()}
    h = np.maximum(x.astype(np.float64) @ w64["fc1_weight"] + w64["fc1_bias"], 0.0)
    logits = h @ w64["fc2_weight"] + w64["fc2_bias"]
    return {"logits": logits.astype(np.float32), "probabilities": _softmax64(logits).astype(np.float32)}


def _tensor_json(arr: np.ndarray) -> dict:
    assert arr.dtype == np.float32
    # float(np.float32) is the exact value as a Python float; its repr round-trips exactly.
    return {"datatype": "FP32", "shape": list(arr.shape), "data": [float(v) for v in arr.reshape(-1)]}


def build_reference(enc_w: dict[str, np.ndarray], cls_w: dict[str, np.ndarray]) -> dict:
    ref: dict = {"encoder": [], "classifier": []}

    rng = np.random.RandomState(SEED_ENCODER_INPUTS)
    for name, batch, seq in ENCODER_CASES:
        x = rng.standard_normal((batch, seq, D_MODEL)).astype(np.float32)
        out = encoder_reference(enc_w, x)
        ref["encoder"].append({
            "name": name,
            "inputs": {"input": _tensor_json(x)},
            "outputs": {"hidden": _tensor_json(out["hidden"]), "pooled": _tensor_json(out["pooled"])},
        })

    rng = np.random.RandomState(SEED_CLASSIFIER_INPUTS)
    for name, batch in CLASSIFIER_CASES:
        x = rng.standard_normal((batch, CLS_IN)).astype(np.float32)
        out = classifier_reference(cls_w, x)
        ref["classifier"].append({
            "name": name,
            "inputs": {"features": _tensor_json(x)},
            "outputs": {"logits": _tensor_json(out["logits"]), "probabilities": _tensor_json(out["probabilities"])},
        })
    return ref


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def generate() -> dict[Path, bytes]:
    """Build every artifact in memory; returns {path: file bytes}."""
    enc_w = encoder_weights()
    cls_w = classifier_weights()
    reference = build_reference(enc_w, cls_w)
    ref_text = json.dumps(reference, separators=(",", ":"), allow_nan=False) + "\n"
    return {
        MODELS_DIR / "encoder.onnx": build_encoder(enc_w).SerializeToString(),
        MODELS_DIR / "classifier.onnx": build_classifier(cls_w).SerializeToString(),
        FIXTURES_DIR / "dtypes.onnx": build_dtypes().SerializeToString(),
        MODELS_DIR / "reference.json": ref_text.encode("utf-8"),
    }


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO_ROOT))


def write(files: dict[Path, bytes]) -> None:
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        print(f"wrote {_rel(path)} ({len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()})")


def import_onnxruntime(ort_path: Path | None):
    """Import onnxruntime for --check: from ``ort_path`` if given, else from the first of
    DEFAULT_ORT_PATHS that holds it, else from the normal ``sys.path``."""
    candidates = [ort_path] if ort_path is not None else DEFAULT_ORT_PATHS
    for candidate in candidates:
        if (candidate / "onnxruntime" / "__init__.py").is_file():
            sys.path.insert(0, str(candidate))
            break
    import onnxruntime as ort  # noqa: E402  (only needed for --check)

    print(f"onnxruntime {ort.__version__} from {Path(ort.__file__).parent}")
    return ort


def files_up_to_date(files: dict[Path, bytes], script: str) -> int:
    """Compare the files on disk with what `script` generates; print one line each and return
    how many are missing or differ."""
    failures = 0
    for path, data in files.items():
        if not path.exists():
            print(f"FAIL {_rel(path)}: missing (run {script})")
            failures += 1
        elif path.read_bytes() != data:
            print(f"FAIL {_rel(path)}: differs from generated output (run {script})")
            failures += 1
        else:
            print(f"ok   {_rel(path)}: up to date")
    return failures


def check(files: dict[Path, bytes], ort_path: Path | None) -> int:
    # 1. Files on disk must be exactly what this script generates.
    failures = files_up_to_date(files, "models/generate.py")
    if failures:
        return failures

    # 2. ONNX Runtime's outputs must match the independent numpy references.
    ort = import_onnxruntime(ort_path)
    reference = json.loads(files[MODELS_DIR / "reference.json"])
    overall_max = 0.0
    for model_name in ("encoder", "classifier"):
        sess = ort.InferenceSession(
            str(MODELS_DIR / f"{model_name}.onnx"), providers=["CPUExecutionProvider"]
        )
        for case in reference[model_name]:
            feeds = {
                k: np.array(t["data"], dtype=np.float32).reshape(t["shape"]) for k, t in case["inputs"].items()
            }
            names = list(case["outputs"])
            got = dict(zip(names, sess.run(names, feeds)))
            for out_name, t in case["outputs"].items():
                want = np.array(t["data"], dtype=np.float32).reshape(t["shape"])
                g = got[out_name]
                if g.shape != want.shape or g.dtype != np.float32:
                    print(f"FAIL {model_name}/{case['name']}/{out_name}: got {g.dtype}{list(g.shape)}, "
                          f"want float32{list(want.shape)}")
                    failures += 1
                    continue
                diff = float(np.max(np.abs(g.astype(np.float64) - want.astype(np.float64))))
                overall_max = max(overall_max, diff)
                status = "ok  " if diff < TOLERANCE else "FAIL"
                failures += diff >= TOLERANCE
                print(f"{status} {model_name}/{case['name']}/{out_name}: shape {list(g.shape)} max abs diff {diff:.3e}")

    # 3. The dtypes fixture must round-trip every datatype unchanged.
    sess = ort.InferenceSession(str(FIXTURES_DIR / "dtypes.onnx"), providers=["CPUExecutionProvider"])
    samples = {
        "fp32": [1.5, -2.25, 0.0], "fp64": [1.5, -2.25, 1e300], "fp16": [1.5, -2.25, 65504.0],
        "int8": [-128, 0, 127], "int16": [-32768, 0, 32767], "int32": [-(2**31), 0, 2**31 - 1],
        "int64": [-(2**63), 0, 2**63 - 1], "uint8": [0, 1, 255], "bool": [True, False, True],
    }
    feeds = {f"in_{s}": np.array(samples[s], dtype=dt) for s, _, _, dt in DTYPES}
    names = [f"out_{s}" for s, _, _, _ in DTYPES]
    for name, got in zip(names, sess.run(names, feeds)):
        want = feeds["in_" + name[len("out_"):]]
        same = got.dtype == want.dtype and np.array_equal(got, want)
        failures += not same
        print(f"{'ok  ' if same else 'FAIL'} dtypes/{name}: {got.dtype} {got.tolist()}")

    print(f"max abs diff (ORT vs numpy reference) over all cases: {overall_max:.3e} (tolerance {TOLERANCE:g})")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; verify the files on disk are up to date and that ONNX Runtime matches the references",
    )
    parser.add_argument(
        "--ort-path",
        type=Path,
        default=None,
        help="directory (a `pip install --target` dir) prepended to sys.path to import onnxruntime for "
        "--check (default: the first of .deps/onnxruntime, .deps/ort that holds it, else the normal sys.path)",
    )
    args = parser.parse_args()

    files = generate()
    if not args.check:
        write(files)
        return 0
    failures = check(files, args.ort_path)
    print("CHECK PASSED" if failures == 0 else f"CHECK FAILED ({failures} problem(s))")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
