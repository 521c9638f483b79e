#!/usr/bin/env bash
# The GPU runs on a lent NVIDIA H200 (no package registry there).
#
#   scripts/h200_run.sh stage    HERE, before a lease: copy the team's reference streaming client
#                                (../shared/bench/stream_client.py) into .bench/, which travels with the
#                                work tree (untracked, not ignored); `peers` measures with it
#   scripts/h200_run.sh parts    copy the first half of the mlx-cuda-13 wheel to /tmp/parts
#   scripts/h200_run.sh install  join the halves, check the md5, install every wheel into /tmp/site
#   scripts/h200_run.sh tests    the slow real-process tests that matter on a GPU
#   scripts/h200_run.sh drill    the device fire drill (scripts/bench_device_drill.py)
#   scripts/h200_run.sh batch    scripts/bench_batch.py on a 2 GiB bf16 model
#   scripts/h200_run.sh peers    scripts/bench_peers.py with the reference client: the ceilings (stream_generate,
#                                raw loop), memvisor, mlx_lm.server (one warm instance each) at 1/8/32/64 streams,
#                                ~256-token prompts, 256 tokens, 2 rounds; whole-run rate and decode window, TTFT,
#                                NVML peaks (whole GPU and per process); rounds in $OUT/peers.json (~5 min)
#   scripts/h200_run.sh path     scripts/bench_path.py: where a token's time goes, layer by layer, at 1 and 64
#                                streams (ceiling, engine in process, worker over ZeroMQ, server; ~3 min)
#   scripts/h200_run.sh joinmem  scripts/bench_join_memory.py: the decode batch's buffers against its live KV
#   scripts/h200_run.sh gguf     collect the halves of the SmolLM2-135M Q4_1 GGUF (.gg1/, .gg2/, one per call,
#                                `split -b 49500000`) into /tmp/gguf and join them once both are there
#   scripts/h200_run.sh spec     scripts/bench_speculative.py on that GGUF: n-gram guessing on and off through
#                                the server (edit and chat, 3 rounds) and the cost of a K-token pass (--passes)
#   scripts/h200_run.sh swap     scripts/bench_swap.py parts a,b,c,e on a 1 GiB model: a load through a spare
#                                against a fresh process (SPEC W1, W3) on CUDA
#   scripts/h200_run.sh firstpass scripts/bench_first_pass.py: the first pass of each width (a check of K guesses
#                                is K+1 tokens) against the second, in two fresh processes (kernel builds)
#   PROFILE=1 scripts/h200_run.sh path   ... also py-spy the server's rounds (needs py-spy in .whl/)
#
# Wheels travel in .whl/ (Python 3.12 manylinux), the ~90 MB mlx-cuda-13 wheel
# in two halves (.gpu1/, .gpu2/, `split -b 46000000`) because one transfer is
# capped at 64 MiB; ../shared/device-cuda.md says why. Carry .whl in every call
# that installs (a path not carried is gone there). Logs go to $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SITE=/tmp/site
export PYTHONPATH="$SITE:$PWD"
export PATH="$SITE/bin:$PATH"  # py-spy, when its wheel came in .whl/
export PYTHONUNBUFFERED=1
PY=python3

case "${1:-}" in
stage)
    mkdir -p .bench
    cp "${STREAM_CLIENT:-../shared/bench/stream_client.py}" .bench/stream_client.py
    sha256sum .bench/stream_client.py
    ;;
parts)
    mkdir -p /tmp/parts
    cp .gpu1/mlxcuda.part.* /tmp/parts/ 2>/dev/null || true
    cp .gpu2/mlxcuda.part.* /tmp/parts/ 2>/dev/null || true
    ls -la /tmp/parts
    ;;
install)
    # from scratch: pip --target skips a top-level folder that exists (a half install's mlx/)
    rm -rf "$SITE"
    mkdir -p /tmp/parts "$SITE"
    cp .gpu2/mlxcuda.part.* /tmp/parts/ 2>/dev/null || true
    cat /tmp/parts/mlxcuda.part.* > /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
    md5sum /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
    $PY -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl 2>&1 | tail -3
    # mlx and mlx-cuda-13 share the top-level mlx/ folder: pip --target would skip it, so unzip
    $PY -m zipfile -e /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl "$SITE"
    $PY - <<'EOF'
