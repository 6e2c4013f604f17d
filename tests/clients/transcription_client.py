#!/usr/bin/env python3
"""`POST /v1/audio/transcriptions` and `/v1/audio/translations` through OpenAI's own Python client
(the `openai` package), unchanged.

    transcription_client.py BINARY           # starts `BINARY serve` with the tiny Whisper
    transcription_client.py --url URL        # a server already running (model: --model, or
                                             # $VRAMGUARD_SPEECH_MODEL, default `whisper`)
    transcription_client.py --offline        # only the parsers, against the references

Every answer is compared with what `transformers`' `WhisperForConditionalGeneration.generate`
transcribed from the same file (models/speech/whisper/reference.json, made by make.py there):
- `audio.transcriptions.create(file=clip, language="en")` for each short clip: the text of the
  `transcribe` case (greedy, no timestamps), as `json` (the client's default) and `text`;
- `srt`, `vtt` and `verbose_json`: the `timestamps` case's segments (start and end within 0.01 s,
  the same text), the subtitles parsed by `srt` and `webvtt-py` as a player's library would
  (subtitles hold only the segments with text: an SRT cue cannot be empty);
- the 75-second clip (WAV and MP3): its long-form reference (30 s windows, seeking by the last
  timestamp), text and segments;
- the 75-second clip streamed (`stream=True`): the SDK's delta events add up to its done event,
  the long-form reference's text;
- four different clips at once: each its own text;
- `models.list` and `models.retrieve` name the speech model;
- `audio.translations.create`: the `translate_detect` case (language detected, then translated);
- a corrupt WAV and a `.txt` upload: the client's `BadRequestError` (400) naming `file`.
Texts are compared without their leading and trailing spaces (a transcript starts with the
space of its first token; OpenAI's responses trim it).

Run by `make client-compat` (which installs openai, srt and webvtt-py into .deps/pyclients);
prints 'N passed, N failed' and exits non-zero on any failure.
"""
import concurrent.futures
import io
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, ".deps", "pyclients"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import srt  # noqa: E402
import webvtt  # noqa: E402
from serving import Checks, report, serve_config  # noqa: E402

WHISPER = os.path.join(ROOT, "models", "speech", "whisper")
MODELS = os.path.join(ROOT, "models")
REFERENCE = json.load(open(os.path.join(WHISPER, "reference.json")))
SECONDS = 0.01

CONFIG = """
server: {admin_socket: 'off'}
models:
  - {name: whisper, path: %(whisper)s}
pools:
  - {name: cpu, provider: cpu, models: [whisper]}
"""


def path_of(name):
    """The file a reference entry names, under models/."""
    entry = REFERENCE["short"].get(name)
    if entry:
        return os.path.join(MODELS, entry["path"])
    return os.path.join(WHISPER, "audio", name)


def same_text(got, want, what):
    assert got.strip() == want.strip(), (what, got, want)


def same_segments(got, want, what):
    """`got`: (start, end, text) triples, as a response gives them, against the reference's."""
    assert len(got) == len(want), (what, len(got), len(want))
    for i, ((start, end, text), w) in enumerate(zip(got, want)):
        assert abs(start - w["start"]) <= SECONDS and abs(end - w["end"]) <= SECONDS, (what, i, start, end, w)
        same_text(text, w["text"], (what, i))


def cues(segments):
    """The segments a subtitle file holds: those with text (an SRT cue cannot be empty, since a
    blank line ends it; `srt.compose` drops such cues, and the server's srt and vtt do too)."""
    return [s for s in segments if s["text"].strip()]


def srt_segments(body):
    """An SRT file's cues as (start, end, text), parsed by the `srt` package."""
    return [(c.start.total_seconds(), c.end.total_seconds(), c.content) for c in srt.parse(body)]


def vtt_segments(body):
    """A WebVTT file's cues as (start, end, text), parsed by `webvtt-py`."""
    return [(seconds(c.start), seconds(c.end), c.text) for c in webvtt.from_buffer(io.StringIO(body))]


def seconds(stamp):
    """'HH:MM:SS.mmm' (WebVTT) in seconds."""
    hours, minutes, rest = stamp.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(rest)


def verbose_segments(response):
    return [(s.start, s.end, s.text) for s in response.segments]


