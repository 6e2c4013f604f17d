#!/usr/bin/env python3
"""Generate vramguard's tiny text-generation fixture in Hugging Face Optimum's decoder layout.

This script writes ``models/decoder/``:

* ``tokenizer.json`` - a byte-level BPE (GPT-2 style) with 512 entries, trained here with the
  ``tokenizers`` package on ``models/decoder_corpus.txt``. Its special tokens are
  ``<|endoftext|>`` (id 0, end of text and padding), ``<|user|>``, ``<|assistant|>`` and
  ``<|system|>``.
* ``model.onnx`` - a Llama-style decoder with random weights (fixed seed). Its inputs and
  outputs are the ones ``optimum-cli export onnx --task text-generation-with-past`` gives a
  decoder: ``input_ids``, ``attention_mask``, ``position_ids`` and ``past_key_values.{i}.key``/
  ``.value`` in; ``logits`` and ``present.{i}.key``/``.value`` out. One graph serves the first
  pass (empty past, the whole prompt) and every later step (the previous ``present`` as past).
* ``config.json`` - what a Hugging Face folder says of the model (as ``transformers``'
  ``LlamaConfig`` writes it), above all ``max_position_embeddings``: the positions it takes,
  which vramguard reads from a folder's ``config.json`` and, for the model it bundles, from
  this file.
* ``reference.json`` - prompts, their token ids and their greedy continuations.

Why the references are computed WITHOUT ONNX Runtime
----------------------------------------------------
The same reasoning as ``models/generate.py``: ONNX Runtime is what vramguard runs, so a
reference taken from it would only show that it agrees with itself. The greedy continuations
come from a separate numpy implementation of the model's math, in float64 from the float32
weights, which recomputes the whole sequence for every new token. It uses no KV cache, no
padding and no graph, so it is an oracle for all three.

``--check`` regenerates everything in memory and verifies that the files on disk are
byte-identical. It then runs ``model.onnx`` with ONNX Runtime five ways: the whole sequence
again at each step (empty past), one token at a time with the KV cache, the prompt in two
chunks (past and a multi-token step together), the cached way again with every position moved
up to end at the last the model takes, and two prompts batched with left padding.
Each way must give the reference's greedy tokens, with logits within LOGIT_TOLERANCE of the
numpy values at every step. ONNX Runtime never produces a file.

Determinism
-----------
Weights come from ``numpy.random.RandomState`` with a fixed seed. The rotary tables use
Python's ``math.cos``/``math.sin`` rather than numpy's vectorised ones, whose last bit may
depend on the CPU. BPE training in ``tokenizers`` is deterministic for a given input and
version. So every run writes the same bytes, for the pinned package versions below.

Usage (the packages go into the git-ignored .deps/, like the rest of the project's tools)::

    python3 -m pip install --target .deps/modelgen numpy==2.4.6 onnx==1.23.2 tokenizers==0.23.2
    PYTHONPATH=.deps/modelgen python3 models/generate_decoder.py           # (re)write the files
    PYTHONPATH=.deps/modelgen python3 models/generate_decoder.py --check   # verify + compare with ORT
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from generate import IR_VERSION, OPSET, PRODUCER_NAME, PRODUCER_VERSION, files_up_to_date, import_onnxruntime

REPO_ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = REPO_ROOT / "models" / "decoder"
# The tokenizer's training text: plain ASCII paragraphs about GPU memory and serving, written
# for this project (no third-party text), so it can be committed and changed freely.
CORPUS = REPO_ROOT / "models" / "decoder_corpus.txt"

# Model dimensions. Llama's architecture: RMSNorm, rotary positions, grouped-query attention
# (4 query heads share 2 key/value heads), SwiGLU MLP, untied output projection.
VOCAB = 512
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_SIZE = HIDDEN // HEADS  # 16
INTERMEDIATE = 128
# Rows of the rotary tables; a larger position_id fails in Gather. 32768 so that what a chat front
# end sends fits the default config's toy model: Open WebUI 0.12's chat carries 28 built-in tool
# schemas (about 21 KB of JSON, about 15,000 tokens of this small vocabulary), its title, tag and
# RAG prompts 1-2 KB. Rows below 512 are the same as when it had 512, so are the references.
MAX_POSITIONS = 32768
ROPE_THETA = 10000.0
RMS_EPS = 1e-5

SPECIAL_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"]
EOS_TOKEN = "<|endoftext|>"

SEED_WEIGHTS = 173  # chosen so that no reference step is a near tie (see MIN_GREEDY_MARGIN)

MAX_NEW_TOKENS = 16
# ORT (float32) against numpy (float64): the differences are about 1e-5; see README.
LOGIT_TOLERANCE = 1e-3
# A greedy step whose best two logits are closer than this could flip between execution
# providers or thread counts; generation refuses such a reference.
MIN_GREEDY_MARGIN = 0.05

# (name, prompt, stop sequences). The stop sequence of "stop" was picked from that prompt's
# greedy continuation, so that a stop rule has a token to cut at.
PROMPTS = [
    ("short", "The GPU", []),
    (
        "long",
        "A home server runs a chat model, an embedding model and a speech model on one GPU. "
        "Each of them keeps its weights in memory, and the chat model also keeps a key and value "
        "cache that grows with every token. When a long prompt arrives, the server estimates the "
        "memory it will need before it admits the request, and it keeps a reserve for the work "
        "that is already running. If the request does not fit, the server",
        [],
    ),
    (
        "chat",
        "<|system|>\nYou are a helpful assistant.\n<|user|>\nHow much memory does the cache need?\n<|assistant|>\n",
        [],
    ),
    ("stop", "When the queue is full, the server", [" GPU"]),
]
# Prompts run together with left padding in the batched check and reference.
BATCH = ["short", "long"]


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS.read_text(encoding="utf-8")], trainer=trainer)
    if tok.get_vocab_size() != VOCAB:
        raise SystemExit(f"the corpus gave {tok.get_vocab_size()} tokens, not {VOCAB}: it needs more text")
    return tok


# --------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------


def writable_tokens(tok: Tokenizer) -> list[int]:
    """EOS and the ordinary tokens whose text on its own is printable ASCII or a newline.

    A random model would otherwise write lone bytes of multi-byte UTF-8 characters and control
    characters, which no trained model on this corpus would: its answers would decode to U+FFFD
    and streamed text would depend on where the detokenizer splits.
    """
    special = {tok.token_to_id(t) for t in SPECIAL_TOKENS}
    ok = [i for i in range(VOCAB) if i not in special and all(
        c == "\n" or (c.isascii() and c.isprintable()) for c in tok.decode([i]))]
    return sorted([tok.token_to_id(EOS_TOKEN), *ok])


def decoder_weights(writable: list[int]) -> dict[str, np.ndarray]:
    """HF Llama parameter names; projection matrices are stored [in, out] for MatMul.

    The output projection's column is zero for every token not in ``writable``: its logit is
    then 0 while the best writable token's is about +9 or more, so greedy decoding never picks
    it and at temperature 1 all of them together get well under 1% of the probability.
    """
    rng = np.random.RandomState(SEED_WEIGHTS)

    def normal(shape: tuple[int, ...], scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm_weight() -> np.ndarray:
        # Around 1 but not 1, so a graph that drops a norm's weight disagrees with the reference.
        return (1.0 + rng.standard_normal(HIDDEN) * 0.1).astype(np.float32)

    proj = 1.0 / math.sqrt(HIDDEN)
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal((VOCAB, HIDDEN), 1.0)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = norm_weight()
        w[f"{p}.self_attn.q_proj.weight"] = normal((HIDDEN, HEADS * HEAD_SIZE), proj)
        w[f"{p}.self_attn.k_proj.weight"] = normal((HIDDEN, KV_HEADS * HEAD_SIZE), proj)
        w[f"{p}.self_attn.v_proj.weight"] = normal((HIDDEN, KV_HEADS * HEAD_SIZE), proj)
        w[f"{p}.self_attn.o_proj.weight"] = normal((HEADS * HEAD_SIZE, HIDDEN), proj)
        w[f"{p}.post_attention_layernorm.weight"] = norm_weight()
        w[f"{p}.mlp.gate_proj.weight"] = normal((HIDDEN, INTERMEDIATE), proj)
        w[f"{p}.mlp.up_proj.weight"] = normal((HIDDEN, INTERMEDIATE), proj)
        w[f"{p}.mlp.down_proj.weight"] = normal((INTERMEDIATE, HIDDEN), 1.0 / math.sqrt(INTERMEDIATE))
    w["model.norm.weight"] = norm_weight()
    lm_head = normal((HIDDEN, VOCAB), 4.0 * proj)  # logits with a spread of a few units
    silent = np.ones(VOCAB, dtype=bool)
    silent[writable] = False
    lm_head[:, silent] = 0.0
    w["lm_head.weight"] = lm_head
    return w


def inv_freq() -> list[float]:
    return [1.0 / ROPE_THETA ** (2 * j / HEAD_SIZE) for j in range(HEAD_SIZE // 2)]


def rotary_tables() -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of position * frequency, [MAX_POSITIONS, HEAD_SIZE], halves repeated (HF layout)."""
    freqs = inv_freq()
    angles = [[pos * f for f in freqs + freqs] for pos in range(MAX_POSITIONS)]
    cos = np.array([[math.cos(a) for a in row] for row in angles], dtype=np.float32)
    sin = np.array([[math.sin(a) for a in row] for row in angles], dtype=np.float32)
    return cos, sin