import mlx.core as mx, pynvml
print("mlx", mx.__version__, mx.default_device(), {k: v for k, v in mx.device_info().items()})
from shared.probe import nvml
print(nvml.read_device())
EOF
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
    ;;
tests)
    timeout "${2:-540}" $PY -m pytest -p no:cacheprovider -q -m slow --durations=15 -rP \
        tests/live/test_d_gpu_live.py tests/live/test_d_device_live.py tests/live/test_supervisor_live.py \
        tests/live/test_supervisor_wire_live.py tests/live/test_supervisor_guard_live.py \
        tests/live/test_worker_process_live.py tests/live/test_p_cadence_live.py tests/live/test_u_usage_live.py \
        tests/live/test_reliability_live.py tests/live/test_models_live.py \
        2>&1 | grep -v " INFO " | tee "$OUT/tests.log" | tail -40
    ;;
drill)
    timeout "${2:-300}" $PY scripts/bench_device_drill.py --trials "${3:-10}" --rate 8GiB --headroom 4GiB \
        2>&1 | grep -v " INFO " | tee "$OUT/drill.log" | tail -20
    ;;
batch)
    timeout "${2:-400}" $PY scripts/bench_batch.py --size 2GiB --dtype bfloat16 --streams 1,8,32 --tokens 64 \
        --runs 1 2>&1 | grep -v " INFO " | tee "$OUT/batch.log" | tail -20
    ;;
peers)
    [ -f .bench/stream_client.py ] || { echo "no .bench/stream_client.py: run '$0 stage' before the lease" >&2; exit 2; }
    timeout "${2:-570}" $PY scripts/bench_peers.py --size 2GiB --dtype bfloat16 --streams 1,8,32,64 --tokens 256 \
        --words 135 --rounds 2 --client .bench/stream_client.py --json "$OUT/peers.json" \
        2>&1 | grep -v " INFO " | tee "$OUT/peers.log" | tail -40
    ;;
path)
    PROF=()
    [ "${PROFILE:-0}" = 1 ] && PROF=(--profile "$OUT/prof" --profile-seconds 20)
    timeout "${2:-400}" $PY scripts/bench_path.py --size 2GiB --dtype bfloat16 --streams "${STREAMS:-1,64}" \
        --tokens 128 --runs "${RUNS:-2}" "${PROF[@]}" 2>&1 | grep -v " INFO " | tee "$OUT/path.log" | tail -20
    ;;
joinmem)
    timeout "${2:-300}" $PY scripts/bench_join_memory.py --size 512MiB --requests 64 \
        2>&1 | grep -v " INFO " | tee "$OUT/joinmem.log" | tail -10
    ;;
gguf)
    mkdir -p /tmp/gguf
    cp .gg1/gg.part.* .gg2/gg.part.* /tmp/gguf/ 2>/dev/null || true
    ls -la /tmp/gguf
    if [ -f /tmp/gguf/gg.part.aa ] && [ -f /tmp/gguf/gg.part.ab ]; then
        cat /tmp/gguf/gg.part.* > /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
        md5sum /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    fi
    ;;
spec)
    timeout "${2:-500}" $PY scripts/bench_speculative.py --gguf /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf \
        --skip-draft --passes --rounds "${3:-3}" --json "$OUT/spec.json" \
        2>&1 | grep -v " INFO " | tee "$OUT/spec.log" | tail -40
    ;;
firstpass)
    timeout "${2:-240}" $PY scripts/bench_first_pass.py --size 256MiB --quantize 4 --processes 2 \
        2>&1 | grep -v " INFO " | tee "$OUT/firstpass.log" | tail -25
    ;;
swap)
    timeout "${2:-300}" $PY scripts/bench_swap.py --parts a,b,c,e --size 1GiB --rounds 3 --floor-runs 2 \
        2>&1 | grep -v " INFO " | tee "$OUT/swap.log" | tail -30
    ;;
*)
    echo "usage: $0 stage|parts|install|tests|drill|batch|peers|path|joinmem|gguf|spec|swap|firstpass" >&2
    exit 2
    ;;
esac
