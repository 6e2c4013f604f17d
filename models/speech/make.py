"""Speech fixtures for vramguard's audio front end (issue 53): short clips of synthetic speech in
every container `/v1/audio/transcriptions` accepts, and the log-mel features `transformers`'
`WhisperFeatureExtractor` computes from each, as a user's pipeline would feed them to Whisper.

    python models/speech/make.py            # writes models/speech/audio/ and reference.json

Needs espeak-ng, sox and ffmpeg (Debian packages) and the venv of models/embed
(requirements-embed.txt: transformers, numpy). Running it twice writes the same bytes.

Each clip is spoken by espeak-ng (22,050 Hz mono), then written as:
- `<clip>-16k.wav`: 16 kHz mono 16-bit PCM, Whisper's own rate (no resampling on our side);
- `<clip>-44k-stereo.flac`: 44.1 kHz, two channels;
- `<clip>.mp3`: MPEG layer III at 24 kHz;
- `<clip>.ogg`: Ogg Vorbis at 48 kHz.
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


def main():
    os.makedirs(AUDIO, exist_ok=True)
    extractor = WhisperFeatureExtractor(feature_size=80)
    reference = {"feature_extractor": extractor.to_dict(), "files": {}}
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
        }
        for name, command in files.items():
            path = os.path.join(AUDIO, name)
            run(*command, path)
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
    sys.exit(main())