# --------------------------------------------------------------------------
# Graph
# --------------------------------------------------------------------------


class Graph:
    """Collects nodes and initializers; names every node after its output."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def op(self, op_type: str, inputs: list[str], output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output, **attrs))
        return output


def _rms_norm(g: Graph, x: str, weight: str, out: str) -> str:
    sq = g.op("Mul", [x, x], f"{out}/sq")
    mean = g.op("ReduceMean", [sq], f"{out}/mean", axes=[-1], keepdims=1)
    std = g.op("Sqrt", [g.op("Add", [mean, "rms_eps"], f"{out}/add_eps")], f"{out}/std")
    return g.op("Mul", [g.op("Div", [x, std], f"{out}/normed"), weight], out)


def _rotate(g: Graph, x: str, out: str) -> str:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = concat(-x2, x1) over the last axis."""
    x1 = g.op("Slice", [x, "zero_1d", "half_1d", "minus1_1d"], f"{out}/x1")
    x2 = g.op("Slice", [x, "half_1d", "head_size_1d", "minus1_1d"], f"{out}/x2")
    rotated = g.op("Concat", [g.op("Neg", [x2], f"{out}/neg_x2"), x1], f"{out}/rotated", axis=-1)
    return g.op(
        "Add",
        [g.op("Mul", [x, "cos"], f"{out}/x_cos"), g.op("Mul", [rotated, "sin"], f"{out}/rot_sin")],
        out,
    )


