#!/usr/bin/env python3
"""A tiny Whisper for `/v1/audio/transcriptions` (issue 53), made with the real tools users run.

    .deps/fixtures-venv-embed/bin/python models/speech/whisper/make.py   # after models/speech/make.py

Writes, beside this script, the folder a server is given (what `optimum-cli export onnx --task
automatic-speech-recognition-with-past` writes for a Whisper from the hub, without the weights'
safetensors copy):

  encoder_model.onnx, decoder_model.onnx, decoder_with_past_model.onnx, decoder_model_merged.onnx
  config.json, generation_config.json, preprocessor_config.json
  tokenizer.json, tokenizer_config.json, vocab.json, merges.txt, added_tokens.json,
  special_tokens_map.json

and the audio only this model needs (audio/: a 75-second clip and two more short ones), and
`reference.json`: what `WhisperForConditionalGeneration.generate` (torch, greedy) transcribes from
each clip, and what Optimum's `ORTModelForSpeechSeq2Seq.generate` gives on the exported files.

The model: `WhisperConfig` with tiny dimensions (d_model 48, 2 + 2 layers of 4 heads) but real
windows (80 mel bins, 1500 source positions: a [batch, 80, 3000] input) and 448 target positions,
random weights from a fixed seed. Drawn at Whisper's own 0.02 the decoder would ignore the audio
(every clip would transcribe the same, and a server that ignored the audio would pass), never
write <|endoftext|> (its row is the padding row, zero) and write timestamp tokens where it should
not, so `widen` draws the encoder's and the cross-attention's weights wider and gives the output
rows biases that end a transcription within about a hundred tokens and place timestamps
deterministically (its docstring says how). The references check that every clip transcribes
differently, that the task token matters, and record the smallest top-1/top-2 logit gap.

The tokenizer is Whisper's layout built here (no hub): a byte-level BPE whose first 256 tokens are
the bytes in GPT-2's order (so " " is 220, as in Whisper, and the symbols Whisper suppresses keep
their ids), merges learnt from models/decoder_corpus.txt (ties broken by the pair, so every run
learns the same), `<|endoftext|>` last in vocab.json, then Whisper's special tokens in Whisper's
order and the 1501 timestamps `<|0.00|>` ... `<|30.00|>`, saved by `WhisperTokenizerFast`.

Deterministic: running it twice writes the same bytes (`sha256sum` over the folder; it re-runs
itself with PYTHONHASHSEED=0, since Optimum's decoder merge names weights in hash order).
"""
import collections
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SPEECH = os.path.dirname(HERE)
ROOT = os.path.dirname(os.path.dirname(SPEECH))
CORPUS = os.path.join(ROOT, "models", "decoder_corpus.txt")

# Byte-level tokens then merges: 256 + MERGES, then <|endoftext|>.
MERGES = 255
SEED = 57
# Whisper's own init_std is 0.02; these are the weights drawn otherwise (see `widen`).
ENCODER_STD = 0.2  # every encoder matrix: the audio's features must survive to the decoder
CROSS_STD = 0.5  # cross-attention queries and keys: each step attends to a few frames, not all
CROSS_VALUE_STD = 0.2  # cross-attention values and output
DECODER_STD = 0.3  # self-attention and MLPs: the prompt (task, language) changes what follows
POSITION_STD = 0.3  # decoder positions: each step reads the audio somewhere else
TOKEN_STD = 0.1  # token embeddings (tied to the output projection)
LOGIT_GAIN = 5.0  # the final norm's weight: logits a few units apart
POSITION_RAMP = 1.0  # added per position to the decoder positions' channel 1 (see `widen`)
EOT_BIAS = 6.0  # <|endoftext|>'s bias
EOT_STD = 0.08  # and its row
TIMESTAMP_BIAS = 4.0  # a timestamp's bias at TIMESTAMP_PEAK, falling by TIMESTAMP_SLOPE a step
TIMESTAMP_PEAK = 1000  # <|20.00|>
TIMESTAMP_SLOPE = 0.05
CONTROL_BIAS = -20.0  # tokens holding a control character (newline, tab...): never written
WEIGHTS = ["SEED", "ENCODER_STD", "CROSS_STD", "CROSS_VALUE_STD", "DECODER_STD", "POSITION_STD", "TOKEN_STD",
           "LOGIT_GAIN", "POSITION_RAMP", "EOT_BIAS", "EOT_STD", "TIMESTAMP_BIAS", "TIMESTAMP_PEAK",
           "TIMESTAMP_SLOPE", "CONTROL_BIAS"]


