#!/usr/bin/env python3
"""The README's tour, followed in order as a new user would, against `make run`'s default.

Starts `vramguard serve` (path in argv[1]) on the embedded default, then runs every `sh` and
`python` block of README.md after its first (the set-up commands) in the order they appear:
- a `sh` block is split into commands (a command spans lines until bash can parse it); the
  `# ...` lines right after a command are output the README promises, and each must be a line
  of that command's output; a `#` line after a blank line is the reader's note, not output;
- every command must succeed: an HTTP error answer fails it (curl runs with
  --fail-with-body), and so does a non-zero exit;
- assignments (`ADMIN=...`) carry over to the later commands, as in the reader's shell.

What differs from the reader's machine, and only that: the server listens on a free port (the
README's `localhost:8080` is replaced by it), its admin socket is in a runtime directory of its
own (XDG_RUNTIME_DIR, which the README's ADMIN line reads) as is its cache (XDG_CACHE_HOME), `vramguard` is the binary under
test, and `vramguard doctor` asks this server.

Run by `make test` (`make tour`); prints 'N passed, N failed' and exits non-zero on any failure.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")


def blocks(text):
    """The fenced code blocks of `text`: (language, lines)."""
    found = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        found.append((match.group(1), match.group(2).splitlines()))
    return found


def parses(script):
    return subprocess.run(["bash", "-n", "-c", script], capture_output=True).returncode == 0


def steps(lines):
    """A sh block's commands, each with the output lines the README shows for it."""
    out = []
    command, expected, after_blank = [], [], False
    for line in lines:
        if not line.strip():
            after_blank = True
            continue
        comment = line.startswith("#")
        if comment and command and parses("\n".join(command)) and not after_blank:
            expected.append(line[1:].strip())
        elif comment:
            pass
        elif command and parses("\n".join(command)):
            out.append(("\n".join(command), expected))
            command, expected = [line], []
        else:
            command.append(line)
        after_blank = False
    if command:
        out.append(("\n".join(command), expected))
    return out


def main():
    binary = os.path.abspath(sys.argv[1])
    runtime = tempfile.mkdtemp(prefix="tour-")
    # Its cache folder in there too: what the server optimizes stays out of the user's cache.
    env = {**os.environ, "XDG_RUNTIME_DIR": runtime, "XDG_CACHE_HOME": os.path.join(runtime, "cache"),
           "NO_COLOR": "1"}
    proc = subprocess.Popen(
        [binary, "--log-format", "json", "serve", "--listen", "127.0.0.1:0"],
        stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
    )
    address = None
    for line in proc.stderr:
        if '"vramguard serving"' in line:
            address = re.search(r'"address":"([^"]+)"', line).group(1)
            break
    if address is None:
        shutil.rmtree(runtime, ignore_errors=True)
        print("FAIL vramguard exited before serving")
        print("0 passed, 1 failed")
        return 1
    # The log keeps coming: drain it so the server never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()

    bindir = tempfile.mkdtemp(prefix="tour-bin-")
    os.symlink(binary, os.path.join(bindir, "vramguard"))
    prelude = "\n".join([
        "set -o pipefail",
        f'export PATH="{bindir}:$PATH"',
        'curl() { command curl --fail-with-body "$@"; }',
        f'vramguard() {{ if [ "$1" = doctor ]; then command vramguard doctor --url http://{address} "${{@:2}}"; '
        'else command vramguard "$@"; fi; }',
    ])
    pyenv = {**env, "PYTHONPATH": os.path.join(ROOT, ".deps", "pyclients")}
    here = lambda text: text.replace("localhost:8080", address).replace("127.0.0.1:8080", address)

    passed, failed = 0, 0
    assignments = []
    try:
        for language, lines in blocks(open(README).read())[1:]:
            if language == "python":
                code = here("\n".join(lines))
                run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                     cwd=ROOT, env=pyenv, timeout=120)
                name = lines[0]
                ok = run.returncode == 0
                why = run.stderr[-2000:]
            elif language == "sh":
                for command, expected in steps(lines):
                    script = "\n".join([prelude, *assignments, here(command)])
                    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                                         cwd=ROOT, env=env, timeout=300)
                    got = [l.strip() for l in run.stdout.splitlines()]
                    missing = [e for e in expected if e not in got]
                    ok = run.returncode == 0 and not missing
                    why = (f"exit {run.returncode}; missing {missing}\n"
                           f"stdout: {run.stdout[-2000:]}\nstderr: {run.stderr[-2000:]}")
                    if re.match(r"^[A-Z_]+=", command):
                        assignments.append(command)
                    name = command.splitlines()[0][:100]
                    passed, failed = report(ok, name, why, passed, failed)
                continue
            else:
                continue
            passed, failed = report(ok, name, why, passed, failed)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(bindir, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


def report(ok, name, why, passed, failed):
    if ok:
        print(f"ok   {name}")
        return passed + 1, failed
    print(f"FAIL {name}\n{why}")
    return passed, failed + 1


if __name__ == "__main__":
    sys.exit(main())
