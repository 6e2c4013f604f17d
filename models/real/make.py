#!/usr/bin/env python3
"""Real-exporter fixtures: tiny random-weight LLMs of five architectures, exported with the two
tools users run, and the outputs vramguard's tests compare with (`make fixtures`).

Each architecture (Llama with grouped-query attention, Qwen2, Gemma, Phi-3, Mistral) is built by
`transformers` from a config (no hub): hidden 64, 2 layers, 4 query heads over 2 key-value heads,
random weights scaled so that greedy choices are far from ties. They share one byte-level BPE
tokenizer trained here on models/decoder_corpus.txt, holding the special tokens every family's
chat template needs. Each model is exported twice:

  <arch>-optimum   Hugging Face Optimum, `text-generation-with-past` (model.onnx, config.json,
                   generation_config.json, tokenizer files, as `optimum-cli export onnx` writes)
  <arch>-genai     ONNX Runtime GenAI's model builder, fp32, CPU (model.onnx + model.onnx.data,
                   genai_config.json: GroupQueryAttention, the builder's own layout)

plus `llama-optimum-extdata` (the Llama Optimum export re-saved with its weights in
`model.onnx_data`, as Optimum writes models over 2 GB) and `qwen2-genai-int4` (the builder's
`-p int4`: MatMulNBits). Each folder's tokenizer_config.json carries its family's real chat
template (models/real/templates/, see models/README.md).

models/real/reference.json holds, for every folder, the greedy continuations of PROMPTS by
`transformers`' own `generate` on the same weights (MAX_NEW tokens each; EOS is never among
them: `generate` is kept from it, and the ONNX checks below, which are not, would then differ),
the smallest top-2 logit margin along them, whether `transformers`' batched rows (left-padded,
as it pads) equal each prompt alone, and the chat templates' renders by `apply_chat_template`
with their token ids. The script checks, and fails loudly otherwise: ONNX Runtime (Python)
greedy on each Optimum export gives `transformers`' tokens, and GenAI's own generator gives them
on each fp32 GenAI build. The int4 build's reference is GenAI's generator (quantized weights
cannot give `transformers`' logits). models/real/logprobs.json holds the log-probabilities of the
first prompt's first greedy steps, plain and penalized (stage `logprobs`, which rebuilds the
models from their seeds and can run alone).

The two exporters cannot share one environment (optimum-onnx 0.1.0 needs transformers < 4.58,
onnxruntime-genai 0.18's builder needs transformers 5.x), so this file runs as an orchestrator
under any Python 3 and runs its stages with each environment's interpreter:

  FIXTURE_PYTHON_OPTIMUM  python with models/real/requirements-optimum.txt (default
                          .deps/fixtures-venv-optimum/bin/python, which `make fixtures` creates)
  FIXTURE_PYTHON_GENAI    python with models/real/requirements-genai.txt (default
                          .deps/fixtures-venv-genai/bin/python)

Run from the repository root: `python3 models/real/make.py` (scratch files go to
target/fixtures-work/). FIXTURE_FAMILIES=gemma2,gemma3 rebuilds those families' folders only,
keeping the others' files and references as they are. Torch's CPU kernels are deterministic here, but the exporters' bytes may
change with their versions: the references are recomputed with the files, never kept apart.
"""

import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "models", "real")
WORK = os.path.join(ROOT, "target", "fixtures-work")
CORPUS = os.path.join(ROOT, "models", "decoder_corpus.txt")

VOCAB = 600
MAX_NEW = 24
# Smallest top-2 logit gap allowed along any reference generation: float32 ONNX graphs differ
# from PyTorch by about 1e-5, so a gap this wide cannot flip a greedy choice.
MIN_MARGIN = 0.05
PROMPTS = [
    "The GPU",
    "A chat model answers questions, an embedding model indexes notes, and",
    "When the queue is full, the server",
    "Each of them keeps its weights in memory",
    "A home server runs a chat model, an embedding model and a speech model on one GPU. When a "
    "long prompt arrives, the server estimates the memory it will need before it",
]
SPECIAL = [
    "<|endoftext|>", "<s>", "</s>", "<pad>", "<unk>",
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
    "<|im_start|>", "<|im_end|>",
    "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
    "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
]
# <tool_call> and </tool_call> are added tokens but not special: Qwen's tokenizer keeps them in
# decoded text, where tool calls are read back from.
ADDED = ["<tool_call>", "</tool_call>"]

