"""Start `vramguard serve` for the client compatibility checks and wait until it serves."""
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(binary, *serve_args, env=None):
    """Run `binary serve --listen 127.0.0.1:0 SERVE_ARGS...` from the repository root, with
    `env` added to the environment; return the process and the address it listens on (read
    from its JSON log)."""
    proc = subprocess.Popen(
        [binary, "--log-format", "json", "serve", "--listen", "127.0.0.1:0", *serve_args],
        stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, **(env or {})},
    )
    for line in proc.stderr:
        try:
            log = json.loads(line)
        except ValueError:
            continue
        if log.get("message") == "vramguard serving":
            return proc, log["address"]
    raise RuntimeError("vramguard exited before serving")
