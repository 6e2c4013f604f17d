#!/usr/bin/env python3
"""Embedding fixtures for `POST /v1/embeddings`, made with the real tools users run.

Sentence-transformers folders built from random weights (no hub): a tiny BERT with a
WordPiece tokenizer whose vocabulary is the most frequent words of models/decoder_corpus.txt,
and a tiny Qwen3 with a byte-level BPE tokenizer whose merges are learnt here from that corpus
(the Qwen3-Embedding layout: <|endoftext|> appended to each input, padding on the left), then

  bert-mean-normalize/  Transformer -> Pooling(mean) -> Normalize
  bert-cls/             Transformer -> Pooling(cls)
  qwen3-lasttoken/      Transformer -> Pooling(lasttoken) -> Normalize

and one saved by sentence-transformers' current release (CURRENT_VERSION, installed beside the
venv's by `make fixtures`; this script runs itself again with it, as `--current OUT`), whose
Pooling config names its mode (`"pooling_mode": "mean"`) where older releases set
`pooling_mode_mean_tokens`, and which keeps `max_seq_length` as the tokenizer's
`model_max_length` only:

  bert-mean-st57/       Transformer -> Pooling(mean) -> Normalize, its reference with a long input
                        cut as that release cuts it

and a cross-encoder for `POST /v1/rerank`: the BERT with one logit (sequence classification),

  bert-cross-encoder/   saved by `CrossEncoder.save`, exported by Optimum's `text-classification`

each saved by `SentenceTransformer.save`, its transformer exported by Hugging Face Optimum
(`optimum.exporters.onnx.main_export`, task `feature-extraction`, library `transformers`:
output `last_hidden_state`) into the same folder as `model.onnx`, and `reference.json`: what
`SentenceTransformer.encode` gives for each folder's sentences (the reference the tests compare
the server with), and for the cross-encoder what `CrossEncoder.predict` and `rank` give for
each query against the sentences (`rerankers`).

Run with a venv of requirements-embed.txt (the Optimum venv of models/real, plus
sentence-transformers), and requirements-embed-current.txt installed with `--no-deps --target
.deps/fixtures-st-current` (or named by ST_CURRENT):
    .deps/fixtures-venv-embed/bin/python models/embed/make.py
It is deterministic: the same versions write the same files (checked twice, byte for byte).
"""
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CORPUS = os.path.join(ROOT, "models", "decoder_corpus.txt")

SENTENCES = [
    "The GPU is shared by a chat model and an embedding model.",
    "An embedding model indexes notes",
    "When the queue is full, the server defers the request.",
    "short",
    "A speech model listens for commands, and now and then an image model draws a picture; each of them keeps its weights in GPU memory.",
]

# `positions` and `max_seq_length`: what the model and sentence-transformers take. The embedded
# default serves bert-mean-normalize as `tiny-embed`: 512 tokens, as BERT's, so that a front
# end's document chunks (Open WebUI's are 1,000 characters, about 250 tokens) embed.
FOLDERS = {
    "bert-mean-normalize": {"arch": "bert", "pooling": "mean", "normalize": True, "seed": 11,
                            "positions": 512, "max_seq_length": 512},
    "bert-cls": {"arch": "bert", "pooling": "cls", "normalize": False, "seed": 12},
    # The Qwen3-Embedding layout: a decoder, its tokenizer appending <|endoftext|> to every
    # input and padding on the left, the last token's state pooled and normalized.
    "qwen3-lasttoken": {"arch": "qwen3", "pooling": "lasttoken", "normalize": True, "seed": 13},
}

# Saved by sentence-transformers' current release (a process of its own: see `current`).
CURRENT_VERSION = "5.7.0"
CURRENT = {
    "bert-mean-st57": {"arch": "bert", "pooling": "mean", "normalize": True, "seed": 15},
}
# An input longer than max_seq_length: what the current release embeds of it is its first tokens.
LONG = "the server defers the request " * 40

# Queries for the cross-encoder, each scored against every sentence above.
QUERIES = [
    "Which model shares the GPU?",
    "what happens when the queue is full",
]

RERANKERS = ["bert-cross-encoder"]


def train_tokenizer(out, positions=128):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, decoders
    # The vocabulary is made here rather than by the WordPiece trainer, whose ties between
    # equally frequent pairs fall differently each run: the special tokens, every character
    # alone and as a continuation, then the corpus's most frequent words (ties by the word).
    import collections
    import re
    with open(CORPUS) as f:
        text = f.read().lower()
    words = collections.Counter(re.findall(r"\w+|[^\w\s]", text))
    chars = sorted(set("".join(words)))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars]
    common = sorted(words.items(), key=lambda kv: (-kv[1], kv[0]))
    vocab += [w for w, _ in common if w not in vocab][: 600 - len(vocab)]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.decoder = decoders.WordPiece()
    from transformers import PreTrainedTokenizerFast
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=positions)
    fast.save_pretrained(out)
    return fast