# Per family: the template file (models/real/templates/), the special tokens of its
# tokenizer_config.json, the seed of its weights (the first to give no loop on any prompt), the scale of its logits (chosen so MIN_MARGIN holds) and, for Gemma,
# the gain of each layer's output projections: Gemma multiplies its input embeddings by
# sqrt(hidden) and ties them to the LM head, so with small layer outputs the residual stream is
# the input token's own embedding and the model repeats one token.
FAMILIES = {
    "llama": {"template": "meta-llama-Llama-3.1-8B-Instruct.jinja", "bos": "<|begin_of_text|>",
              "eos": "<|eot_id|>", "pad": "<pad>", "seed": 3, "logit_scale": 24.0},
    "qwen2": {"template": "Qwen-Qwen2.5-7B-Instruct.jinja", "bos": None, "eos": "<|im_end|>",
              "pad": "<|endoftext|>", "seed": 5, "logit_scale": 256.0},
    "gemma": {"template": "google-gemma-2-2b-it.jinja", "bos": "<bos>", "eos": "<eos>",
              "pad": "<pad>", "seed": 2, "logit_scale": 160.0, "layer_gain": 32.0},
    "phi3": {"template": "microsoft-Phi-3.5-mini-instruct.jinja", "bos": "<s>",
             "eos": "<|endoftext|>", "pad": "<|endoftext|>", "seed": 6, "logit_scale": 48.0},
    "mistral": {"template": "mistralai-Mistral-Nemo-Instruct-2407.jinja", "bos": "<s>",
                "eos": "</s>", "pad": "<pad>", "seed": 2, "logit_scale": 16.0},
    # Sliding-window attention (SLIDING_WINDOW positions on their local layers, fewer than
    # every prompt and its MAX_NEW tokens, so the window moves in every reference). Gemma 3's
    # template is Gemma 2's (the hub's differs in how it folds a system turn, which no chat here
    # sends).
    "gemma2": {"template": "google-gemma-2-2b-it.jinja", "bos": "<bos>", "eos": "<eos>",
               "pad": "<pad>", "seed": 2, "logit_scale": 160.0, "layer_gain": 16.0},
    # No GenAI build: onnxruntime-genai 0.18's builder fails on any Gemma 3 under the
    # transformers 5.x it needs, whose config nests `rope_parameters` by layer type
    # (`KeyError: 'rope_type'` in builders/base.py's make_rope_init).
    "gemma3": {"template": "google-gemma-2-2b-it.jinja", "bos": "<bos>", "eos": "<eos>",
               "pad": "<pad>", "seed": 2, "logit_scale": 160.0, "layer_gain": 16.0,
               "genai": False},
}
# The window of the sliding families' local layers: Gemma 2 alternates local and global layers
# (layer 0 local), Gemma 3 is given the same pattern for its two layers.
SLIDING_WINDOW = 8
# The families rebuilt: FIXTURE_FAMILIES (comma-separated), else all.
BUILT = [f for f in os.environ.get("FIXTURE_FAMILIES", ",".join(FAMILIES)).split(",") if f]
for _family in BUILT:
    if _family not in FAMILIES:
        sys.exit(f"make.py: FIXTURE_FAMILIES names `{_family}`, not one of {', '.join(FAMILIES)}")
EXTDATA = "llama-optimum-extdata"
INT4 = "qwen2-genai-int4"

TOOLS = [{"type": "function", "function": {
    "name": "get_free_memory",
    "description": "How much memory a device has free.",
    "parameters": {"type": "object",
                   "properties": {"device": {"type": "string", "description": "The device's name."}},
                   "required": ["device"]}}}]