def _split_heads(g: Graph, x: str, heads: int, out: str) -> str:
    """[batch, seq, heads*head_size] -> [batch, heads, seq, head_size]"""
    shape = g.const(f"{out}/shape", np.array([0, 0, heads, HEAD_SIZE], dtype=np.int64))
    return g.op("Transpose", [g.op("Reshape", [x, shape], f"{out}/split")], out, perm=[0, 2, 1, 3])


def build_decoder(w: dict[str, np.ndarray]) -> onnx.ModelProto:
    g = Graph()
    for name, arr in w.items():
        g.const(name, arr)
    cos, sin = rotary_tables()
    g.const("model.rotary_emb.cos_cached", cos)
    g.const("model.rotary_emb.sin_cached", sin)
    g.const("rms_eps", np.array(RMS_EPS, dtype=np.float32))
    g.const("attn_scale", np.array(1.0 / math.sqrt(HEAD_SIZE), dtype=np.float32))
    # Masked scores are replaced (not offset) by the lowest float: a row with no allowed key (a
    # padding position) becomes uniform instead of NaN, and NaN never reaches the KV cache.
    g.const("masked_score", np.array(np.finfo(np.float32).min, dtype=np.float32))
    g.const("zero", np.array(0, dtype=np.int64))
    g.const("one", np.array(1, dtype=np.int64))
    g.const("zero_1d", np.array([0], dtype=np.int64))
    g.const("half_1d", np.array([HEAD_SIZE // 2], dtype=np.int64))
    g.const("head_size_1d", np.array([HEAD_SIZE], dtype=np.int64))
    g.const("minus1_1d", np.array([-1], dtype=np.int64))
    g.const("axes_0", np.array([0], dtype=np.int64))
    g.const("axes_1", np.array([1], dtype=np.int64))
    g.const("axes_1_2", np.array([1, 2], dtype=np.int64))
    g.const("axes_2", np.array([2], dtype=np.int64))
    g.const("kv_repeat", np.array([1, 1, HEADS // KV_HEADS, 1, 1], dtype=np.int64))
    g.const("all_heads_shape", np.array([0, HEADS, -1, HEAD_SIZE], dtype=np.int64))
    g.const("merge_heads_shape", np.array([0, 0, HEADS * HEAD_SIZE], dtype=np.int64))

    # Positions: rotary cos/sin for each token, [batch, 1, seq, head_size].
    for table in ("cos", "sin"):
        gathered = g.op("Gather", [f"model.rotary_emb.{table}_cached", "position_ids"], f"{table}/gather")
        g.op("Unsqueeze", [gathered, "axes_1"], table)

    # Which keys each query may see, [batch, 1, seq, past+seq]: the causal rule on cache slots
    # (query i is slot past+i) and the attention mask (0 = padding).
    past = g.op("Squeeze", [g.op("Shape", ["past_key_values.0.key"], "past_len_1d", start=2, end=3)], "past_len")
    seq = g.op("Squeeze", [g.op("Shape", ["input_ids"], "seq_len_1d", start=1, end=2)], "seq_len")
    total = g.op("Add", [past, seq], "total_len")
    q_pos = g.op("Unsqueeze", [g.op("Range", [past, total, "one"], "query_positions"), "axes_1"], "query_positions_col")
    k_pos = g.op("Unsqueeze", [g.op("Range", ["zero", total, "one"], "key_positions"), "axes_0"], "key_positions_row")
    causal = g.op("LessOrEqual", [k_pos, q_pos], "causal")
    not_pad = g.op("Unsqueeze", [g.op("Cast", ["attention_mask"], "mask_bool", to=TensorProto.BOOL), "axes_1_2"],
                   "mask_keys")
    allowed = g.op("And", [causal, not_pad], "allowed")

    x = g.op("Gather", ["model.embed_tokens.weight", "input_ids"], "embeddings")
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        h = _rms_norm(g, x, f"{p}.input_layernorm.weight", f"{p}/input_norm")
        q = _split_heads(g, g.op("MatMul", [h, f"{p}.self_attn.q_proj.weight"], f"{p}/q_proj"), HEADS, f"{p}/q")
        k = _split_heads(g, g.op("MatMul", [h, f"{p}.self_attn.k_proj.weight"], f"{p}/k_proj"), KV_HEADS, f"{p}/k")
        v = _split_heads(g, g.op("MatMul", [h, f"{p}.self_attn.v_proj.weight"], f"{p}/v_proj"), KV_HEADS, f"{p}/v")
        q = _rotate(g, q, f"{p}/q_rot")
        k = _rotate(g, k, f"{p}/k_rot")
        # The cache holds keys after rotation, as HF's does: [batch, kv_heads, past+seq, head_size].
        present_k = g.op("Concat", [f"past_key_values.{i}.key", k], f"present.{i}.key", axis=2)
        present_v = g.op("Concat", [f"past_key_values.{i}.value", v], f"present.{i}.value", axis=2)

        def all_heads(kv: str, name: str) -> str:
            # Grouped-query attention: query head h reads key/value head h // (HEADS // KV_HEADS).
            unsq = g.op("Unsqueeze", [kv, "axes_2"], f"{name}/unsqueeze")
            rep = g.op("Expand", [unsq, "kv_repeat"], f"{name}/expand")
            return g.op("Reshape", [rep, "all_heads_shape"], name)

        k_all = all_heads(present_k, f"{p}/k_all_heads")
        v_all = all_heads(present_v, f"{p}/v_all_heads")
        k_t = g.op("Transpose", [k_all], f"{p}/k_t", perm=[0, 1, 3, 2])
        scores = g.op("Mul", [g.op("MatMul", [q, k_t], f"{p}/qk"), "attn_scale"], f"{p}/scores")
        scores = g.op("Where", [allowed, scores, "masked_score"], f"{p}/masked_scores")
        probs = g.op("Softmax", [scores], f"{p}/probs", axis=-1)
        ctx = g.op("Transpose", [g.op("MatMul", [probs, v_all], f"{p}/ctx_heads")], f"{p}/ctx_t", perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", [ctx, "merge_heads_shape"], f"{p}/ctx")
        attn = g.op("MatMul", [ctx, f"{p}.self_attn.o_proj.weight"], f"{p}/o_proj")
        x = g.op("Add", [x, attn], f"{p}/attn_residual")

        h = _rms_norm(g, x, f"{p}.post_attention_layernorm.weight", f"{p}/post_attention_norm")
        gate = g.op("MatMul", [h, f"{p}.mlp.gate_proj.weight"], f"{p}/gate_proj")
        up = g.op("MatMul", [h, f"{p}.mlp.up_proj.weight"], f"{p}/up_proj")
        silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}/gate_sigmoid")], f"{p}/gate_silu")
        down = g.op("MatMul", [g.op("Mul", [silu, up], f"{p}/gated"), f"{p}.mlp.down_proj.weight"], f"{p}/down_proj")
        x = g.op("Add", [x, down], f"{p}/mlp_residual")

    x = _rms_norm(g, x, "model.norm.weight", "final_norm")
    g.op("MatMul", [x, "lm_head.weight"], "logits")

    batch, seq_dim, past_dim = "batch_size", "sequence_length", "past_sequence_length"
    total_dim = "past_sequence_length + sequence_length"
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq_dim]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [batch, total_dim]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, [batch, seq_dim]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, seq_dim, VOCAB])]
    for i in range(LAYERS):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(
                f"past_key_values.{i}.{kind}", TensorProto.FLOAT, [batch, KV_HEADS, past_dim, HEAD_SIZE]))
            outputs.append(helper.make_tensor_value_info(
                f"present.{i}.{kind}", TensorProto.FLOAT, [batch, KV_HEADS, total_dim, HEAD_SIZE]))

    graph = helper.make_graph(g.nodes, "decoder", inputs=inputs, outputs=outputs, initializer=g.inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name=PRODUCER_NAME,
        producer_version=PRODUCER_VERSION,
        doc_string=(
            f"vramguard test decoder in Optimum's decoder-with-past layout: Llama-style, {LAYERS} layers, "
            f"hidden {HIDDEN}, {HEADS} query heads and {KV_HEADS} key/value heads of size {HEAD_SIZE}, "
            f"vocab {VOCAB}, positions < {MAX_POSITIONS}. Weights are random (fixed seed); generated by "
            "models/generate_decoder.py."
        ),
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


# --------------------------------------------------------------------------
# Independent numpy reference (float64, whole sequence, no cache)
# --------------------------------------------------------------------------


def reference_logits(w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Logits [len(ids), VOCAB] for one unpadded sequence at positions 0..len-1."""
    w64 = {k: v.astype(np.float64) for k, v in w.items()}
    n = len(ids)

    def rms(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + RMS_EPS) * weight

    angles = np.arange(n, dtype=np.float64)[:, None] * np.array(inv_freq())[None, :]  # [n, head/2]

    def rope(t: np.ndarray) -> np.ndarray:  # [heads, n, head_size], pairs (j, j + head/2) rotate together
        a, b = t[..., : HEAD_SIZE // 2], t[..., HEAD_SIZE // 2:]
        c, s = np.cos(angles), np.sin(angles)
        return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)

    causal = np.tril(np.ones((n, n), dtype=bool))
    x = w64["model.embed_tokens.weight"][ids]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        h = rms(x, w64[f"{p}.input_layernorm.weight"])
        q = rope((h @ w64[f"{p}.self_attn.q_proj.weight"]).reshape(n, HEADS, HEAD_SIZE).transpose(1, 0, 2))
        k = rope((h @ w64[f"{p}.self_attn.k_proj.weight"]).reshape(n, KV_HEADS, HEAD_SIZE).transpose(1, 0, 2))
        v = (h @ w64[f"{p}.self_attn.v_proj.weight"]).reshape(n, KV_HEADS, HEAD_SIZE).transpose(1, 0, 2)
        group = HEADS // KV_HEADS
        k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
        scores = np.where(causal, q @ k.transpose(0, 2, 1) / math.sqrt(HEAD_SIZE), -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        ctx = (probs @ v).transpose(1, 0, 2).reshape(n, HEADS * HEAD_SIZE)
        x = x + ctx @ w64[f"{p}.self_attn.o_proj.weight"]
        h = rms(x, w64[f"{p}.post_attention_layernorm.weight"])
        gate = h @ w64[f"{p}.mlp.gate_proj.weight"]
        silu = gate / (1.0 + np.exp(-gate))
        x = x + (silu * (h @ w64[f"{p}.mlp.up_proj.weight"])) @ w64[f"{p}.mlp.down_proj.weight"]
    return rms(x, w64["model.norm.weight"]) @ w64["lm_head.weight"]


def greedy_reference(w: dict[str, np.ndarray], prompt_ids: list[int], eos: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy continuation (stops after MAX_NEW_TOKENS or at EOS) and the last-position logits of each step."""
    ids, new, steps = list(prompt_ids), [], []
    for _ in range(MAX_NEW_TOKENS):
        logits = reference_logits(w, ids)[-1]
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] < MIN_GREEDY_MARGIN:
            raise SystemExit(f"greedy step {len(new)} of {prompt_ids[:8]}... is a near tie "
                             f"({top2[1] - top2[0]:.2e}); change the prompt or the seed")
        token = int(np.argmax(logits))
        steps.append(logits)
        new.append(token)
        ids.append(token)
        if token == eos:
            break
    return new, steps


def left_padded_batch(prompts: list[list[int]], pad: int) -> dict[str, np.ndarray]:
    """HF's convention for batched prompts: padding on the left, masked with 0, and positions
    counted over the real tokens only (padding positions get 1, a harmless valid position)."""
    width = max(len(p) for p in prompts)
    input_ids = np.array([[pad] * (width - len(p)) + p for p in prompts], dtype=np.int64)
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=np.int64)
    positions = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 1).astype(np.int64)
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions}