def train_bpe(out):
    """A byte-level BPE tokenizer in Qwen's layout, its merges learnt here from the corpus (ties
    broken by the pair, so every run learns the same), appending <|endoftext|> to each input as
    Qwen3-Embedding's tokenizer does, and padding on the left as its tokenizer_config says."""
    import collections
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    with open(CORPUS) as f:
        text = f.read()
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = collections.Counter(w for w, _ in pre.pre_tokenize_str(text))
    vocab = sorted(pre_tokenizers.ByteLevel.alphabet())
    splits = {w: list(w) for w in words}
    merges = []
    while len(vocab) < 500:
        pairs = collections.Counter()
        for w, n in words.items():
            for pair in zip(splits[w], splits[w][1:]):
                pairs[pair] += n
        if not pairs:
            break
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merges.append((a, b))
        vocab.append(a + b)
        for w, parts in splits.items():
            merged, i = [], 0
            while i < len(parts):
                if parts[i] == a and i + 1 < len(parts) and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            splits[w] = merged
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    eos = "<|endoftext|>"
    tok.add_special_tokens([eos, "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {eos}:0", pair=f"$A:0 {eos}:0 $B:1 {eos}:1", special_tokens=[(eos, tok.token_to_id(eos))])
    from transformers import PreTrainedTokenizerFast
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos, padding_side="left",
                                   model_max_length=128)
    fast.save_pretrained(out)
    return fast


def transformer(arch, hf, seed, positions):
    """A tiny `arch` model of random weights saved to `hf` with its tokenizer; the tokenizer.

    Weights drawn wider than BERT's 0.02: with those the layers add little to each token's own
    embedding, and [CLS] (the same token first in every input) pools to nearly one vector for
    every sentence, so a cosine against the reference could not tell sentences apart; the
    decoder's last token (<|endoftext|> in every input) would be the same."""
    import torch
    if arch == "bert":
        from transformers import BertConfig as Config, BertModel as Model
        fast = train_tokenizer(hf, positions)
        config = Config(vocab_size=len(fast), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=positions, pad_token_id=fast.pad_token_id,
                        initializer_range=0.4)
    else:
        from transformers import Qwen3Config as Config, Qwen3Model as Model
        fast = train_bpe(hf)
        config = Config(vocab_size=len(fast), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=positions,
                        pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id, initializer_range=0.4,
                        tie_word_embeddings=True)
    torch.manual_seed(seed)
    Model(config).eval().save_pretrained(hf)
    return fast


def build(name, spec, work):
    from sentence_transformers import SentenceTransformer, models as st
    hf = os.path.join(work, name + "-hf")
    fast = transformer(spec["arch"], hf, spec["seed"], spec.get("positions", 128))
    max_seq_length = spec.get("max_seq_length", 64)
    word = st.Transformer(hf, max_seq_length=max_seq_length)
    # `get_embedding_dimension` from 5.7 on.
    dimension = getattr(word, "get_word_embedding_dimension", None) or word.get_embedding_dimension
    pooling = st.Pooling(dimension(), pooling_mode=spec["pooling"])
    modules = [word, pooling] + ([st.Normalize()] if spec["normalize"] else [])
    model = SentenceTransformer(modules=modules, device="cpu")
    out = os.path.join(HERE, name)
    shutil.rmtree(out, ignore_errors=True)
    model.save(out)
    from optimum.exporters.onnx import main_export
    onnx_dir = os.path.join(work, name + "-onnx")
    shutil.rmtree(onnx_dir, ignore_errors=True)
    main_export(hf, onnx_dir, task="feature-extraction", library_name="transformers", do_validation=False)
    shutil.copy(os.path.join(onnx_dir, "model.onnx"), os.path.join(out, "model.onnx"))
    strip(out)
    emb = model.encode(SENTENCES, convert_to_numpy=True, batch_size=len(SENTENCES))
    alone = [model.encode([s], convert_to_numpy=True)[0] for s in SENTENCES]
    ids = [fast(s)["input_ids"] for s in SENTENCES]
    return {"pooling": spec["pooling"], "normalize": spec["normalize"], "max_seq_length": max_seq_length,
            "dimensions": int(emb.shape[1]),
            "cases": [{"input": s, "ids": i, "embedding": [float(x) for x in e], "alone": [float(x) for x in a]}
                      for s, i, e, a in zip(SENTENCES, ids, emb, alone)]}, model, fast


def strip(out):
    """The weights are in model.onnx: the safetensors copy sentence-transformers saved is not
    needed. Nor is the model card it writes (it names the versions and the date)."""
    for f in os.listdir(out):
        if f.endswith(".safetensors") or f == "README.md":
            os.remove(os.path.join(out, f))


