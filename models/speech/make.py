"""Speech fixtures for vramguard's audio front end (issue 53): short clips of synthetic speech in
every container `/v1/audio/transcriptions` accepts, and the log-mel features `transformers`'
`WhisperFeatureExtractor` computes from each, as a user's pipeline would feed them to Whisper.

    python models/speech/make.py            # writes models/speech/audio/ and reference.json
    python models/speech/make.py .mp4       # only the files whose names end so (and their
                                            # references), the rest of reference.json kept

Needs espeak-ng, sox and ffmpeg (Debian packages) and the venv of models/embed
(requirements-embed.txt: transformers, numpy). Running it twice writes the same bytes.

Each clip is spoken by espeak-ng (22,050 Hz mono), then written as:
- `<clip>-16k.wav`: 16 kHz mono 16-bit PCM, Whisper's own rate (no resampling on our side);
- `<clip>-44k-stereo.flac`: 44.1 kHz, two channels;
- `<clip>.mp3`: MPEG layer III at 24 kHz;
- `<clip>.ogg`: Ogg Vorbis at 48 kHz;
- `<clip>.webm`: Opus in WebM, 48 kHz stereo, as a browser's MediaRecorder records it (what chat
  front ends' voice input sends): written live (the segment's size unknown, no cues), then every
  cluster's size made unknown too, as Chrome's and Firefox's recorders leave them;
- `<clip>.opus`: Ogg Opus, mono;
- `<clip>.m4a`: AAC-LC in MP4 at 44.1 kHz mono, as phones' voice recorders write it (ffmpeg's
  own `aac` encoder: its edit list says the first 1024 frames are the encoder's priming);
- `<clip>.mp4`: AAC-LC at 48 kHz in fragmented MP4 (an empty `moov`, then a `moof` and `mdat`
  a second), as Safari's MediaRecorder writes it.
The reference of a file is what transformers' ASR pipeline does with it: decode and resample to
16 kHz mono with ffmpeg (`ffmpeg_read`), then `WhisperFeatureExtractor` (80 mel bins, 30 s
windows). Only the frames that hold audio are kept (the rest of the 30 s window is padding, one
value), as little-endian float32 in `<file>.mel`, row-major [80, frames].
"""
import base64
import json
import os
import subprocess
import sys

import numpy as np
from transformers import WhisperFeatureExtractor

HERE = os.path.dirname(os.path.abspath(__file__))
AUDIO = os.path.join(HERE, "audio")
CLIPS = {
    "gpu": "The accelerator is shared by chat, embeddings and speech.",
    "memory": "Seven hundred megabytes are free; the request waits for them.",
}


def run(*args):
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def decoded(path):
    """The file as transformers' pipeline reads it: ffmpeg to 16 kHz mono float32."""
    out = subprocess.run(
        ["ffmpeg", "-nostdin", "-i", path, "-ac", "1", "-ar", "16000", "-f", "f32le", "-hide_banner",
         "-loglevel", "quiet", "pipe:1"],
        check=True, stdout=subprocess.PIPE).stdout
    return np.frombuffer(out, dtype="<f4")


def vint(data, at):
    """An EBML variable-length integer at `at`: its value (the length marker masked off) and
    its length in bytes."""
    length = 1
    while not data[at] & (0x80 >> (length - 1)):
        length += 1
    value = data[at] & (0xFF >> length)
    for byte in data[at + 1:at + length]:
        value = (value << 8) | byte
    return value, length


def as_recorded(path):
    """Rewrite a live WebM's clusters with an unknown size (the 8-byte all-ones size), as
    MediaRecorder writes them: it streams each cluster before it knows how long it will be.
    ffmpeg's live mode leaves the segment's size unknown but sizes each cluster."""
    CLUSTER = bytes.fromhex("1f43b675")
    data = open(path, "rb").read()
    out, at = bytearray(), 0
    while True:
        found = data.find(CLUSTER, at)
        if found < 0:
            out += data[at:]
            break
        size, length = vint(data, found + 4)
        body = found + 4 + length
        out += data[at:found] + CLUSTER + bytes.fromhex("01ffffffffffffff")
        out += data[body:body + size]
        at = body + size
    open(path, "wb").write(bytes(out))


def main(only=""):
    os.makedirs(AUDIO, exist_ok=True)
    extractor = WhisperFeatureExtractor(feature_size=80)
    reference = {"feature_extractor": extractor.to_dict(), "files": {}}
    if only:
        with open(os.path.join(HERE, "reference.json")) as f:
            reference["files"] = json.load(f)["files"]
    for clip, text in CLIPS.items():
        spoken = os.path.join(AUDIO, f"{clip}-espeak.wav")
        run("espeak-ng", "-v", "en-us", "-s", "160", "-w", spoken, text)
        files = {
            f"{clip}-16k.wav": ["sox", "-D", "-R", spoken, "-r", "16000", "-b", "16", "-c", "1"],
            f"{clip}-44k-stereo.flac": ["sox", "-D", "-R", spoken, "-r", "44100", "-b", "16", "-c", "2"],
            f"{clip}.mp3": ["ffmpeg", "-nostdin", "-y", "-i", spoken, "-ar", "24000", "-b:a", "48k",
                            "-bitexact", "-map_metadata", "-1"],
            f"{clip}.ogg": ["ffmpeg", "-nostdin", "-y", "-i", spoken, "-ar", "48000", "-c:a", "libvorbis",
                            "-q:a", "3", "-bitexact", "-map_metadata", "-1"],
            f"{clip}.webm": ["ffmpeg", "-nostdin", "-y", "-i", spoken, "-ac", "2", "-ar", "48000", "-c:a",
                             "libopus", "-b:a", "48k", "-bitexact", "-map_metadata", "-1", "-f", "webm",
                             "-live", "1"],
            f"{clip}.opus": ["ffmpeg", "-nostdin", "-y", "-i", spoken, "-ar", "48000", "-c:a", "libopus",
                             "-b:a", "32k", "-bitexact", "-map_metadata", "-1"],
            f"{clip}.m4a": ["ffmpeg", "-nostdin", "-y", "-i", spoken, "-ar", "44100", "-c:a", "aac",
                            "-b:a", "64k", "-bitexact", "-map_metadata", "-1"],
            f"{clip}.mp4": ["ffmpeg", "-nostdin", "-y", "-i", spoken, "-ar", "48000", "-c:a", "aac",
                            "-b:a", "64k", "-bitexact", "-map_metadata", "-1", "-movflags",
                            "+frag_keyframe+empty_moov+default_base_moof", "-frag_duration", "1000000"],
        }
        for name, command in files.items():
            if not name.endswith(only):
                continue
            path = os.path.join(AUDIO, name)
            run(*command, path)
            if name.endswith(".webm"):
                as_recorded(path)
            samples = decoded(path)
            features = extractor(samples, sampling_rate=16000, return_tensors="np").input_features[0]
            frames = len(samples) // extractor.hop_length + 1
            kept = np.ascontiguousarray(features[:, :frames], dtype="<f4")
            kept.tofile(os.path.join(AUDIO, f"{name}.mel"))
            reference["files"][name] = {
                "text": text,
                "samples_16k": int(len(samples)),
                "frames": int(frames),
                "padding_value": float(features[0, -1]),
            }
        os.remove(spoken)
    with open(os.path.join(HERE, "reference.json"), "w") as f:
        json.dump(reference, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