# Conversations as an OpenAI client sends them (a tool call's arguments as a JSON string).
CHATS = {
    "system_user": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "How much memory does the cache need?"}],
    "multi_turn": [
        {"role": "user", "content": "Which model runs on the GPU?"},
        {"role": "assistant", "content": "The chat model does."},
        {"role": "user", "content": " And the speech model? "}],
    "tools": [
        {"role": "system", "content": "You watch the devices."},
        {"role": "user", "content": "Is there room on gpu0?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call0abcd", "type": "function",
            "function": {"name": "get_free_memory", "arguments": "{\"device\": \"gpu0\"}"}}]},
        {"role": "tool", "tool_call_id": "call0abcd", "content": "{\"free\": \"3GiB\"}"}],
}
# Which conversations each family's template takes (Gemma refuses a system turn, Phi-3.5's
# template knows no tools).
CHATS_OF = {
    "llama": ["system_user", "multi_turn", "tools"],
    "qwen2": ["system_user", "multi_turn", "tools"],
    "gemma": ["multi_turn"],
    "gemma2": ["multi_turn"],
    "gemma3": ["multi_turn"],
    "phi3": ["system_user", "multi_turn"],
    "mistral": ["system_user", "multi_turn", "tools"],
}


def fail(message):
    sys.exit(f"make.py: {message}")


def dump(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=1, ensure_ascii=False)
        f.write("\n")


