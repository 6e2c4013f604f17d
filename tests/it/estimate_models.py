#!/usr/bin/env python3
"""Generate the models tests/it/estimates.rs checks memory estimates on, into a folder.

    estimate_models.py OUT_DIR

writes, with fixed seeds (so every run writes the same bytes), opset 17, IR version 8:

* ``conv.onnx``    - input ``image`` FP32 [batch, 3, height, width]: three 3x3 convolutions
  (padding 1) with Relu, 3 -> 16 -> 32 -> 16 channels, then a 1x1 convolution to 3 channels.
  Its working memory grows with batch*height*width.
* ``scores.onnx``  - inputs ``x`` FP32 [batch, n, 32] and ``y`` FP32 [batch, m, 32]: both
  projected by a 32x32 weight, scores = x' @ y'^T of shape [batch, n, m], Softmax over m, then
  scores @ y' of shape [batch, n, 32]. Its working memory grows with batch*n*m, plus terms
  linear in batch*n and batch*m.

The tests run this script into a scratch folder, so nothing it writes is committed. It needs
only onnx and numpy (``make .deps/modelgen/.installed``; PYTHONPATH=.deps/modelgen).
"""

import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8


def weight(rng, name, shape, fan_in):
    values = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
    return numpy_helper.from_array(values, name)


def save(graph, path):
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="vramguard-tests",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    with open(path, "wb") as f:
        f.write(model.SerializeToString())


def conv_model(path):
    rng = np.random.RandomState(19)
    channels = [3, 16, 32, 16]
    nodes, inits = [], []
    previous = "image"
    for i in range(1, len(channels)):
        w, b = f"w{i}", f"b{i}"
        inits.append(weight(rng, w, (channels[i], channels[i - 1], 3, 3), channels[i - 1] * 9))
        inits.append(numpy_helper.from_array(np.zeros(channels[i], np.float32), b))
        nodes.append(
            helper.make_node("Conv", [previous, w, b], [f"c{i}"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
        )
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
        previous = f"r{i}"
    inits.append(weight(rng, "w_out", (3, channels[-1], 1, 1), channels[-1]))
    nodes.append(helper.make_node("Conv", [previous, "w_out"], ["output"], kernel_shape=[1, 1]))
    dims = ["batch", 3, "height", "width"]
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, dims)],
        inits,
    )
    save(graph, path)


def scores_model(path):
    rng = np.random.RandomState(20)
    inits = [weight(rng, "wx", (32, 32), 32), weight(rng, "wy", (32, 32), 32)]
    nodes = [
        helper.make_node("MatMul", ["x", "wx"], ["px"]),
        helper.make_node("MatMul", ["y", "wy"], ["py"]),
        helper.make_node("Transpose", ["py"], ["pyt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["px", "pyt"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["weights"], axis=-1),
        helper.make_node("MatMul", ["weights", "py"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "scores",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n", 32]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "m", 32]),
        ],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", "n", 32])],
        inits,
    )
    save(graph, path)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: estimate_models.py OUT_DIR")
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    conv_model(os.path.join(out, "conv.onnx"))
    scores_model(os.path.join(out, "scores.onnx"))


if __name__ == "__main__":
    main()