def _f32(values: np.ndarray) -> list[float]:
    # float(np.float32) is the exact float32 value; its repr round-trips.
    return [float(v) for v in np.asarray(values, dtype=np.float32)]


def build_reference(tok: Tokenizer, w: dict[str, np.ndarray]) -> tuple[dict, dict[str, list[np.ndarray]]]:
    """The reference.json document, and each case's per-step float64 logits (for --check)."""
    eos = tok.token_to_id(EOS_TOKEN)
    cases, step_logits = [], {}
    for name, prompt, stop in PROMPTS:
        prompt_ids = tok.encode(prompt).ids
        new, steps = greedy_reference(w, prompt_ids, eos)
        step_logits[name] = steps
        text = tok.decode(new)  # special tokens (a final EOS) are not part of the answer's text
        case = {
            "name": name,
            "prompt": prompt,
            "prompt_ids": prompt_ids,
            "max_new_tokens": MAX_NEW_TOKENS,
            "greedy_ids": new,
            "text": text,
            "finish_reason": "stop" if new[-1] == eos else "length",
            "min_greedy_margin": round(float(min(np.sort(s)[-1] - np.sort(s)[-2] for s in steps)), 4),
        }
        if stop:
            # OpenAI semantics: generation ends once the text contains a stop sequence, and the
            # answer is the text before it.
            for k in range(1, len(new) + 1):
                partial = tok.decode(new[:k])
                hits = [partial.find(s) for s in stop if s in partial]
                if hits:
                    break
            else:
                raise SystemExit(f"case {name}: no stop sequence {stop} in {text!r}")
            case.update({"stop": stop, "stop_after_tokens": k, "stop_text": partial[: min(hits)]})
        cases.append(case)

    first = cases[0]
    logits = step_logits[first["name"]][0]
    top5 = [int(i) for i in np.argsort(-logits, kind="stable")[:5]]
    padded = left_padded_batch([next(c["prompt_ids"] for c in cases if c["name"] == n) for n in BATCH], eos)
    reference = {
        "model": {
            "layers": LAYERS,
            "hidden_size": HIDDEN,
            "attention_heads": HEADS,
            "key_value_heads": KV_HEADS,
            "head_size": HEAD_SIZE,
            "vocab_size": VOCAB,
            "max_positions": MAX_POSITIONS,
            "kv_dtype": "FP32",
            "kv_bytes_per_token": LAYERS * 2 * KV_HEADS * HEAD_SIZE * 4,
            "eos_token_id": eos,
            "pad_token_id": eos,
            "special_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
        },
        "logit_tolerance": LOGIT_TOLERANCE,
        "cases": cases,
        "first_step_top5": {"case": first["name"], "ids": top5, "logits": _f32(logits[top5])},
        "batched": {"cases": BATCH, **{k: v.tolist() for k, v in padded.items()}},
    }
    return reference, step_logits


