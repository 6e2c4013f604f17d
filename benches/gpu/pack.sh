#!/usr/bin/env bash
# Make the two folders that `benches/gpu/run.sh` needs on a lent GPU machine (see there), from
# this checkout: ONNX Runtime's CUDA build from PyPI (the version `make deps` pins), the release
# `vramguard` and the generation bench's binary. Both folders stay out of git
# (.git/info/exclude) and each stays under the 64 MiB a call may carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
ORT_VERSION=$(sed -n 's/^ORT_VERSION *:= *//p' Makefile)
work=target/gpu-pack
mkdir -p "$work" .gpu1 .gpu2
grep -qx '/.gpu1/' .git/info/exclude || printf '/.gpu1/\n/.gpu2/\n' >>.git/info/exclude
wheel=$(ls "$work"/onnxruntime_gpu-"$ORT_VERSION"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d "$work" "onnxruntime-gpu==$ORT_VERSION"
    wheel=$(ls "$work"/onnxruntime_gpu-"$ORT_VERSION"-*.whl | head -1)
fi
unzip -o -q "$wheel" 'onnxruntime/capi/lib*' -d "$work"
lib=$work/onnxruntime/capi
python3 benches/gpu/strip_fatbin.py "$lib/libonnxruntime_providers_cuda.so" "$work/providers_cuda.so" 90
xz -T0 -6 -c "$work/providers_cuda.so" >.gpu1/libonnxruntime_providers_cuda.so.xz
xz -T0 -6 -c "$lib/libonnxruntime.so.$ORT_VERSION" >".gpu2/libonnxruntime.so.$ORT_VERSION.xz"
cp "$lib/libonnxruntime_providers_shared.so" .gpu2/
cargo build --release --bin vramguard
bench=$(cargo bench --bench generation --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("reason") == "compiler-artifact" and m.get("executable") and "generation" in m["target"]["name"]][0])')
strip -o "$work/vramguard" target/release/vramguard
strip -o "$work/generation" "$bench"
xz -T0 -6 -c "$work/vramguard" >.gpu2/vramguard.xz
xz -T0 -6 -c "$work/generation" >.gpu2/generation.xz
cp "$(command -v wrk)" "$(ldd "$(command -v wrk)" | awk '/libluajit/ {print $3}')" .gpu2/
du -sh .gpu1 .gpu2
