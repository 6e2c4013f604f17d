#!/usr/bin/env python3
"""Image-search fixtures for `POST /v1/embeddings`: a tiny CLIP made with the real tools users run.

A `CLIPModel` from seeded random weights (no hub; text and vision towers of width 32, images of
32 pixels in patches of 8, a 16-dimensional shared space) with the WordPiece tokenizer of
make.py, saved into clip/ as the Transformers.js layout has it (one folder, a graph per tower):

  clip/text_model.onnx    CLIPTextModelWithProjection: input_ids -> text_embeds
  clip/vision_model.onnx  CLIPVisionModelWithProjection: pixel_values -> image_embeds
  clip/config.json, tokenizer.json (and its config), preprocessor_config.json (CLIPImageProcessor)

Each tower is exported by Hugging Face Optimum's `export` with Optimum's own ONNX configs for
CLIP's towers, their outputs cut to the projected vector: `CLIPTextWithProjectionOnnxConfig`
(the `clip-text-with-projection` type Optimum registers for diffusers) and
`CLIPVisionModelOnnxConfig` (`clip_vision_model`, whose registered export is the tower without
its projection: Optimum registers no vision tower with projection, so the projection's model,
`CLIPVisionModelWithProjection`, is given to that config here).

clip/images/ holds the test images (PNG, JPEG and a lossless WebP, of other sizes and aspect ratios than the
model's 32x32, drawn here with Pillow), and clip/reference.json what transformers gives:
`CLIPImageProcessor`'s pixel_values for each image, `CLIPModel.get_image_features` and
`get_text_features` (as given, and normalized), and the text-to-image similarity matrix
(`logits_per_text` over `logit_scale`: the cosines). siglip/ is the same for a tiny SigLIP
(`siglip()` below).

Run with the venv of requirements-embed.txt:
    .deps/fixtures-venv-embed/bin/python models/embed/make_clip.py
It is deterministic: the same versions write the same files (checked twice, byte for byte).
"""
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "clip")

TEXTS = [
    "a red square on a white ground",
    "a blue circle",
    "stripes of green and yellow",
    "a dark night with one star",
]

# name, format, size: every one of another size or aspect ratio than the model's 32x32, so the
# processor's resize (shortest edge, bicubic) and center crop both change each.
IMAGES = [
    ("square.png", "PNG", (48, 48)),
    ("wide.png", "PNG", (97, 40)),
    ("tall.jpg", "JPEG", (36, 70)),
    ("small.jpg", "JPEG", (20, 25)),
    ("gray.png", "PNG", (64, 50)),
    ("lossless.webp", "WEBP", (45, 33)),
]