def load(path):
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------- stage `hf` (Optimum's env)

def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers import AddedToken

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(ADDED), special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with open(CORPUS) as f:
        tok.train_from_iterator(f.read().splitlines(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok


def tokenizer_for(family, tok):
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    with open(os.path.join(HERE, "templates", spec["template"])) as f:
        template = f.read()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec["bos"],
                                   eos_token=spec["eos"], pad_token=spec["pad"],
                                   unk_token=None, padding_side="left",
                                   model_input_names=["input_ids", "attention_mask"])
    fast.chat_template = template
    return fast


def build_model(family, fast):
    import torch
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                              Gemma3TextConfig, GemmaConfig, GemmaForCausalLM, LlamaConfig,
                              LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config,
                              Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    spec = FAMILIES[family]
    ids = {"bos_token_id": fast.convert_tokens_to_ids(spec["bos"] or "<|endoftext|>"),
           "eos_token_id": fast.convert_tokens_to_ids(spec["eos"]),
           "pad_token_id": fast.convert_tokens_to_ids(spec["pad"])}
    common = dict(vocab_size=len(fast), hidden_size=64, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, initializer_range=0.1, **ids)
    config, model = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "gemma": (GemmaConfig, GemmaForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "gemma2": (Gemma2Config, Gemma2ForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    }[family]
    sliding = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": SLIDING_WINDOW,
               "layer_types": ["sliding_attention", "full_attention"]}
    extra = {"gemma": {"head_dim": 16}, "phi3": {"original_max_position_embeddings": 256},
             "mistral": {"sliding_window": None}, "qwen2": {"tie_word_embeddings": False},
             # Gemma 2's final soft-capping (30 · tanh(logit / 30)) would squeeze the logits
             # of these random weights within MIN_MARGIN of ties; its attention's is kept.
             "gemma2": {**sliding, "final_logit_softcapping": None},
             "gemma3": {**sliding, "rope_local_base_freq": 10000.0}}
    torch.manual_seed(spec["seed"])
    m = model(config(**common, **extra.get(family, {}))).eval()
    # The logits are scaled through the final norm's gain, not the LM head, which Gemma ties to
    # the input embeddings. Gemma's norm multiplies by (1 + weight).
    with torch.no_grad():
        norm = m.model.norm.weight
        offset = 1.0 if family.startswith("gemma") else 0.0
        norm.copy_((norm + offset) * spec["logit_scale"] - offset)
        for layer in m.model.layers:
            # Gemma 2 and 3 normalize each branch's output before the residual: its gain is
            # that norm's.
            if hasattr(layer, "post_feedforward_layernorm"):
                for post in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                    post.weight.copy_((post.weight + 1.0) * spec.get("layer_gain", 1.0) - 1.0)
                continue
            layer.self_attn.o_proj.weight.mul_(spec.get("layer_gain", 1.0))
            layer.mlp.down_proj.weight.mul_(spec.get("layer_gain", 1.0))
    return m


def greedy(m, ids):
    """`transformers`' greedy continuation of `ids` and the smallest top-2 gap along it."""
    import torch

    out = m.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                     max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                     output_scores=True, return_dict_in_generate=True)
    new = out.sequences[0, len(ids):].tolist()
    # min_new_tokens masks EOS to -inf; the gap is over the tokens that could be chosen.
    margin = min(float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores)
    return new, margin


def batched(m, fast, prompts):
    enc = fast(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = m.generate(**enc, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
    return [row[enc.input_ids.shape[1]:].tolist() for row in out]


def template_messages(messages):
    """What vramguard gives templates: a tool call's arguments as an object."""
    shaped = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"],
                                                  "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        shaped.append(m)
    return shaped


def ort_greedy(folder, ids, layout):
    """ONNX Runtime (Python) greedy on an Optimum export, one prompt alone."""
    import numpy as np
    import onnxruntime as ort

    s = ort.InferenceSession(os.path.join(folder, "model.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in s.get_inputs()]
    outs = [o.name for o in s.get_outputs()]
    feeds = {f"past_key_values.{l}.{k}": np.zeros((1, layout["kv_heads"], 0, layout["head_size"]),
                                                  np.float32)
             for l in range(layout["layers"]) for k in ("key", "value")}
    seq, new = list(ids), []
    step = list(ids)
    while len(new) < MAX_NEW:
        feeds["input_ids"] = np.array([step], np.int64)
        feeds["attention_mask"] = np.ones((1, len(seq)), np.int64)
        if "position_ids" in names:
            feeds["position_ids"] = np.arange(len(seq) - len(step), len(seq), dtype=np.int64)[None]
        r = dict(zip(outs, s.run(None, feeds)))
        t = int(r["logits"][0, -1].argmax())
        new.append(t)
        seq.append(t)
        step = [t]
        for o, v in r.items():
            if o.startswith("present"):
                feeds[o.replace("present", "past_key_values")] = v
    return new


def export_optimum(hf, out):
    from optimum.exporters.onnx import main_export

    shutil.rmtree(out, ignore_errors=True)
    main_export(hf, out, task="text-generation-with-past", device="cpu", no_post_process=False)


def resave_external(src, out):
    import onnx

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    m = onnx.load(os.path.join(src, "model.onnx"))
    onnx.save_model(m, os.path.join(out, "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx_data", size_threshold=0)


def stage_hf():
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tok = train_tokenizer()
    refs = {}
    for family in BUILT:
        fast = tokenizer_for(family, tok)
        m = build_model(family, fast)
        hf = os.path.join(WORK, "hf", family)
        shutil.rmtree(hf, ignore_errors=True)
        m.save_pretrained(hf)
        fast.save_pretrained(hf)
        cases, margins = [], []
        for p in PROMPTS:
            ids = fast(p, add_special_tokens=False).input_ids
            new, margin = greedy(m, ids)
            if len(set(new)) < MAX_NEW // 4:
                fail(f"{family}: `{p}` loops over {len(set(new))} tokens: {new}")
            cases.append({"prompt": p, "prompt_ids": ids, "ids": new,
                          "text": fast.decode(new, skip_special_tokens=True)})
            margins.append(margin)
        rows = batched(m, fast, PROMPTS)
        config = m.config
        layout = {"layers": config.num_hidden_layers, "kv_heads": config.num_key_value_heads,
                  "head_size": config.hidden_size // config.num_attention_heads}
        chats = {}
        for name in CHATS_OF[family]:
            messages = CHATS[name]
            tools = TOOLS if name == "tools" else None
            text = fast.apply_chat_template(template_messages(messages), tools=tools,
                                            add_generation_prompt=True, tokenize=False)
            chats[name] = {"messages": messages, "tools": tools, "text": text,
                           "ids": fast(text, add_special_tokens=False).input_ids}
        refs[family] = {"cases": cases, "min_margin": min(margins),
                        "batched_equals_alone": [r == c["ids"] for r, c in zip(rows, cases)],
                        "chats": chats, "layout": layout,
                        "eos_token_id": config.eos_token_id}
        print(f"{family}: smallest top-2 margin {min(margins):.4f}; transformers batched == alone: "
              f"{refs[family]['batched_equals_alone']}")
        if min(margins) < MIN_MARGIN:
            fail(f"{family}: a greedy choice is {min(margins):.4f} from a tie (< {MIN_MARGIN})")
        out = os.path.join(HERE, f"{family}-optimum")
        export_optimum(hf, out)
        for c in cases:
            got = ort_greedy(out, c["prompt_ids"], layout)
            if got != c["ids"]:
                fail(f"{family}-optimum: ONNX Runtime gives {got} for `{c['prompt']}`, "
                     f"transformers {c['ids']}")
        print(f"{family}-optimum: ONNX Runtime greedy == transformers ({len(cases)} prompts)")
    if "llama" in BUILT:
        resave_external(os.path.join(HERE, "llama-optimum"), os.path.join(HERE, EXTDATA))
        for c in refs["llama"]["cases"]:
            if ort_greedy(os.path.join(HERE, EXTDATA), c["prompt_ids"], refs["llama"]["layout"]) != c["ids"]:
                fail(f"{EXTDATA}: ONNX Runtime's greedy differs from transformers'")
    dump(os.path.join(WORK, "hf.json"), refs)


# ------------------------------------------------------- stage `logprobs` (Optimum's env)

# What logprobs.json holds: per family, the first prompt's first LOGPROB_STEPS greedy steps with
# the TOP_LOGPROBS most likely tokens' log-probabilities at each, plain and under PENALIZED
# (OpenAI's `logit_bias`, `frequency_penalty`, `presence_penalty` and `repetition_penalty`).
LOGPROB_STEPS = 8
TOP_LOGPROBS = 5
PENALIZED = {"repetition_penalty": 1.5, "frequency_penalty": 0.75, "presence_penalty": 0.5,
             "logit_bias": {"first": 1.0, "second": -4.0}}


def penalized_steps(m, prompt_ids, plain_ids, vocab):
    """Greedy steps under PENALIZED, the logits processed as vramguard documents: `logit_bias`
    by `transformers`' SequenceBiasLogitsProcessor (single-token sequences: added every step),
    then its RepetitionPenaltyLogitsProcessor over prompt and generated tokens, then OpenAI's
    frequency and presence penalties over the generated tokens only. The bias raises the plain
    run's first token and lowers its second, so that it bears on what is picked; PENALIZED's
    values keep every choice at least MIN_MARGIN from a tie on every family."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    bias = {str(plain_ids[0]): PENALIZED["logit_bias"]["first"],
            str(plain_ids[1]): PENALIZED["logit_bias"]["second"]}
    processors = [
        SequenceBiasLogitsProcessor(sequence_bias=[[[int(t)], b] for t, b in bias.items()]),
        RepetitionPenaltyLogitsProcessor(penalty=PENALIZED["repetition_penalty"]),
    ]

    def openai_penalties(generated, scores):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=vocab).float()
        return (scores - counts * PENALIZED["frequency_penalty"]
                - (counts > 0).float() * PENALIZED["presence_penalty"])

    ids = list(prompt_ids)
    steps = greedy_steps(m, ids, lambda seq, scores: openai_penalties(
        seq[len(prompt_ids):], _chain(processors, seq, scores)))
    params = {k: v for k, v in PENALIZED.items() if k != "logit_bias"}
    return {**steps, "params": {**params, "logit_bias": bias}}


def _chain(processors, seq, scores):
    """`scores` (one row) through `transformers`' logits `processors` after the ids `seq`."""
    import torch

    scores = scores[None]
    for p in processors:
        scores = p(torch.tensor([seq]), scores)
    return scores[0]


def greedy_steps(m, prompt_ids, process):
    """LOGPROB_STEPS greedy steps of `m` on `prompt_ids`, each step's logits of the whole
    sequence's last position passed through `process(sequence, logits)`: the ids picked, and at
    each step the log-softmax's TOP_LOGPROBS (id, logprob) and the picked token's logprob."""
    import torch

    seq, ids, top, picked, margins = list(prompt_ids), [], [], [], []
    with torch.no_grad():
        for _ in range(LOGPROB_STEPS):
            logits = m(torch.tensor([seq])).logits[0, -1].double()
            scores = process(seq, logits)
            logprobs = torch.log_softmax(scores, dim=-1)
            values, order = logprobs.topk(TOP_LOGPROBS)
            margins.append(float(values[0] - values[1]))
            t = int(order[0])
            ids.append(t)
            picked.append(float(logprobs[t]))
            top.append([[int(i), float(v)] for i, v in zip(order, values)])
            seq.append(t)
    return {"ids": ids, "logprobs": picked, "top": top, "min_margin": min(margins)}


def stage_logprobs():
    """models/real/logprobs.json from the models rebuilt from their seeds as stage `hf` builds
    them (their greedy ids checked against reference.json's): the reference the logprobs and
    penalties of every folder with `transformers`' weights (Optimum's and GenAI's fp32 builds,
    which the builder makes from the same saved weights) are compared with."""
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    reference = load(os.path.join(HERE, "reference.json"))["models"]
    tok = train_tokenizer()
    out = {"steps": LOGPROB_STEPS, "top_logprobs": TOP_LOGPROBS, "families": {}}
    path = os.path.join(HERE, "logprobs.json")
    if os.path.exists(path):
        out["families"] = {f: v for f, v in load(path)["families"].items() if f not in BUILT}
    for family in BUILT:
        fast = tokenizer_for(family, tok)
        m = build_model(family, fast)
        case = reference[f"{family}-optimum"]["cases"][0]
        plain = greedy_steps(m, case["prompt_ids"], lambda seq, logits: logits)
        if plain["ids"] != case["ids"][:LOGPROB_STEPS]:
            fail(f"{family}: the rebuilt model's greedy ids {plain['ids']} are not reference.json's "
                 f"{case['ids'][:LOGPROB_STEPS]}")
        penalized = penalized_steps(m, case["prompt_ids"], plain["ids"], len(fast))
        if penalized["min_margin"] < MIN_MARGIN:
            fail(f"{family}: a penalized greedy choice is {penalized['min_margin']:.4f} from a tie")
        if penalized["ids"] == plain["ids"]:
            fail(f"{family}: the penalties change nothing: {plain['ids']}")
        out["families"][family] = {"prompt": case["prompt"], "prompt_ids": case["prompt_ids"],
                                   "plain": plain, "penalized": penalized}
        print(f"{family}: plain {plain['ids']}, penalized {penalized['ids']} "
              f"(margin {penalized['min_margin']:.3f})")
    out["families"] = dict(sorted(out["families"].items(), key=lambda kv: list(FAMILIES).index(kv[0])))
    dump(path, out)


# --------------------------------------------------------- stage `genai` (the builder's env)

def build_genai(hf, out, precision):
    shutil.rmtree(out, ignore_errors=True)
    cache = os.path.join(WORK, "cache")
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf, "-o", out,
                    "-p", precision, "-e", "cpu", "-c", cache], check=True)


def genai_greedy(folder, ids):
    """GenAI's own generator, greedy, one prompt alone: the new tokens and the smallest gap."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(folder)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + MAX_NEW, min_length=0)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([ids], np.int32))
    new, margins = [], []
    while len(new) < MAX_NEW and not gen.is_done():
        logits = np.array(gen.get_logits())[0, -1]
        top = np.sort(logits)[-2:]
        margins.append(float(top[1] - top[0]))
        gen.generate_next_token()
        new.append(int(gen.get_next_tokens()[0]))
    return new, min(margins)


def stage_genai():
    refs = load(os.path.join(WORK, "hf.json"))
    out = {}
    for family in (f for f in BUILT if FAMILIES[f].get("genai", True)):
        hf = os.path.join(WORK, "hf", family)
        folder = os.path.join(HERE, f"{family}-genai")
        build_genai(hf, folder, "fp32")
        for c in refs[family]["cases"]:
            got, _ = genai_greedy(folder, c["prompt_ids"])
            if got != c["ids"]:
                fail(f"{family}-genai: GenAI's generator gives {got} for `{c['prompt']}`, "
                     f"transformers {c['ids']}")
        print(f"{family}-genai: GenAI's generator == transformers ({len(refs[family]['cases'])} prompts)")
    family = INT4.split("-")[0]
    if family not in BUILT:
        dump(os.path.join(WORK, "genai.json"), out)
        return
    folder = os.path.join(HERE, INT4)
    build_genai(os.path.join(WORK, "hf", family), folder, "int4")
    cases, margins = [], []
    for c in refs[family]["cases"]:
        got, margin = genai_greedy(folder, c["prompt_ids"])
        cases.append({"prompt": c["prompt"], "prompt_ids": c["prompt_ids"], "ids": got})
        margins.append(margin)
    print(f"{INT4}: smallest top-2 margin {min(margins):.4f}")
    if min(margins) < MIN_MARGIN:
        fail(f"{INT4}: a greedy choice is {min(margins):.4f} from a tie (< {MIN_MARGIN})")
    out[INT4] = {"cases": cases, "min_margin": min(margins)}
    dump(os.path.join(WORK, "genai.json"), out)


# ------------------------------------------------------------------------ stage `finish`

def stage_finish():
    """Texts of the int4 tokens, the tokenizer files users would have, and reference.json."""
    from transformers import AutoTokenizer

    hf, genai = load(os.path.join(WORK, "hf.json")), load(os.path.join(WORK, "genai.json"))
    folders = sorted(d for d in os.listdir(HERE) if os.path.isfile(os.path.join(HERE, d, "model.onnx")))
    kept = load(os.path.join(HERE, "reference.json"))["models"] if os.path.exists(os.path.join(HERE, "reference.json")) else {}
    models = {}
    for folder in folders:
        if folder.split("-")[0] not in BUILT:
            models[folder] = kept[folder]
            continue
        family = folder.split("-")[0]
        fast = AutoTokenizer.from_pretrained(os.path.join(WORK, "hf", family))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(os.path.join(WORK, "hf", family, name), os.path.join(HERE, folder, name))
        # transformers >= 4.43 may write the template beside the config instead: the hub's
        # files of these families keep it inside tokenizer_config.json, as vramguard reads it.
        for name in ("chat_template.jinja", "chat_template.json"):
            path = os.path.join(HERE, folder, name)
            if os.path.exists(path):
                os.remove(path)
        config = load(os.path.join(HERE, folder, "tokenizer_config.json"))
        if "chat_template" not in config:
            with open(os.path.join(HERE, "templates", FAMILIES[family]["template"])) as f:
                config["chat_template"] = f.read()
            dump(os.path.join(HERE, folder, "tokenizer_config.json"), config)
        ref = dict(hf[family])
        if folder in genai:
            ref = {**ref, **genai[folder], "reference": "onnxruntime_genai"}
            ref["batched_equals_alone"] = None
            for c in ref["cases"]:
                c["text"] = fast.decode(c["ids"], skip_special_tokens=True)
        else:
            ref["reference"] = "transformers"
        ref.pop("layout")
        models[folder] = ref
    dump(os.path.join(HERE, "reference.json"), {"max_new_tokens": MAX_NEW, "models": models})
    sizes = {f: sum(os.path.getsize(os.path.join(HERE, f, x)) for x in os.listdir(os.path.join(HERE, f)))
             for f in folders}
    print("sizes (KB):", {f: s // 1024 for f, s in sizes.items()}, "total", sum(sizes.values()) // 1024)


def interpreter(variable, venv):
    path = os.environ.get(variable) or os.path.join(ROOT, ".deps", venv, "bin", "python")
    if not os.path.exists(path):
        fail(f"{path} does not exist: set {variable}, or run `make fixtures`, which creates it")
    return path


def main():
    if len(sys.argv) > 1:
        {"hf": stage_hf, "genai": stage_genai, "finish": stage_finish,
         "logprobs": stage_logprobs}[sys.argv[1]]()
        return
    optimum = interpreter("FIXTURE_PYTHON_OPTIMUM", "fixtures-venv-optimum")
    genai = interpreter("FIXTURE_PYTHON_GENAI", "fixtures-venv-genai")
    os.makedirs(WORK, exist_ok=True)
    for python, stage in ((optimum, "hf"), (genai, "genai"), (optimum, "finish"),
                          (optimum, "logprobs")):
        print(f"== {stage} ({python})", flush=True)
        subprocess.run([python, os.path.abspath(__file__), stage], check=True, cwd=ROOT)


if __name__ == "__main__":
    main()