def model_config(tok: Tokenizer) -> dict:
    """config.json, as transformers' LlamaConfig names these dimensions."""
    eos = tok.token_to_id(EOS_TOKEN)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_SIZE,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": False,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "torch_dtype": "float32",
    }


def _reference_json(reference: dict) -> bytes:
    text = json.dumps(reference, indent=2, ensure_ascii=False, allow_nan=False)
    # Keep lists of numbers and of plain strings (token ids, masks, stop sequences) on one line.
    item = r'(?:-?[0-9.e]+|"[^"\\\[\]]*")'
    one_line = lambda m: "[" + re.sub(r",\n\s+", ", ", m.group(1)) + "]"  # noqa: E731
    text = re.sub(rf"\[\s+({item}(?:,\s+{item})*)\s+\]", one_line, text)
    return (text + "\n").encode("utf-8")


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def generate() -> tuple[dict[Path, bytes], dict, dict[str, list[np.ndarray]]]:
    """Build every artifact in memory: ({path: bytes}, reference document, per-step logits)."""
    tok = train_tokenizer()
    w = decoder_weights(writable_tokens(tok))
    reference, step_logits = build_reference(tok, w)
    files = {
        OUT_DIR / "tokenizer.json": (tok.to_str(pretty=True) + "\n").encode("utf-8"),
        OUT_DIR / "model.onnx": build_decoder(w).SerializeToString(),
        OUT_DIR / "reference.json": _reference_json(reference),
        OUT_DIR / "config.json": (json.dumps(model_config(tok), indent=2) + "\n").encode("utf-8"),
    }
    return files, reference, step_logits


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO_ROOT))


