#!/usr/bin/env bash
# The checks that need a real NVIDIA GPU, on a lent machine that has CUDA 13's libraries (as
# PyTorch's wheels bring them) but no Rust toolchain and no network. Everything else travels in
# two folders that git ignores, made here by `benches/gpu/pack.sh`:
#   .gpu1/  ONNX Runtime's CUDA provider, xz (the largest part: it travels alone, first call)
#   .gpu2/  ONNX Runtime's CUDA build of libonnxruntime, the release `vramguard` and the
#           generation bench's binary, wrk and its LuaJIT
# Usage, in the repository's root there:
#   benches/gpu/run.sh unpack1      # call 1: unpack .gpu1, say what the machine has
#   benches/gpu/run.sh all          # call 2: unpack .gpu2, then check.py and the generation bench
#                                   # (BENCH_ISOLATIONS="process thread" BENCH_RUNS=2: both, twice)
# Results go under $OUT.
set -u
OUT=${OUT:-/tmp/vg-out}
VG_DIR=/tmp/vg
mkdir -p "$VG_DIR/ort" "$VG_DIR/bin" "$VG_DIR/lib" "$OUT"

unxz_to() {
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"), 1 << 24)' "$1" "$2"
}

environment() {
    # CUDA 13's runtime libraries, wherever the image keeps them (PyTorch's nvidia-* wheels).
    local dirs
    dirs=$(find /opt /usr/local /usr/lib/x86_64-linux-gnu -maxdepth 9 \
        \( -name 'libcudart.so.13*' -o -name 'libcublas.so.13*' -o -name 'libcublasLt.so.13*' \
        -o -name 'libcudnn.so.9*' -o -name 'libcufft.so.12*' -o -name 'libcurand.so.10*' \
        -o -name 'libnvrtc.so.13*' -o -name 'libnvidia-ml.so.1' \) -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)
    export LD_LIBRARY_PATH="$VG_DIR/ort:$VG_DIR/lib:$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export ORT_DYLIB_PATH="$VG_DIR/ort/libonnxruntime.so.1.31.1"
    export PATH="$VG_DIR/bin:$PATH"
}

case "${1:-all}" in
unpack1)
    time unxz_to .gpu1/libonnxruntime_providers_cuda.so.xz "$VG_DIR/ort/libonnxruntime_providers_cuda.so"
    environment
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    grep -E '^(PRETTY_NAME)' /etc/os-release
    ldd --version | head -1
    ldd "$VG_DIR/ort/libonnxruntime_providers_cuda.so" | grep -E 'not found|cud|cublas|cufft|curand|nvrtc'
    python3 -c 'import onnx, numpy, requests, torch; print("onnx", onnx.__version__, "numpy", numpy.__version__, "torch", torch.__version__)'
    ;;
all)
    for f in libonnxruntime.so.1.31.1; do unxz_to ".gpu2/$f.xz" "$VG_DIR/ort/$f"; done
    cp .gpu2/libonnxruntime_providers_shared.so "$VG_DIR/ort/"
    ln -sf libonnxruntime.so.1.31.1 "$VG_DIR/ort/libonnxruntime.so.1"
    cp .gpu2/libluajit-5.1.so.2 "$VG_DIR/lib/"
    cp .gpu2/wrk "$VG_DIR/bin/" && chmod +x "$VG_DIR/bin/wrk"
    # The bench binary carries this checkout's paths (CARGO_MANIFEST_DIR and the target folder
    # of /work/main): make them point here.
    if [ "$(pwd -P)" != /work/main ]; then mkdir -p /work && ln -sfn "$(pwd -P)" /work/main; fi
    mkdir -p target/release target/bench target/tmp
    unxz_to .gpu2/vramguard.xz target/release/vramguard && chmod +x target/release/vramguard
    unxz_to .gpu2/generation.xz "$VG_DIR/bin/generation" && chmod +x "$VG_DIR/bin/generation"
    environment
    ldd "$VG_DIR/ort/libonnxruntime_providers_cuda.so" | grep 'not found'
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
    [ -f target/bench/decoder-large/model.onnx ] ||
        (time python3 benches/larger_decoder.py target/bench/decoder-large) >"$OUT/larger-decoder.log" 2>&1 &
    maker=$!
    PYTHONUNBUFFERED=1 timeout 300 python3 benches/gpu/check.py target/release/vramguard "$OUT" 2>&1 | tee "$OUT/check.log"
    wait $maker
    tail -3 "$OUT/larger-decoder.log"
    # The CUDA pool in a worker process (the default), then in the server's own process:
    # BENCH_ISOLATIONS picks, BENCH_RUNS sets each one's --runs.
    for isolation in ${BENCH_ISOLATIONS:-process}; do
        (cd /work/main && timeout "${BENCH_SECONDS:-330}" "$VG_DIR/bin/generation" --provider cuda \
            --isolation "$isolation" --runs "${BENCH_RUNS:-1}" --seconds 2) >"$OUT/generation-$isolation.log" 2>&1
        echo "== generation bench, CUDA pool with isolation: $isolation"
        grep -E 'MET|MISSED|server / in process' "$OUT/generation-$isolation.log"
        cp target/bench/generation-cuda.json "$OUT/generation-cuda-$isolation.json" 2>/dev/null
    done
    nvidia-smi --query-gpu=memory.used --format=csv,noheader
    ;;
*)
    echo "usage: $0 unpack1|all" >&2
    exit 2
    ;;
esac
