#!/usr/bin/env python3
"""Embedding fixtures for `POST /v1/embeddings`, made with the real tools users run.

Two sentence-transformers folders built from random weights (no hub): a tiny BERT with a
WordPiece tokenizer whose vocabulary is the most frequent words of models/decoder_corpus.txt, then

  bert-mean-normalize/  Transformer -> Pooling(mean) -> Normalize
  bert-cls/             Transformer -> Pooling(cls)

each saved by `SentenceTransformer.save`, its transformer exported by Hugging Face Optimum
(`optimum.exporters.onnx.main_export`, task `feature-extraction`, library `transformers`:
output `last_hidden_state`) into the same folder as `model.onnx`, and `reference.json`: what
`SentenceTransformer.encode` gives for each folder's sentences (the reference the tests compare
the server with).

Run with a venv of requirements-embed.txt (the Optimum venv of models/real, plus
sentence-transformers):
    .deps/fixtures-venv-optimum/bin/python models/embed/make.py
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

FOLDERS = {
    "bert-mean-normalize": {"pooling": "mean", "normalize": True, "seed": 11},
    "bert-cls": {"pooling": "cls", "normalize": False, "seed": 12},
}


def train_tokenizer(out):
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
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=128)
    fast.save_pretrained(out)
    return fast


def build(name, spec, work):
    import torch
    from transformers import BertConfig, BertModel
    from sentence_transformers import SentenceTransformer, models as st
    hf = os.path.join(work, name + "-hf")
    fast = train_tokenizer(hf)
    torch.manual_seed(spec["seed"])
    # Weights drawn wider than BERT's 0.02: with those the layers add little to each token's own
    # embedding, and [CLS] (the same token first in every input) pools to nearly one vector for
    # every sentence, so a cosine against the reference could not tell sentences apart.
    config = BertConfig(vocab_size=len(fast), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, pad_token_id=fast.pad_token_id,
                        initializer_range=0.4)
    BertModel(config).eval().save_pretrained(hf)
    word = st.Transformer(hf, max_seq_length=64)
    pooling = st.Pooling(word.get_word_embedding_dimension(), pooling_mode=spec["pooling"])
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
    # The weights are in model.onnx: the safetensors copy sentence-transformers saved is not needed.
    # Nor is the model card it writes (it names the versions and the date).
    for f in os.listdir(out):
        if f.endswith(".safetensors") or f == "README.md":
            os.remove(os.path.join(out, f))
    emb = model.encode(SENTENCES, convert_to_numpy=True, batch_size=len(SENTENCES))
    alone = [model.encode([s], convert_to_numpy=True)[0] for s in SENTENCES]
    ids = [fast(s)["input_ids"] for s in SENTENCES]
    return {"pooling": spec["pooling"], "normalize": spec["normalize"], "max_seq_length": 64,
            "dimensions": int(emb.shape[1]),
            "cases": [{"input": s, "ids": i, "embedding": [float(x) for x in e], "alone": [float(x) for x in a]}
                      for s, i, e, a in zip(SENTENCES, ids, emb, alone)]}


def main():
    import torch
    torch.set_num_threads(1)
    work = os.path.join(HERE, ".work")
    os.makedirs(work, exist_ok=True)
    ref = {"tool": "sentence-transformers", "models": {}}
    for name, spec in FOLDERS.items():
        ref["models"][name] = build(name, spec, work)
    with open(os.path.join(HERE, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    shutil.rmtree(work)
    sizes = {n: sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(HERE, n)) for f in fs)
             for n in FOLDERS}
    print("sizes (KB):", {k: v // 1024 for k, v in sizes.items()})


if __name__ == "__main__":
    sys.exit(main())