def write(files: dict[Path, bytes]) -> None:
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        print(f"wrote {_rel(path)} ({len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()})")


class OrtDecoder:
    """Drives model.onnx the way a server does: a first pass over the prompt with an empty past,
    then further passes fed with the previous pass's present."""

    def __init__(self, ort, path: Path) -> None:
        self.sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.outputs = [o.name for o in self.sess.get_outputs()]

    def run(self, input_ids, attention_mask, position_ids, past):
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, **past}
        out = dict(zip(self.outputs, self.sess.run(self.outputs, feeds)))
        present = {name.replace("present.", "past_key_values."): t for name, t in out.items() if name != "logits"}
        return out["logits"], present

    @staticmethod
    def empty_past(batch: int) -> dict[str, np.ndarray]:
        return {f"past_key_values.{i}.{kind}": np.zeros((batch, KV_HEADS, 0, HEAD_SIZE), dtype=np.float32)
                for i in range(LAYERS) for kind in ("key", "value")}


def _row(ids: list[int]) -> np.ndarray:
    return np.array([ids], dtype=np.int64)


def ort_greedy(dec: OrtDecoder, prompt: list[int], n: int, mode: str) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and last-position logits from ORT, in one of four ways of using the cache
    ("shifted": "cached" with every position moved up so that the last token generated is at
    MAX_POSITIONS - 1; rotary attention depends only on differences of positions, so the tokens
    are the same, and every row of the rotary tables up to the last is read)."""
    ids, new, logits_per_step = list(prompt), [], []
    past = OrtDecoder.empty_past(1)
    shift = MAX_POSITIONS - len(prompt) - n if mode == "shifted" else 0
    if mode == "shifted":
        logits, past = dec.run(_row(prompt), _row([1] * len(prompt)), _row(list(range(shift, shift + len(prompt)))), past)
    elif mode == "chunked":  # the prompt in two passes: the second has both a past and several tokens
        cut = len(prompt) // 2
        _, past = dec.run(_row(prompt[:cut]), _row([1] * cut), _row(list(range(cut))), past)
        logits, past = dec.run(_row(prompt[cut:]), _row([1] * len(prompt)), _row(list(range(cut, len(prompt)))), past)
    elif mode == "cached":
        logits, past = dec.run(_row(prompt), _row([1] * len(prompt)), _row(list(range(len(prompt)))), past)
    for step in range(n):
        if mode == "full":  # no cache: the whole sequence each time, past always empty
            logits, _ = dec.run(_row(ids), _row([1] * len(ids)), _row(list(range(len(ids)))), OrtDecoder.empty_past(1))
        last = logits[0, -1].astype(np.float64)
        token = int(np.argmax(last))
        logits_per_step.append(last)
        new.append(token)
        ids.append(token)
        if mode != "full" and step + 1 < n:
            logits, past = dec.run(_row([token]), _row([1] * len(ids)), _row([shift + len(ids) - 1]), past)
    return new, logits_per_step


def ort_greedy_batched(dec: OrtDecoder, batched: dict, n: int) -> tuple[list[list[int]], list[list[np.ndarray]]]:
    """Greedy tokens for left-padded prompts run as one batch with the cache."""
    input_ids = np.array(batched["input_ids"], dtype=np.int64)
    mask = np.array(batched["attention_mask"], dtype=np.int64)
    positions = np.array(batched["position_ids"], dtype=np.int64)
    b = input_ids.shape[0]
    logits, past = dec.run(input_ids, mask, positions, OrtDecoder.empty_past(b))
    new: list[list[int]] = [[] for _ in range(b)]
    steps: list[list[np.ndarray]] = [[] for _ in range(b)]
    next_pos = positions[:, -1:] + 1
    for step in range(n):
        last = logits[:, -1].astype(np.float64)
        tokens = np.argmax(last, axis=-1)
        for r in range(b):
            new[r].append(int(tokens[r]))
            steps[r].append(last[r])
        if step + 1 < n:
            mask = np.concatenate([mask, np.ones((b, 1), dtype=np.int64)], axis=1)
            logits, past = dec.run(tokens[:, None].astype(np.int64), mask, next_pos, past)
            next_pos = next_pos + 1
    return new, steps


def check(files: dict[Path, bytes], reference: dict, step_logits: dict[str, list[np.ndarray]],
          ort_path: Path | None) -> int:
    failures = files_up_to_date(files, "models/generate_decoder.py")
    if failures:
        return failures

    ort = import_onnxruntime(ort_path)
    dec = OrtDecoder(ort, OUT_DIR / "model.onnx")
    worst = 0.0

    def compare(label: str, want_ids: list[int], want_logits: list[np.ndarray], got_ids, got_logits) -> int:
        nonlocal worst
        diff = max(float(np.max(np.abs(g - w))) for g, w in zip(got_logits, want_logits))
        worst = max(worst, diff)
        ok = got_ids == want_ids and diff < LOGIT_TOLERANCE
        print(f"{'ok  ' if ok else 'FAIL'} {label}: {len(got_ids)} tokens "
              f"{'match' if got_ids == want_ids else f'{got_ids} != {want_ids}'}, max logit diff {diff:.2e}")
        return 0 if ok else 1

    cases = {c["name"]: c for c in reference["cases"]}
    for name, case in cases.items():
        n = len(case["greedy_ids"])
        for mode in ("full", "cached", "chunked", "shifted"):
            got = ort_greedy(dec, case["prompt_ids"], n, mode)
            failures += compare(f"{name}/{mode}", case["greedy_ids"], step_logits[name], *got)

    batched = reference["batched"]
    got_ids, got_logits = ort_greedy_batched(dec, batched, MAX_NEW_TOKENS)
    for r, name in enumerate(batched["cases"]):
        failures += compare(f"{name}/batched-left-padded", cases[name]["greedy_ids"], step_logits[name],
                            got_ids[r], got_logits[r])

    top5 = reference["first_step_top5"]
    prompt = cases[top5["case"]]["prompt_ids"]
    logits, _ = dec.run(_row(prompt), _row([1] * len(prompt)), _row(list(range(len(prompt)))), OrtDecoder.empty_past(1))
    got = logits[0, -1]
    order_ok = [int(i) for i in np.argsort(-got, kind="stable")[:5]] == top5["ids"]
    top5_diff = float(np.max(np.abs(got[top5["ids"]] - np.array(top5["logits"]))))
    ok = order_ok and top5_diff < LOGIT_TOLERANCE
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} first_step_top5: same 5 ids in order {order_ok}, max logit diff {top5_diff:.2e}")
    print(f"max logit diff (ORT vs numpy reference) over all runs: {worst:.2e} (tolerance {LOGIT_TOLERANCE:g})")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; verify the files on disk are up to date and that ONNX Runtime "
                        "reproduces the reference generations")
    parser.add_argument("--ort-path", type=Path, default=None,
                        help="directory (a `pip install --target` dir) to import onnxruntime from for --check "
                        "(default: .deps/onnxruntime or .deps/ort if present, else the normal sys.path)")
    args = parser.parse_args()

    files, reference, step_logits = generate()
    if not args.check:
        write(files)
        return 0
    failures = check(files, reference, step_logits, args.ort_path)
    print("CHECK PASSED" if failures == 0 else f"CHECK FAILED ({failures} problem(s))")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
