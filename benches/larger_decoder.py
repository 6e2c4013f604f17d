"""Write a larger decoder for the generation bench: the fixture's graph, layout and tokenizer
(models/generate_decoder.py) with bigger dimensions, random weights, into OUT_DIR.

    PYTHONPATH=.deps/modelgen python3 benches/larger_decoder.py target/bench/decoder-large

Never committed (about 150 MB) and made once: an OUT_DIR that already holds these dimensions is
left alone. No references are computed: the bench checks the server's tokens against the same
loop in-process, and the fixture's own check covers the graph's math.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))

import generate_decoder as gd  # noqa: E402

# About 37M parameters: 6 Llama-style layers of hidden 768 (12 query heads and 4 key/value heads
# of 64, SwiGLU of 2048). On one core a token takes tens of milliseconds, so a bench run of a few
# seconds still sees several generations.
DIMENSIONS = {"HIDDEN": 768, "LAYERS": 6, "HEADS": 12, "KV_HEADS": 4, "HEAD_SIZE": 64, "INTERMEDIATE": 2048,
              "MAX_POSITIONS": 1024}


def main() -> int:
    out = Path(sys.argv[1])
    stamp = out / "dimensions.json"
    if stamp.exists() and json.loads(stamp.read_text()) == DIMENSIONS and (out / "model.onnx").exists():
        return 0
    for name, value in DIMENSIONS.items():
        setattr(gd, name, value)
    tok = gd.train_tokenizer()
    weights = gd.decoder_weights(gd.writable_tokens(tok))
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    (out / "model.onnx").write_bytes(gd.build_decoder(weights).SerializeToString())
    stamp.write_text(json.dumps(DIMENSIONS))
    print(f"wrote {out}: {sum(w.size for w in weights.values()) / 1e6:.0f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