def build_cross_encoder(name, work):
    """A tiny BERT with one logit (sequence classification) saved by `CrossEncoder.save`,
    exported by Optimum's `text-classification` (output `logits` [batch, 1]); its reference is
    `CrossEncoder.predict`'s scores with its default activation (Sigmoid for one label, which
    `save` writes into config.json as `sentence_transformers.activation_fn`), for each query
    against every sentence, all at once and each pair alone."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    from sentence_transformers import CrossEncoder
    hf = os.path.join(work, name + "-hf")
    fast = train_tokenizer(hf)
    config = BertConfig(vocab_size=len(fast), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, pad_token_id=fast.pad_token_id,
                        initializer_range=0.4, num_labels=1)
    torch.manual_seed(14)
    model = BertForSequenceClassification(config).eval()
    # The classifier drawn narrower than the layers, so that the logits stay where a sigmoid
    # still tells them apart (with 0.4 they run to tens and every score rounds to 0 or 1).
    torch.nn.init.normal_(model.classifier.weight, std=0.05)
    model.save_pretrained(hf)
    cross = CrossEncoder(hf, device="cpu")
    out = os.path.join(HERE, name)
    shutil.rmtree(out, ignore_errors=True)
    cross.save(out)
    from optimum.exporters.onnx import main_export
    onnx_dir = os.path.join(work, name + "-onnx")
    main_export(hf, onnx_dir, task="text-classification", library_name="transformers", do_validation=False)
    shutil.copy(os.path.join(onnx_dir, "model.onnx"), os.path.join(out, "model.onnx"))
    strip(out)
    cases = []
    for query in QUERIES:
        pairs = [(query, d) for d in SENTENCES]
        scores = cross.predict(pairs, batch_size=len(pairs), convert_to_numpy=True)
        alone = [float(cross.predict([p], convert_to_numpy=True)[0]) for p in pairs]
        ranked = cross.rank(query, SENTENCES)
        cases.append({"query": query, "documents": SENTENCES, "scores": [float(x) for x in scores],
                      "alone": alone, "order": [r["corpus_id"] for r in ranked],
                      "ids": [fast(query, d)["input_ids"] for d in SENTENCES],
                      "token_type_ids": [fast(query, d)["token_type_ids"] for d in SENTENCES]})
    # A pair longer than the model's 128 positions, which `predict` cuts (`longest_first`).
    long = (QUERIES[0], "the server defers the request " * 40)
    truncated = {"query": long[0], "document": long[1], "score": float(cross.predict([long])[0]),
                 "ids": fast(*long, truncation=True)["input_ids"]}
    return {"activation": type(cross.activation_fn).__name__, "cases": cases, "truncated": truncated}


def current(work):
    """The CURRENT folders and their references, made by this script run again with
    sentence-transformers CURRENT_VERSION first on its path (ST_CURRENT, or
    .deps/fixtures-st-current): one process imports one release."""
    import subprocess
    where = os.environ.get("ST_CURRENT", os.path.join(ROOT, ".deps", "fixtures-st-current"))
    out = os.path.join(work, "current.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([where] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    subprocess.run([sys.executable, os.path.abspath(__file__), "--current", out], env=env, check=True)
    with open(out) as f:
        return json.load(f)


def build_current(out):
    """The CURRENT folders under sentence-transformers CURRENT_VERSION, their references to
    `out`: each as `build`'s, with the release's version and what it embeds of LONG."""
    import sentence_transformers
    import torch
    assert sentence_transformers.__version__ == CURRENT_VERSION, sentence_transformers.__version__
    torch.set_num_threads(1)
    work = os.path.join(HERE, ".work-current")
    os.makedirs(work, exist_ok=True)
    refs = {}
    for name, spec in CURRENT.items():
        ref, model, fast = build(name, spec, work)
        ref["sentence_transformers"] = CURRENT_VERSION
        ref["long"] = {"input": LONG, "ids": fast(LONG, truncation=True, max_length=64)["input_ids"],
                       "embedding": [float(x) for x in model.encode([LONG], convert_to_numpy=True)[0]]}
        refs[name] = ref
    shutil.rmtree(work)
    with open(out, "w") as f:
        json.dump(refs, f)


def main():
    if sys.argv[1:2] == ["--current"]:
        return build_current(sys.argv[2])
    import torch
    torch.set_num_threads(1)
    work = os.path.join(HERE, ".work")
    os.makedirs(work, exist_ok=True)
    ref = {"tool": "sentence-transformers", "models": {}, "rerankers": {}}
    for name, spec in FOLDERS.items():
        ref["models"][name] = build(name, spec, work)[0]
    ref["models"].update(current(work))
    for name in RERANKERS:
        ref["rerankers"][name] = build_cross_encoder(name, work)
    with open(os.path.join(HERE, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    shutil.rmtree(work)
    sizes = {n: sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(HERE, n)) for f in fs)
             for n in list(FOLDERS) + list(CURRENT) + RERANKERS}
    print("sizes (KB):", {k: v // 1024 for k, v in sizes.items()})


if __name__ == "__main__":
    sys.exit(main())