def draw(name, size, seed):
    """A picture with shapes, a gradient and noise: a few KB, unlike any other of the set."""
    import random
    from PIL import Image, ImageDraw
    rng = random.Random(seed)
    w, h = size
    img = Image.new("RGB", size)
    px = img.load()
    for y in range(h):
        for x in range(w):
            px[x, y] = ((x * 255 // w + rng.randrange(40)) % 256, (y * 255 // h) % 256, rng.randrange(256) // 3)
    d = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        box = [x0, y0, x0 + rng.randrange(5, w), y0 + rng.randrange(5, h)]
        colour = tuple(rng.randrange(256) for _ in range(3))
        (d.ellipse if rng.random() < 0.5 else d.rectangle)(box, fill=colour)
    return img.convert("L") if name.startswith("gray") else img


def export_tower(model, onnx_config, path):
    from pathlib import Path
    from optimum.exporters.onnx import export
    export(model, onnx_config, Path(path), opset=17)


def main():
    import numpy as np
    import torch
    from transformers import (CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTextModelWithProjection,
                              CLIPVisionModelWithProjection)
    from optimum.exporters.onnx.model_configs import CLIPTextWithProjectionOnnxConfig, CLIPVisionModelOnnxConfig
    from PIL import Image
    sys.path.insert(0, HERE)
    from make import train_tokenizer

    torch.set_num_threads(1)
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(os.path.join(OUT, "images"))
    work = os.path.join(HERE, ".work-clip")
    shutil.rmtree(work, ignore_errors=True)
    fast = train_tokenizer(work)
    fast.model_max_length = 32
    # CLIP's text tower pools the first end token: [SEP] here (an id other than 2, which would
    # make transformers take the largest id instead, as the first CLIP checkpoints had it).
    sep, pad = fast.sep_token_id, fast.pad_token_id
    torch.manual_seed(21)
    # initializer_factor 8 in each tower: with CLIP's own (1.0) the random layers add little to the patch and
    # token embeddings, and every image (every text) lands on nearly one vector.
    config = CLIPConfig(
        text_config=dict(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=32, eos_token_id=sep, pad_token_id=pad,
                         bos_token_id=fast.cls_token_id, projection_dim=16, initializer_factor=8.0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8, projection_dim=16, initializer_factor=8.0),
        projection_dim=16, initializer_factor=8.0)
    model = CLIPModel(config).eval()
    model.save_pretrained(work)
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor.save_pretrained(OUT)
    fast.save_pretrained(OUT)
    config.save_pretrained(OUT)

    text = CLIPTextModelWithProjection.from_pretrained(work).eval()
    vision = CLIPVisionModelWithProjection.from_pretrained(work).eval()

    class TextConfig(CLIPTextWithProjectionOnnxConfig):
        @property
        def outputs(self):
            return {"text_embeds": {0: "batch_size"}}

    class VisionConfig(CLIPVisionModelOnnxConfig):
        @property
        def outputs(self):
            return {"image_embeds": {0: "batch_size"}}

    export_tower(text, TextConfig(text.config, task="feature-extraction"), os.path.join(OUT, "text_model.onnx"))
    export_tower(vision, VisionConfig(vision.config, task="feature-extraction"), os.path.join(OUT, "vision_model.onnx"))

    images = []
    for i, (name, fmt, size) in enumerate(IMAGES):
        path = os.path.join(OUT, "images", name)
        options = {"JPEG": {"quality": 90}, "PNG": {"optimize": False}, "WEBP": {"lossless": True}}[fmt]
        draw(name, size, 100 + i).save(path, fmt, **options)
        images.append(Image.open(path))
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    ids = [fast(t)["input_ids"] for t in TEXTS]
    longest = max(map(len, ids))
    batch = torch.tensor([i + [pad] * (longest - len(i)) for i in ids])
    with torch.no_grad():
        image_features = model.get_image_features(pixel_values=pixels)
        text_features = model.get_text_features(input_ids=batch, attention_mask=(batch != pad).long())
        alone = [model.get_text_features(input_ids=torch.tensor([i]))[0] for i in ids]
        out = model(input_ids=batch, attention_mask=(batch != pad).long(), pixel_values=pixels)
    unit = lambda t: torch.nn.functional.normalize(t, dim=-1)
    similarity = (out.logits_per_text / model.logit_scale.exp()).tolist()
    rows = lambda t: [[float(x) for x in row] for row in t]
    ref = {
        "tool": "transformers CLIPModel, CLIPImageProcessor",
        "texts": [{"input": t, "ids": i, "features": [float(x) for x in f], "alone": [float(x) for x in a],
                   "embedding": [float(x) for x in u]}
                  for t, i, f, a, u in zip(TEXTS, ids, text_features, alone, unit(text_features))],
        "images": [{"file": name, "features": [float(x) for x in f], "embedding": [float(x) for x in u],
                    "pixel_values": [round(float(x), 6) for x in np.asarray(p).reshape(-1)]}
                   for (name, _, _), f, u, p in zip(IMAGES, image_features, unit(image_features), pixels)],
        "similarity": rows(similarity),
    }
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    shutil.rmtree(work)
    cos = unit(image_features) @ unit(image_features).T
    print("largest cosine between two images:", float((cos - torch.eye(len(IMAGES))).max()))
    cos = unit(text_features) @ unit(text_features).T
    print("largest cosine between two texts:", float((cos - torch.eye(len(TEXTS))).max()))
    print("size (KB):", sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(OUT) for f in fs) // 1024)
    siglip(images)


def siglip(images):
    """siglip/: a tiny SigLIP, its towers exported as CLIP's are (their features are the towers'
    `pooler_output`, the pooling head included), its texts padded to its 32 positions as
    SigLIP's processor is told to (`padding="max_length"`), its images resized to 32 x 32 with
    Pillow's bilinear and not cropped (`SiglipImageProcessor`); the reference is on the same
    images as clip/'s."""
    import numpy as np
    import torch
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel, SiglipTextModel, SiglipVisionModel
    from optimum.exporters.onnx.model_configs import SiglipTextWithProjectionOnnxConfig, SiglipVisionModelOnnxConfig
    from make import train_tokenizer

    out = os.path.join(HERE, "siglip")
    shutil.rmtree(out, ignore_errors=True)
    work = os.path.join(HERE, ".work-siglip")
    shutil.rmtree(work, ignore_errors=True)
    fast = train_tokenizer(work)
    fast.model_max_length = 32
    torch.manual_seed(31)
    config = SiglipConfig(
        text_config=dict(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=32, pad_token_id=fast.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8))
    model = SiglipModel(config).eval()
    # SigLIP's own initialization is narrow, as CLIP's: widened so different inputs differ.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.4)
    model.save_pretrained(work)
    processor = SiglipImageProcessor(size={"height": 32, "width": 32}, resample=2, do_convert_rgb=True)
    processor.save_pretrained(out)
    fast.save_pretrained(out)
    config.save_pretrained(out)
    text = SiglipTextModel.from_pretrained(work).eval()
    vision = SiglipVisionModel.from_pretrained(work).eval()

    class TextConfig(SiglipTextWithProjectionOnnxConfig):
        @property
        def outputs(self):
            return {"pooler_output": {0: "batch_size"}}

    class VisionConfig(SiglipVisionModelOnnxConfig):
        @property
        def outputs(self):
            return {"pooler_output": {0: "batch_size"}}

    export_tower(text, TextConfig(text.config, task="feature-extraction"), os.path.join(out, "text_model.onnx"))
    export_tower(vision, VisionConfig(vision.config, task="feature-extraction"), os.path.join(out, "vision_model.onnx"))
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    batch = fast(TEXTS, padding="max_length", max_length=32, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        image_features = model.get_image_features(pixel_values=pixels)
        text_features = model.get_text_features(input_ids=batch)
    unit = lambda t: torch.nn.functional.normalize(t, dim=-1)
    ref = {
        "tool": "transformers SiglipModel, SiglipImageProcessor",
        "texts": [{"input": t, "ids": [int(x) for x in i if x != fast.pad_token_id], "embedding": [float(x) for x in u]}
                  for t, i, u in zip(TEXTS, batch, unit(text_features))],
        "images": [{"file": name, "embedding": [float(x) for x in u],
                    "pixel_values": [round(float(x), 6) for x in np.asarray(p).reshape(-1)]}
                   for (name, _, _), u, p in zip(IMAGES, unit(image_features), pixels)],
        "similarity": [[float(x) for x in row] for row in unit(text_features) @ unit(image_features).T],
    }
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    shutil.rmtree(work)
    cos = unit(image_features) @ unit(image_features).T
    print("siglip: largest cosine between two images:", float((cos - torch.eye(len(IMAGES))).max()))
    cos = unit(text_features) @ unit(text_features).T
    print("siglip: largest cosine between two texts:", float((cos - torch.eye(len(TEXTS))).max()))
    print("siglip: size (KB):", sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(out) for f in fs) // 1024)


if __name__ == "__main__":
    sys.exit(main())