def offline():
    """The parsers and comparisons, fed subtitles written from the references by the same
    libraries (`srt.compose`, `webvtt`'s writer): each reference must pass against itself and
    fail against another clip's."""
    import datetime
    checks = Checks()

    def compose_srt(segments):
        return srt.compose([srt.Subtitle(i + 1, datetime.timedelta(seconds=s["start"]),
                                         datetime.timedelta(seconds=s["end"]), s["text"].strip())
                            for i, s in enumerate(segments)])

    def compose_vtt(segments):
        def stamp(t):
            return "%02d:%02d:%06.3f" % (t // 3600, t % 3600 // 60, t % 60)
        return "WEBVTT\n\n" + "".join(f"{stamp(s['start'])} --> {stamp(s['end'])}\n{s['text'].strip()}\n\n"
                                       for s in segments)

    cases = [(n, e["cases"]["timestamps"]["segments"]) for n, e in REFERENCE["short"].items()]
    cases += [(n, e["segments"]) for n, e in REFERENCE["long"].items()]
    for name, segments in cases:
        @checks.check(f"{name}: srt and vtt written from the reference parse back to it")
        def _(name=name, segments=segments):
            same_segments(srt_segments(compose_srt(segments)), cues(segments), (name, "srt"))
            same_segments(vtt_segments(compose_vtt(cues(segments))), cues(segments), (name, "vtt"))

    @checks.check("another clip's subtitles do not pass")
    def _():
        first, second = cases[0][1], cases[3][1]
        try:
            same_segments(srt_segments(compose_srt(second)), cues(first), "swapped")
        except AssertionError:
            return
        raise AssertionError("two clips' segments compare equal")

    return report(checks, "offline")


def run(address, model):
    import openai
    client = openai.OpenAI(base_url=f"{address}/v1", api_key="unused", max_retries=0, timeout=300)
    checks = Checks()
    check = checks.check

    def transcribe(name, **kw):
        with open(path_of(name), "rb") as f:
            return client.audio.transcriptions.create(model=model, file=f, **kw)

    for name, entry in REFERENCE["short"].items():
        cases = entry["cases"]

        @check(f"{name}: json and text equal transformers' transcription")
        def _(name=name, cases=cases):
            same_text(transcribe(name, language="en").text, cases["transcribe"]["text"], name)
            same_text(transcribe(name, language="en", response_format="text"), cases["transcribe"]["text"], name)

        @check(f"{name}: srt, vtt and verbose_json segments equal transformers' (timestamps)")
        def _(name=name, cases=cases):
            want = cases["timestamps"]["segments"]
            same_segments(srt_segments(transcribe(name, language="en", response_format="srt")), cues(want), "srt")
            same_segments(vtt_segments(transcribe(name, language="en", response_format="vtt")), cues(want), "vtt")
            verbose = transcribe(name, language="en", response_format="verbose_json",
                                 timestamp_granularities=["segment"])
            same_segments(verbose_segments(verbose), want, "verbose_json")
            same_text(verbose.text, cases["timestamps"]["text"], "verbose_json text")

    for name, entry in REFERENCE["long"].items():
        @check(f"{name}: 75 s in long-form windows, as transformers seeks them")
        def _(name=name, entry=entry):
            verbose = transcribe(name, language="en", response_format="verbose_json",
                                 timestamp_granularities=["segment"])
            same_segments(verbose_segments(verbose), entry["segments"], name)
            same_text(verbose.text, entry["text"], name)
            same_text(transcribe(name, language="en").text, entry["text"], name)

        @check(f"{name}: streamed, the SDK's deltas add up to its done event, the same text")
        def _(name=name, entry=entry):
            with open(path_of(name), "rb") as f:
                events = list(client.audio.transcriptions.create(model=model, file=f, language="en", stream=True))
            kinds = [e.type for e in events]
            assert kinds[-1] == "transcript.text.done", kinds
            assert set(kinds[:-1]) == {"transcript.text.delta"}, kinds
            deltas = "".join(e.delta for e in events[:-1])
            assert deltas == events[-1].text, (deltas, events[-1].text)
            same_text(events[-1].text, entry["text"], name)

    @check("models.list and models.retrieve name the speech model")
    def _():
        assert model in [m.id for m in client.models.list()], model
        assert client.models.retrieve(model).id == model

    @check("four different clips at once: each its own transcription")
    def _():
        names = REFERENCE["concurrent"]
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            texts = list(pool.map(lambda n: transcribe(n, language="en").text, names))
        for name, text in zip(names, texts):
            same_text(text, REFERENCE["short"][name]["cases"]["transcribe"]["text"], name)

    @check("translations: the detected language, translated")
    def _():
        for name in REFERENCE["concurrent"]:
            with open(path_of(name), "rb") as f:
                got = client.audio.translations.create(model=model, file=f)
            same_text(got.text, REFERENCE["short"][name]["cases"]["translate_detect"]["text"], name)

    def refused(name, data, words):
        try:
            client.audio.transcriptions.create(model=model, file=(name, data))
        except openai.BadRequestError as err:
            body = err.body if isinstance(err.body, dict) else {}
            message = str(body.get("message", err)).lower()
            assert body.get("param") == "file", body
            assert any(w in message for w in words), message
            return
        raise AssertionError(f"{name} was transcribed")

    @check("a corrupt WAV: 400 naming file, saying it cannot be decoded")
    def _():
        # Cut inside its `fmt ` chunk. (A whole header followed by any bytes is a valid WAV:
        # PCM samples are whatever the bytes say, and ffmpeg decodes them as noise too.)
        with open(path_of("gpu-16k.wav"), "rb") as f:
            head = f.read(30)
        refused("broken.wav", head, ["decode", "corrupt", "invalid"])

    @check("a .txt upload: 400 naming file, saying the format is not supported")
    def _():
        refused("notes.txt", b"The accelerator is shared.\n", ["format", "supported", "audio"])

    return report(checks)


def main():
    args = sys.argv[1:]
    if args == ["--offline"]:
        return offline()
    model = os.environ.get("VRAMGUARD_SPEECH_MODEL", "whisper")
    if "--model" in args:
        model = args[args.index("--model") + 1]
    if "--url" in args:
        return run(args[args.index("--url") + 1].rstrip("/"), model)
    if len(args) != 1:
        print(__doc__)
        return 2
    return serve_config(args[0], CONFIG % {"whisper": os.path.join(WHISPER, "encoder_model.onnx")}, lambda address: run(f"http://{address}", model))


if __name__ == "__main__":
    sys.exit(main())
