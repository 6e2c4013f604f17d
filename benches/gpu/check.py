"""What a real NVIDIA GPU shows that the simulated accelerator cannot: run on a machine with one,
next to `benches/gpu/run.sh` (which sets up ONNX Runtime's CUDA build and calls this).

    python3 benches/gpu/check.py VRAMGUARD_BINARY OUT_DIR

Phases, each recorded in OUT_DIR/gpu-check.json and summed up in a table at the end:

- `doctor`: `vramguard doctor` on the embedded default, next to a PyTorch process holding 8 GiB.
- `default`: `vramguard serve` with no config (the `gpu` pool is then a CUDA pool in a worker
  process): encoder, classifier and chat requests; `/metrics` before and while a PyTorch process
  holds all but 512 MiB of the device; a seq-8192 encoder request (1 GiB of attention scores)
  under that pressure (the policy must redirect it to the CPU, flagged degraded) and after it
  (back on the GPU); the worker process killed with SIGKILL while requests keep coming (a new
  worker, breaker closed, nothing lost).
- `oom`: the same config with a policy that admits everything: under the same pressure the
  seq-8192 request makes the CUDA arena's own allocation fail (a genuine `cudaMalloc` failure),
  which must be retried once on the CPU, and the next short request must run on the GPU (an
  out-of-memory error is not sticky).

Nothing here is a test of CI: it needs a GPU and PyTorch, which CI has not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

VG = sys.argv[1]
OUT = Path(sys.argv[2])
OUT.mkdir(parents=True, exist_ok=True)
RECORD: dict = {}
ROWS: list[tuple[str, str, str]] = []

HOLDER = r"""
import sys, time, torch
keep = int(sys.argv[1])
free, total = torch.cuda.mem_get_info()
held = max(free - keep, 0)
x = torch.empty(held, dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
print("held", held, "of", total, flush=True)
time.sleep(float(sys.argv[2]))
"""


def row(check: str, ok: bool | None, what: str) -> None:
    mark = {True: "ok", False: "FAIL", None: "info"}[ok]
    ROWS.append((mark, check, what))
    print(f"{mark:5} {check:44} {what}", flush=True)


def encoder_body(seq: int) -> bytes:
    return json.dumps(
        {
            "inputs": [{"name": "input", "shape": [1, seq, 64], "datatype": "FP32", "data": [0.01] * (seq * 64)}],
            "outputs": [{"name": "pooled"}],
        }
    ).encode()


BODIES = {seq: encoder_body(seq) for seq in (128, 1024, 8192)}


def infer(base: str, seq: int, timeout: float = 120) -> dict:
    started = time.monotonic()
    try:
        r = requests.post(f"{base}/v2/models/encoder/infer", data=BODIES[seq], timeout=timeout)
    except requests.RequestException as e:
        return {"seq": seq, "status": None, "error": str(e), "ms": (time.monotonic() - started) * 1e3}
    h = r.headers
    return {
        "seq": seq,
        "status": r.status_code,
        "ms": round((time.monotonic() - started) * 1e3, 2),
        "pool": h.get("x-vramguard-pool"),
        "decision": h.get("x-vramguard-decision"),
        "degraded": h.get("x-vramguard-degraded"),
        "body": r.text[:300] if r.status_code != 200 else None,
    }


def metric_lines(base: str, *prefixes: str) -> list[str]:
    text = requests.get(f"{base}/metrics", timeout=10).text
    return [
        line
        for line in text.splitlines()
        if not line.startswith("#") and any(line.startswith(p) for p in prefixes)
    ]


def sample(lines: list[str], name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


def start_serve(name: str, args: list[str], port: int) -> tuple[subprocess.Popen, str]:
    log = open(OUT / f"serve-{name}.log", "wb")
    env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "info"))
    proc = subprocess.Popen([VG, "serve", *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve {name} exited with {proc.returncode}: see serve-{name}.log")
        try:
            if requests.get(f"{base}/v2/health/ready", timeout=2).status_code == 200:
                return proc, base
        except requests.RequestException:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"serve {name} not ready in 120 s")


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return -9


def hold(keep: int, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(keep), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline().strip()
    RECORD.setdefault("holders", []).append(line)
    print("pressure:", line, flush=True)
    return proc


def gpu_pool(base: str) -> dict:
    status = requests.get(f"{base}/status", timeout=10).json()
    return next(p for p in status["pools"] if p["name"] == "gpu")


def phase_doctor() -> None:
    env = dict(os.environ)
    # 8 GiB held by another process, so the doctor's NVML facts show a neighbour.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import torch,time; x=torch.empty(8<<30,dtype=torch.uint8,device='cuda'); x.fill_(1); "
            "torch.cuda.synchronize(); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    holder.stdout.readline()
    out = subprocess.run([VG, "doctor"], capture_output=True, text=True, env=env, timeout=120)
    holder.kill()
    (OUT / "doctor.txt").write_text(out.stdout + out.stderr)
    RECORD["doctor"] = {"rc": out.returncode, "output": out.stdout + out.stderr}
    text = out.stdout + out.stderr
    row("doctor exit", out.returncode == 0, f"rc {out.returncode}")
    for line in text.splitlines():
        if any(k in line for k in ("nvml", "cuda", "onnxruntime", "device")):
            row("doctor line", None, line.strip()[:110])


def phase_default() -> None:
    proc, base = start_serve("default", [], 8080)
    rec: dict = {}
    RECORD["default"] = rec
    try:
        rec["v2"] = requests.get(f"{base}/v2", timeout=10).json()
        rec["status_start"] = requests.get(f"{base}/status", timeout=10).json()
        pool = gpu_pool(base)
        row("gpu pool provider", pool.get("provider") == "cuda", json.dumps({k: pool.get(k) for k in ("provider", "device", "isolation", "worker_pid", "state")}))
        runs = [infer(base, 128) for _ in range(20)] + [infer(base, 1024) for _ in range(10)]
        rec["warm"] = runs
        on_gpu = [r for r in runs if r["pool"] == "gpu" and r["status"] == 200]
        row("encoder on the GPU", len(on_gpu) == len(runs), f"{len(on_gpu)} of {len(runs)} answered 200 by pool gpu")
        for seq in (128, 1024):
            ms = sorted(r["ms"] for r in runs[2:] if r["seq"] == seq)
            if ms:
                row(f"encoder seq {seq} client ms", None, f"p50 {ms[len(ms) // 2]:.2f} (JSON body, this Python client)")
        cls = requests.post(
            f"{base}/v2/models/classifier/infer",
            json={"inputs": [{"name": "features", "shape": [1, 16], "datatype": "FP32", "data": [0.1 * i for i in range(16)]}]},
            timeout=30,
        )
        row("classifier", cls.status_code == 200, f"{cls.status_code} pool {cls.headers.get('x-vramguard-pool')}")
        chat = requests.post(
            f"{base}/v1/chat/completions",
            json={"model": "tiny", "max_tokens": 16, "messages": [{"role": "user", "content": "Is the GPU full?"}]},
            timeout=60,
        )
        row("chat tiny", chat.status_code == 200, f"{chat.status_code} pool {chat.headers.get('x-vramguard-pool')}")
        # Only classifier runs for 2.5 s (two of the sampler's intervals): the pool's arena
        # figures are read after one of them, and must still hold the encoder's arena.
        started = time.monotonic()
        while time.monotonic() - started < 2.5:
            requests.post(f"{base}/v2/models/classifier/infer", data=cls.request.body, timeout=30)
            time.sleep(0.05)
        arena = gpu_pool(base).get("arena") or {}
        rec["arena_after_classifier"] = arena
        row(
            "gpu arena: every session's, summed",
            (arena.get("reserved_bytes") or 0) >= 8 << 20,
            f"reserved {arena.get('reserved_bytes')} active {arena.get('active_bytes')} B after seq-1024 encoder runs",
        )
        idle = metric_lines(base, "vramguard_device_memory", "vramguard_process_device_memory", "vramguard_arena", "vramguard_pool_memory", "vramguard_allocator")
        rec["metrics_idle"] = idle
        (OUT / "metrics-default-idle.txt").write_text("\n".join(idle))
        row("device memory in /metrics", any(l.startswith("vramguard_device_memory") for l in idle), f"{len(idle)} memory lines")

        holder = hold(keep=512 << 20, seconds=90)
        time.sleep(2.5)
        pressed = metric_lines(base, "vramguard_device_memory", "vramguard_process_device_memory")
        rec["metrics_pressure"] = pressed
        (OUT / "metrics-default-pressure.txt").write_text("\n".join(pressed))
        rec["status_pressure"] = requests.get(f"{base}/status", timeout=10).json()
        neighbours = [l for l in pressed if l.startswith("vramguard_process_device_memory") and f'pid="{holder.pid}"' in l]
        row("the neighbour's memory per process", bool(neighbours), (neighbours or ["no line with the holder's pid"])[0][:110])
        long = infer(base, 8192)
        rec["long_under_pressure"] = long
        row(
            "seq 8192 under pressure: redirected",
            long["status"] == 200 and long["pool"] == "cpu" and long["decision"] == "redirect" and bool(long["degraded"]),
            f"{long['status']} pool {long['pool']} decision {long['decision']} degraded {bool(long['degraded'])} {long['ms']:.0f} ms",
        )
        short = infer(base, 128)
        rec["short_under_pressure"] = short
        row("seq 128 under pressure: on the GPU", short["status"] == 200 and short["pool"] == "gpu", f"{short['status']} pool {short['pool']} {short['decision']}")
        holder.kill()
        holder.wait()
        time.sleep(2.5)
        after = infer(base, 8192)
        rec["long_after"] = after
        row("seq 8192 after pressure: on the GPU", after["status"] == 200 and after["pool"] == "gpu", f"{after['status']} pool {after['pool']} {after['decision']} {after['ms']:.0f} ms")

        # The worker process killed while requests keep coming.
        pool = gpu_pool(base)
        pid = pool.get("worker_pid")
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        during, back_ms = [], None
        while time.monotonic() - killed_at < 20:
            during.append(infer(base, 128, timeout=30))
            now = gpu_pool(base)
            if back_ms is None and now.get("worker_pid") not in (None, pid) and now.get("breaker") == "closed" and now.get("state") in ("ready", "healthy", "available", "ok"):
                back_ms = (time.monotonic() - killed_at) * 1e3
            if back_ms is not None and during[-1]["pool"] == "gpu":
                break
        rec["worker_kill"] = {"pid": pid, "during": during, "back_ms": back_ms, "pool_after": gpu_pool(base)}
        answered = sum(1 for r in during if r["status"] == 200)
        row("worker killed: new worker", back_ms is not None, f"pid {pid} -> {gpu_pool(base).get('worker_pid')}, back after {back_ms and round(back_ms)} ms")
        row("worker killed: requests answered", answered == len(during), f"{answered} of {len(during)} 200; pools {sorted(set(str(r['pool']) for r in during))}")
        counted = metric_lines(base, "vramguard_requests_total", "vramguard_failovers_total", "vramguard_worker_restarts_total", "vramguard_allocator_failures_total", "vramguard_worker_up")
        rec["metrics_end"] = counted
        # The breaker opens at the first run that finds the worker's connection closed, not
        # when the driver has torn the killed process's context down and it is reaped.
        lost = sample(counted, 'vramguard_failovers_total{from="gpu",to="cpu",reason="worker_lost"}')
        row("worker killed: breaker open at the first lost run", lost <= 3, f"{lost:.0f} requests reached the dead worker first (61 before the fix)")
        (OUT / "metrics-default-end.txt").write_text("\n".join(counted))
    finally:
        rec["exit"] = stop(proc)
        row("serve default exits cleanly", rec["exit"] == 0, f"rc {rec['exit']}")


def phase_oom() -> None:
    raw = subprocess.run([VG, "config", "default"], capture_output=True, text=True, check=True).stdout
    policy = OUT / "admit-all.rhai"
    policy.write_text("// Admits everything: the allocator, not the policy, has the last word.\nfn decide(req, state) { admit() }\n")
    lines, section = [], ""
    for line in raw.splitlines():
        if line and not line.startswith((" ", "#")):
            section = line.rstrip(":")
        if section == "policy" and line.startswith("  path: builtin:default"):
            line = f"  path: {policy}"
        if section == "server" and line.startswith("  listen:"):
            line = "  listen: 127.0.0.1:8081"
        lines.append(line)
    config = OUT / "oom.yaml"
    config.write_text("\n".join(lines) + "\n")
    proc, base = start_serve("oom", ["--config", str(config)], 8081)
    rec: dict = {}
    RECORD["oom"] = rec
    try:
        warm = [infer(base, 128) for _ in range(3)]
        row("admit-all: warm on the GPU", all(r["pool"] == "gpu" for r in warm), str([r["pool"] for r in warm]))
        holder = hold(keep=512 << 20, seconds=90)
        time.sleep(1.0)
        long = infer(base, 8192)
        rec["long"] = long
        row(
            "admit-all: seq 8192 hits a real CUDA OOM",
            long["status"] == 200 and long["pool"] == "cpu",
            f"{long['status']} pool {long['pool']} decision {long['decision']} degraded {long['degraded']} {long['body'] or ''}"[:150],
        )
        short = infer(base, 128)
        rec["short_after_oom"] = short
        row("admit-all: next short request on the GPU", short["status"] == 200 and short["pool"] == "gpu", f"{short['status']} pool {short['pool']} {short['body'] or ''}"[:150])
        counted = metric_lines(base, "vramguard_allocator_failures_total", "vramguard_failovers_total", "vramguard_retries_total", "vramguard_requests_total")
        rec["metrics"] = counted
        (OUT / "metrics-oom.txt").write_text("\n".join(counted))
        row("admit-all: allocator failure counted", sample(counted, "vramguard_allocator_failures_total") >= 1, str([l for l in counted if l.startswith("vramguard_allocator_failures_total") and not l.endswith(" 0")])[:150])
        holder.kill()
        holder.wait()
    finally:
        rec["exit"] = stop(proc)
        row("serve oom exits cleanly", rec["exit"] == 0, f"rc {rec['exit']}")


def main() -> int:
    for name, phase in (("doctor", phase_doctor), ("default", phase_default), ("oom", phase_oom)):
        try:
            phase()
        except Exception as e:  # one phase's failure must not hide the others' facts
            row(f"phase {name}", False, f"{type(e).__name__}: {e}"[:150])
    (OUT / "gpu-check.json").write_text(json.dumps(RECORD, indent=1))
    print("\n".join(f"{m:5} {c:44} {w}" for m, c, w in ROWS))
    return 1 if any(m == "FAIL" for m, _, _ in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