def byte_chars():
    """GPT-2's byte-to-unicode table (byte value -> character) and its order: the printable bytes
    first ('!' is 0, so '"' is 1 and '#' is 2, as in Whisper's suppress list), then the others,
    mapped past 255 (' ' becomes 'Ġ', 220)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + n) for n, b in enumerate(others)})
    return table, printable + others


def bytes_in_gpt2_order():
    table, order = byte_chars()
    return [table[b] for b in order]


def byte_values(token):
    """The bytes a byte-level token stands for."""
    inverse = {c: b for b, c in byte_chars()[0].items()}
    return [inverse[c] for c in token]


def learn_bpe():
    """vocab (token -> id) and merges, learnt from the corpus with GPT-2's pre-tokenizer."""
    from tokenizers import pre_tokenizers
    with open(CORPUS) as f:
        text = f.read()
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = collections.Counter(w for w, _ in pre.pre_tokenize_str(text))
    vocab = bytes_in_gpt2_order()
    splits = {w: list(w) for w in words}
    merges = []
    while len(merges) < MERGES:
        pairs = collections.Counter()
        for w, n in words.items():
            for pair in zip(splits[w], splits[w][1:]):
                pairs[pair] += n
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
    vocab.append("<|endoftext|>")
    return {t: i for i, t in enumerate(vocab)}, merges


