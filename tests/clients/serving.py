"""Start `vramguard serve` for the client compatibility checks and wait until it serves; the
checks' registry and their report, shared by every client script."""
import atexit
import json
import math
import os
import shutil
import subprocess
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cache_home():
    """The cache folder (XDG_CACHE_HOME) of the servers this check starts: a temporary one,
    removed when the check exits, so what they optimize never lands in the user's cache."""
    global _CACHE_HOME
    if _CACHE_HOME is None:
        _CACHE_HOME = tempfile.mkdtemp(prefix="vramguard-client-cache-")
        atexit.register(shutil.rmtree, _CACHE_HOME, True)
    return _CACHE_HOME


_CACHE_HOME = None


def start(binary, *serve_args, env=None):
    """Run `binary serve --listen 127.0.0.1:0 SERVE_ARGS...` from the repository root, with
    the check's own cache folder and `env` added to the environment; return the process and
    the address it listens on (read from its JSON log)."""
    proc = subprocess.Popen(
        [binary, "--log-format", "json", "serve", "--listen", "127.0.0.1:0", *serve_args],
        stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "XDG_CACHE_HOME": cache_home(), **(env or {})},
    )
    for line in proc.stderr:
        try:
            log = json.loads(line)
        except ValueError:
            continue
        if log.get("message") == "vramguard serving":
            return proc, log["address"]
    raise RuntimeError("vramguard exited before serving")


def serve_config(binary, yaml, run):
    """Serve `yaml` (written to a config file of its own) with `binary`, give `run` the
    address, and stop the server however `run` ends; what `run` returned."""
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "config.yaml")
        with open(config, "w") as f:
            f.write(yaml)
        proc, address = start(binary, "--config", config)
        try:
            return run(address)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


class Checks(list):
    """Named checks, each added with the `@checks.check(name)` decorator, run by `run`."""

    def check(self, name):
        def wrap(fn):
            self.append((name, fn))
            return fn
        return wrap

    def run(self):
        """Run every check (a failing one does not stop the rest), printing each result;
        (passed, failed)."""
        passed = failed = 0
        for name, fn in self:
            try:
                fn()
                print(f"PASS {name}")
                passed += 1
            except Exception:
                print(f"FAIL {name}")
                traceback.print_exc()
                failed += 1
        return passed, failed


def report(checks, label=None):
    """Run `checks` (a `Checks`, or (name, function) pairs) and print the count, after `label`
    when given; 1 when any failed."""
    passed, failed = Checks(checks).run()
    print(f"{label + ': ' if label else ''}{passed} passed, {failed} failed")
    return 1 if failed else 0
