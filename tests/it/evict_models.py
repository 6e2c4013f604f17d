#!/usr/bin/env python3
"""Generate the models tests/it/evict.rs evicts, into a folder.

    evict_models.py OUT_DIR MIB

writes ``a.onnx``, ``b.onnx`` and ``c.onnx`` with fixed seeds (so every run writes the same
bytes), opset 17, IR version 8: input ``x`` FP32 [batch, 64], one MatMul by a constant
[64, N] weight holding MIB mebibytes, then ReduceMean over the last axis, so the output
``y`` is FP32 [batch, 1]. Their weights dominate their memory: a simulated device sized for
two of them cannot hold the third.

Nothing it writes is committed. It needs only onnx and numpy (PYTHONPATH=.deps/modelgen).
"""

import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
ROWS = 64


def dense(path, seed, mib):
    columns = mib * (1 << 20) // (4 * ROWS)
    rng = np.random.RandomState(seed)
    w = numpy_helper.from_array((rng.standard_normal((ROWS, columns)) / 8.0).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("ReduceMean", ["h"], ["y"], axes=[1], keepdims=1),
        ],
        "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", ROWS])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="vramguard-tests")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    with open(path, "wb") as f:
        f.write(model.SerializeToString())


def main():
    out, mib = sys.argv[1], int(sys.argv[2])
    os.makedirs(out, exist_ok=True)
    for seed, name in enumerate(["a", "b", "c"]):
        dense(os.path.join(out, f"{name}.onnx"), 41 + seed, mib)


if __name__ == "__main__":
    main()