def languages():
    """The 99 languages of Whisper's multilingual tokenizers before large-v3 (which appended
    <|yue|>, the 100th of transformers' list)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES
    return list(LANGUAGES)[:99]


def special_tokens():
    """Whisper's special tokens after <|endoftext|>, in Whisper's order."""
    return (["<|startoftranscript|>"] + [f"<|{code}|>" for code in languages()]
            + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
               "<|notimestamps|>"])


def tokenizer(work):
    """Whisper's tokenizer as `transformers`' conversion script makes one from OpenAI's files:
    the slow tokenizer from vocab.json and merges.txt, the special tokens added as
    additional_special_tokens, the timestamps as plain added tokens; then the fast one."""
    from transformers import AddedToken, WhisperTokenizer, WhisperTokenizerFast
    vocab, merges = learn_bpe()
    slow_dir = os.path.join(work, "slow")
    os.makedirs(slow_dir, exist_ok=True)
    with open(os.path.join(slow_dir, "vocab.json"), "w") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(slow_dir, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    slow = WhisperTokenizer(os.path.join(slow_dir, "vocab.json"), os.path.join(slow_dir, "merges.txt"),
                            model_max_length=448)
    slow.add_special_tokens({"additional_special_tokens": special_tokens()})
    slow.add_tokens([AddedToken("<|%.2f|>" % (i * 0.02), lstrip=False, rstrip=False) for i in range(1501)])
    slow.save_pretrained(slow_dir)
    fast = WhisperTokenizerFast.from_pretrained(slow_dir)
    return fast


def suppress_tokens(fast):
    """What OpenAI's `Tokenizer.non_speech_tokens` suppresses (symbols a speaker does not say, alone
    or after a space, and the first token of each musical sign), then, as the hub's Whisper
    generation configs list them, <|startoftranscript|>, <|startoflm|>, <|startofprev|> and
    <|nospeech|>."""
    symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
    symbols += "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
    miscellaneous = set("♩♪♫♬♭♮♯")
    enc = lambda s: fast.encode(s, add_special_tokens=False)
    ids = fast.convert_tokens_to_ids
    # " -", " '" and " " before a musical sign's first byte are one token each in Whisper's
    # vocabulary; here they are one only if the merges learnt them, and " " alone (220) is never
    # suppressed: that would suppress every space.
    space = ids("Ġ")
    result = {enc(s)[0] for s in (" -", " '") if len(enc(s)) == 1}
    for symbol in symbols + sorted(miscellaneous):
        for tokens in [enc(symbol), enc(" " + symbol)]:
            if len(tokens) == 1 or symbol in miscellaneous and tokens[0] != space:
                result.add(tokens[0])
    result |= {ids("<|startoftranscript|>"), ids("<|startoflm|>"), ids("<|startofprev|>"), ids("<|nospeech|>")}
    return sorted(result)


def generation_config(fast):
    from transformers import GenerationConfig
    ids = fast.convert_tokens_to_ids
    eot = ids("<|endoftext|>")
    return GenerationConfig(
        # Two of the eight heads, as a hub Whisper lists the cross-attention heads that align
        # with words ([layer, head]).
        alignment_heads=[[1, 0], [1, 2]],
        begin_suppress_tokens=[ids("Ġ"), eot],
        bos_token_id=eot,
        decoder_start_token_id=ids("<|startoftranscript|>"),
        eos_token_id=eot,
        forced_decoder_ids=[[1, None], [2, ids("<|transcribe|>")], [3, ids("<|notimestamps|>")]],
        is_multilingual=True,
        lang_to_id={f"<|{code}|>": ids(f"<|{code}|>") for code in languages()},
        max_initial_timestamp_index=50,
        max_length=448,
        no_timestamps_token_id=ids("<|notimestamps|>"),
        pad_token_id=eot,
        prev_sot_token_id=ids("<|startofprev|>"),
        return_timestamps=False,
        suppress_tokens=suppress_tokens(fast),
        task_to_id={"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")},
    )


def widen(model, fast, eot_bias=EOT_BIAS):
    """Redraw the weights so that the transcription depends on the audio and behaves as a
    trained Whisper's does in the ways the server relies on (the module's docstring says why):

    - the encoder and the cross-attention wider than init_std (queries and keys widest, so each
      step attends to a few frames), the decoder's positions wide (each step reads elsewhere),
      its self-attention and MLPs wide (the task and language tokens change what follows);
    - the final norm's channel 0 a constant 1 (weight 0, bias 1), so that every output row's
      entry 0 is that token's bias, and channel 0 of every token embedding 0;
    - a ramp on channel 1 of the decoder positions (and that channel 0 in the tokens and in the
      final norm's output): as it grows it takes over the norm, the text logits shrink, and the
      bias of <|endoftext|> wins, so that a transcription ends within tens of tokens;
    - timestamps: rows that are only their bias, highest at <|20.00|> and falling 0.05 a step
      either side. One timestamp is never the best token (below <|endoftext|>'s bias), so without
      timestamps none is written; all of them together outweigh the text once it shrinks, so
      with timestamps the rules force them, the first at <|1.00|> (the highest allowed by
      max_initial_timestamp_index) and then <|20.00|>, each the best by 0.05; as timestamps
      cannot go back, each later one is the next, 0.02 s on: a window's last pair falls a little
      after 20 s (20.14-20.34 s here), so long-form decoding seeks about 20 s a window, windows
      overlapping about 10 s;
    - tokens holding a control character (newline, tab...) a bias far below, as Whisper never
      writes them (and a subtitle file would not survive a newline). The special tokens keep
      their drawn rows: this model writes a language token inside a transcript now and then,
      which decoding with skip_special_tokens drops, as a server must.

    The encoder's sinusoidal positions are left as they are: they are not drawn."""
    import torch
    ids = fast.convert_tokens_to_ids
    eot, first_timestamp = ids("<|endoftext|>"), ids("<|0.00|>")
    with torch.no_grad():
        for name, p in model.model.encoder.named_parameters():
            if name.endswith("weight") and p.dim() > 1 and "embed_positions" not in name:
                p.normal_(0.0, ENCODER_STD)
        decoder = model.model.decoder
        for layer in decoder.layers:
            attn = layer.encoder_attn
            for proj in (attn.q_proj, attn.k_proj):
                proj.weight.normal_(0.0, CROSS_STD)
            for proj in (attn.v_proj, attn.out_proj):
                proj.weight.normal_(0.0, CROSS_VALUE_STD)
            for p in list(layer.self_attn.parameters()) + list(layer.fc1.parameters()) + list(layer.fc2.parameters()):
                if p.dim() > 1:
                    p.normal_(0.0, DECODER_STD)
        positions = decoder.embed_positions.weight
        positions.normal_(0.0, POSITION_STD)
        positions[:, 1] = POSITION_RAMP * torch.arange(positions.shape[0], dtype=positions.dtype)
        rows = decoder.embed_tokens.weight
        rows.normal_(0.0, TOKEN_STD)
        rows[first_timestamp:] = 0.0
        rows[eot].normal_(0.0, EOT_STD)
        rows[:, :2] = 0.0
        decoder.layer_norm.weight.fill_(LOGIT_GAIN)
        decoder.layer_norm.weight[:2] = 0.0
        decoder.layer_norm.bias.zero_()
        decoder.layer_norm.bias[0] = 1.0
        rows[eot, 0] = eot_bias
        times = torch.arange(rows.shape[0] - first_timestamp, dtype=rows.dtype)
        rows[first_timestamp:, 0] = TIMESTAMP_BIAS - TIMESTAMP_SLOPE * (times - TIMESTAMP_PEAK).abs()
        for token, i in fast.get_vocab().items():
            if i < eot and any(b < 32 or b == 127 for b in byte_values(token)):
                rows[i, 0] = CONTROL_BIAS


# The fixture's dimensions; benches/speech.py builds the same model at whisper-tiny's.
DIMS = {"d_model": 48, "encoder_layers": 2, "encoder_attention_heads": 4, "decoder_layers": 2,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 96, "decoder_ffn_dim": 96}


def build(work, dims=None, eot_bias=EOT_BIAS):
    """The tiny Whisper (DIMS, or `dims`; <|endoftext|>'s bias `eot_bias`) saved in transformers'
    layout under work/hf; the model and its tokenizer."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration
    hf = os.path.join(work, "hf")
    fast = tokenizer(work)
    ids = fast.convert_tokens_to_ids
    eot = ids("<|endoftext|>")
    gen = generation_config(fast)
    config = WhisperConfig(
        vocab_size=len(fast), num_mel_bins=80, **(dims or DIMS), max_source_positions=1500,
        max_target_positions=448, pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
        decoder_start_token_id=ids("<|startoftranscript|>"),
        suppress_tokens=gen.suppress_tokens, begin_suppress_tokens=gen.begin_suppress_tokens,
        forced_decoder_ids=None, use_cache=True)
    torch.manual_seed(SEED)
    model = WhisperForConditionalGeneration(config).eval()
    widen(model, fast, eot_bias)
    model.generation_config = gen
    model.save_pretrained(hf)
    fast.save_pretrained(hf)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(hf)
    return hf, model, fast


def export(hf, work, out=HERE):
    """Optimum's export, as `optimum-cli export onnx --task automatic-speech-recognition-with-past`
    runs it, into `out`; the transformers files beside it are the ones from `hf`."""
    from optimum.exporters.onnx import main_export
    onnx_dir = os.path.join(work, "onnx")
    shutil.rmtree(onnx_dir, ignore_errors=True)
    main_export(hf, onnx_dir, task="automatic-speech-recognition-with-past", library_name="transformers",
                do_validation=False)
    os.makedirs(out, exist_ok=True)
    for name in sorted(os.listdir(out)):
        if name.endswith(".onnx") or name.endswith(".json") and name != "reference.json" or name == "merges.txt":
            os.remove(os.path.join(out, name))
    for name in sorted(os.listdir(onnx_dir)):
        if not name.endswith(".safetensors") and name != "README.md":
            shutil.copy(os.path.join(onnx_dir, name), os.path.join(out, name))


def versions():
    import onnxruntime
    import optimum.version
    import tokenizers
    import transformers
    import torch
    return {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
            "tokenizers": tokenizers.__version__, "optimum": optimum.version.__version__,
            "onnxruntime": onnxruntime.__version__}


def main():
    # Optimum's merge of the two decoders names shared weights in an order that follows Python's
    # string hashing: with a random hash seed, decoder_model_merged.onnx differs run to run.
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, "PYTHONHASHSEED": "0"})
    import torch
    torch.set_num_threads(1)
    # Outside the folder: Optimum's loader would find the intermediate ONNX files in it.
    work = tempfile.mkdtemp(prefix="whisper-fixture-")
    hf, model, fast = build(work)
    export(hf, work)
    if "--model-only" not in sys.argv:
        import references
        reference = references.write(HERE, model, fast)
        reference["tools"] = versions()
        reference["weights"] = {k: globals()[k] for k in WEIGHTS}
        with open(os.path.join(HERE, "reference.json"), "w") as f:
            json.dump(reference, f, indent=1)
            f.write("\n")
        references.check(reference)
    shutil.rmtree(work)
    sizes = {n: os.path.getsize(os.path.join(HERE, n)) // 1024 for n in sorted(os.listdir(HERE))
             if n.endswith(".onnx")}
    print("sizes (KB):", sizes)


if __name__ == "__main__":
    sys.exit(main())
